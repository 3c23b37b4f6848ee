"""`aggregator relay`: a site's devices on their local broker, one partial per round over the WAN.

To the site's devices the relay's broker looks like the coordinator's: it copies the coordinator's
signed tasks and refusals (for the site's clients only), model chunks, control and server status down, and the
devices' announces, declines and statuses up, so the coordinator picks and pins site devices like any other.
Updates stay on the site: the relay checks and sums them as an aggregator worker does (same checks,
same plan; aggregator/worker.py) and sends the coordinator a receipt per update (in signed batches) and one partial
aggregate per round. Bytes crossing the WAN per round are then O(model) for updates, plus a few
hundred bytes per device for announces, declines, statuses and tasks, instead of one update per
device. The command line is in aggregator/scale_cli.py.
"""

from __future__ import annotations

import logging


from aggregator.worker import Worker, WorkerConfig
from nefl.protocol.messages import MAX_CONTROL_BYTES
from nefl.protocol.mqtt import QOS, BrokerSettings, Connection
from nefl.protocol.signing import Signer

log = logging.getLogger("aggregator.worker")


class Relay(Worker):
    role = "relay"

    def __init__(self, cfg: WorkerConfig, upstream: BrokerSettings, site: BrokerSettings, key: Signer) -> None:
        super().__init__(cfg, upstream, key)
        self.site = Connection(site, f"nefl-relay-{cfg.federation}-{self.me}", None, b"", log)
        self.sources = [self.site]
        self.site_clients: set[str] = set()
        self.dropped = 0  # oversized control messages from the site, not copied up

    def subscriptions(self, conn: Connection) -> list[str]:
        t = self.topics
        if conn is self.site:
            return [t.update("+"), t.resend("+"), *t.relay_up()]
        return [t.workers_round, t.workers_close, *t.relay_down(),
                *(own for c in sorted(self.site_clients) for own in self._own(c))]

    def _own(self, client: str) -> list[str]:
        """The coordinator's topics addressed to one site device: its tasks and the refusals of its announces."""
        return [self.topics.task(client), self.topics.refusal(client)]

    def route(self, conn: Connection, topic: str, payload: bytes) -> None:
        t = self.topics
        if conn is self.site and any(t.client_of(topic, kind) for kind in ("announce", "decline", "status", "sent")):
            self._up(topic, payload)
        elif conn is self.up and (t.client_of(topic, "task") or t.is_model(topic)
                                  or topic in (t.control, t.server_status)):
            self.site.client.publish(topic, payload, qos=QOS, retain=True)  # all retained at the source
        elif conn is self.up and t.client_of(topic, "refusal"):
            self.site.client.publish(topic, payload, qos=QOS)  # said once, as the coordinator says it
        else:
            super().route(conn, topic, payload)

    def _up(self, topic: str, payload: bytes) -> None:
        """A site device's announce, decline, status or upload notice, copied up unchanged (the coordinator
        checks it, signature included); its task and refusal topics are followed from now on, subscribed before
        the announce goes up, so the answer to that announce reaches the device. A decline (about one task) and a
        notice (about one upload) are not states to remember, so they are the ones not retained."""
        if len(payload) > MAX_CONTROL_BYTES:
            self.dropped += 1
            log.info(f"not relaying a {len(payload)}-byte message on {topic} (limit {MAX_CONTROL_BYTES})")
            return
        client = self.topics.client_of(topic, "announce")
        if client is not None and client not in self.site_clients:
            self.site_clients.add(client)
            for own in self._own(client):
                self.up.client.subscribe(own, qos=QOS)
        self.publish_up(topic, payload, retain=not any(self.topics.client_of(topic, k) for k in ("decline", "sent")))
