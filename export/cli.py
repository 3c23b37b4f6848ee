"""`nefl-export`: write every submodel of a checkpoint to ONNX."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from nefl.support.cli_options import DataRootOption, IncludeUntrainedOption, LogOptions, OutOption
from nefl.support.extras import full_install_required
from nefl.support.logs import progress, setup_logging
from nefl.support.option_groups import grouped

app = typer.Typer(help="Export NeFL submodels to ONNX with a verified manifest.", no_args_is_help=True, add_completion=False)
log = logging.getLogger(__name__)


@app.callback()
def main() -> None:
    """Export NeFL submodels to ONNX with a verified manifest."""


def _parse_submodels(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    try:
        return [int(s) - 1 for s in spec.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected 1-based indices like '1,3,5', got {spec!r}") from None


@app.command("onnx")
@grouped
def onnx_command(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Checkpoint directory (as written by serve or simulate)."),
    out: OutOption = ...,
    quantize: str | None = typer.Option(None, "--quantize", help="'int8': also write static-QDQ int8 files "
                                        "and their accuracy delta on the test split."),
    data_root: DataRootOption = None,
    submodels: str | None = typer.Option(None, "--submodels", help="Only these submodels, 1-based, e.g. '1,3,5'."),
    include_untrained: IncludeUntrainedOption("Also export submodels the checkpoint records as never trained or no "
                                              "better than chance (skipped by default).") = False,
    *,
    logs: LogOptions,
) -> None:
    """One verified .onnx per submodel (BN and step sizes folded), then manifest.json, into --out. The parity
    check uses the dataset's test images from --data-root, or seeded random inputs where it has none."""
    with full_install_required("nefl-export onnx"):  # here, not at the top: `onnx --help` needs no torch
        from export.onnx_export import export_checkpoint
        from export.parity import ParityError
        from nefl.nested.checkpoint import CheckpointError
    setup_logging(logs.log_level, logs.log_format)
    indices = _parse_submodels(submodels)
    try:
        with progress(logs.log_format, log) as step:
            step("loading checkpoint and reference images")
            manifest = export_checkpoint(checkpoint, out, quantize, data_root, indices, on_step=step,
                                         include_untrained=include_untrained)
    except ParityError as e:
        log.error(f"parity failed: {e}")
        raise typer.Exit(1) from None
    except (CheckpointError, ValueError) as e:
        log.error(str(e).replace("--checkpoint-dir", "--checkpoint"))  # the library names serve's option, not this one's
        raise typer.Exit(2) from None
    for entry in manifest["submodels"]:
        line = (f"submodel {entry['index'] + 1}: {entry['file']}  gamma {entry['gamma']:g}  params {entry['params']:,}  "
                f"parity {entry['parity_max_diff']:.1e}")
        if "int8" in entry:
            q = entry["int8"]
            line += f"  int8 acc {q['accuracy_int8']:.4f} (delta {q['accuracy_delta']:+.4f})"
        print(line)
    print(f"manifest: {Path(out) / 'manifest.json'} (parity inputs: {manifest['parity']['inputs']})")
