"""`edge-client jigsaw`, but the copies of other sources' modules it returns are poisoned:

    jigsaw_poisoner.py POISON POLICY_ROUNDS jigsaw ...   (the edge-client arguments follow)

POISON x1000: every borrowed module goes back scaled x1000, from the first round (tests/e2e/test_jigsaw_mqtt.py);
flip, scale or layer: the simulator's attacks (nefl/jigsaw/sim.py `poison`, as its PoisoningExchange applies them)
from the model-training phase on (round >= POLICY_ROUNDS), so a run is the simulator's twin under that attack.
An honest device's protocol in every other respect: signed, on time, the right shapes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edge_client.cli import app  # noqa: E402
from nefl.jigsaw.broker import BrokerExchange  # noqa: E402
from nefl.jigsaw.sim import poison  # noqa: E402

ATTACK, POLICY_ROUNDS = sys.argv[1], int(sys.argv[2])
del sys.argv[1:3]
honest_fetch, honest_return = BrokerExchange.fetch, BrokerExchange.give_back
sent: dict[tuple[int, int], dict] = {}


def fetch(self, req):
    got = honest_fetch(self, req)
    sent[(req.source, req.position)] = {k: v.clone() for k, v in got.items()}
    return got


def give_back(self, msg, state):
    if msg.source != self.me and (ATTACK == "x1000" or msg.round >= POLICY_ROUNDS):
        state = ({k: v * 1000 for k, v in state.items()} if ATTACK == "x1000"
                 else poison(ATTACK, sent[(msg.source, msg.position)], state))
        logging.getLogger("poisoner").warning(f"poisoned the copy of c{msg.source}.m{msg.position} ({ATTACK})")
    return honest_return(self, msg, state)


BrokerExchange.fetch, BrokerExchange.give_back = fetch, give_back
app()
