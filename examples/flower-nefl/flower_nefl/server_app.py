"""ServerApp: the kit's NeFL strategy, configured by the run config (pyproject.toml, `flwr run -c`)."""

from aggregator.flower_app import server_app

app = server_app()
