"""`edge-client infer` and `edge-client serve`: the adaptive ONNX runtime from the command line."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import typer
from rich.console import Console

from edge_client.http_api import MAX_BODY_BYTES, MAX_IMAGE_PIXELS, QUEUE_SIZE, REQUEST_TIMEOUT_S, WORKERS, make_server
from edge_client.runtime import AdaptiveRuntime, ImageError, ModelsError
from nefl.logs import setup_logging
from nefl.signals import Stop, stop_on_sigterm, stop_reason

console = Console()
log = logging.getLogger(__name__)

MODELS = typer.Option(..., "--models", help="Export directory with manifest.json (from `nefl-export onnx`).")
BUDGET = typer.Option(20.0, "--latency-budget-ms", min=0.0, help="Per-request latency budget; the runtime picks "
                      "the largest submodel predicted to meet it under the current load.")
THREADS = typer.Option(None, "--threads", min=1, help="onnxruntime intra-op threads (default: half the cores).")
PRECISION = typer.Option("fp32", "--precision", help="fp32, or int8 when exported with --quantize int8.")
UNTRAINED = typer.Option(False, "--include-untrained", help="Also use submodels the export records as never trained "
                         "or no better than chance (skipped by default, with a warning).")


def _runtime(models: Path, budget: float, threads: int | None, precision: str, include_untrained: bool) -> AdaptiveRuntime:
    setup_logging("info")
    try:
        with console.status("loading and calibrating submodels..."):
            return AdaptiveRuntime(models, latency_budget_ms=budget, threads=threads, precision=precision,
                                   include_untrained=include_untrained)
    except (ModelsError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


def infer_command(
    images: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="PNG/JPEG files to classify."),
    models: Path = MODELS, latency_budget_ms: float = BUDGET, threads: int | None = THREADS,
    precision: str = PRECISION, include_untrained: bool = UNTRAINED,
) -> None:
    """Classify image files, one request each, and show which submodel answered and why."""
    runtime = _runtime(models, latency_budget_ms, threads, precision, include_untrained)
    failed = 0
    for path in images:
        try:
            result = runtime.predict(runtime.decode_image(path.read_bytes()))
        except ImageError as e:
            console.print(f"[red]{path}:[/red] {e}", soft_wrap=True)
            failed += 1
            continue
        label = result.labels[0]
        name = runtime.class_names[label] if runtime.class_names else str(label)
        console.print(f"{path}: {name} (p={float(np.max(result.probabilities[0])):.3f})  submodel "
                      f"{result.submodel + 1} (gamma {result.gamma:g}) in {result.latency_ms:.2f} ms: {result.reason}",
                      soft_wrap=True, markup=False)
    raise typer.Exit(1 if failed else 0)


def serve_command(
    models: Path = MODELS, port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port (0: any free)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes it to the network."),
    latency_budget_ms: float = BUDGET, threads: int | None = THREADS, precision: str = PRECISION,
    include_untrained: bool = UNTRAINED,
    max_body_bytes: int = typer.Option(MAX_BODY_BYTES, "--max-body-bytes", min=1, help="Largest accepted upload."),
    max_pixels: int = typer.Option(MAX_IMAGE_PIXELS, "--max-pixels", min=1, help="Largest image (width x height) "
                                   "decoded; checked on the header before decoding (413 above it)."),
    workers: int = typer.Option(WORKERS, "--workers", min=1, help="Requests handled at once (fixed thread pool)."),
    queue_size: int = typer.Option(QUEUE_SIZE, "--queue-size", min=1, help="Connections waiting for a worker; "
                                   "beyond this the server answers 503 at once."),
    request_timeout: float = typer.Option(REQUEST_TIMEOUT_S, "--request-timeout", min=0.001, help="Seconds a client "
                                          "has to send the whole request (headers and body)."),
) -> None:
    """Serve POST /predict (image bytes -> JSON), GET /health and GET /models over HTTP."""
    stop_on_sigterm()  # from here on SIGTERM is a clean stop (exit code 0), as Ctrl-C
    try:
        runtime = _runtime(models, latency_budget_ms, threads, precision, include_untrained)
        try:
            server = make_server(runtime, host, port, max_body_bytes, max_pixels=max_pixels, workers=workers,
                                 queue_size=queue_size, timeout_s=request_timeout)
        except OSError as e:
            console.print(f"[red]error:[/red] cannot listen on {host}:{port} ({e.strerror or e}); choose another --port",
                          soft_wrap=True)
            raise typer.Exit(2) from None
        bound_host, bound_port = server.server_address[:2]
        console.print(f"serving {runtime.manifest.profile} ({len(runtime.submodels)} submodels) "
                      f"on http://{bound_host}:{bound_port}  (POST /predict, GET /health, GET /models)")
        try:
            server.serve_forever()
        finally:
            server.server_close()
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({stop_reason(e)})")
