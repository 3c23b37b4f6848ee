"""A hostile edge device for the attack tests and benchmarks: the real `edge-client join` (its own device
key, the real agent, wire and limits) whose honest delta is replaced by an attack of nefl/aggregation/attacks.py
before it is uploaded, from a given round on.

    python -m tests.harness.attack_device KIND SCALE FROM_ROUND join --broker ... (the usual join arguments)

SCALE `default` takes the kind's default. What a device knows of the round: its own delta, the weights it was
sent, and the last global step (its weights now minus those of its previous task, where both cover a tensor),
which ALIE, min-max, min-sum and adaptive take as the honest updates; adaptive asks the kit's aggregation
with `serve`'s defaults and a seed of its own (the server's secret draws are not known to it). Data attacks
(label-flip, the backdoors) train on the device's own shard poisoned from FROM_ROUND on.
"""

from __future__ import annotations

import sys

import torch

import edge_client.device as device
from nefl.aggregation.attack_oracle import device_oracle
from nefl.aggregation.attacks import Attack, Knowledge, craft, poison_dataset
from nefl.nested.state import Layout

Delta = dict[str, torch.Tensor]
ORACLE_SEED = 1  # the attacker's own draws for its oracle's sketch


class Attacker:
    """Turns a LocalDevice's honest training into `attack` from round `first` on."""

    def __init__(self, attack: Attack, first: int) -> None:
        self.attack, self.first = attack, first
        self.previous: tuple[int, Delta] | None = None  # the submodel and weights of its previous task
        self.poisoned = False

    def last_step(self, k: int, start: Delta, delta: Delta, per_submodel: frozenset[str]) -> list[Delta]:
        """The last global step where it can tell it: on each tensor's part that both tasks' weights cover (a
        per-submodel tensor only when both were submodel k); elsewhere its own delta, which adds no spread."""
        if self.previous is None:
            return []
        pk, prev = self.previous
        step = {}
        for name, now in start.items():
            out = delta[name].clone()
            before = prev.get(name)
            if before is not None and before.dim() == now.dim() and (name not in per_submodel or pk == k):
                common = tuple(slice(0, min(a, b)) for a, b in zip(now.shape, before.shape))
                out[common] = now[common] - before[common]
            step[name] = out
        return [step]

    def knowledge(self, layout: Layout, k: int, index: int, delta: Delta, start: Delta) -> Knowledge:
        per_submodel = frozenset(layout.inconsistent)
        honest = [delta, *self.last_step(k, start, delta, per_submodel)]
        oracle = device_oracle(layout, k, start, honest, index, ORACLE_SEED) if self.attack.kind == "adaptive" else None
        return Knowledge(honest, per_submodel=per_submodel, oracle=oracle)

    def poison_data(self, dev: device.LocalDevice, layout: Layout) -> None:
        """From now on the device trains on its shard poisoned (flipped labels, or triggered images)."""
        dev.train_set = poison_dataset(dev.train_set, torch.as_tensor(dev.indices), self.attack,
                                       layout.profile.num_classes, dev.cfg.seed)
        dev.indices = torch.arange(len(dev.train_set.labels))
        self.poisoned = True

    def wrap(self, honest):
        def hostile(dev, layout, task, start, budget_s):
            if self.attack.on_data and task.round >= self.first and not self.poisoned:
                self.poison_data(dev, layout)
            res = honest(dev, layout, task, start, budget_s)
            if task.round >= self.first:
                known = self.knowledge(layout, task.submodel, task.round, res.delta, start)
                res.delta = craft(self.attack, res.delta, {n: start[n] for n in res.delta}, known)
            self.previous = (task.submodel, {n: t.clone() for n, t in start.items()})
            return res
        return hostile


def main() -> None:
    kind, scale, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    attack = Attack(kind, None if scale == "default" else float(scale))
    device.LocalDevice.train = Attacker(attack, first).wrap(device.LocalDevice.train)
    sys.argv = [sys.argv[0], *sys.argv[4:]]
    from edge_client.cli import app
    app()


if __name__ == "__main__":
    main()
