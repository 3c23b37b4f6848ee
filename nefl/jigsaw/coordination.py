"""The messages between FedJigsaw devices and their light coordinator (`aggregator jigsaw-serve`).

The coordinator holds no model: it admits devices (their self-signed hello names their key), announces the
plan (who takes part under which index and key, the topology, the settings every device's client step and
shard need), then opens each round (its phase, which devices are active, how many trained copies each source
must wait for from the round before) and hears how each round went. During the policy phase it also runs
CoRe-Tune's critic on the devices' PolicyReports (nefl.jigsaw.coretune). Its messages are signed by its key,
the devices' by theirs; every one goes through the strict loader (nefl.protocol.messages.decode).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from nefl.jigsaw.client import ClientSettings
from nefl.jigsaw.coretune import ModuleKey
from nefl.jigsaw.shards import ShardSpec
from nefl.jigsaw.symbio import ClientIndex
from nefl.protocol.messages import Count, KeyText, Message, Name, Round, Seconds, Short
from nefl.support.settings import TrainConfig

MAX_PLAN_BYTES = 1 << 20
MAX_DEVICES = 1024
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Phase = Literal["policy", "train", "end", "over"]  # end: score the chain as last trained; over: leave
Clients = Annotated[list[ClientIndex], msgspec.Meta(max_length=4 * MAX_DEVICES)]


class JigsawHello(Message, frozen=True, tag="jigsaw_hello", tag_field="type"):
    """Device -> coordinator (retained, signed by the key it names): I take part, with this memory budget."""

    federation: Name
    client_id: Name
    key: KeyText
    budget: Annotated[int, msgspec.Meta(ge=1, le=1 << 50)]  # bytes the device may use for training (it picks its base)


class Participant(msgspec.Struct, frozen=True, kw_only=True):
    index: ClientIndex
    client_id: Name
    key: KeyText


class JigsawPlan(Message, frozen=True, tag="jigsaw_plan", tag_field="type"):
    """Coordinator -> devices (retained, signed): everything a device needs to run its client step."""

    federation: Name
    run: Name  # this coordinator run: rounds and advice of another run are refused
    key: KeyText  # the coordinator's key, which signs this plan (trusted on first use where none is pinned)
    method: Name
    dataset: Name
    archs: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=32)]
    participants: Annotated[list[Participant], msgspec.Meta(min_length=1, max_length=MAX_DEVICES)]
    links: Annotated[list[Clients], msgspec.Meta(max_length=MAX_DEVICES)]  # each participant's neighbours
    shards: ShardSpec
    settings: ClientSettings
    train: TrainConfig
    rounds: Annotated[int, msgspec.Meta(ge=1, le=100_000)]  # model-training rounds
    policy_rounds: Annotated[int, msgspec.Meta(ge=0, le=100_000)]
    fetch_timeout_s: Seconds  # a peer that does not answer a fetch within this is masked for the round
    norm_bound: Annotated[float, msgspec.Meta(gt=0, le=1e6)]  # a returned copy may differ from the source's by this x its norm
    screen: bool = True  # sources judge each module's returns together (nefl.jigsaw.screen) before Eq. 2


class JigsawRound(Message, frozen=True, tag="jigsaw_round", tag_field="type"):
    """Coordinator -> devices (retained, signed): round `round` opens. After the last one, phase "end" closes it
    (sources average the last returns, devices score the chain as they last trained it, or their local path, on their
    local test set), then "over"."""

    federation: Name
    run: Name
    round: Round
    phase: Phase
    active: Clients  # devices taking part in this round (the others are offline or were too slow)
    returns: Clients  # per participant index: trained copies of its modules sent in the previous round


class RoundDone(Message, frozen=True, tag="jigsaw_done", tag_field="type"):
    """Device -> coordinator (signed): how its round went (phase "end": its final local test accuracy)."""

    federation: Name
    run: Name
    client: ClientIndex
    round: Round
    trained: bool  # False: no chain could be assembled from the peers that answered
    accuracy: Unit  # validation accuracy after training (end: local test accuracy)
    loss: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
    chain: Annotated[list[ModuleKey], msgspec.Meta(max_length=64)]
    changed: bool
    returned: Clients  # the source of every trained copy sent back to a peer
    masked: Clients  # peers masked this round (no answer to a fetch in time)
    rejected: Annotated[dict[Short, Count], msgspec.Meta(max_length=32)]  # inbound messages refused, by reason
    traffic: Annotated[dict[Short, Count], msgspec.Meta(max_length=32)]  # bytes sent and received, by kind
    model_bytes: Count = 0  # the device's base model's parameters: what FedAvg would move each way per round
