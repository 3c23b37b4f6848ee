"""A site relay (aggregator/relay.py) in process: what it copies between the coordinator's broker and its site's,
with the paho clients replaced by recorders (the processes are tests/e2e/test_scale.py's)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.relay import Relay
from aggregator.worker import WorkerConfig
from nefl.protocol.mqtt import parse_broker
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics

T = Topics("t")


class Recorder:
    """The publish and subscribe calls of a paho client."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, bool]] = []
        self.subscribed: list[str] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))

    def subscribe(self, topic: str, qos: int = 0) -> None:
        self.subscribed.append(topic)


def relay() -> Relay:
    r = Relay(WorkerConfig(federation="t", worker_id="site-a", shared=False), parse_broker("mqtt://127.0.0.1:1"),
              parse_broker("mqtt://127.0.0.1:2"), Signer(Ed25519PrivateKey.generate()))
    r.up.client, r.site.client = Recorder(), Recorder()  # type: ignore[assignment]
    return r


def test_a_site_devices_refusals_are_followed_from_its_announce_and_copied_down() -> None:
    r = relay()
    r.route(r.site, T.announce("c1"), b"announce")
    assert r.up.client.subscribed == [T.task("c1"), T.refusal("c1")]  # before the announce goes up
    assert r.up.client.published == [(T.announce("c1"), b"announce", True)]
    assert {T.task("c1"), T.refusal("c1")} <= set(r.subscriptions(r.up))  # again after a reconnect
    r.route(r.up, T.refusal("c1"), b"signed refusal")
    assert r.site.client.published == [(T.refusal("c1"), b"signed refusal", False)]  # said once, as upstream


@settings(max_examples=100, deadline=None)
@given(client=st.sampled_from(["c1", "c2", "+", "a/b", ""]), payload=st.binary(max_size=64))
def test_any_bytes_on_a_refusal_topic_are_copied_or_ignored_never_raised(client: str, payload: bytes) -> None:
    """The relay checks nothing a device checks itself (the coordinator's signature): it copies, or drops a topic
    that names no client."""
    r = relay()
    r.route(r.up, f"{T.root}/refusal/{client}", payload)
    copied = r.site.client.published
    assert copied == ([(T.refusal(client), payload, False)] if client in ("c1", "c2") else [])
