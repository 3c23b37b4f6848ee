"""Fakes for the agent's logic tests: a transport that records, a device that trains instantly, and
a signed server that speaks to the agent like the aggregator does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from edge_client.agent import Agent, AgentConfig
from edge_client.select import Selection
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout
from nefl.nested.train import OutOfTime, TrainResult
from nefl.protocol.messages import (AnnounceRefusal, Control, DeviceSummary, ServerStatus, Task, TrainingSettings,
                                   UpdateRefusal, refusal_hint)
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Encoded, encode

PROFILE = "resnet8-fmnist-w"
T = Topics("t")


@dataclass
class FakeTransport:
    published: list[tuple[str, bytes, bool]] = field(default_factory=list)
    subscribed: list[str] = field(default_factory=list)
    unsubscribed: list[str] = field(default_factory=list)

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.published.append((topic, payload, retain))

    def subscribe(self, topic: str, qos: int = 0) -> None:
        self.subscribed.append(topic)

    def unsubscribe(self, topic: str) -> None:
        self.unsubscribed.append(topic)

    def on(self, topic: str) -> list[bytes]:
        return [p for t, p, _ in self.published if t == topic]


@dataclass
class FakeDevice:
    """Can train submodels up to `can` (1-based; 0: nothing); training returns a zero delta at once."""

    can: int = 5
    samples: int = 100
    out_of_time: bool = False  # training finds not even one step fits the time left
    trained: list[tuple[int, int, float]] = field(default_factory=list)  # (round, submodel, budget_s)

    def summary(self) -> DeviceSummary:
        return DeviceSummary(machine="fake")

    def plan(self, layout: Layout, training: TrainingSettings, budget_s: float, cap: int,
             hold: int | None = None) -> Selection:
        k = min(self.can, cap)
        return Selection(k - 1 if k else None, f"fake device: submodel <= {k}", "memory" if k else "none", None, ())

    def train(self, layout: Layout, task: Task, start: dict[str, torch.Tensor], budget_s: float) -> TrainResult:
        if self.out_of_time:
            raise OutOfTime(f"not even one step fits the {budget_s:.1f} s left")
        self.trained.append((task.round, task.submodel, budget_s))
        delta = {n: torch.zeros(s) for n, s in layout.upload_shapes(task.submodel).items()}
        return TrainResult(delta, self.samples, 1.0, 0.5, 0.01, {"steps": 4, "budget_cut": 0})


class FakeServer:
    """Signs what the aggregator would send: status, tasks, weights (each message stamped with the run
    incarnation and the next sequence number, as the aggregator's are)."""

    def __init__(self, directory: Path, run: str = "run1", incarnation: int = 1) -> None:
        self.signer = Signer.load_or_create(directory)
        self.run, self.incarnation, self.seq = run, incarnation, 0
        profile = load_profile(PROFILE)
        self.layout = Layout.build(profile)
        self.profile = profile

    def stamp(self) -> dict[str, int]:
        self.seq += 1
        return {"incarnation": self.incarnation, "seq": self.seq}

    def status(self, **kw) -> bytes:
        args = dict(state="training", federation="t", run=self.run, round=1, rounds=3, profile=self.profile.to_dict(),
                    method=self.profile.method, profile_hash=self.layout.profile.hash, key=self.signer.public_text,
                    time=1000.0, training=TrainingSettings(batch_size=16, round_timeout=60), **self.stamp())
        return self.signer.sign(ServerStatus(**{**args, **kw}).to_json())

    def end(self, **kw) -> bytes:
        return self.signer.sign(Control(**{**dict(federation="t", run=self.run, event="end", **self.stamp()), **kw}).to_json())

    def refusal(self, reason: str, key: str = "", **kw) -> bytes:
        args = dict(client="c1", federation="t", run=self.run, reason=reason, key=key, hint=refusal_hint(reason, "c1"),
                    **self.stamp())
        return self.signer.sign(AnnounceRefusal(**{**args, **kw}).to_json())

    def update_refusal(self, reason: str, **kw) -> bytes:
        args = dict(client="c1", federation="t", run=self.run, round=7, submodel=0, version=1, current=20,
                    reason=reason, **self.stamp())
        return self.signer.sign(UpdateRefusal(**{**args, **kw}).to_json())

    def weights(self, k: int = 0, round: int = 1, scale: float = 0.0) -> list[bytes]:
        return self.model(k, round, scale).messages

    def model(self, k: int = 0, round: int = 1, scale: float = 0.0) -> Encoded:
        shapes = self.layout.sub_shapes[k]
        return encode({n: torch.full(s, scale) for n, s in shapes.items()}, kind="model", federation="t", round=round,
                      submodel=k, client="server", chunk_bytes=1 << 20)

    def task_msg(self, k: int = 0, round: int = 1, **kw) -> Task:
        w, header = self.model(k, round)
        args = dict(federation="t", run=self.run, round=round, submodel=k, lr=0.1, epochs=1, batch_size=16,
                    profile_hash=self.layout.profile.hash, deadline_s=60.0, chunks=len(w),
                    model_digest=header.digest, model_bytes=header.size, **self.stamp())
        return Task(**{**args, **kw})

    def task(self, k: int = 0, round: int = 1, **kw) -> bytes:
        return self.signer.sign(self.task_msg(k, round, **kw).to_json())


def make_agent(tmp: Path, server: FakeServer | None = None, device: FakeDevice | None = None,
               clock=None, pinned: bool = True, **cfg_kw) -> tuple[Agent, FakeTransport, FakeDevice]:
    """An agent that pins `server`'s key (unless `pinned` is False: trust on first use) and has adopted
    its profile from its status."""
    transport, device = FakeTransport(), device or FakeDevice()
    key = cfg_kw.pop("server_key", server.signer.public_text if server is not None and pinned else None)
    cfg = AgentConfig("c1", federation="t", pin_file=tmp / "pins" / "t.pub", server_key=key,
                      device_key=Signer.load_or_create(tmp / "device-keys", "c1.key"), run_file=tmp / "pins" / "t.run",
                      **cfg_kw)
    agent = Agent(cfg, transport, device, **({"clock": clock} if clock else {}))
    if server is not None:
        agent.dispatch(T.server_status, server.status())
    return agent, transport, device
