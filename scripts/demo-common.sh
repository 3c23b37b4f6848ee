# What both demos (scripts/demo.sh, scripts/demo_fedjigsaw.sh) set up before their first process: sourced,
# never run. Needs PYTHON and OUT; gives PORT (a free local port), PIDS with its cleanup on exit, and the
# `aggregator` / `edge_client` shell functions that run the CLIs from this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -rf "$OUT"
mkdir -p "$OUT/logs"
PIDS=()
# A CLI started in the background through its shell function below runs in a subshell, and `$!` is that
# subshell: kill its children too, or the Python process outlives the demo.
cleanup() { for pid in "${PIDS[@]}"; do pkill -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

aggregator() { "$PYTHON" -c 'from aggregator.cli import app; app()' "$@"; }
edge_client() { "$PYTHON" -c 'from edge_client.cli import app; app()' "$@"; }
