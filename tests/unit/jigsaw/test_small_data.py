"""Where clients have too little data alone (issue 43), sharing pays: on a small Dir(1.0) federation of real
Fashion-MNIST (10 clients, 40 training images each: docs/fedjigsaw.md's small-data budget, seed 0) FedJigsaw
ends ahead of training alone by more than a point, with its clients training shared modules together."""

from __future__ import annotations

import pytest
import torch

from nefl.jigsaw.sim import JigsawConfig, JigsawSimulator

SMALL = dict(clients=10, rounds=8, policy_rounds=4, critic_warmup=1, max_samples_per_client=40, test_per_client=300,
             val_samples=200, eval_every=0, local_epochs=5, batch_size=16, non_iid=1.0, seed=0)


def _mean_accuracy(method: str) -> tuple[float, JigsawSimulator]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the figures in docs/fedjigsaw.md were measured so
    try:
        sim = JigsawSimulator(JigsawConfig(method=method, **SMALL))
        accs = sim.run().accuracy
    finally:
        torch.set_num_threads(threads)
    return sum(accs) / len(accs), sim


@pytest.mark.slow
@pytest.mark.extended
def test_fedjigsaw_beats_training_alone_on_small_data() -> None:
    alone, _ = _mean_accuracy("local-only")
    shared, sim = _mean_accuracy("fedjigsaw")
    assert shared > alone + 0.01, (shared, alone)
    users: dict[str, int] = {}
    for c in range(sim.cfg.clients):
        for m in sim.fed.chain(c):
            users[m.key] = users.get(m.key, 0) + 1
    assert max(users.values()) >= sim.cfg.clients // 2, users  # co-training: half the clients or more on a module
