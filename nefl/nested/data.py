"""Data layer: dataset registry, in-memory loading, batched augmentation, client partitions.

Whole datasets are held in memory as uint8 tensors and augmented per batch with
vectorised tensor ops, because per-sample PIL transforms are far too slow on the
small CPUs that edge clients and CI run on.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision import datasets as tv_datasets

from nefl.support.fsio import atomic_write

__all__ = [
    "DATASETS",
    "ENV_DATA_ROOT",
    "SYSTEM_FASHION_MNIST_DIR",
    "ArrayDataset",
    "BatchLoader",
    "ColorJitter",
    "DatasetInfo",
    "DatasetUnavailable",
    "color_jitter",
    "get_dataset_info",
    "load_dataset",
    "load_image_folder",
    "parse_partition",
    "partition_dirichlet",
    "partition_iid",
    "random_crop",
    "random_hflip",
    "resolve_data_root",
]

# Where Debian's `dataset-fashion-mnist` package puts the gzipped IDX files.
# Module-level so tests can point it elsewhere.
SYSTEM_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
ENV_DATA_ROOT = "NEFL_DATA_ROOT"
DEFAULT_DATA_ROOT = Path("~/.cache/nefl/data")

# Label-skew sampling rarely needs more than a few tries; past this the request
# (too many clients, too small alpha or too large min_size) is unrealistic.
_DIRICHLET_MAX_TRIES = 1000


class DatasetUnavailable(Exception):
    """The dataset is neither on disk nor downloadable; the message names the fix."""


@dataclass(frozen=True)
class ColorJitter:
    """Ranges of the per-image factors, with torchvision ColorJitter semantics."""

    brightness: tuple[float, float]
    contrast: tuple[float, float]
    saturation: tuple[float, float]


@dataclass(frozen=True)
class DatasetInfo:
    """Registry entry: how to load a dataset and how to normalise/augment it."""

    name: str
    display_name: str
    tv_class: type
    uses_split: bool  # SVHN takes split="train"/"test" instead of train=bool
    storage: str  # layout of the torchvision `.data` array: "NHW", "NHWC" or "NCHW"
    label_attr: str
    on_disk: str  # what --data-root must hold, for error messages
    apt_package: str | None
    shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_padding: int
    hflip: bool
    jitter: ColorJitter | None = None


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            name="fashion-mnist",
            display_name="Fashion-MNIST",
            tv_class=tv_datasets.FashionMNIST,
            uses_split=False,
            storage="NHW",
            label_attr="targets",
            on_disk="FashionMNIST/raw/",
            apt_package="dataset-fashion-mnist",
            shape=(1, 28, 28),
            num_classes=10,
            mean=(0.2860,),
            std=(0.3530,),
            crop_padding=2,
            hflip=True,
        ),
        DatasetInfo(
            name="mnist",
            display_name="MNIST",
            tv_class=tv_datasets.MNIST,
            uses_split=False,
            storage="NHW",
            label_attr="targets",
            on_disk="MNIST/raw/",
            apt_package=None,
            shape=(1, 28, 28),
            num_classes=10,
            mean=(0.1307,),
            std=(0.3081,),
            crop_padding=2,
            hflip=False,
        ),
        DatasetInfo(
            name="cifar10",
            display_name="CIFAR-10",
            tv_class=tv_datasets.CIFAR10,
            uses_split=False,
            storage="NHWC",
            label_attr="targets",
            on_disk="cifar-10-batches-py/",
            apt_package=None,
            shape=(3, 32, 32),
            num_classes=10,
            mean=(0.4914, 0.4822, 0.4465),
            std=(0.2023, 0.1994, 0.2010),
            crop_padding=4,
            hflip=True,
        ),
        DatasetInfo(
            name="cifar100",
            display_name="CIFAR-100",
            tv_class=tv_datasets.CIFAR100,
            uses_split=False,
            storage="NHWC",
            label_attr="targets",
            on_disk="cifar-100-python/",
            apt_package=None,
            shape=(3, 32, 32),
            num_classes=100,
            mean=(0.5071, 0.4865, 0.4409),
            std=(0.2673, 0.2564, 0.2762),
            crop_padding=4,
            hflip=True,
        ),
        DatasetInfo(
            name="svhn",
            display_name="SVHN",
            tv_class=tv_datasets.SVHN,
            uses_split=True,
            storage="NCHW",
            label_attr="labels",
            on_disk="train_32x32.mat and test_32x32.mat",
            apt_package=None,
            shape=(3, 32, 32),
            num_classes=10,
            mean=(0.4376821, 0.4437697, 0.47280442),
            std=(0.19803012, 0.20101562, 0.19703614),
            crop_padding=2,
            hflip=False,  # digits are not mirror-symmetric
            jitter=ColorJitter(
                brightness=(1 - 63 / 255, 1 + 63 / 255),
                contrast=(0.2, 1.8),
                saturation=(0.5, 1.5),
            ),
        ),
    )
}


def class_names(info: DatasetInfo) -> tuple[str, ...] | None:
    """The dataset's label names (torchvision's `classes`), e.g. Fashion-MNIST's 'T-shirt/top', 'Trouser'."""
    names = getattr(info.tv_class, "classes", None)
    return tuple(names) if isinstance(names, list) and len(names) == info.num_classes else None


def _folder_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def folder_labels(folders: list[str], info: DatasetInfo) -> dict[str, int]:
    """Class folder -> label: a number 0..K-1, or the dataset's class name (case, spaces and
    punctuation ignored; a unique prefix is enough: 'T-shirt' is 'T-shirt/top'). Anything else is an
    error naming what is expected, never a silent relabelling by sorted order."""
    names = class_names(info) or ()
    keys = [_folder_key(n) for n in names]
    labels = {}
    for folder in folders:
        if folder.isdigit() and int(folder) < info.num_classes:
            labels[folder] = int(folder)
            continue
        key = _folder_key(folder)
        hits = [i for i, k in enumerate(keys) if k == key] or [i for i, k in enumerate(keys) if key and k.startswith(key)]
        if len(hits) != 1:
            expected = ", ".join(repr(n) for n in names) if names else f"0..{info.num_classes - 1}"
            raise DatasetUnavailable(f"class folder {folder!r} is not one of {info.display_name}'s classes: "
                                     f"name each folder after a class ({expected}) or its number 0..{info.num_classes - 1}")
        labels[folder] = hits[0]
    return labels


def get_dataset_info(name: str) -> DatasetInfo:
    """Registry lookup that fails with the list of valid names."""
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}") from None


@dataclass
class ArrayDataset:
    """A whole dataset in memory: uint8 images N×C×H×W and int64 labels N."""

    images: torch.Tensor
    labels: torch.Tensor
    info: DatasetInfo

    def __post_init__(self) -> None:
        # Fail here rather than deep inside a training step.
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"images must be a uint8 N×C×H×W tensor, got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if tuple(self.images.shape[1:]) != self.info.shape:
            raise ValueError(f"{self.info.name} images must be {self.info.shape}, got {tuple(self.images.shape[1:])}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be an int64 tensor of length {self.images.shape[0]}, "
                f"got {self.labels.dtype} {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.images.shape[0]


def resolve_data_root(root: str | Path | None = None) -> Path:
    """Where datasets live: `root`, else $NEFL_DATA_ROOT, else ~/.cache/nefl/data."""
    if root is None:
        root = os.environ.get(ENV_DATA_ROOT) or DEFAULT_DATA_ROOT
    return Path(root).expanduser()


def _extract_system_copy(system_dir: Path, raw_dir: Path) -> None:
    """Gunzip the Debian package's IDX files into raw_dir, skipping ones already there.

    The packaged .gz files have other checksums than torchvision's, so torchvision
    would reject them; the unpacked IDX files are what it reads. Each file is
    written atomically (nefl/support/fsio.py), so a concurrent or interrupted run never
    leaves a truncated file behind.
    """
    raw_dir.mkdir(parents=True, exist_ok=True)
    for gz_path in sorted(system_dir.glob("*.gz")):
        target = raw_dir / gz_path.stem
        if target.exists():
            continue
        atomic_write(target, lambda tmp: _gunzip(gz_path, tmp))


def _gunzip(src_path: Path, dest: str) -> None:
    with open(dest, "wb") as out, gzip.open(src_path, "rb") as src:
        shutil.copyfileobj(src, out)


def _open_torchvision(info: DatasetInfo, root: Path, train: bool, download: bool) -> tv_datasets.VisionDataset:
    split = {"split": "train" if train else "test"} if info.uses_split else {"train": train}
    return info.tv_class(str(root), download=download, **split)


def _to_array_dataset(info: DatasetInfo, tv_dataset: tv_datasets.VisionDataset) -> ArrayDataset:
    images = torch.as_tensor(tv_dataset.data)
    if info.storage == "NHW":
        images = images.unsqueeze(1)
    elif info.storage == "NHWC":
        images = images.permute(0, 3, 1, 2)
    labels = torch.as_tensor(getattr(tv_dataset, info.label_attr), dtype=torch.int64)
    return ArrayDataset(images=images.contiguous(), labels=labels, info=info)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def load_dataset(
    name: str, root: str | Path | None = None, train: bool = True, download: bool = True
) -> ArrayDataset:
    """Load a whole split into memory.

    Tries, in order: torchvision's layout under the data root (see
    `resolve_data_root`); for Fashion-MNIST, the Debian package's files unpacked
    into that root; a torchvision download when `download` is true. Raises
    `DatasetUnavailable` naming the fix when all of these fail.
    """
    info = get_dataset_info(name)
    data_root = resolve_data_root(root)
    reasons: list[str] = []

    def attempt(download_now: bool) -> ArrayDataset | None:
        try:
            return _to_array_dataset(info, _open_torchvision(info, data_root, train, download_now))
        except Exception as exc:  # torchvision raises RuntimeError, URLError, OSError, ImportError...
            if download_now:
                reasons.append(f"torchvision download failed: {_one_line(exc)}")
            elif "not found" not in str(exc).lower():
                reasons.append(f"reading {data_root} failed: {_one_line(exc)}")
            return None

    dataset = attempt(download_now=False)
    if dataset is None and info.apt_package is not None and SYSTEM_FASHION_MNIST_DIR.is_dir():
        raw_dir = data_root / info.on_disk
        try:
            _extract_system_copy(SYSTEM_FASHION_MNIST_DIR, raw_dir)
        except OSError as exc:
            reasons.append(f"unpacking {SYSTEM_FASHION_MNIST_DIR} into {raw_dir} failed: {_one_line(exc)}")
        else:
            dataset = attempt(download_now=False)
    if dataset is None and download:
        dataset = attempt(download_now=True)
    if dataset is not None:
        return dataset

    if not download:
        reasons.append("download disabled")
    fix = f"pass --data-root DIR holding {info.on_disk}"
    if info.apt_package is not None:
        fix = f"install it with `apt-get install {info.apt_package}` or {fix}"
    raise DatasetUnavailable(f"{info.display_name} not found: {fix} ({'; '.join(reasons)})")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def load_image_folder(root: str | Path, like: str) -> ArrayDataset:
    """A device's own images in the ImageFolder layout (ROOT/CLASS/IMAGE), shaped like dataset `like`.

    Images are converted to that dataset's channels and size so they train the same model with the
    same normalisation. Class folders are named after the dataset's classes or their numbers
    (folder_labels), so a device's 'Sneaker' folder trains label 7 as the model's readers expect.
    """
    from PIL import Image, UnidentifiedImageError

    info = get_dataset_info(like)
    base = Path(root)
    classes = sorted(d.name for d in base.iterdir() if d.is_dir()) if base.is_dir() else []
    if not classes:
        raise DatasetUnavailable(f"{base}: no class folders; expected {base}/CLASS/IMAGE.png (one folder per class)")
    labels_of = folder_labels(classes, info)
    c, h, w = info.shape
    images, labels = [], []
    for cls in classes:
        for f in sorted((base / cls).iterdir()):
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(f) as im:
                    pixels = np.asarray(im.convert("L" if c == 1 else "RGB").resize((w, h)), dtype=np.uint8)
            except (UnidentifiedImageError, OSError) as e:
                raise DatasetUnavailable(f"{f}: not a readable image ({e}); remove it from the data folder") from None
            images.append(pixels.reshape(h, w, c).transpose(2, 0, 1))
            labels.append(labels_of[cls])
    if not images:
        raise DatasetUnavailable(f"{base}: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders")
    return ArrayDataset(torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64), info)


def random_crop(images: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad by `padding` and crop back to H×W at a random offset per image.

    One advanced-indexing gather instead of a per-image loop.
    """
    b, c, h, w = images.shape
    padded = images.new_zeros((b, c, h + 2 * padding, w + 2 * padding))
    padded[:, :, padding : padding + h, padding : padding + w] = images
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


def random_hflip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = torch.rand(images.shape[0], generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    if images.shape[1] == 1:
        return images
    weights = torch.tensor([0.2989, 0.587, 0.114], dtype=images.dtype).view(1, 3, 1, 1)
    return (images * weights).sum(dim=1, keepdim=True)


def color_jitter(images: torch.Tensor, jitter: ColorJitter, generator: torch.Generator) -> torch.Tensor:
    """Per-image brightness, contrast and saturation factors on float images in [0, 1].

    Same blends as torchvision's ColorJitter, applied in a fixed order so the
    whole batch is processed at once.
    """
    b = images.shape[0]

    def factors(bounds: tuple[float, float]) -> torch.Tensor:
        lo, hi = bounds
        return (lo + (hi - lo) * torch.rand(b, generator=generator)).view(b, 1, 1, 1)

    def blend(x: torch.Tensor, other: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return (f * x + (1 - f) * other).clamp_(0.0, 1.0)

    x = (images * factors(jitter.brightness)).clamp_(0.0, 1.0)
    x = blend(x, _grayscale(x).mean(dim=(1, 2, 3), keepdim=True), factors(jitter.contrast))
    return blend(x, _grayscale(x), factors(jitter.saturation))


def _epoch_seed(seed: int, epoch: int) -> int:
    # Distinct, reproducible generator seed per (seed, epoch) pair.
    return (seed * 0x9E3779B97F4A7C15 + epoch) % 2**64


class BatchLoader:
    """Iterates normalised (x float32 N×C×H×W, y int64) batches over a subset of an ArrayDataset.

    Each `__iter__` call is one epoch and advances `epoch`; the random stream of an
    epoch depends only on (seed, epoch), so a run is reproducible end to end.
    """

    def __init__(
        self,
        dataset: ArrayDataset,
        indices: Sequence[int] | torch.Tensor | None,
        batch_size: int,
        shuffle: bool,
        augment: bool,
        seed: int,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if indices is None:
            idx = torch.arange(len(dataset))
        else:
            idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
            if idx.numel() and (idx.min() < 0 or idx.max() >= len(dataset)):
                raise ValueError(f"indices must lie in [0, {len(dataset)})")
        self.dataset = dataset
        self.indices = idx
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.augment = augment
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        channels = dataset.info.shape[0]
        self._mean = torch.tensor(dataset.info.mean, dtype=torch.float32).view(1, channels, 1, 1)
        self._std = torch.tensor(dataset.info.std, dtype=torch.float32).view(1, channels, 1, 1)

    @property
    def num_samples(self) -> int:
        """Samples seen per epoch (drop_last may skip a few)."""
        if self.drop_last:
            return len(self) * self.batch_size
        return self.indices.numel()

    def __len__(self) -> int:
        n = self.indices.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        self.epoch += 1
        order = self.indices
        if self.shuffle:
            order = order[torch.randperm(order.numel(), generator=generator)]
        return self._batches(order, generator)

    def _batches(
        self, order: torch.Tensor, generator: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = self.dataset.info
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            x = self.dataset.images[idx]
            if self.augment and info.crop_padding:
                x = random_crop(x, info.crop_padding, generator)
            if self.augment and info.hflip:
                x = random_hflip(x, generator)
            x = x.to(torch.float32).div_(255.0)
            if self.augment and info.jitter is not None:
                x = color_jitter(x, info.jitter, generator)
            yield (x - self._mean) / self._std, self.dataset.labels[idx]


def partition_iid(num_samples: int, num_clients: int, seed: int) -> list[torch.Tensor]:
    """Split a random permutation of range(num_samples) into shards whose sizes differ by at most one.

    Each shard is sorted (it is a set; BatchLoader does the shuffling).
    """
    if not 1 <= num_clients <= num_samples:
        raise ValueError(f"need 1 <= num_clients <= num_samples, got {num_clients} clients for {num_samples} samples")
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    return [shard.sort().values for shard in torch.tensor_split(perm, num_clients)]


def partition_dirichlet(
    labels: torch.Tensor, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> list[torch.Tensor]:
    """Label-skewed split: each class is spread over clients by Dirichlet(alpha) proportions.

    The usual scheme (Hsu et al. 2019; Wang et al. 2020, FedMA): clients already
    holding more than an equal share get no more samples, and the whole draw is
    repeated until every client has at least `min_size` samples. Smaller alpha
    means stronger skew. Each shard is sorted.
    """
    y = torch.as_tensor(labels).reshape(-1).cpu().numpy()
    n = y.size
    if num_clients < 1 or alpha <= 0 or min_size < 0:
        raise ValueError(f"need num_clients >= 1, alpha > 0, min_size >= 0; got {num_clients}, {alpha}, {min_size}")
    if n == 0 or num_clients * min_size > n:
        raise ValueError(f"{n} samples cannot give {num_clients} clients at least {min_size} samples each")
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == k) for k in np.unique(y)]
    for _ in range(_DIRICHLET_MAX_TRIES):
        shards: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            members = rng.permutation(members)
            drawn = rng.dirichlet(np.full(num_clients, alpha))
            proportions = drawn * (sizes < n / num_clients)
            # Tiny alpha can underflow the eligible clients' shares to zero.
            proportions = proportions / proportions.sum() if proportions.sum() > 0 else drawn / drawn.sum()
            cuts = (np.cumsum(proportions) * members.size).astype(np.int64)[:-1]
            for client, part in enumerate(np.split(members, cuts)):
                shards[client].append(part)
                sizes[client] += part.size
        if sizes.min() >= min_size:
            return [torch.from_numpy(np.sort(np.concatenate(parts))).to(torch.int64) for parts in shards]
    raise ValueError(
        f"gave up after {_DIRICHLET_MAX_TRIES} Dirichlet draws: could not give all {num_clients} clients "
        f"at least {min_size} of {n} samples with alpha={alpha}; "
        "use a larger alpha, fewer clients or a smaller min_size"
    )


_PARTITION_RE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


def parse_partition(spec: str) -> tuple[int, int]:
    """Parse a 1-based "I/N" client spec (as typed on a command line) into (zero-based I, N)."""
    match = _PARTITION_RE.fullmatch(spec)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"invalid partition {spec!r}: expected I/N with 1 <= I <= N, e.g. '2/4'")
    return int(match[1]) - 1, int(match[2])
