"""`aggregator`: the server's command line.

Each command lives in the module that owns its job; this file only assembles them.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="NeFL aggregator: run a federation over MQTT, simulate, inspect status.",
                  no_args_is_help=True, add_completion=False)

# command registrations (one import per module that adds commands):
from aggregator.server import serve_command  # noqa: E402
from aggregator.status import status_command  # noqa: E402

app.command("serve")(serve_command)
app.command("status")(status_command)
from aggregator.simulate_cli import simulate_command  # noqa: E402

app.command("simulate")(simulate_command)
