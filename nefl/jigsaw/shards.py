"""Every FedJigsaw client's data and starting point, computed alike by the simulator and by a device.

A device of an MQTT federation (nefl/jigsaw/device.py) derives its own shard from the coordinator's
`ShardSpec`, as the simulator derives all of them: so a device holds exactly the images its simulated twin
holds, and the two runs can be compared round by round. Each source also initialises its modules from a seed
of its own (`initial_modules`), so no client needs to know the others' architectures to start as in the
simulator.

A client gets a Dirichlet label-skewed task shard (nefl.nested.data, as `aggregator simulate`) with a validation split
for the reward, a local test set drawn from the test images with its shard's label distribution, and a proxy
shard for the policy phase: training images set aside before partitioning (so no client's task data), each
rotated by 0/90/180/270 degrees and labelled with its rotation, a task-agnostic pretext task.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from nefl.jigsaw.client import Loaders
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, build_module, fixed_bytes, peak_bytes
from nefl.nested.data import ArrayDataset, BatchLoader, partition_dirichlet
from nefl.nested.state import module_state


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the clients' data are cut (the coordinator announces it; the simulator's config fills it)."""

    clients: int
    seed: int
    non_iid: float  # Dirichlet alpha of the label skew
    max_samples_per_client: int | None
    val_fraction: float
    test_per_client: int
    proxy_samples: int
    probe_samples: int
    batch_size: int


@dataclass
class ClientData:
    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    proxy_train: torch.Tensor  # indices into the proxy dataset
    proxy_val: torch.Tensor
    histogram: torch.Tensor  # label distribution of the task shard: the policy's CLS input, never sent


def local_test_indices(test: ArrayDataset, train_labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`n` test images drawn with the client's own label distribution (its training shard's)."""
    classes = test.info.num_classes
    share = torch.bincount(train_labels, minlength=classes).double()
    counts = torch.floor(share / share.sum() * n).long()
    gen = torch.Generator().manual_seed(seed)
    picked = []
    for k in range(classes):
        pool = torch.nonzero(test.labels == k).flatten()
        picked.append(pool[torch.randperm(pool.numel(), generator=gen)[: min(int(counts[k]), pool.numel())]])
    return torch.cat(picked).sort().values


def rotation_task(images: torch.Tensor, info, seed: int) -> ArrayDataset:
    """The proxy: each image rotated by k x 90 degrees (k seeded) and labelled k, whatever it shows."""
    k = torch.randint(4, (images.shape[0],), generator=torch.Generator().manual_seed(seed))
    rotated = torch.stack([torch.rot90(img, int(r), dims=(1, 2)) for img, r in zip(images, k)])
    return ArrayDataset(rotated.contiguous(), k.to(torch.int64), info)


def client_data(train: ArrayDataset, test: ArrayDataset, cfg: ShardSpec) -> tuple[list[ClientData], ArrayDataset]:
    """Per client its task, validation, local test and proxy indices; and the proxy dataset. The proxy images
    are set aside (IID) before the Dirichlet partition of the rest, so they are nobody's task data."""
    gen = torch.Generator().manual_seed(cfg.seed * 31 + 5)
    order = torch.randperm(len(train), generator=gen)
    n_proxy = cfg.clients * cfg.proxy_samples
    pool, rest = order[:n_proxy].sort().values, order[n_proxy:].sort().values
    proxy = rotation_task(train.images[pool], train.info, cfg.seed)
    parts = partition_dirichlet(train.labels[rest], cfg.clients, cfg.non_iid, cfg.seed)
    out = []
    for c, part in enumerate(parts):
        g = torch.Generator().manual_seed(cfg.seed * 7919 + c)
        part = rest[part[torch.randperm(part.numel(), generator=g)]]
        if cfg.max_samples_per_client:
            part = part[: cfg.max_samples_per_client]
        n_val = max(1, int(part.numel() * cfg.val_fraction))
        labels = train.labels[part]
        hist = torch.bincount(labels, minlength=train.info.num_classes).float()
        mine = torch.arange(c * cfg.proxy_samples, (c + 1) * cfg.proxy_samples)
        p_val = max(1, int(cfg.proxy_samples * cfg.val_fraction))
        out.append(ClientData(part[n_val:].sort().values, part[:n_val].sort().values,
                              local_test_indices(test, labels, cfg.test_per_client, cfg.seed * 104729 + c),
                              mine[p_val:], mine[:p_val], hist / hist.sum()))
    return out, proxy


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


def probe_images(input_dims: tuple[int, int, int], spec: ShardSpec) -> torch.Tensor:
    """The shared, task-agnostic noise images every client scores E_data on (the Exp term)."""
    gen = torch.Generator().manual_seed(10_007 + spec.seed)
    return torch.randn(spec.probe_samples, *input_dims, generator=gen)


class ClientShard:
    """One client's loaders, seeded per round exactly as the simulator seeds them."""

    def __init__(self, client: int, data: ClientData, train: ArrayDataset, test: ArrayDataset, proxy: ArrayDataset,
                 spec: ShardSpec) -> None:
        self.client, self.data, self.train, self.test, self.proxy, self.spec = client, data, train, test, proxy, spec

    def _seed(self, r: int) -> int:
        return self.spec.seed * 1_000_003 + r * 1009 + self.client

    def task(self, r: int) -> Loaders:
        """The round's training batches are all full when the shard holds a batch or more: a device with 450
        images and batch 32 would otherwise end every round on a step of 2 images, whose BatchNorm statistics
        and gradient can undo the round (docs/fedjigsaw.md, Deploying). A new shuffle each round,
        so no image is left out for good."""
        idx = self.data.train
        return Loaders(BatchLoader(self.train, idx, self.spec.batch_size, shuffle=True, augment=True, seed=self._seed(r),
                                   drop_last=idx.numel() >= self.spec.batch_size), plain(self.train, self.data.val))

    def proxy_task(self, r: int) -> Loaders:
        """No augmentation: a flip would change what a rotation looks like."""
        return Loaders(BatchLoader(self.proxy, self.data.proxy_train, self.spec.batch_size, shuffle=True, augment=False,
                                   seed=self._seed(r)), plain(self.proxy, self.data.proxy_val))

    def loaders(self, r: int, policy_phase: bool) -> Loaders:
        return self.proxy_task(r) if policy_phase else self.task(r)

    def own_train(self) -> BatchLoader:
        return plain(self.train, self.data.train)

    def local_test(self) -> BatchLoader:
        return plain(self.test, self.data.test)


def plain(dataset: ArrayDataset, idx: torch.Tensor) -> BatchLoader:
    return BatchLoader(dataset, idx, 256, shuffle=False, augment=False, seed=0)
