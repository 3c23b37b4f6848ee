"""Every FedJigsaw client's data and starting point, computed alike by the simulator and by a device.

A device of an MQTT federation (nefl/jigsaw/device.py) derives its own shard from the coordinator's
`ShardSpec`, as the simulator derives all of them: so a device holds exactly the images its simulated twin
holds, and the two runs can be compared round by round. Each source also initialises its modules from a seed
of its own (`initial_modules`), so no client needs to know the others' architectures to start as in the
simulator.

A client gets a Dirichlet label-skewed task shard (nefl.nested.data, as `aggregator simulate`): a held-out
validation split of `val_samples` images for the policy's reward (taken before `max_samples_per_client` caps the
training part, so a client with few training images still scores its reward on enough images), and a local test
set drawn from the test images with its shard's label distribution. Every client also holds the same
`probe_samples` unlabelled images, set aside before partitioning (nobody's task data): CoRe-Tune's E_data is a
task-trained model's mean output on them, so it reflects the label skew the model learnt.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
from torch import nn

from nefl.jigsaw.client import Loaders
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, build_module, fixed_bytes, peak_bytes
from nefl.nested.data import ArrayDataset, BatchLoader, partition_dirichlet
from nefl.nested.state import module_state
from nefl.nested.train import evaluate, recompute_bn_stats


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the clients' data are cut (the coordinator announces it; the simulator's config fills it)."""

    clients: int
    seed: int
    non_iid: float  # Dirichlet alpha of the label skew
    max_samples_per_client: int | None  # cap on the training part of a shard
    val_samples: int  # held-out validation images per client (the reward), at most half its shard
    test_per_client: int
    probe_samples: int  # shared unlabelled images set aside before partitioning (E_data)
    batch_size: int


@dataclass
class ClientData:
    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    histogram: torch.Tensor  # label distribution of the task shard: the policy's CLS input, never sent


def local_test_indices(test: ArrayDataset, labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`n` test images drawn with the client's own label distribution: that of `labels`, its whole shard."""
    classes = test.info.num_classes
    share = torch.bincount(labels, minlength=classes).double()
    counts = torch.floor(share / share.sum() * n).long()
    gen = torch.Generator().manual_seed(seed)
    picked = []
    for k in range(classes):
        pool = torch.nonzero(test.labels == k).flatten()
        picked.append(pool[torch.randperm(pool.numel(), generator=gen)[: min(int(counts[k]), pool.numel())]])
    return torch.cat(picked).sort().values


def client_data(train: ArrayDataset, test: ArrayDataset, cfg: ShardSpec) -> tuple[list[ClientData], torch.Tensor]:
    """Per client its training, validation and local test indices; and the shared probe images, set aside (IID)
    before the Dirichlet partition of the rest, so they are nobody's task data."""
    gen = torch.Generator().manual_seed(cfg.seed * 31 + 5)
    order = torch.randperm(len(train), generator=gen)
    pool, rest = order[:cfg.probe_samples].sort().values, order[cfg.probe_samples:].sort().values
    parts = partition_dirichlet(train.labels[rest], cfg.clients, cfg.non_iid, cfg.seed)
    out = []
    for c, part in enumerate(parts):
        g = torch.Generator().manual_seed(cfg.seed * 7919 + c)
        part = rest[part[torch.randperm(part.numel(), generator=g)]]
        n_val = max(1, min(cfg.val_samples, part.numel() // 2))
        own = part[n_val:]
        if cfg.max_samples_per_client:
            own = own[: cfg.max_samples_per_client]
        hist = torch.bincount(train.labels[own], minlength=train.info.num_classes).float()
        # the local test follows the whole shard's label mix, as the validation split does: under a small cap the
        # training images' own mix is a noisy draw of it (40 images: median total variation 0.16 at Dir(1.0)), and
        # the reward and the guard, which score on the validation split, would choose for another mix than is scored
        test_idx = local_test_indices(test, train.labels[part], cfg.test_per_client, cfg.seed * 104729 + c)
        out.append(ClientData(own.sort().values, part[:n_val].sort().values, test_idx, hist / hist.sum()))
    return out, torch.cat([x for x, _ in plain(train, pool)])  # normalised as the loaders normalise


def device_budgets(bases: list[BaseArch], clients: int, batch_size: int, headroom: float, seed: int) -> list[float]:
    """Memory budgets (bytes) of simulated devices: evenly spaced from the smallest base model's training peak
    to `headroom` x the largest one's share above the fixed part, in a seeded order."""
    fixed = fixed_bytes(bases[0].input, batch_size)
    peaks = [peak_bytes(b.metas(0), b.input, batch_size) for b in bases]
    lo, hi = min(peaks), fixed + (max(peaks) - fixed) * headroom
    spaced = [lo + (hi - lo) * (i + 0.5) / clients for i in range(clients)]
    order = torch.randperm(clients, generator=torch.Generator().manual_seed(seed * 13 + 1)).tolist()
    return [spaced[i] for i in order]

def module_seed(seed: int, client: int) -> int:
    return seed * 1_000_003 + 7919 * client + 1


def initial_modules(metas: list[ModuleMeta], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """One source's modules at their initial parameters, from its own seed (`module_seed`)."""
    torch.manual_seed(seed)
    return {m.key: module_state(build_module(m)) for m in metas}


class ClientShard:
    """One client's loaders, seeded per round exactly as the simulator seeds them."""

    def __init__(self, client: int, data: ClientData, train: ArrayDataset, test: ArrayDataset, spec: ShardSpec) -> None:
        self.client, self.data, self.train, self.test, self.spec = client, data, train, test, spec

    def _seed(self, r: int) -> int:
        return self.spec.seed * 1_000_003 + r * 1009 + self.client

    def task(self, r: int, t: int | None = None) -> Loaders:
        """Round r's loaders. In model-training round t (None in the policy phase) the guard's local path gets
        the batches a local-only client (no policy phase) trains on in its round t, so it is that training."""
        return Loaders(self._batches(r), self.val(), None if t is None else self._batches(t))

    def _batches(self, r: int) -> BatchLoader:
        """The round's training batches are all full when the shard holds a batch or more: a device with 450
        images and batch 32 would otherwise end every round on a step of 2 images, whose BatchNorm statistics
        and gradient can undo the round (docs/fedjigsaw.md, Deploying). A new shuffle each round,
        so no image is left out for good."""
        idx = self.data.train
        return BatchLoader(self.train, idx, self.spec.batch_size, shuffle=True, augment=True, seed=self._seed(r),
                           drop_last=idx.numel() >= self.spec.batch_size)

    def val(self) -> BatchLoader:
        """The held-out validation split (the reward; the guard's choice)."""
        return plain(self.train, self.data.val)

    def own_train(self) -> BatchLoader:
        return plain(self.train, self.data.train)

    def local_test(self) -> BatchLoader:
        return plain(self.test, self.data.test)

    def score(self, model: nn.Module) -> float:
        """`model` as deployed on this client: BatchNorm statistics recomputed on its own images, then its top-1 on
        its local test split."""
        recompute_bn_stats(model, self.own_train())
        return evaluate(model, self.local_test())[0]


def plain(dataset: ArrayDataset, idx: torch.Tensor) -> BatchLoader:
    return BatchLoader(dataset, idx, 256, shuffle=False, augment=False, seed=0)
