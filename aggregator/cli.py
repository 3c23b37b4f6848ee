"""`aggregator`: the server's command line.

Each command lives in the module that owns its job; this file only assembles them.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="NeFL aggregator: run a federation over MQTT, simulate, inspect status.",
                  no_args_is_help=True, add_completion=False)

from nefl.extras import full_install_required  # noqa: E402

# command registrations (one import per module that adds commands):
with full_install_required("aggregator"):
    from aggregator.jigsaw_cli import jigsaw_command
    from aggregator.enrol_cli import enroll_command, revoke_command
    from aggregator.serve_cli import key_command, serve_command
    from aggregator.simulate_cli import simulate_command
    from aggregator.status import status_command
    from aggregator.loadtest import loadtest_command
    from aggregator.relay import relay_command
    from aggregator.worker import worker_command
    from aggregator.rollout import publish_command, rollout_app

app.command("serve")(serve_command)
app.command("key")(key_command)
app.command("enroll")(enroll_command)
app.command("revoke")(revoke_command)
app.command("status")(status_command)
app.command("simulate")(simulate_command)
app.command("worker")(worker_command)
app.command("relay")(relay_command)
app.command("loadtest")(loadtest_command)
app.command("jigsaw")(jigsaw_command)
app.command("publish")(publish_command)
app.add_typer(rollout_app, name="rollout")
