"""`aggregator`: the server's command line.

Each command lives in the module that owns its job; this file only assembles them, importing a
command's module only when that command runs (nefl/support/commands.py), so `--help` answers at once.
"""

from __future__ import annotations

from nefl.support.commands import Lazy, lazy_app

COMMANDS = {
    "serve": Lazy("aggregator.serve_cli", "serve_command",
                  "Run a federation: rounds over MQTT, NeFedAvg, checkpoints after every round."),
    "key": Lazy("aggregator.serve_cli", "key_command",
                "Print the aggregator's public key (created if missing), for devices' --server-key and workers."),
    "enroll": Lazy("aggregator.enrol_cli", "enroll_command",
                   "Enrol a device (prints a one-time join token for `edge-client join --join-token`) or authorise a "
                   "worker's key.\nEnrolling an id that is already pinned rotates its key once the device presents the new "
                   "token."),
    "revoke": Lazy("aggregator.enrol_cli", "revoke_command",
                   "Revoke an id's key: its messages are refused from now on, also in a running federation (a device "
                   "comes back\nonly with a new `aggregator enroll`)."),
    "status": Lazy("aggregator.status", "status_command",
                   "Show a federation's live state (round, clients, rejections, accuracy)."),
    "simulate": Lazy("aggregator.simulate_cli", "simulate_command",
                     "Simulate a NeFL federation (or a baseline) on a real dataset and print per-submodel accuracy."),
    "worker": Lazy("aggregator.scale_cli", "worker_command",
                   "Check and sum a share of a federation's updates for `aggregator serve` (docs/scale.md)."),
    "relay": Lazy("aggregator.scale_cli", "relay_command",
                  "Serve a site's devices on its own broker; send the coordinator one partial per round (docs/scale.md)."),
    "loadtest": Lazy("aggregator.scale_cli", "loadtest_command",
                     "Play a fleet of simulated devices sending valid random deltas (docs/scale.md, `make bench-scale`)."),
    "jigsaw": Lazy("aggregator.jigsaw_cli", "jigsaw_command",
                   "Simulate FedJigsaw (clients assemble models from shared modules) or a baseline; print local accuracy "
                   "per client."),
    "jigsaw-serve": Lazy("aggregator.jigsaw_cli", "jigsaw_serve_command",
                         "Coordinate FedJigsaw devices over MQTT: rounds, topology, phase and the CoRe-Tune critic; no "
                         "central model."),
    "publish": Lazy("aggregator.rollout", "publish_command",
                    "Roll an export out to the devices following the federation (`edge-client serve --follow`): signed, "
                    "retained."),
    "rollout": Lazy("aggregator.rollout", "rollout_app",
                    "See and steer a model rollout: who runs which version; promote or roll back."),
}

app = lazy_app("aggregator", "NeFL aggregator: run a federation over MQTT, simulate, inspect status.", COMMANDS)
