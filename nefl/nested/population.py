"""The simulated population of the paper's protocol: client ids, tiers, data shards and the seed each
client trains a round with.

Defined once for every runner that replays it: `aggregator simulate` trains the clients one after the
other in one process, the Flower apps (aggregator/flower.py, edge_client/flower.py) train each on its
own simulated node. Same ids, tiers, shards and seeds make the same run.
"""

from __future__ import annotations

import torch

from nefl.nested.data import ArrayDataset, BatchLoader, partition_dirichlet, partition_iid
from nefl.support.settings import PAPER_WINDOW


def tier_of(client: int, num_clients: int, num_tiers: int) -> int:
    """The paper's equal tiers by client index, tier 0 the most constrained."""
    return client * num_tiers // num_clients


def tier_bound(tier: int, num_submodels: int) -> int:
    """The largest submodel (0-based) a client of `tier` can train: the top of its paper window."""
    return min(tier + PAPER_WINDOW, num_submodels - 1)


def client_id(client: int, num_clients: int) -> str:
    """Zero-padded, so the ids sort in index order: the seeded sampling of participants draws from
    the sorted ids, and the paper's draws replay the simulator's runs from before it drove a Federation."""
    return f"c{client:0{len(str(num_clients - 1))}d}"


def client_ids(num_clients: int) -> list[str]:
    return [client_id(c, num_clients) for c in range(num_clients)]


def partitions(train: ArrayDataset, num_clients: int, non_iid: float | None, seed: int,
               max_samples: int | None = None) -> list[torch.Tensor]:
    """Every client's training indices: IID shards, or Dirichlet(non_iid) label skew; at most
    `max_samples` each."""
    if non_iid is None:
        parts = partition_iid(len(train), num_clients, seed)
    else:
        parts = partition_dirichlet(train.labels, num_clients, non_iid, seed)
    return [p[:max_samples] for p in parts] if max_samples else parts


def train_seed(seed: int, round_index: int, client: int) -> int:
    """The seed of client `client`'s batches in round `round_index` (1-based) of a run seeded `seed`."""
    return seed * 1_000_003 + (round_index - 1) * 1009 + client


def client_batches(data: ArrayDataset, indices: torch.Tensor | None, batch_size: int, seed: int) -> BatchLoader:
    """What a simulated client trains on: its shard, shuffled and augmented with its round's seed."""
    return BatchLoader(data, indices, batch_size, shuffle=True, augment=True, seed=seed)
