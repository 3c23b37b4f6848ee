"""`edge-client infer` and `edge-client serve`: the adaptive ONNX runtime from the command line.

`serve --follow` also takes the models the aggregator rolls out (edge_client/follow.py); the MQTT
client is imported only then, so plain `infer` and `serve` start as fast as before.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.console import Console

from edge_client.follow_options import FollowOptions
from nefl.support.cli_options import IncludeUntrainedOption, MemoryBudgetOption, ThreadsOption
from nefl.support.option_groups import SharedOption
from edge_client.http_api import MAX_BODY_BYTES, MAX_IMAGE_PIXELS, QUEUE_SIZE, REQUEST_TIMEOUT_S, WORKERS, make_server
from edge_client.runtime import AdaptiveRuntime, ExternalLoadProbe, ImageError, ModelsError, Probe
from edge_client.serving import Active, Serving
from edge_client.store import followed_current
from nefl.support.logs import setup_logging
from nefl.support.option_groups import grouped, option_group
from nefl.support.signals import Stop, stop_on_sigterm, stop_reason
from nefl.support.units import parse_size

console = Console()
log = logging.getLogger(__name__)

@option_group("Runtime")
class RuntimeOptions:
    """How the adaptive runtime picks and runs submodels (AdaptiveRuntime's arguments, by name)."""

    latency_budget_ms: Annotated[float, typer.Option(
        min=0.0, help="Per-request latency budget; the runtime picks the largest submodel predicted to meet it under "
                      "the current load.")] = 20.0
    threads: ThreadsOption("onnxruntime intra-op threads (default: half the cores).") = None
    precision: Annotated[str, typer.Option(help="fp32, or int8 when exported with --quantize int8.")] = "fp32"
    include_untrained: IncludeUntrainedOption("Also use submodels the export records as never trained or no better "
                                              "than chance (skipped by default, with a warning).") = False


def _runtime(models: Path, options: RuntimeOptions, probe: Probe | None = None) -> AdaptiveRuntime:
    setup_logging("info")
    try:
        with console.status("loading and calibrating submodels..."):
            return AdaptiveRuntime(followed_current(models), probe=probe, **asdict(options))
    except (ModelsError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


# required where a command gives no default
ModelsOption = SharedOption(Optional[Path], "--models", help="Export directory with manifest.json (from `nefl-export onnx`).")


@grouped
def infer_command(
    images: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="PNG/JPEG files to classify."),
    models: ModelsOption("Export directory with manifest.json (from `nefl-export onnx`), or a directory `serve "
                         "--follow` keeps (its current version is used).") = ...,
    *,
    runtime_options: RuntimeOptions,
) -> None:
    """Classify image files, one request each, and show which submodel answered and why."""
    runtime = _runtime(models, runtime_options)
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


@grouped
def serve_command(
    models: ModelsOption("Export directory with manifest.json (from `nefl-export onnx`); with --follow, the "
                         "directory the followed versions are kept in (default: $NEFL_CACHE_DIR/deploy/FEDERATION).") = None,
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port (0: any free)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes it to the network."),
    max_body_bytes: int = typer.Option(MAX_BODY_BYTES, "--max-body-bytes", min=1, help="Largest accepted upload."),
    max_pixels: int = typer.Option(MAX_IMAGE_PIXELS, "--max-pixels", min=1, help="Largest image (width x height) "
                                   "decoded; checked on the header before decoding (413 above it)."),
    request_threads: int = typer.Option(WORKERS, min=1, help="Requests handled at once (fixed thread pool)."),
    queue_size: int = typer.Option(QUEUE_SIZE, "--queue-size", min=1, help="Connections waiting for a worker; "
                                   "beyond this the server answers 503 at once."),
    request_timeout: float = typer.Option(REQUEST_TIMEOUT_S, "--request-timeout", min=0.001, help="Seconds a client "
                                          "has to send the whole request (headers and body)."),
    memory_budget: MemoryBudgetOption("Emulate a device with this much free memory (e.g. 300MB): the submodel choice "
                                      "per request, and which submodels --follow fetches, see at most this much.") = None,
    *,
    runtime_options: RuntimeOptions,
    following: FollowOptions,
) -> None:
    """Serve POST /predict (image bytes -> JSON), GET /health and GET /models over HTTP."""
    setup_logging("info")
    stop_on_sigterm()  # from here on SIGTERM is a clean stop (exit code 0), as Ctrl-C
    try:
        probe = _budgeted_probe(memory_budget)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    stop, follower_thread, server = threading.Event(), None, None
    try:
        if following.follow is None:
            if models is None:
                console.print("[red]error:[/red] give --models DIR (an export directory), or --follow mqtt://HOST:PORT")
                raise typer.Exit(2)
            runtime = _runtime(models, runtime_options, probe)
            serving, what = Serving(Active(runtime, None)), f"{runtime.manifest.profile} ({len(runtime.submodels)} submodels)"
        else:
            from edge_client.follow_cli import start_following  # paho only when following

            serving, follower_thread, what = start_following(
                stop, following, models, runtime_options.include_untrained, probe,
                lambda d: AdaptiveRuntime(d, probe=probe, latency_budget_ms=runtime_options.latency_budget_ms,
                                          threads=runtime_options.threads,
                                          include_untrained=runtime_options.include_untrained),
                runtime_options.precision)
        try:
            server = make_server(serving, host, port, max_body_bytes, max_pixels=max_pixels, workers=request_threads,
                                 queue_size=queue_size, timeout_s=request_timeout)
        except OSError as e:
            console.print(f"[red]error:[/red] cannot listen on {host}:{port} ({e.strerror or e}); choose another --port",
                          soft_wrap=True)
            raise typer.Exit(2) from None
        bound_host, bound_port = server.server_address[:2]
        console.print(f"serving {what} on http://{bound_host}:{bound_port}  (POST /predict, GET /health, GET /models)")
        server.serve_forever()
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({stop_reason(e)})")
    finally:
        stop.set()
        if follower_thread is not None:
            follower_thread.join(10)
        if server is not None:
            server.server_close()


def _budgeted_probe(memory_budget: str | None) -> Probe | None:
    """The runtime's load probe with available memory capped at --memory-budget (None: the default probe)."""
    if memory_budget is None:
        return None
    cap, probe = parse_size(memory_budget), ExternalLoadProbe()

    def budgeted() -> tuple[float | None, int | None]:
        cpu, available = probe()
        return cpu, cap if available is None else min(available, cap)

    return budgeted
