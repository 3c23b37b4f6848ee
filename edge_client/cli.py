"""`edge-client`: the device agent's command line.

Each command lives in the module that owns its job; this file only assembles them.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="NeFL edge agent: probe the device, join a federation, run exported submodels.",
                  no_args_is_help=True, add_completion=False)

# command registrations (one import per module that adds commands):
from edge_client.agent import join_command  # noqa: E402

app.command("join")(join_command)
from edge_client.infer_cli import infer_command, serve_command  # noqa: E402

app.command("infer")(infer_command)
app.command("serve")(serve_command)
from edge_client.device_cli import plan_command, probe_command  # noqa: E402

app.command("probe")(probe_command)
app.command("plan")(plan_command)
