"""The MQTT topic tree of one federation: the only place that spells topic strings.

Everything lives under `nefl/{federation}/` so one broker can carry several federations and an
ACL can confine a client to `.../{client}` leaves (docs/security.md). MQTT 3.1.1 features only.

    announce/{client}     client -> server  retained  device summary, samples, largest submodel
    decline/{client}      client -> server            "I will not train task (run, round, submodel)"
    status/{client}       client -> server  retained  "online"; last will "offline"
    task/{client}         server -> client  retained  round, submodel, lr, epochs
    refusal/{client}      server -> client            signed: its announce was refused, why, what to do
    model/{sub}/{chunk}   server -> all     retained  submodel weights, once per round (broker fans out)
    update/{client}       client -> server            chunked delta of the assigned submodel
    sent/{client}         client -> server            signed notice: "my update for (run, round) is out"
    resend/{client}       client -> server            the same update again, when the server asks (never shared)
    control               server -> all     retained  {"event": "end"} when the federation is over
    server/status         server -> all     retained  live state; last will "offline"

Model rollout (docs/deploy.md, "Rolling out a trained model"): the aggregator publishes exported
models to devices that follow them with `edge-client serve --follow`.

    deploy/rollout                  server -> devices  retained  signed: stable and canary version, canary devices, revoked
    deploy/release/{version}        server -> devices  retained  signed: the export's manifest, files, sizes, Merkle roots
    deploy/file/{version}/{f}/{i}   server -> devices  retained  chunk i of file f of that release (wire kind "file")
    deploy/status/{client}          device -> server   retained  signed by the device key: version, health, latency;
                                                                 last will "offline"

FedJigsaw over the broker (docs/fedjigsaw.md, "Deploying"): a light coordinator (`aggregator jigsaw-serve`) and
devices (`edge-client jigsaw`) that exchange modules among themselves; every message is signed by its sender.

    jigsaw/hello/{client}      device -> coordinator  retained  self-signed: device key, memory budget
    jigsaw/plan                coordinator -> all     retained  participants and their keys, topology, settings
    jigsaw/round               coordinator -> all     retained  round, phase, active devices, returns to expect
    jigsaw/done/{client}       device -> coordinator            the round's accuracy, chain, traffic, rejections
    jigsaw/report/{client}     device -> coordinator            policy phase: CoRe-Tune's PolicyReport
    jigsaw/advice/{client}     coordinator -> device            policy phase: CoRe-Tune's CriticAdvice
    jigsaw/meta/{client}       device -> neighbours   retained  metadata of the modules it owns (no parameters)
    jigsaw/fetch/{source}      borrower -> source               "send me your module at position p for round r"
    jigsaw/module/{borrower}   source -> borrower               that module's parameters (wire kind "module")
    jigsaw/return/{source}     borrower -> source               a trained copy of the source's module (kind "return")

Scale-out (docs/scale.md): aggregator workers and site relays talk to the coordinator under
`workers/` and `worker/{id}/`; a broker ACL should let only server-side accounts use them, and the
coordinator takes worker messages only signed by a key the operator authorised (docs/security.md).

    workers/round         coordinator -> workers  retained  signed round plan (assignments, bounds)
    workers/close         coordinator -> workers            signed "send your partial for round r"
    worker/{id}/status    worker -> coordinator   retained  "online"; last will "offline"
    worker/{id}/receipt   worker -> coordinator             a signed batch: one receipt per accepted or rejected update
    worker/{id}/partial   worker -> coordinator             chunked safetensors of its partial sums
    worker/{id}/summary   worker -> coordinator             weights, counts, clients of that partial
    worker/{id}/forward   worker -> worker                  a chunk of a multi-chunk update, to its owner
"""

from __future__ import annotations

import re

PREFIX = "nefl"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
WORKER_KINDS = ("status", "receipt", "partial", "summary", "forward")
JIGSAW_KINDS = ("hello", "done", "report", "advice", "meta", "fetch", "module", "return")


WORKER_GROUP = "nefl-workers"  # the workers' shared-subscription group unless told another (a secret one: docs/security.md)


def check_name(kind: str, value: str) -> str:
    """Federation and client ids become topic levels, so wildcards and slashes are refused."""
    if not _NAME.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return value


class Topics:
    def __init__(self, federation: str) -> None:
        self.federation = check_name("federation name", federation)
        self.root = f"{PREFIX}/{federation}"

    def announce(self, client: str) -> str:
        return f"{self.root}/announce/{client}"

    def status(self, client: str) -> str:
        return f"{self.root}/status/{client}"

    def decline(self, client: str) -> str:
        return f"{self.root}/decline/{client}"

    def task(self, client: str) -> str:
        return f"{self.root}/task/{client}"

    def refusal(self, client: str) -> str:
        return f"{self.root}/refusal/{client}"

    def update(self, client: str) -> str:
        return f"{self.root}/update/{client}"

    def sent(self, client: str) -> str:
        return f"{self.root}/sent/{client}"

    def resend(self, client: str) -> str:
        return f"{self.root}/resend/{client}"

    def model_chunk(self, submodel: int, index: int) -> str:
        return f"{self.root}/model/{submodel}/{index}"

    def model_all(self, submodel: int) -> str:
        return f"{self.root}/model/{submodel}/+"

    @property
    def control(self) -> str:
        return f"{self.root}/control"

    @property
    def server_status(self) -> str:
        return f"{self.root}/server/status"

    def server_subscriptions(self) -> list[str]:
        return [f"{self.root}/{kind}/+" for kind in ("announce", "decline", "status", "update", "sent", "resend")]

    def update_shared(self, group: str) -> str:
        """The MQTT 3.1.1 shared subscription that spreads updates over a group of workers: the broker
        hands each message to one member (mosquitto 2.x, EMQX, HiveMQ, VerneMQ)."""
        return f"$share/{check_name('worker group', group)}/{self.root}/update/+"

    @property
    def workers_round(self) -> str:
        return f"{self.root}/workers/round"

    @property
    def workers_close(self) -> str:
        return f"{self.root}/workers/close"

    def worker(self, worker: str, kind: str) -> str:
        """`worker/{id}/{kind}`, kind one of WORKER_KINDS."""
        if kind not in WORKER_KINDS:
            raise ValueError(f"unknown worker topic kind {kind!r}")
        return f"{self.root}/worker/{worker}/{kind}"

    def coordinator_subscriptions(self) -> list[str]:
        """What a coordinator hears from its workers and relays (the forward topic is theirs alone)."""
        return [f"{self.root}/worker/+/{kind}" for kind in WORKER_KINDS if kind != "forward"]

    def worker_of(self, topic: str) -> tuple[str, str] | None:
        """(worker id, kind) of a `worker/{id}/{kind}` topic, or None when the topic is not one."""
        head = f"{self.root}/worker/"
        if not topic.startswith(head):
            return None
        worker, _, kind = topic[len(head):].partition("/")
        return (worker, kind) if _NAME.fullmatch(worker) and kind in WORKER_KINDS else None

    def relay_down(self) -> list[str]:
        """What a site relay copies from the coordinator's broker to its site (tasks: per site client)."""
        return [f"{self.root}/model/#", self.control, self.server_status]

    def relay_up(self) -> list[str]:
        """What a site relay copies from its site to the coordinator's broker (updates it sums itself)."""
        return [f"{self.root}/{kind}/+" for kind in ("announce", "decline", "status", "sent")]

    @property
    def deploy_rollout(self) -> str:
        return f"{self.root}/deploy/rollout"

    def deploy_release(self, version: int) -> str:
        return f"{self.root}/deploy/release/{version}"

    def deploy_file(self, version: int, file: int, index: int) -> str:
        return f"{self.root}/deploy/file/{version}/{file}/{index}"

    def deploy_file_chunks(self, version: int, file: int) -> str:
        """Every chunk of one file of a release (a subscription)."""
        return f"{self.root}/deploy/file/{version}/{file}/+"

    def deploy_status(self, client: str) -> str:
        return f"{self.root}/deploy/status/{client}"

    @property
    def deploy_statuses(self) -> str:
        return f"{self.root}/deploy/status/+"

    def jigsaw(self, kind: str, client: str | None = None) -> str:
        """`jigsaw/{kind}` or `jigsaw/{kind}/{client}`, kind one of JIGSAW_KINDS (per-client) or plan, round."""
        if kind not in (JIGSAW_KINDS if client is not None else ("plan", "round")):
            raise ValueError(f"unknown FedJigsaw topic {kind!r}{' per client' if client is not None else ''}")
        return f"{self.root}/jigsaw/{kind}" + (f"/{client}" if client is not None else "")

    def jigsaw_of(self, topic: str) -> tuple[str, str | None] | None:
        """(kind, client or None) of a FedJigsaw topic, or None when the topic is not one."""
        head = f"{self.root}/jigsaw/"
        if not topic.startswith(head):
            return None
        kind, _, client = topic[len(head):].partition("/")
        if not client:
            return (kind, None) if kind in ("plan", "round") else None
        return (kind, client) if kind in JIGSAW_KINDS and _NAME.fullmatch(client) else None

    def is_model(self, topic: str) -> bool:
        return topic.startswith(f"{self.root}/model/")

    def client_of(self, topic: str, kind: str) -> str | None:
        """The client id of an `{kind}/{client}` topic, or None when the topic is not one."""
        head = f"{self.root}/{kind}/"
        if not topic.startswith(head):
            return None
        client = topic[len(head):]
        return client if _NAME.fullmatch(client) else None
