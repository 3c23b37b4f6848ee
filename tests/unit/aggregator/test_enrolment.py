"""Enrolment (aggregator/enrolment.py, nefl/protocol/tokens.py, `aggregator enroll` / `revoke`): who may pin a device
key, for how long, and which keys may speak for workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aggregator.enrolment import Enrolment, EnrolmentPolicy, Grant, Revoke, append
from aggregator.federation import Rejected
from aggregator.keys import KeyDir
from nefl.protocol.signing import Signer
from nefl.protocol.tokens import TokenError, check_proof, fingerprint, new_token, parse_token, proof, verifier_of
from tests.harness.procs import ROOT


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def keys(n: int) -> list[str]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    return [Signer(Ed25519PrivateKey.generate()).public_text for _ in range(n)]


def reasons(fn) -> str:
    with pytest.raises(Rejected) as e:
        fn()
    return e.value.reason


def test_a_token_proves_one_id_and_one_key_and_never_travels(tmp_path):
    server, dev, other = keys(3)
    token, verifier = new_token(server)
    fp, secret = parse_token(token)
    assert fp == fingerprint(server) and verifier == verifier_of(secret) and secret not in verifier
    p = proof(secret, "t", "c1", dev)
    assert check_proof(verifier, p, "t", "c1", dev)
    for fed, client, key in (("t", "c2", dev), ("t", "c1", other), ("u", "c1", dev)):
        assert not check_proof(verifier, p, fed, client, key)
    assert not check_proof(verifier, "not base64!", "t", "c1", dev)
    with pytest.raises(TokenError):
        parse_token("nefl.1234.abc")


def journal_with(tmp_path, *entries) -> Enrolment:
    j = tmp_path / "enrolment.jsonl"
    for e in entries:
        append(j, e)
    assert oct(j.stat().st_mode & 0o777) == "0o600"
    return j


def test_closed_enrolment_admits_only_token_holders_and_tokens_are_spent_once(tmp_path):
    clock = Clock()
    server, dev, thief, new = keys(4)
    token, verifier = new_token(server)
    _, secret = parse_token(token)
    j = journal_with(tmp_path, Grant(client="c1", created=clock.now, verifier=verifier, expires=clock.now + 3600))
    e = Enrolment("t", EnrolmentPolicy(), j, clock)
    e.reload()
    assert not e.open  # a token list exists: closed by default
    assert reasons(lambda: e.precheck("c1", "")) == "not_enrolled"  # no token, no pin: refused before any signature
    assert reasons(lambda: e.admit("c1", thief, proof(secret, "t", "c1", dev))) == "bad_token"  # a proof read off the broker
    e.admit("c1", dev, proof(secret, "t", "c1", dev))
    assert e.key("c1") == dev
    e.admit("c1", dev, proof(secret, "t", "c1", dev))  # the device keeps presenting it: fine
    e.admit("c1", dev)
    assert reasons(lambda: e.admit("c1", thief)) == "key_mismatch"
    assert reasons(lambda: e.admit("c1", "")) == "unsigned"
    assert reasons(lambda: e.admit("c1", new, proof(secret, "t", "c1", new))) == "token_used"
    # rotation: a new token for the id moves the pin to the device's new key
    token2, verifier2 = new_token(server)
    append(j, Grant(client="c1", created=clock.now + 1, verifier=verifier2, expires=clock.now + 3600))
    e.reload()
    e.admit("c1", new, proof(parse_token(token2)[1], "t", "c1", new))
    assert e.key("c1") == new
    # an expired token
    token3, verifier3 = new_token(server)
    append(j, Grant(client="c2", created=clock.now, verifier=verifier3, expires=clock.now + 10))
    e.reload()
    clock.now += 11
    assert reasons(lambda: e.admit("c2", dev, proof(parse_token(token3)[1], "t", "c2", dev))) == "token_expired"


def test_revocation_and_key_grants_apply_once_and_survive_a_checkpoint(tmp_path):
    clock = Clock()
    dev, new, worker = keys(3)
    j = journal_with(tmp_path, Grant(client="c1", created=clock.now, key=dev),
                     Grant(client="w1", role="worker", created=clock.now, key=worker))
    e = Enrolment("t", EnrolmentPolicy(), j, clock)
    assert e.reload() == [] and e.key("c1") == dev and e.worker_key("w1") == worker and e.has_workers()
    e.trained(["c1"])
    append(j, Revoke(client="c1", time=clock.now + 1))
    append(j, Revoke(client="w1", role="worker", time=clock.now + 1))
    assert e.reload() == ["c1"] and e.key("c1") is None and e.worker_key("w1") is None
    assert reasons(lambda: e.admit("c1", dev)) == "not_enrolled"
    append(j, Grant(client="c1", created=clock.now + 2, key=new))  # enrolled again, with a new key
    e.reload()
    assert e.key("c1") == new
    restored = Enrolment("t", EnrolmentPolicy(), j, clock)
    restored.load_state_dict(json.loads(json.dumps(e.state_dict())))
    restored.reload()  # the journal again, over the checkpoint: nothing changes
    assert restored.state_dict() == e.state_dict()
    legacy = Enrolment("t")
    legacy.load_state_dict(None, {"old": dev})  # an older checkpoint's client_keys
    assert legacy.key("old") == dev and legacy.pins["old"].trained


def test_open_pins_are_rate_limited_capped_and_expire_unless_they_trained(tmp_path):
    clock = Clock()
    e = Enrolment("t", EnrolmentPolicy(new_pins_per_minute=3, max_unproven=5, unproven_ttl_s=600), None, clock)
    ks = keys(8)
    assert e.open
    for i in range(3):
        e.admit(f"c{i}", ks[i])
    assert reasons(lambda: e.admit("c3", ks[3])) == "pin_rate_limited"
    clock.now += 61
    e.admit("c3", ks[3])
    e.admit("c4", ks[4])
    assert reasons(lambda: e.admit("c5", ks[5])) == "too_many_pins"  # 5 untrained first-use pins
    e.trained(["c0"])
    clock.now += 61
    e.admit("c5", ks[5])
    clock.now += 601
    assert sorted(e.expire(keep={"c1"})) == ["c2", "c3", "c4", "c5"]  # c0 trained, c1 is in the open round
    assert set(e.pins) == {"c0", "c1"}
    e.admit("c9", "")  # an unsigned (old) device under open enrolment: accepted, never pinned
    assert e.key("c9") is None
    strict = Enrolment("t", EnrolmentPolicy(require_device_keys=True))
    assert reasons(lambda: strict.admit("c9", "")) == "unsigned"
    append(tmp_path / "j", Revoke(client="c0", time=clock.now))
    e.journal = tmp_path / "j"
    e.reload()
    assert reasons(lambda: e.admit("c0", ks[0])) == "revoked"  # no first-use pin after a revocation


def test_keys_live_apart_from_runs_and_an_old_key_moves_in(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = Signer.load_or_create(run)
    kd = KeyDir("t", tmp_path / "keys")
    assert kd.server_signer(run).public_text == old.public_text and not (run / "server.key").exists()
    assert oct(kd.path.stat().st_mode & 0o777) == "0o700" and oct(kd.server_key.stat().st_mode & 0o777) == "0o600"
    Signer.load_or_create(run)  # a different key appears in the old place: refused, with the fix
    with pytest.raises(ValueError, match="two server keys"):
        kd.server_signer(run)
    assert kd.next_incarnation() == 1 and kd.next_incarnation() == 2


def test_enroll_and_revoke_commands(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEFL_KEY_DIR": str(tmp_path / "keys")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "from aggregator.cli import app; app()", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    out = cli("enroll", "edge-1", "--federation", "t")
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    server = cli("key", "--federation", "t").stdout.strip()
    assert parse_token(token)[0] == fingerprint(server)
    bad = cli("enroll", "w1", "--worker", "--federation", "t")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--public-key" in bad.stderr
    assert cli("enroll", "w1", "--worker", "--public-key", keys(1)[0], "--federation", "t").returncode == 0
    assert cli("revoke", "edge-1", "--federation", "t").returncode == 0
    e = Enrolment("t", journal=tmp_path / "keys" / "t" / "enrolment.jsonl")
    e.reload()
    assert e.has_workers() and not e.open and "edge-1" in e.revoked


def test_a_spent_token_stays_spent_for_any_later_serve_on_the_key_directory(tmp_path):
    """The spend is journalled: a fresh registry (a `serve` without --resume, no checkpoint) refuses the token
    and keeps the pin; a revocation after the spend removes the pin and names itself to the device."""
    clock = Clock()
    server, dev, thief = keys(3)
    token, verifier = new_token(server)
    _, secret = parse_token(token)
    j = journal_with(tmp_path, Grant(client="c1", created=clock.now, verifier=verifier, expires=clock.now + 3600))
    first = Enrolment("t", EnrolmentPolicy(), j, clock)
    first.reload()
    clock.now += 5
    first.admit("c1", dev, proof(secret, "t", "c1", dev))
    fresh = Enrolment("t", EnrolmentPolicy(), j, clock)
    fresh.reload()
    assert fresh.key("c1") == dev and verifier in fresh.used
    assert reasons(lambda: fresh.admit("c1", thief, proof(secret, "t", "c1", thief))) == "token_used"
    fresh.admit("c1", dev, proof(secret, "t", "c1", dev))  # the device itself keeps presenting its proof: fine
    assert first.reload() == [] and first.key("c1") == dev  # its own spend read back: nothing changes
    append(j, Revoke(client="c1", time=clock.now + 1))
    again = Enrolment("t", EnrolmentPolicy(), j, clock)
    again.reload()
    assert again.key("c1") is None
    assert reasons(lambda: again.admit("c1", dev, proof(secret, "t", "c1", dev))) == "revoked"


def test_a_spend_that_cannot_be_recorded_enrols_no_one(tmp_path):
    clock = Clock()
    server, dev = keys(2)
    token, verifier = new_token(server)
    j = journal_with(tmp_path, Grant(client="c1", created=clock.now, verifier=verifier, expires=clock.now + 3600))
    e = Enrolment("t", EnrolmentPolicy(), j, clock)
    e.reload()
    j.chmod(0o400)
    if os.access(j, os.W_OK):  # root writes anyway: take the file's place with a directory instead
        j.chmod(0o600)
        j.rename(tmp_path / "moved")
        j.mkdir()
    assert reasons(lambda: e.admit("c1", dev, proof(parse_token(token)[1], "t", "c1", dev))) == "journal_unwritable"
    assert e.key("c1") is None and verifier not in e.used


def test_a_follower_enrolment_lets_an_id_report_on_rollouts_never_train() -> None:
    e = Enrolment("t")
    e.apply([Grant(client="f1", role="follower", created=1.0, key="k1")])
    assert e.report_key("f1") == "k1" and e.key("f1") is None and e.open  # open enrolment for training stays open
    e.apply([Grant(client="f1", role="follower", created=1.0, key="k1"), Revoke(client="f1", role="follower", time=2.0)])
    assert e.report_key("f1") is None
    with pytest.raises(ValueError, match="follower is authorised by its key"):
        Grant(client="f1", role="follower", created=1.0, verifier="0" * 64)
