"""A hostile edge device for the attack tests and benchmarks: the real `edge-client join` (its own device
key, the real agent, wire and limits) whose honest delta is replaced by an attack of nefl/aggregation/attacks.py
before it is uploaded, from a given round on.

    python -m tests.harness.attack_device KIND SCALE FROM_ROUND join --broker ... (the usual join arguments)
"""

from __future__ import annotations

import sys

import edge_client.device as device
from nefl.aggregation.attacks import Attack, craft


def main() -> None:
    kind, scale, first = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    attack = Attack(kind, scale)
    honest = device.LocalDevice.train

    def hostile(self, layout, task, start, budget_s):
        res = honest(self, layout, task, start, budget_s)
        if task.round >= first:
            res.delta = craft(attack, res.delta, {n: start[n] for n in res.delta})
        return res

    device.LocalDevice.train = hostile
    sys.argv = [sys.argv[0], *sys.argv[4:]]
    from edge_client.cli import app
    app()


if __name__ == "__main__":
    main()
