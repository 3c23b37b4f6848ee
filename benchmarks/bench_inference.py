"""Batch-1 latency per submodel: torch eager (the trained module) vs onnxruntime fp32 and int8.

    PYTHONPATH=. python benchmarks/bench_inference.py [--checkpoint DIR] [--threads 1] [--runs 200]

Without --checkpoint it exports a freshly initialised resnet20-fmnist-w (latency does not depend
on the weights; the int8 accuracy delta of an untrained model is meaningless, pass a trained one).
Both engines get the same thread count; medians over --runs after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch
from rich.console import Console
from rich.table import Table

from edge_client.runtime import session_options
from export.onnx_export import export_checkpoint, submodel_module
from nefl.nested.checkpoint import load_checkpoint, save_checkpoint
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--out", type=Path, help="export directory (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--data-root", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="nefl-bench-"))
    ckpt_dir = args.checkpoint
    if ckpt_dir is None:
        layout = Layout.build(load_profile("resnet20-fmnist-w"))
        ckpt_dir = save_checkpoint(tmp / "ckpt", GlobalState.init(layout, 0), layout, {"round": 0})
    out = args.out or tmp / "onnx"
    manifest = export_checkpoint(ckpt_dir, out, quantize="int8", data_root=args.data_root)
    ckpt = load_checkpoint(ckpt_dir)
    x = torch.zeros(1, *ckpt.layout.profile.input_shape)
    opts = session_options(args.threads, enable_cpu_mem_arena=True)
    table = Table("submodel", "gamma", "MFLOPs", "torch eager ms", "ORT fp32 ms", "ORT int8 ms",
                  "torch / ORT fp32", "torch / ORT int8", "int8 / fp32 time", "int8 acc delta", title=f"batch 1, {args.threads} thread(s), median of {args.runs}")
    for entry in manifest["submodels"]:
        model = submodel_module(ckpt, entry["index"])
        with torch.inference_mode():
            t_torch = median_ms(lambda: model(x), args.runs)
        feed = {"input": x.numpy()}
        sess32 = ort.InferenceSession(str(out / entry["file"]), opts, providers=["CPUExecutionProvider"])
        sess8 = ort.InferenceSession(str(out / entry["int8"]["file"]), opts, providers=["CPUExecutionProvider"])
        t32 = median_ms(lambda: sess32.run(None, feed), args.runs)
        t8 = median_ms(lambda: sess8.run(None, feed), args.runs)
        table.add_row(str(entry["index"] + 1), f"{entry['gamma']:g}", f"{entry['flops'] / 1e6:.1f}",
                      f"{t_torch:.3f}", f"{t32:.3f}", f"{t8:.3f}", f"{t_torch / t32:.1f}x", f"{t_torch / t8:.1f}x", f"{t8 / t32:.2f}x",
                      f"{entry['int8']['accuracy_delta']:+.4f}")
    Console().print(table)
    print(f"export: {out}")


if __name__ == "__main__":
    main()
