"""A real `Server` (its message handling and round loop, no broker: its publishes are captured, its inbox fed)
and a real `Agent` linked in one process, every message through their own code paths."""

from __future__ import annotations

from dataclasses import dataclass, field

from aggregator.server import ServeConfig, Server, load_start
from edge_client.agent import Agent, AgentConfig, status_message
from nefl.protocol.mqtt import BrokerSettings
from nefl.protocol.signing import Signer
from tests.harness.agent_fakes import PROFILE, T, FakeDevice, FakeTransport


@dataclass
class Wire:
    """Links a real Server (no broker: its publishes are captured, its inbox fed) and a real Agent."""

    server: Server
    agent: Agent
    transport: FakeTransport
    to_agent: list[tuple[str, bytes]] = field(default_factory=list)
    retained: dict[str, bytes] = field(default_factory=dict)  # what a broker keeps for later subscribers
    sent: int = 0  # how many of the agent's publishes the server has been given
    subscribed: int = 0  # how many of the agent's subscriptions got their retained messages

    def from_server(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        if retain:
            self.retained[topic] = payload
        self.to_agent.append((topic, payload))

    def deliver_to_server(self, handle: bool = False) -> None:
        """The agent's new publishes, into the server's inbox (where the broker puts them for its round
        loop to read), or straight to its handler when no round loop runs."""
        for topic, payload, _ in self.transport.published[self.sent:]:
            (self.server.handle if handle else lambda *m: self.server.link.conn.inbox.put(m))(topic, payload)
        self.sent = len(self.transport.published)

    def deliver_to_agent(self) -> None:
        """The server's publishes the agent subscribed to, and the retained ones of each new subscription."""
        while self.to_agent:
            topic, payload = self.to_agent.pop(0)
            if any(_matches(s, topic) for s in self.agent.subscriptions()):
                self.agent.dispatch(topic, payload)
        while self.subscribed < len(self.transport.subscribed):
            sub = self.transport.subscribed[self.subscribed]
            self.subscribed += 1
            for topic, payload in list(self.retained.items()):
                if _matches(sub, topic):
                    self.agent.dispatch(topic, payload)


def _matches(subscription: str, topic: str) -> bool:
    return subscription == topic or (subscription.endswith("/+") and topic.rpartition("/")[0] == subscription[:-2])


def wire_up(tmp_path, device: FakeDevice) -> Wire:
    cfg = ServeConfig(profile=PROFILE, federation="t", rounds=2, clients_per_round=1, min_clients=1, round_timeout=30,
                      checkpoint_dir=str(tmp_path / "run"), batch_size=16)
    server = Server(cfg, BrokerSettings("127.0.0.1", 1), load_start(cfg), Signer.load_or_create(tmp_path / "run"))
    transport = FakeTransport()
    agent = Agent(AgentConfig("c1", federation="t", pin_file=tmp_path / "pins" / "t.pub",
                              device_key=Signer.load_or_create(tmp_path / "keys", "c1.key")), transport, device)
    wire = Wire(server, agent, transport)
    server.link.client.publish = wire.from_server
    agent.on_connected()
    server.control.publish_status("waiting")
    wire.deliver_to_agent()  # the agent trusts the server, adopts the profile, plans and announces
    server.handle(T.status("c1"), status_message(agent.cfg.device_key, "online", 0))
    return wire
