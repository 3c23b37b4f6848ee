"""A hostile edge device for the attack tests and benchmarks: the real `edge-client join` (its own device
key, the real agent, wire and limits) whose honest delta is replaced by an attack of nefl/aggregation/attacks.py
before it is uploaded, from a given round on.

    python -m tests.harness.attack_device KIND SCALE FROM_ROUND join --broker ... (the usual join arguments)

SCALE `default` takes the kind's default. What a device knows of the round: its own delta, the weights it was
sent, and the last global step (its weights now minus those of its previous task, when that was the same
submodel), which ALIE, min-max, min-sum and adaptive take as the honest updates; adaptive asks the kit's aggregation
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
        self.previous: Delta | None = None  # the weights of its previous task
        self.poisoned = False

    def last_step(self, start: Delta) -> list[Delta]:
        """The last global step, if its previous task was the same submodel (same shapes)."""
        prev = self.previous
        if prev is None or prev.keys() != start.keys() or any(prev[n].shape != t.shape for n, t in start.items()):
            return []
        return [{n: t - prev[n] for n, t in start.items()}]

    def knowledge(self, layout: Layout, k: int, index: int, delta: Delta, start: Delta) -> Knowledge:
        honest = [delta, *self.last_step(start)]
        oracle = device_oracle(layout, k, start, honest, index, ORACLE_SEED) if self.attack.kind == "adaptive" else None
        return Knowledge(honest, per_submodel=frozenset(layout.inconsistent), oracle=oracle)

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
            self.previous = {n: t.clone() for n, t in start.items()}
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
