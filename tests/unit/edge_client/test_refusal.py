"""A refused announce reaches the device: a verified refusal of its own announce says what to do (and a final
one ends `join` with EXIT_REFUSED); a forged, unsigned, foreign or other-run one is dropped and counted."""

from __future__ import annotations

import logging

import pytest

from edge_client.join import EXIT_REFUSED, run
from nefl.protocol.messages import FINAL_REFUSALS
from nefl.protocol.signing import split_signed
from tests.harness.agent_fakes import FakeServer, T, make_agent


def _broken(payload: bytes) -> bytes:
    """The signature's first characters changed."""
    i = payload.rindex(b'"', 0, len(payload) - 2) + 1
    return payload[:i] + (b"B" if payload[i:i + 1] == b"A" else b"A") + payload[i + 1:]


def _agent(tmp_path):
    server = FakeServer(tmp_path / "s")
    agent, transport, _ = make_agent(tmp_path, server)
    return agent, server, agent.cfg.device_key.public_text


@pytest.mark.parametrize("reason, says", [
    ("revoked", "revoked by the operator: ask for a new token (aggregator enroll c1)"),
    ("bad_token", "issue a new token"), ("token_used", "issue a new token"), ("token_expired", "issue a new token"),
])
def test_a_final_refusal_of_our_own_announce_ends_the_device_with_one_line(tmp_path, caplog, reason, says):
    agent, server, mine = _agent(tmp_path)
    with caplog.at_level(logging.INFO):
        agent.dispatch(T.refusal("c1"), server.refusal(reason, key=mine))
    assert agent.refused == reason
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and says in lines[0] and reason in lines[0]


@pytest.mark.parametrize("reason, says", [("not_enrolled", "enrol with a join token"),
                                          ("key_mismatch", "pinned to another device key")])
def test_a_refusal_retrying_can_fix_is_said_once_and_the_device_goes_on(tmp_path, caplog, reason, says):
    agent, server, mine = _agent(tmp_path)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            agent.dispatch(T.refusal("c1"), server.refusal(reason, key=mine))
        agent.dispatch(T.control, server.end())
    assert agent.refused is None and not agent.ended
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len([s for s in said if says in s]) == 1  # once, not per retry
    assert not any("stays for the next run" in r.getMessage() for r in caplog.records)
    assert any(f"refused this device ({reason})" in s for s in said)  # the run's end names the refusal instead


def test_a_forged_refusal_does_not_stop_the_device(tmp_path):
    agent, server, mine = _agent(tmp_path)
    impostor = FakeServer(tmp_path / "impostor")
    agent.dispatch(T.refusal("c1"), impostor.refusal("revoked", key=mine))  # signed by another key
    agent.dispatch(T.refusal("c1"), _broken(server.refusal("revoked", key=mine)))  # signature broken
    assert agent.refused is None and agent.dropped["bad_signature"] >= 1 and sum(agent.dropped.values()) == 2


def test_an_unsigned_refusal_is_dropped(tmp_path):
    agent, server, mine = _agent(tmp_path)
    body = split_signed(server.refusal("revoked", key=mine))[0]
    agent.dispatch(T.refusal("c1"), body)
    assert agent.refused is None and sum(agent.dropped.values()) == 1


@pytest.mark.parametrize("kw, reason", [({"run": "run0"}, "wrong_run"), ({"federation": "other"}, "wrong_run"),
                                        ({"client": "c2"}, "client_mismatch")])
def test_a_refusal_of_another_run_or_device_is_dropped(tmp_path, kw, reason):
    agent, server, mine = _agent(tmp_path)
    agent.dispatch(T.refusal("c1"), server.refusal("revoked", key=mine, **kw))
    assert agent.refused is None and agent.dropped[reason] == 1


@pytest.mark.parametrize("reason", sorted(FINAL_REFUSALS))
def test_a_final_refusal_of_an_announce_forged_under_our_id_does_not_stop_us(tmp_path, reason):
    agent, server, _ = _agent(tmp_path)
    forger = FakeServer(tmp_path / "forger").signer.public_text  # the key that signed the forged announce
    agent.dispatch(T.refusal("c1"), server.refusal(reason, key=forger))
    agent.dispatch(T.refusal("c1"), server.refusal(reason, key=""))  # refused before any signature was checked
    assert agent.refused is None and agent.dropped["not_our_announce"] == 2


class _Conn:
    """The shell's connection, delivering the messages queued in `inbox`."""

    def __init__(self, messages) -> None:
        import queue

        self.inbox: queue.Queue = queue.Queue()
        for m in messages:
            self.inbox.put(m)
        self.stamp, self.connected, self.stopped = 0, True, None

    def start(self) -> None:
        pass

    def just_connected(self) -> bool:
        return False

    def stop(self, last) -> None:
        self.stopped = last


def test_join_exits_with_exit_refused_after_a_final_refusal(tmp_path):
    agent, server, mine = _agent(tmp_path)
    conn = _Conn([(T.refusal("c1"), server.refusal("revoked", key=mine))])
    assert run(agent, conn, None) == EXIT_REFUSED and conn.stopped is not None  # "offline" said on the way out


@pytest.mark.parametrize("reason", ["not_enrolled", "revoked"])
def test_a_device_without_pin_or_token_says_a_refusal_and_never_obeys_it(tmp_path, caplog, reason):
    """Trust on first use: the refusal is signed by a key the device has only seen in a status. It says what to do,
    once; it neither ends the device (anyone can run a server that refuses it) nor pins that key."""
    server = FakeServer(tmp_path / "s")
    agent, _, _ = make_agent(tmp_path, server, pinned=False)
    mine = agent.cfg.device_key.public_text
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            agent.dispatch(T.refusal("c1"), server.refusal(reason, key=mine))
    assert agent.refused is None and agent.pin.key is None and not agent.dropped
    said = [r.getMessage() for r in caplog.records if "refused this device's announce" in r.getMessage()]
    assert len(said) == 1 and f"({reason})" in said[0] and "not obeyed" in said[0]
