"""`edge-client jigsaw`, but every module it borrowed goes back to its source scaled x1000 (tests/e2e/test_jigsaw_mqtt.py).

An honest device's protocol in every other respect: signed, on time, the right shapes; only the norm bound
against the source's own copy can tell.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edge_client.cli import app  # noqa: E402
from nefl.jigsaw.broker import BrokerExchange  # noqa: E402

honest = BrokerExchange.give_back


def poisoned(self, msg, state):
    if msg.source != self.me:
        state = {k: v * 1000 for k, v in state.items()}
        logging.getLogger("poisoner").warning(f"poisoned the copy of c{msg.source}.m{msg.position}")
    return honest(self, msg, state)


BrokerExchange.give_back = poisoned
app()
