"""Tests for nefl.nested.data: loading, batching/augmentation, partitions."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import pytest
import torch

from nefl.nested import data
from nefl.nested.data import (
    DATASETS,
    ArrayDataset,
    BatchLoader,
    ColorJitter,
    DatasetUnavailable,
    color_jitter,
    load_dataset,
    parse_partition,
    partition_dirichlet,
    partition_iid,
    random_crop,
    random_hflip,
)

SYSTEM_DIR_PRESENT = data.SYSTEM_FASHION_MNIST_DIR.is_dir()
needs_system_fmnist = pytest.mark.skipif(
    not SYSTEM_DIR_PRESENT,
    reason=f"{data.SYSTEM_FASHION_MNIST_DIR} absent: install Debian package dataset-fashion-mnist",
)


# ---------------------------------------------------------------- helpers


def synthetic(name: str, n: int, seed: int = 0) -> ArrayDataset:
    info = DATASETS[name]
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, *info.shape), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, info.num_classes, (n,), generator=g)
    return ArrayDataset(images=images, labels=labels, info=info)


def write_idx_gz(path: Path, array: torch.Tensor) -> None:
    """Write a uint8 tensor as a gzipped IDX file, the format of the Debian package."""
    header = struct.pack(">HBB", 0, 0x08, array.dim()) + struct.pack(f">{array.dim()}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.contiguous().numpy().tobytes())


@pytest.fixture
def fake_system_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """A tiny stand-in for /usr/share/datasets/fashion-mnist (12 train, 5 test images)."""
    system = tmp_path / "system"
    system.mkdir()
    g = torch.Generator().manual_seed(1)
    arrays = {
        "train-images-idx3-ubyte": torch.randint(0, 256, (12, 28, 28), generator=g, dtype=torch.uint8),
        "train-labels-idx1-ubyte": torch.arange(12, dtype=torch.uint8) % 10,
        "t10k-images-idx3-ubyte": torch.randint(0, 256, (5, 28, 28), generator=g, dtype=torch.uint8),
        "t10k-labels-idx1-ubyte": torch.tensor([3, 1, 4, 1, 5], dtype=torch.uint8),
    }
    for stem, array in arrays.items():
        write_idx_gz(system / f"{stem}.gz", array)
    monkeypatch.setattr(data, "SYSTEM_FASHION_MNIST_DIR", system)
    return arrays


@pytest.fixture(scope="module")
def real_fmnist(tmp_path_factory: pytest.TempPathFactory) -> tuple[ArrayDataset, ArrayDataset]:
    if not SYSTEM_DIR_PRESENT:
        pytest.skip(f"{data.SYSTEM_FASHION_MNIST_DIR} absent: install Debian package dataset-fashion-mnist")
    root = tmp_path_factory.mktemp("fmnist")
    return load_dataset("fashion-mnist", root=root, download=False), load_dataset(
        "fashion-mnist", root=root, train=False, download=False
    )


# ---------------------------------------------------------------- registry and loading


def test_registry_entries_are_consistent() -> None:
    assert set(DATASETS) == {"fashion-mnist", "mnist", "cifar10", "cifar100", "svhn"}
    for info in DATASETS.values():
        assert len(info.mean) == len(info.std) == info.shape[0]
    assert DATASETS["cifar10"].mean == (0.4914, 0.4822, 0.4465)
    assert DATASETS["cifar100"].num_classes == 100
    assert (DATASETS["svhn"].hflip, DATASETS["svhn"].crop_padding) == (False, 2)
    assert DATASETS["svhn"].jitter is not None
    assert (DATASETS["fashion-mnist"].hflip, DATASETS["mnist"].hflip) == (True, False)


@needs_system_fmnist
def test_real_fashion_mnist_loads(real_fmnist: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, test = real_fmnist
    assert train.images.shape == (60000, 1, 28, 28)
    assert test.images.shape == (10000, 1, 28, 28)
    for split in (train, test):
        assert split.images.dtype == torch.uint8
        assert split.labels.dtype == torch.int64
        assert split.labels.unique().tolist() == list(range(10))
    assert test.labels.bincount().tolist() == [1000] * 10


@needs_system_fmnist
def test_real_fashion_mnist_normalises_to_zero_mean_unit_std(real_fmnist: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, _ = real_fmnist
    x = torch.cat([x for x, _ in BatchLoader(train, None, 20000, shuffle=False, augment=False, seed=0)])
    assert abs(x.mean().item()) < 0.01
    assert abs(x.std().item() - 1) < 0.01


def test_system_copy_is_extracted_once_into_env_root(
    fake_system_dir: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("NEFL_DATA_ROOT", str(cache))
    train = load_dataset("fashion-mnist", download=False)
    test = load_dataset("fashion-mnist", train=False, download=False)

    raw = cache / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(fake_system_dir)  # no temp files left
    assert torch.equal(train.images[:, 0], fake_system_dir["train-images-idx3-ubyte"])
    assert torch.equal(train.labels, fake_system_dir["train-labels-idx1-ubyte"].long())
    assert test.labels.tolist() == [3, 1, 4, 1, 5]

    mtimes = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    load_dataset("fashion-mnist", download=False)
    assert {p.name: p.stat().st_mtime_ns for p in raw.iterdir()} == mtimes


def test_explicit_root_wins_over_env(
    fake_system_dir: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEFL_DATA_ROOT", str(tmp_path / "env"))
    load_dataset("fashion-mnist", root=tmp_path / "explicit", download=False)
    assert (tmp_path / "explicit" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    assert not (tmp_path / "env").exists()


def test_missing_fashion_mnist_names_both_fixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "SYSTEM_FASHION_MNIST_DIR", tmp_path / "missing")
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("fashion-mnist", root=tmp_path / "empty", download=False)
    message = str(err.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data-root" in message and "FashionMNIST/raw/" in message
    assert "\n" not in message


def test_missing_cifar_names_data_root(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable, match=r"--data-root DIR holding cifar-10-batches-py/"):
        load_dataset("cifar10", root=tmp_path, download=False)


def test_unknown_dataset_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"imagenet.*fashion-mnist.*svhn"):
        load_dataset("imagenet", download=False)


def test_array_dataset_rejects_wrong_shapes() -> None:
    info = DATASETS["mnist"]
    with pytest.raises(ValueError, match="uint8"):
        ArrayDataset(torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long), info)
    with pytest.raises(ValueError, match=r"\(1, 28, 28\)"):
        ArrayDataset(torch.zeros(2, 3, 28, 28, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), info)
    with pytest.raises(ValueError, match="labels"):
        ArrayDataset(torch.zeros(2, 1, 28, 28, dtype=torch.uint8), torch.zeros(3, dtype=torch.long), info)


# ---------------------------------------------------------------- BatchLoader


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_batches_have_shapes_dtypes_and_count(name: str) -> None:
    ds = synthetic(name, 50)
    for augment in (False, True):
        loader = BatchLoader(ds, None, 16, shuffle=True, augment=augment, seed=0)
        batches = list(loader)
        assert len(loader) == len(batches) == 4
        assert [x.shape[0] for x, _ in batches] == [16, 16, 16, 2]
        assert loader.num_samples == 50
        for x, y in batches:
            assert x.dtype == torch.float32 and x.shape[1:] == DATASETS[name].shape
            assert y.dtype == torch.int64
    dropped = BatchLoader(ds, None, 16, shuffle=True, augment=False, seed=0, drop_last=True)
    assert len(dropped) == len(list(dropped)) == 3
    assert dropped.num_samples == 48


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_normalisation_uses_per_channel_mean_and_std(name: str) -> None:
    info = DATASETS[name]
    channel_mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    images = (channel_mean * 255).round().to(torch.uint8).expand(4, *info.shape).contiguous()
    ds = ArrayDataset(images, torch.zeros(4, dtype=torch.long), info)
    (x, _), = BatchLoader(ds, None, 4, shuffle=False, augment=False, seed=0)
    assert x.abs().max() < 0.5 / 255 / min(info.std) + 1e-6
    ones = ArrayDataset(torch.full((1, *info.shape), 255, dtype=torch.uint8), torch.zeros(1, dtype=torch.long), info)
    (x, _), = BatchLoader(ones, None, 1, shuffle=False, augment=False, seed=0)
    expected = (1 - torch.tensor(info.mean)) / torch.tensor(info.std)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), expected)


def test_indices_are_honoured_and_unshuffled_order_kept() -> None:
    ds = synthetic("mnist", 30)
    picked = [7, 3, 22, 0]
    (x, y), = BatchLoader(ds, picked, 8, shuffle=False, augment=False, seed=0)
    assert torch.equal(y, ds.labels[picked])
    plain = (ds.images[picked].float() / 255 - 0.1307) / 0.3081
    assert torch.allclose(x, plain)
    with pytest.raises(ValueError, match="indices"):
        BatchLoader(ds, [30], 8, shuffle=False, augment=False, seed=0)


def test_shuffle_covers_every_index_once_per_epoch() -> None:
    # Tag each image with its index in pixel (0, 0) so batches reveal what they hold.
    ds = synthetic("mnist", 200)
    ds.images[:, 0, 0, 0] = torch.arange(200, dtype=torch.uint8)
    subset = torch.arange(1, 200, 3)
    loader = BatchLoader(ds, subset, 16, shuffle=True, augment=False, seed=5)
    orders = []
    for _ in range(2):
        seen = torch.cat([x[:, 0, 0, 0] for x, _ in loader]) * 0.3081 + 0.1307
        seen = (seen * 255).round().long()
        assert sorted(seen.tolist()) == subset.tolist()
        orders.append(seen)
    assert not torch.equal(orders[0], orders[1]), "each epoch should reshuffle"
    assert not torch.equal(orders[0], subset)


def test_same_seed_gives_same_batches_and_epochs_differ() -> None:
    ds = synthetic("svhn", 40)

    def epochs(seed: int) -> list[list[torch.Tensor]]:
        loader = BatchLoader(ds, None, 16, shuffle=True, augment=True, seed=seed)
        return [[x for x, _ in loader] for _ in range(2)]

    a, b, c = epochs(3), epochs(3), epochs(4)
    for ea, eb in zip(a, b):
        assert all(torch.equal(xa, xb) for xa, xb in zip(ea, eb))
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], c[0][0])


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_augmentation_changes_images_but_keeps_shapes(name: str) -> None:
    ds = synthetic(name, 32)
    (plain, y0), = BatchLoader(ds, None, 32, shuffle=False, augment=False, seed=0)
    (aug, y1), = BatchLoader(ds, None, 32, shuffle=False, augment=True, seed=0)
    assert aug.shape == plain.shape and aug.dtype == plain.dtype
    assert torch.equal(y0, y1)
    changed = (aug != plain).flatten(1).any(dim=1)
    assert changed.float().mean() > 0.5


def test_random_crop_is_a_shifted_window_of_the_padded_image() -> None:
    images = torch.randint(1, 256, (64, 2, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = random_crop(images, 2, torch.Generator().manual_seed(1))
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    offsets = set()
    for i in range(64):
        windows = {(dy, dx): padded[i, :, dy : dy + 6, dx : dx + 5] for dy in range(5) for dx in range(5)}
        matches = [offset for offset, window in windows.items() if torch.equal(out[i], window)]
        assert len(matches) == 1
        offsets.add(matches[0])
    assert len(offsets) > 10, "offsets should vary per sample"


def test_random_hflip_flips_about_half() -> None:
    images = torch.randint(0, 256, (200, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = random_hflip(images, torch.Generator().manual_seed(1))
    flipped = (out == images.flip(-1)).flatten(1).all(dim=1)
    kept = (out == images).flatten(1).all(dim=1)
    assert bool((flipped | kept).all())
    assert 60 < int(flipped.sum()) < 140


def test_color_jitter_stays_in_range_and_identity_factors_are_noops() -> None:
    images = torch.rand(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = color_jitter(images, DATASETS["svhn"].jitter, torch.Generator().manual_seed(1))
    assert out.shape == images.shape
    assert out.min() >= 0 and out.max() <= 1
    assert not torch.allclose(out, images)
    identity = ColorJitter(brightness=(1, 1), contrast=(1, 1), saturation=(1, 1))
    assert torch.allclose(color_jitter(images, identity, torch.Generator()), images)
    gray = images[:, :1].expand(-1, 3, -1, -1)
    desaturate = ColorJitter(brightness=(1, 1), contrast=(1, 1), saturation=(0, 0))
    assert torch.allclose(color_jitter(gray, desaturate, torch.Generator()), gray, atol=1e-3)


# ---------------------------------------------------------------- partitions


def assert_disjoint_and_complete(shards: list[torch.Tensor], n: int) -> None:
    assert all(s.dtype == torch.int64 for s in shards)
    assert sum(s.numel() for s in shards) == n
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(n))


def test_iid_partition_is_disjoint_complete_balanced_and_seeded() -> None:
    shards = partition_iid(1003, 10, seed=0)
    assert len(shards) == 10
    assert_disjoint_and_complete(shards, 1003)
    assert {s.numel() for s in shards} == {100, 101}
    assert all(torch.equal(a, b) for a, b in zip(shards, partition_iid(1003, 10, seed=0)))
    assert not torch.equal(shards[0], partition_iid(1003, 10, seed=1)[0])
    with pytest.raises(ValueError):
        partition_iid(5, 6, seed=0)


def label_skew(shards: list[torch.Tensor], labels: torch.Tensor) -> float:
    """Mean over clients of the largest single-class fraction of its samples."""
    return sum(labels[s].bincount(minlength=10).max().item() / s.numel() for s in shards) / len(shards)


def test_dirichlet_partition_is_disjoint_complete_seeded_and_skewed() -> None:
    labels = torch.arange(5000) % 10
    skewed = partition_dirichlet(labels, 10, alpha=0.1, seed=0)
    even = partition_dirichlet(labels, 10, alpha=100.0, seed=0)
    for shards in (skewed, even):
        assert len(shards) == 10
        assert_disjoint_and_complete(shards, 5000)
        assert min(s.numel() for s in shards) >= 10
    again = partition_dirichlet(labels, 10, alpha=0.1, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(skewed, again))
    other = partition_dirichlet(labels, 10, alpha=0.1, seed=1)
    assert any(not torch.equal(a, b) for a, b in zip(skewed, other))
    assert label_skew(skewed, labels) > 0.5
    assert label_skew(even, labels) < 0.2


def test_dirichlet_partition_respects_min_size_and_gives_up_clearly() -> None:
    labels = torch.arange(1000) % 10
    shards = partition_dirichlet(labels, 20, alpha=0.5, seed=0, min_size=30)
    assert min(s.numel() for s in shards) >= 30
    with pytest.raises(ValueError, match="cannot give"):
        partition_dirichlet(labels, 20, alpha=0.5, seed=0, min_size=51)
    two_classes = torch.arange(200) % 2
    with pytest.raises(ValueError, match="gave up"):
        partition_dirichlet(two_classes, 20, alpha=0.001, seed=0, min_size=10)


@pytest.mark.parametrize(
    ("spec", "expected"), [("2/4", (1, 4)), ("1/1", (0, 1)), ("4/4", (3, 4)), (" 3 / 10 ", (2, 10))]
)
def test_parse_partition_accepts_one_based_specs(spec: str, expected: tuple[int, int]) -> None:
    assert parse_partition(spec) == expected


@pytest.mark.parametrize("spec", ["0/4", "5/4", "2/0", "-1/4", "2", "a/b", "", "2/4/6", "1.5/4"])
def test_parse_partition_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match=r"expected I/N"):
        parse_partition(spec)


def test_image_folder_of_a_device_is_shaped_like_the_dataset(tmp_path) -> None:
    from PIL import Image

    from nefl.nested.data import load_image_folder

    for label in (0, 3):
        (tmp_path / str(label)).mkdir()
        for i in range(2):
            Image.new("RGB", (40, 30), (label * 60, 10, 10)).save(tmp_path / str(label) / f"{i}.png")
    (tmp_path / "3" / "notes.txt").write_text("not an image, skipped")
    ds = load_image_folder(tmp_path, "fashion-mnist")
    assert ds.images.shape == (4, 1, 28, 28) and ds.images.dtype == torch.uint8
    assert ds.labels.tolist() == [0, 0, 3, 3]
    (tmp_path / "0" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DatasetUnavailable, match="broken.png: not a readable image"):
        load_image_folder(tmp_path, "fashion-mnist")
    with pytest.raises(DatasetUnavailable, match="no class folders"):
        load_image_folder(tmp_path / "0", "fashion-mnist")


def test_class_folders_are_matched_to_the_dataset_class_names(tmp_path) -> None:
    from PIL import Image

    from nefl.nested.data import load_image_folder

    for folder in ("Sneaker", "trouser", "T-shirt", "9"):
        (tmp_path / folder).mkdir()
        Image.new("L", (28, 28), 5).save(tmp_path / folder / "a.png")
    ds = load_image_folder(tmp_path, "fashion-mnist")  # sorted folders: 9, Sneaker, T-shirt, trouser
    assert ds.labels.tolist() == [9, 7, 0, 1]
    (tmp_path / "Sneakers2").mkdir()
    Image.new("L", (28, 28), 5).save(tmp_path / "Sneakers2" / "a.png")
    with pytest.raises(DatasetUnavailable, match="'Sneakers2' is not one of Fashion-MNIST's classes.*'Ankle boot'"):
        load_image_folder(tmp_path, "fashion-mnist")
