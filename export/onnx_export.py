"""Export every submodel of a checkpoint to ONNX, verify it, and write the manifest last.

Each file comes from the physically smaller module of its submodel (its own widths, blocks, BN and
step sizes), folded (see fold.py), exported with a dynamic batch axis and checked twice: by
onnx.checker and by running it in onnxruntime against the unfolded torch module. Any failure
raises before manifest.json exists, so a directory with a manifest is always a verified export.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import onnx
import torch

from export.fold import fold, fold_error
from export.parity import (
    PARITY_ATOL, PARITY_BATCHES, PARITY_FILE, PARITY_RTOL, ParityError, ReferenceData, normalisation, parity,
    reference_data, top1, torch_logits, write_reference,
)
from export.quantize import quantize_int8
from nefl.nested.checkpoint import STATE_FILE, UPDATES_TOTAL_KEY, Checkpoint, checkpoint_files, load_checkpoint
from nefl.nested.cost import submodel_cost
from nefl.protocol.manifest import (
    InputSpec, Int8File, Manifest, OutputSpec, ParitySpec, SubmodelEntry, sha256_file, untrained_reason, write_manifest,
)
from nefl.nested.state import load_module_state

log = logging.getLogger(__name__)

FOLD_TOLERANCE = 1e-5  # relative to the largest logit (fold_error)
INPUT_NAME, OUTPUT_NAME = "input", "logits"
EVAL_IMAGES = 2000  # held-out test images for the fp32/int8 accuracy
CALIBRATION_IMAGES = 256  # taken after the held-out ones: never the images the accuracy is measured on
PARITY_IMAGES = 8


def submodel_module(ckpt: Checkpoint, k: int) -> torch.nn.Module:
    """Submodel k as the physically smaller module with its own weights, in eval mode."""
    model = ckpt.layout.module(k)
    load_module_state(model, ckpt.state.extract(ckpt.layout, k))
    return model.eval()


def export_onnx(model: torch.nn.Module, path: Path, example: torch.Tensor, metadata: dict[str, Any]) -> None:
    """torch.export-based exporter (the legacy TorchScript one is deprecated) with a dynamic batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), dynamo=True, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False,
        )
    proto = program.model_proto
    onnx.helper.set_model_props(proto, {k: str(v) for k, v in metadata.items()})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


def _accuracy(ckpt: Checkpoint, k: int) -> float | None:
    acc = ckpt.meta.get("accuracy")
    return float(acc[k]) if isinstance(acc, list) and k < len(acc) and acc[k] is not None else None


def _updates(ckpt: Checkpoint, k: int) -> int | None:
    totals = ckpt.meta.get(UPDATES_TOTAL_KEY)
    return int(totals[k]) if isinstance(totals, list) and k < len(totals) and isinstance(totals[k], int) else None


def _submodel_entry(ckpt: Checkpoint, k: int, path: Path, diff: float, int8: Int8File | None) -> SubmodelEntry:
    profile = ckpt.layout.profile
    spec = profile.submodels[k]
    cost = submodel_cost(profile, spec)
    return SubmodelEntry(
        index=k, file=path.name, sha256=sha256_file(path),
        gamma=spec.gamma, gamma_w=spec.gamma_w, params=cost.params, flops=cost.macs,
        weight_bytes=4 * cost.params, activation_bytes_per_sample=4 * cost.activations,
        accuracy=_accuracy(ckpt, k), parity_max_diff=diff, int8=int8, updates=_updates(ckpt, k),
    )


def _trained(ckpt: Checkpoint, indices: list[int], include_untrained: bool) -> list[int]:
    """The submodels worth exporting; says which are not and why."""
    keep = []
    for k in indices:
        why = untrained_reason(_updates(ckpt, k), _accuracy(ckpt, k), ckpt.layout.profile.num_classes)
        if why is not None:
            log.warning(f"submodel {k + 1}: {why}" + ("; exporting it anyway (--include-untrained)" if include_untrained
                                                      else "; skipped (--include-untrained exports it anyway)"))
        if why is None or include_untrained:
            keep.append(k)
    if not keep:
        raise ValueError("no trained submodel to export: run more rounds (with --assignment coverage every submodel "
                         "trains), or pass --include-untrained")
    return keep


def _metadata(ckpt: Checkpoint, k: int) -> dict[str, Any]:
    profile = ckpt.layout.profile
    spec = profile.submodels[k]
    cost = submodel_cost(profile, spec)
    return {
        "profile": profile.name, "profile_hash": profile.hash, "method": ckpt.layout.method.name,
        "submodel_index": k, "gamma": spec.gamma, "gamma_w": spec.gamma_w,
        "parameters": cost.params, "flops": cost.macs, "source_round": ckpt.meta.get("round"),
        "accuracy": _accuracy(ckpt, k),
    }


def _quantize(fp32: Path, data: ReferenceData) -> Int8File:
    assert data.labels is not None
    held_x, held_y = data.inputs[:EVAL_IMAGES], data.labels[:EVAL_IMAGES]
    int8 = quantize_int8(fp32, fp32.with_name(fp32.stem + ".int8.onnx"), data.inputs[EVAL_IMAGES:], INPUT_NAME)
    acc32, acc8 = top1(fp32, held_x, held_y), top1(int8, held_x, held_y)
    return Int8File(
        file=int8.name, sha256=sha256_file(int8), format="QDQ static, per-channel int8 weights",
        accuracy_fp32=acc32, accuracy_int8=acc8, accuracy_delta=acc8 - acc32, eval_images=len(held_y),
    )


def export_checkpoint(
    checkpoint_dir: str | Path, out_dir: str | Path, quantize: str | None = None,
    data_root: str | Path | None = None, submodels: Sequence[int] | None = None,
    on_step: Callable[[str], None] = lambda _msg: None, include_untrained: bool = False,
) -> dict[str, Any]:
    """Export, verify and (optionally) quantize; returns the manifest it wrote to out_dir, as plain JSON data.

    `submodels` (0-based) limits the export to some rungs of the ladder, e.g. for a device that
    will never run the largest ones. A submodel the checkpoint says was never trained, or whose
    recorded accuracy is near chance, is skipped with a warning unless `include_untrained`.
    """
    if quantize not in (None, "int8"):
        raise ValueError(f"unknown quantization {quantize!r}; the only choice is 'int8'")
    ckpt = load_checkpoint(checkpoint_dir)
    profile = ckpt.layout.profile
    indices = list(range(profile.num_submodels)) if submodels is None else sorted(set(submodels))
    if not indices or not all(0 <= k < profile.num_submodels for k in indices):
        raise ValueError(f"submodels must be in 1..{profile.num_submodels}, got {[k + 1 for k in indices]}")
    indices = _trained(ckpt, indices, include_untrained)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count = EVAL_IMAGES + CALIBRATION_IMAGES if quantize else PARITY_IMAGES
    data = reference_data(profile, data_root, count)
    if quantize and data.labels is None:
        raise ValueError(f"int8 needs the {profile.dataset} test split to calibrate and measure accuracy; "
                         "pass --data-root DIR holding it")
    example = torch.from_numpy(data.inputs[:2])
    parity_inputs = data.inputs[:PARITY_IMAGES]
    entries, references = [], {}
    for k in indices:
        on_step(f"submodel {k + 1}: fold + export")
        model = submodel_module(ckpt, k)
        folded = fold(model)
        err = fold_error(model, folded, torch.from_numpy(data.inputs[:PARITY_IMAGES]))
        if err > FOLD_TOLERANCE:
            raise ParityError(f"submodel {k + 1}: folded BN/steps differ from the module by {err:.2e} "
                              f"(relative) > {FOLD_TOLERANCE}")
        path = out / f"submodel-{k + 1}.onnx"
        export_onnx(folded, path, example, _metadata(ckpt, k))
        on_step(f"submodel {k + 1}: parity")
        check = parity(path, model, parity_inputs)
        if not check.ok:
            raise ParityError(f"submodel {k + 1}: onnxruntime differs from torch by {check.max_diff:.2e}, over the "
                              f"bound {check.bound:.2e} = {PARITY_ATOL:g} + {PARITY_RTOL:g} x largest logit "
                              f"{check.ref_max:.3g} ({path.name}); no manifest written")
        int8 = None
        if quantize:
            on_step(f"submodel {k + 1}: int8")
            int8 = _quantize(path, data)
        entries.append(_submodel_entry(ckpt, k, path, check.max_diff, int8))
        references[k] = torch_logits(model, parity_inputs)
    reference = write_reference(out / PARITY_FILE, parity_inputs, references)
    norm = normalisation(profile)
    manifest = Manifest(
        profile=profile.name, profile_hash=profile.hash, method=ckpt.layout.method.name,
        dataset=profile.dataset, source_round=ckpt.meta.get("round"), source_checkpoint=str(checkpoint_dir),
        source_state_sha256=sha256_file(checkpoint_files(checkpoint_dir) / STATE_FILE),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        input=InputSpec(name=INPUT_NAME, shape=list(profile.input_shape), mean=list(norm.mean), std=list(norm.std)),
        output=OutputSpec(name=OUTPUT_NAME, num_classes=profile.num_classes,
                          class_names=list(norm.class_names) if norm.class_names else None),
        parity=ParitySpec(tolerance=PARITY_ATOL, rtol=PARITY_RTOL, inputs=data.source,
                          batch_sizes=list(PARITY_BATCHES), file=reference.name, sha256=sha256_file(reference)),
        submodels=entries,
    )
    write_manifest(out, manifest)
    return msgspec.to_builtins(manifest)
