"""Floor 3: how updates become the next global state: NeFedAvg (aggregate), robust rules, the step bound,
rolling windows, and the attacks the rules are measured against. Imports nefl.nested and nefl.support."""
