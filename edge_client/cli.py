"""`edge-client`: the device agent's command line.

Each command lives in the module that owns its job; this file only assembles them. The commands
are imported only when one of them runs (nefl/support/commands.py): `--help` and the inference commands
never import torch, which the small inference install lacks and which costs seconds and hundreds
of MB to import on a Pi.
"""

from __future__ import annotations

from nefl.support.commands import Lazy, lazy_app

COMMANDS = {
    "join": Lazy("edge_client.join", "join_command",
                 "Join a federation: announce, train assigned submodels, upload deltas until the federation ends."),
    "jigsaw": Lazy("edge_client.jigsaw_cli", "jigsaw_command",
                   "Take part in a FedJigsaw federation: assemble a model from neighbours' modules, train it, return them."),
    "plan": Lazy("edge_client.plan_cli", "plan_command",
                 "Show each submodel's cost on this device now, whether it fits, and which one would train."),
    "infer": Lazy("edge_client.infer_cli", "infer_command",
                  "Classify image files, one request each, and show which submodel answered and why."),
    "serve": Lazy("edge_client.infer_cli", "serve_command",
                  "Serve POST /predict (image bytes -> JSON), GET /health and GET /models over HTTP."),
    "probe": Lazy("edge_client.device_cli", "probe_command",
                  "Print one snapshot of memory, CPU/GPU load, thermals, throttling and battery."),
}

app = lazy_app("edge-client", "NeFL edge agent: probe the device, join a federation, run exported submodels.", COMMANDS)
