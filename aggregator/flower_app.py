"""The ServerApp of a NeFL Flower app: its run config as the strategy of its mode (rounds: aggregator/flower.py;
buffered versions: aggregator/flower_buffered.py)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from aggregator.flower import FlowerSettings, NeFLStrategy, run_settings
from aggregator.flower_buffered import BufferedStrategy
from aggregator.simulate import SimConfig


def server_app(cfg: SimConfig | None = None, settings: FlowerSettings | None = None) -> ServerApp:
    """A ServerApp that runs NeFL: with `cfg`, that run; else the one its run config describes."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run, flower = (cfg, settings or FlowerSettings()) if cfg is not None else run_settings(context.run_config)
        strategy = (BufferedStrategy if flower.mode == "buffered" else NeFLStrategy).for_run(run, flower)
        strategy.start(grid, strategy.initial_arrays(), run.rounds, timeout=flower.round_timeout)

    return app
