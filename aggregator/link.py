"""The server's end of the broker: its MQTT connection, what it publishes, and the stamp of what it signs."""

from __future__ import annotations

import logging
import secrets

import paho.mqtt.client as mqtt

from nefl.protocol.messages import ServerStatus
from nefl.protocol.mqtt import QOS, BrokerSettings, Connection
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics


class Link:
    """One run's connection (its last will: the server's status "offline"), its signer, and the run's identity:
    a random run id that tells clients a restarted server's round 3 from the dead one's, and the incarnation and
    sequence number every message the server signs names, so none replays into another run."""

    def __init__(self, settings: BrokerSettings, topics: Topics, signer: Signer, incarnation: int,
                 log: logging.Logger) -> None:
        self.conn = Connection(settings, f"nefl-aggregator-{topics.federation}", topics.server_status,
                               ServerStatus(state="offline", federation=topics.federation).to_json(), log)
        self.client = self.conn.client
        self.signer = signer
        self.run_id = secrets.token_hex(4)
        self.incarnation, self._seq = incarnation, 0
        self.bytes_out = 0  # what `publish` sent: a round's traffic is the difference over the round

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain)
        self.bytes_out += len(payload)

    def retain(self, topic: str, payload: bytes = b"") -> mqtt.MQTTMessageInfo:
        """Retained on the broker and not counted as a round's traffic: statuses, the control message, what a
        reconnect publishes again, and an empty payload that clears a retained message."""
        return self.client.publish(topic, payload, qos=QOS, retain=True)

    def tell(self, topic: str, payload: bytes) -> None:
        """Not retained and not counted as a round's traffic: a refusal to one device."""
        self.client.publish(topic, payload, qos=QOS)

    def stamp(self) -> dict[str, int]:
        """The incarnation and the next sequence number, for a message this server signs."""
        self._seq += 1
        return {"incarnation": self.incarnation, "seq": self._seq}
