import json

import pytest
import torch

from nefl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout


@pytest.fixture
def saved(tmp_path):
    layout = Layout.build(load_profile("resnet20-fmnist-wd"))
    state = GlobalState.init(layout, seed=5)
    save_checkpoint(tmp_path, state, layout, {"round": 3})
    return tmp_path, layout, state


def test_roundtrip_is_bit_identical(saved) -> None:
    d, layout, state = saved
    ck = load_checkpoint(d)
    assert ck.meta["round"] == 3 and ck.meta["method"] == "nefl"
    for n, t in state.flat().items():
        assert torch.equal(ck.state.flat()[n], t)
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp files left


def test_other_profile_is_refused(saved) -> None:
    d, _, _ = saved
    with pytest.raises(CheckpointError, match="resnet20-fmnist-wd.*not 'resnet20-fmnist-w'"):
        load_checkpoint(d, load_profile("resnet20-fmnist-w"))


def test_corrupt_files_are_refused(saved) -> None:
    d, _, _ = saved
    blob = (d / "state.safetensors").read_bytes()
    (d / "state.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="corrupt state file"):
        load_checkpoint(d)
    (d / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt metadata"):
        load_checkpoint(d)


def test_tensor_of_wrong_shape_is_refused(tmp_path, saved) -> None:
    d, layout, state = saved
    state.consistent["fc.weight"] = torch.zeros(10, 3)
    save_checkpoint(tmp_path / "bad", state, layout, {"round": 0})
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_checkpoint(tmp_path / "bad")


def test_missing_checkpoint_says_where(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        load_checkpoint(tmp_path / "nothing")


def test_meta_records_profile_hash(saved) -> None:
    d, layout, _ = saved
    meta = json.loads((d / "meta.json").read_text())
    assert meta["profile_hash"] == layout.profile.hash and meta["profile"] == "resnet20-fmnist-wd"
