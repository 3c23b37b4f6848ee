"""A FedJigsaw device: nefl.jigsaw's client step over the broker, driven by a light coordinator's rounds.

The device admits itself with a self-signed hello (its key, its memory budget), trusts the coordinator's
signed plan (pinned key, or trust on first use as the NeFL agent does), picks the largest base architecture
its budget fits, derives its shard and initial modules as its simulated twin would (nefl/jigsaw/shards.py),
and announces its modules. Then, each round the coordinator opens: it closes the previous one as a source
(Eq. 2 over the copies that came back), runs `JigsawClient.step` against the BrokerExchange (a peer that does
not answer a fetch in time is masked and the chain assembled again without it), tells the coordinator how the
round went and, in the policy phase, learns from CoRe-Tune's advice. After the last round it fetches its final
chain, scores it on its local test set and keeps serving its modules until the coordinator says "over".

Threads: `handle` runs on the thread that drains the connection's inbox and never raises; `run` is the main
thread's loop. They share the coordinator's messages under one condition, the exchange under its own.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nefl.jigsaw.broker import BrokerExchange, Peer, PeerUnavailable, largest_module_bytes, module_bytes
from nefl.jigsaw.client import JigsawClient, StepResult
from nefl.jigsaw.coordination import MAX_PLAN_BYTES, JigsawHello, JigsawPlan, JigsawRound, RoundDone
from nefl.jigsaw.coretune import MAX_REPORT_BYTES, CriticAdvice
from nefl.jigsaw.methods import get_method
from nefl.jigsaw.shards import ClientShard, client_data, initial_modules, module_seed
from nefl.jigsaw.screen import ReturnScreen
from nefl.jigsaw.zoo import BaseArch, base_for_budget, load_base
from nefl.nested.data import load_dataset
from nefl.nested.train import evaluate
from nefl.protocol import signing
from nefl.protocol.messages import MessageError, decode
from nefl.protocol.mqtt import QOS, Transport
from nefl.protocol.signing import KeyPin, Signer, parse_public_key, status_message
from nefl.protocol.topics import Topics

log = logging.getLogger(__name__)


class Abandoned(RuntimeError):
    """The coordinator went quiet (no plan, round or advice in time) or a newer run replaced this one."""


@dataclass(frozen=True)
class DeviceSettings:
    client_id: str
    federation: str
    budget: int  # bytes for training (probed, or the operator's --memory-budget)
    chunk_bytes: int
    data_root: str | None = None
    wait_s: float = 3600.0  # longest wait for the coordinator's next message


class JigsawDevice:
    def __init__(self, cfg: DeviceSettings, signer: Signer, pin: KeyPin, transport: Transport,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.signer, self.pin, self.transport, self.clock = cfg, signer, pin, transport, clock
        self.topics = Topics(cfg.federation)
        self.cond = threading.Condition()
        self.plan: JigsawPlan | None = None
        self.rounds: dict[int, JigsawRound] = {}
        self.advice: dict[int, CriticAdvice] = {}
        self.exchange: BrokerExchange | None = None
        self.me = -1
        self.dropped: dict[str, int] = {}
        self.final_accuracy: float | None = None
        self.base: BaseArch | None = None
        self.final_state: dict[str, torch.Tensor] = {}

    # -- connection -----------------------------------------------------------------------------------

    def subscriptions(self) -> list[str]:
        t = self.topics
        subs = [t.jigsaw("plan"), t.jigsaw("round"), t.jigsaw("advice", self.cfg.client_id)]
        return subs + (self.exchange.subscriptions() if self.exchange is not None else [])

    def on_connected(self, seq: int = 0) -> None:
        """(Re)connected (the connection stamped `seq`): subscribe, say online (the NeFL agent's signed status,
        whose last will says offline) and hello again."""
        for topic in self.subscriptions():
            self.transport.subscribe(topic, qos=QOS)
        self.transport.publish(self.topics.status(self.cfg.client_id), status_message(self.signer, "online", seq),
                               qos=QOS, retain=True)
        hello = JigsawHello(federation=self.cfg.federation, client_id=self.cfg.client_id, key=self.signer.public_text,
                            budget=self.cfg.budget)
        self.transport.publish(self.topics.jigsaw("hello", self.cfg.client_id), self.signer.sign(hello.to_json()),
                               qos=QOS, retain=True)

    # -- inbound: the trust boundary ------------------------------------------------------------------

    def handle(self, topic: str, payload: bytes) -> None:
        """Any message is acted on or dropped with a counted reason; nothing inbound ends the device."""
        parsed = self.topics.jigsaw_of(topic)
        if parsed is None or not payload:
            return
        kind, client = parsed
        try:
            if kind == "plan":
                self._on_plan(bytes(payload))
            elif kind == "round":
                self._on_round(bytes(payload))
            elif kind == "advice" and client == self.cfg.client_id:
                self._on_advice(bytes(payload))
            elif self.exchange is not None:
                self.exchange.handle(topic, payload)
        except MessageError as e:
            self._drop(e.reason, f"{topic}: {e.detail}")
        except Exception as e:  # a hostile message must not end the device, whatever it trips
            self._drop("malformed", f"{topic}: {type(e).__name__}")

    def _drop(self, reason: str, detail: str) -> None:
        with self.cond:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.warning(f"dropped {detail} ({reason})")

    def _server_body(self, payload: bytes) -> bytes:
        if self.pin.key is None:
            raise MessageError("unpinned", "no coordinator key trusted yet (its plan comes first)")
        return signing.verify(payload, self.pin.key)

    def _on_plan(self, payload: bytes) -> None:
        if self.pin.key is None:  # trust on first use: a plan signed by the key it names that lists this device
            body, key = signing.verify_self_signed(payload, lambda b: decode(b, JigsawPlan, MAX_PLAN_BYTES).key)
            plan = decode(body, JigsawPlan, MAX_PLAN_BYTES)
            if not self._lists_me(plan):
                raise MessageError("not_for_me", "a plan without this device pins nothing")
            self.pin.learn(key)
            log.warning(f"trusting coordinator key {key} on first use (pass --server-key to pin it)")
        else:
            plan = decode(self._server_body(payload), JigsawPlan, MAX_PLAN_BYTES)
        if plan.federation != self.cfg.federation or not self._lists_me(plan):
            raise MessageError("not_for_me", f"plan of run {plan.run} does not list {self.cfg.client_id} with this key")
        with self.cond:
            if self.plan is None:
                self.plan = plan
                self.cond.notify_all()
            elif plan.run != self.plan.run:
                raise MessageError("other_run", f"plan of run {plan.run}; this device takes part in {self.plan.run}")

    def _lists_me(self, plan: JigsawPlan) -> bool:
        return any(p.client_id == self.cfg.client_id and p.key == self.signer.public_text for p in plan.participants)

    def _on_round(self, payload: bytes) -> None:
        msg = decode(self._server_body(payload), JigsawRound, MAX_PLAN_BYTES)
        with self.cond:
            if self.plan is None or msg.run != self.plan.run:
                raise MessageError("other_run", f"round of run {msg.run}")
            self.rounds[msg.round] = msg
            self.cond.notify_all()

    def _on_advice(self, payload: bytes) -> None:
        msg = decode(self._server_body(payload), CriticAdvice, MAX_REPORT_BYTES)
        with self.cond:
            if self.plan is None or msg.federation != self.plan.federation or msg.client != self.me:
                raise MessageError("not_for_me", f"advice for client {msg.client} of {msg.federation}")
            self.advice[msg.round] = msg
            self.cond.notify_all()

    def _wait(self, what: str, ready: Callable[[], object], timeout_s: float) -> object:
        deadline = self.clock() + timeout_s
        with self.cond:
            while not (got := ready()):
                left = deadline - self.clock()
                if left <= 0:
                    raise Abandoned(f"no {what} from the coordinator in {timeout_s:.0f} s")
                self.cond.wait(min(left, 0.5))
            return got

    # -- the run --------------------------------------------------------------------------------------

    def run(self) -> float | None:
        """Take part in one run of the coordinator; returns the final local test accuracy (None if cut short)."""
        plan: JigsawPlan = self._wait("plan", lambda: self.plan, self.cfg.wait_s)  # type: ignore[assignment]
        client, shard = self._prepare(plan)
        r = 0
        while True:
            rnd: JigsawRound = self._wait(f"round {r}", lambda: self._round_at_least(r), self.cfg.wait_s)  # type: ignore
            if rnd.phase == "over":
                return self.final_accuracy
            r = rnd.round
            self._open(rnd, plan)
            if rnd.phase == "end":
                self._finish(rnd, client, shard)
            else:
                self._train(rnd, plan, client, shard)
            r += 1

    def _round_at_least(self, r: int) -> JigsawRound | None:
        """The newest round message at or after r (a device that was slow skips the rounds it missed)."""
        later = [m for k, m in self.rounds.items() if k >= r or m.phase == "over"]
        return max(later, key=lambda m: (m.phase == "over", m.round)) if later else None

    def _prepare(self, plan: JigsawPlan) -> tuple[JigsawClient, ClientShard]:
        """Index, base, shard, initial modules and the exchange, all from the plan and this device's budget."""
        me = next(p.index for p in plan.participants if p.client_id == self.cfg.client_id)
        method = get_method(plan.method)
        bases = [load_base(a) for a in plan.archs]
        self.base = base = base_for_budget(bases, self.cfg.budget, plan.shards.batch_size)
        train, test = load_dataset(plan.dataset, self.cfg.data_root, train=True), load_dataset(plan.dataset, self.cfg.data_root, train=False)
        data, self.probe = client_data(train, test, plan.shards)
        shard = ClientShard(me, data[me], train, test, plan.shards)
        initial = self._initial(plan, me)
        client = JigsawClient(me, base, self.cfg.budget, data[me].histogram, plan.settings,
                              seed=plan.shards.seed * 1000 + me, assemble=method.assemble, policy_seed=plan.shards.seed,
                              base_start=initial)
        peers = {p.index: Peer(p.index, p.client_id, parse_public_key(p.key)) for p in plan.participants}
        self.exchange = BrokerExchange(self.topics, me, peers, [list(n) for n in plan.links], self.signer, self.transport,
                                       initial, self.cfg.chunk_bytes, plan.fetch_timeout_s, plan.norm_bound,
                                       largest_module_bytes(bases), self.clock, ReturnScreen() if plan.screen else None)
        self.me = me
        for topic in self.exchange.subscriptions():
            self.transport.subscribe(topic, qos=QOS)
        client.join(self.exchange)
        log.info(f"client {me} of {len(peers)}: base {base.name} for a budget of {self.cfg.budget / 2**20:.1f} MiB, "
                 f"{len(data[me].train)} training samples, neighbours {plan.links[me]}")
        return client, shard

    def _initial(self, plan: JigsawPlan, me: int) -> dict[str, dict[str, torch.Tensor]]:
        assert self.base is not None
        return initial_modules(self.base.metas(me), module_seed(plan.shards.seed, me))

    def _open(self, rnd: JigsawRound, plan: JigsawPlan) -> None:
        """Close the previous round as a source and open this one."""
        assert self.exchange is not None
        expected = rnd.returns[self.me] if self.me < len(rnd.returns) else 0
        # a source waits for late copies at most half as long as a borrower waits for a module, so that a borrower
        # asking it for the new round's module does not give up on it meanwhile
        counts = self.exchange.begin_round(rnd.round, set(rnd.active), expected, plan.fetch_timeout_s / 2)
        if counts:
            log.info(f"round {rnd.round}: averaged {sum(counts.values())} copies of {len(counts)} of this device's modules")

    def _connect(self, client: JigsawClient, plan: JigsawPlan, masked: set[int]) -> None:
        """The client's candidates: the modules of the neighbours that are active and have not been masked."""
        assert self.exchange is not None
        neighbours = set(plan.links[self.me]) if self.me < len(plan.links) else set()
        deadline = self.clock() + plan.fetch_timeout_s
        while any(j not in self.exchange.metadata for j in neighbours & self.exchange.active) and self.clock() < deadline:
            time.sleep(0.05)  # announcements are retained: they arrive right after subscribing
        with self.exchange.cond:
            self.exchange.active -= masked
        client.connect(self.exchange)

    def _train(self, rnd: JigsawRound, plan: JigsawPlan, client: JigsawClient, shard: ClientShard) -> None:
        explore = rnd.phase == "policy"
        t = rnd.round - plan.policy_rounds
        train_cfg = plan.train if explore else plan.train.for_round(t, plan.rounds)
        if rnd.round == plan.policy_rounds and plan.policy_rounds:
            client.begin_model_training()
        masked: set[int] = set()
        result: StepResult | None = None
        while result is None:
            self._connect(client, plan, masked)
            if client.chain is not None and any(m.source not in self.exchange.active for m in client.chain):
                client.chain = None  # a module of the chain is out of reach: assemble anew from what is
            try:
                result = client.step(rnd.round, shard.task(rnd.round, None if explore else t), self.exchange, train_cfg,
                                     self.probe, explore=explore)
            except PeerUnavailable as e:
                log.warning(f"round {rnd.round}: client {e.source} did not send a module in "
                            f"{plan.fetch_timeout_s:.0f} s; masked for this round")
                if e.source in masked or e.source == self.me:
                    break
                masked.add(e.source)
        self._report_round(rnd, plan, result, masked)
        if explore and result is not None and client.agent is not None:
            self._learn(rnd, plan, client, result)

    def _report_round(self, rnd: JigsawRound, plan: JigsawPlan, result: StepResult | None, masked: set[int]) -> None:
        assert self.exchange is not None
        rejected, traffic = self.exchange.take_counters()
        with self.exchange.cond:
            returned = list(self.exchange.sent_back)
        done = RoundDone(federation=plan.federation, run=plan.run, client=self.me, round=rnd.round,
                         trained=result is not None, accuracy=result.accuracy if result else 0.0,
                         loss=min(result.loss, 1e6) if result and math.isfinite(result.loss) else (1e6 if result else 0.0),
                         chain=[(m.source, m.position) for m in result.chain] if result else [],
                         changed=bool(result and result.changed), returned=returned, masked=sorted(masked),
                         rejected=rejected, traffic=traffic, model_bytes=module_bytes(self.exchange.store))
        self.transport.publish(self.topics.jigsaw("done", self.cfg.client_id), self.signer.sign(done.to_json()), qos=QOS)
        if result is not None and result.report is not None:
            self.transport.publish(self.topics.jigsaw("report", self.cfg.client_id),
                                   self.signer.sign(result.report.to_json()), qos=QOS)
        if result is not None:
            log.info(f"round {rnd.round} ({rnd.phase}): accuracy {result.accuracy:.3f}, loss {result.loss:.3f}, chain "
                     f"{' '.join(m.key for m in result.chain)}, {sum(traffic.values())} bytes moved")

    def _learn(self, rnd: JigsawRound, plan: JigsawPlan, client: JigsawClient, result: StepResult) -> None:
        """REINFORCE on the round's reward; without the critic's advice in time, on the client's own baseline."""
        advice = None
        if get_method(plan.method).coretune:
            try:
                advice = self._wait(f"advice for round {rnd.round}", lambda: self.advice.get(rnd.round),
                                    plan.fetch_timeout_s)
            except Abandoned as e:
                log.warning(f"{e}; learning on this device's own baseline")
        client.learn(result, advice)  # type: ignore[arg-type]

    def _finish(self, rnd: JigsawRound, client: JigsawClient, shard: ClientShard) -> None:
        """The final chain as this device trained it in the last round (or the guard's local path, where it
        validates better: JigsawClient.keep), scored on the local test set."""
        assert self.exchange is not None
        if client.chain is None or client.trained is None:
            return
        model = client.keep(client.trained_model(), shard.val(), shard.own_train())
        self.final_accuracy = evaluate(model, shard.local_test())[0]
        self.final_state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
        plan = self.plan
        assert plan is not None
        rejected, traffic = self.exchange.take_counters()  # the last round's late copies
        done = RoundDone(federation=plan.federation, run=plan.run, client=self.me, round=rnd.round, trained=True,
                         accuracy=self.final_accuracy, loss=0.0, chain=[(m.source, m.position) for m in client.chain],
                         changed=False, returned=[], masked=[], rejected=rejected, traffic=traffic,
                         model_bytes=module_bytes(self.exchange.store))
        self.transport.publish(self.topics.jigsaw("done", self.cfg.client_id), self.signer.sign(done.to_json()), qos=QOS)
        log.info(f"final local test accuracy {self.final_accuracy:.4f}")
