"""Model rollout, device side and rule: the follower's logic fed signed messages as the aggregator sends them,
with a real export, real onnxruntime parity checks and a real staging directory (the MQTT loop is
tests/e2e/test_rollout.py's)."""

from __future__ import annotations

import errno
import io
import os
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.deploy import DeployError, RolloutState, build_release, load_state, migrate_state, save_state
from aggregator.enrolment import Grant, Revoke, append
from aggregator.keys import KeyDir
from aggregator.rollout import CanaryRule, EnrolledKeys, FleetBook, choose_canaries, judge, judge_device
from edge_client.follow import FollowConfig, Follower, offline_report
from edge_client.runtime import AdaptiveRuntime
from edge_client.serving import Active, Serving
from edge_client.store import Store, followed_current
from export.onnx_export import export_checkpoint
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.manifest import read_manifest, sha256_file, write_manifest
from nefl.protocol.messages import DeployReport, Refusal, VersionStats
from nefl.protocol.signing import Signer, parse_public_key
from nefl.protocol.topics import Topics
from nefl.protocol.wire import parse_chunk
from tests.harness.agent_fakes import FakeTransport
from tests.harness.rollout_helpers import release_messages, rollout

T = Topics("t")
GIB = 1 << 30
SERVER = Signer(Ed25519PrivateKey.generate())


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smallest and largest rungs of resnet8's ladder, freshly initialised (the weights do not matter here)."""
    from nefl.nested.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("rollout")
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    ckpt = save_checkpoint(root / "ckpt", GlobalState.init(layout, 1), layout, {"round": 3})
    export_checkpoint(ckpt, root / "onnx", submodels=[0, layout.num_submodels - 1])
    return root / "onnx"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp: Path, memory: int | None = 8 * GIB, build=None, **cfg) -> Follower:
    key = Signer.load_or_create(tmp / "keys", "d1.key")
    config = FollowConfig("d1", "t", parse_public_key(SERVER.public_text), key, **cfg)
    build = build or (lambda d: AdaptiveRuntime(d, probe=lambda: (0.0, memory), latency_budget_ms=1000, threads=1,
                                                calibration_runs=1))
    return Follower(config, FakeTransport(), Store(tmp / "models"), Serving(), build, lambda: memory, clock=Clock())


def deliver(f: Follower, export: Path, version: int, seq: int | None = None, **rollout_kw) -> list[tuple[str, bytes]]:
    """Rollout #seq naming `version` stable, its release, then every chunk; returns the chunks."""
    release, chunks = release_messages(SERVER, export, version)
    f.dispatch(T.deploy_rollout, rollout(SERVER, seq or version, version, **rollout_kw))
    f.dispatch(T.deploy_release(version), release)
    for topic, message in chunks:
        f.dispatch(topic, message)
    return chunks


def last_report(f: Follower) -> DeployReport:
    payload = f.transport.on(T.deploy_status("d1"))[-1]
    return DeployReport.from_json(payload[:-(len(payload) - payload.rindex(b',"sig":'))] + b"}")


def test_a_release_is_fetched_checked_and_swapped_in(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    release, chunks = release_messages(SERVER, export, 1)
    f.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))
    assert T.deploy_release(1) in f.transport.subscribed
    f.dispatch(T.deploy_release(1), release)
    assert any(t.endswith("/+") for t in f.transport.subscribed)  # a file not started: one wildcard per file
    for topic, message in chunks:
        f.dispatch(topic, message)
    assert f.version == 1 and f.serving.current().runtime.submodels
    assert followed_current(tmp_path / "models") == (tmp_path / "models" / "versions" / "v1").resolve()
    report = last_report(f)
    assert (report.version, report.state) == (1, "serving")
    assert report.fetched_bytes == report.release_bytes == sum(
        (export / n).stat().st_size for n in os.listdir(export) if n != "manifest.json")
    assert set(f.transport.unsubscribed) >= {T.deploy_release(1)}  # done: nothing retained comes again


def test_only_the_submodels_that_fit_memory_are_fetched(export: Path, tmp_path: Path) -> None:
    manifest = read_manifest(export)
    small, large = sorted(manifest.submodels, key=lambda e: e.gamma)
    need = small.weight_bytes + small.activation_bytes_per_sample + (64 << 20)  # the runtime's reserve
    f = make(tmp_path, memory=need)
    deliver(f, export, 1)
    assert [s.index for s in f.serving.current().runtime.submodels] == [small.index]
    report = last_report(f)
    assert report.fetched_bytes < report.release_bytes
    assert not (tmp_path / "models" / "versions" / "v1" / large.file).exists()


def test_a_broken_transfer_resumes_with_the_missing_chunks_only(export: Path, tmp_path: Path) -> None:
    release, chunks = release_messages(SERVER, export, 1)
    first = make(tmp_path)
    first.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))
    first.dispatch(T.deploy_release(1), release)
    half = len(chunks) // 2
    for topic, message in chunks[:half]:
        first.dispatch(topic, message)
    assert first.version is None
    again = make(tmp_path)  # the process restarted (or the broker went away): a new follower on the same directory
    again.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))
    again.dispatch(T.deploy_release(1), release)
    wanted = set(again.transport.subscribed) - {T.deploy_rollout, T.deploy_release(1)}
    files = {t.rsplit("/", 1)[0] for t, _ in chunks}
    begun = {t.rsplit("/", 1)[0] for t, _ in chunks[:half]}
    # exactly the missing chunks of files begun; one wildcard for each file not begun
    assert wanted == {t for t, _ in chunks[half:] if t.rsplit("/", 1)[0] in begun} | {f + "/+" for f in files - begun}
    for topic, message in chunks[half:]:
        again.dispatch(topic, message)
    assert again.version == 1
    assert again.staging is None and last_report(again).fetched_bytes == sum(len(parse_chunk(m).data) for _, m in chunks[half:])


def test_on_reconnect_only_missing_chunks_are_asked_for(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    release, chunks = release_messages(SERVER, export, 1)
    f.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))
    f.dispatch(T.deploy_release(1), release)
    for topic, message in chunks[:3]:
        f.dispatch(topic, message)
    f.transport.subscribed.clear()
    f.on_connected()  # clean session after a broker drop
    assert set(f.transport.subscribed) - {T.deploy_rollout} <= {t for t, _ in chunks[3:]} | {
        T.deploy_file_chunks(1, p) for p in range(6)}
    assert not set(f.transport.subscribed) & {t for t, _ in chunks[:3]}


@pytest.mark.parametrize("case, expected", [
    ("unsigned", "refused rollout message: message carries no server signature"),
    ("other key", "refused rollout message: signature does not match the pinned server key"),
    ("other federation", "refused rollout of federation 'other': this device follows 't'"),
])
def test_untrusted_rollouts_are_refused_and_the_old_version_serves(export: Path, tmp_path: Path, case: str,
                                                                    expected: str) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    forger = Signer(Ed25519PrivateKey.generate())
    payload = {"unsigned": rollout(SERVER, 2, 2)[:rollout(SERVER, 2, 2).rindex(b',"sig"')] + b"}",
               "other key": rollout(forger, 2, 2),
               "other federation": rollout(SERVER, 2, 2, federation="other")}[case]
    f.dispatch(T.deploy_rollout, payload)
    assert f.event == expected and f.version == 1 and f.target == 1
    assert T.deploy_release(2) not in f.transport.subscribed


def test_an_older_version_needs_a_signed_rollback(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    deliver(f, export, 2)
    assert f.version == 2 and f.store.previous == 1
    f.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))  # an old rollout replayed
    assert "refused rollout #1: #2 is already applied" in f.event and f.version == 2
    f.dispatch(T.deploy_rollout, rollout(SERVER, 3, 1))  # newer, signed, but does not revoke v2
    assert f.event.startswith("refused v1: older than v2") and "no downgrade unless the operator signs a rollback" in f.event
    assert f.version == 2
    f.dispatch(T.deploy_rollout, rollout(SERVER, 4, 1, revoked=[2], reason="bad answers"))
    assert f.version == 1 and f.event == "rolled back v2 -> v1: the operator's signed rollback (bad answers)"
    f.dispatch(T.deploy_rollout, rollout(SERVER, 5, 1, revoked=[2]))
    assert f.version == 1 and f.state.revoked == [2]


@pytest.mark.parametrize("damage, reason, words", [
    (lambda data: data[:-100], "size_mismatch", "bytes, the header says"),
    (lambda data: data + b"x" * 100, "size_mismatch", "bytes, the header says"),
    (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "digest_mismatch", "does not hash to the digest in its header"),
])
def test_damaged_chunks_are_dropped_and_the_intact_copy_still_completes(export: Path, tmp_path: Path, damage, reason,
                                                                        words) -> None:
    from nefl.protocol.wire import split_chunk
    f = make(tmp_path)
    deliver(f, export, 1)
    release, chunks = release_messages(SERVER, export, 2)
    f.dispatch(T.deploy_rollout, rollout(SERVER, 2, 2))
    f.dispatch(T.deploy_release(2), release)
    topic, message = chunks[0]
    data = bytes(split_chunk(message)[3])
    f.dispatch(topic, message[:len(message) - len(data)] + damage(data))
    assert f.dropped[reason] == 1 and words in f.event and f.version == 1
    for topic, message in chunks:
        f.dispatch(topic, message)
    assert f.version == 2


def test_a_release_too_large_for_the_device_is_refused(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path, max_release_bytes=1000)
    deliver(f, export, 1)
    assert f.version is None and f.dropped["oversized"] == 1
    assert "over the 1000 B it accepts" in f.event


def test_a_disk_without_room_is_refused_before_writing(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path, keep_free_bytes=1 << 60)
    deliver(f, export, 1)
    assert f.version is None and f.dropped["disk_full"] == 1
    assert "cannot stage v1: v1 needs" in f.event and "must stay free" in f.event
    assert not list((tmp_path / "models" / "staging").glob("*/*.part"))


def test_a_disk_that_fills_while_staging_keeps_the_old_version_and_retries(export: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    release, chunks = release_messages(SERVER, export, 2)
    f.dispatch(T.deploy_rollout, rollout(SERVER, 2, 2))
    f.dispatch(T.deploy_release(2), release)
    f.dispatch(*chunks[0])

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    f.dispatch(*chunks[1])
    assert f.version == 1 and f.staging is None and f.dropped["disk_full"] == 1
    assert "No space left on device" in f.event and "staging discarded, retrying in 30 s" in f.event
    assert not (tmp_path / "models" / "staging" / "v2").exists()
    monkeypatch.undo()
    f.clock.now += 31
    f.tick()  # the retry asks for the retained release again
    f.dispatch(T.deploy_release(2), release)
    for topic, message in chunks:
        f.dispatch(topic, message)
    assert f.version == 2


def _resign(export: Path, dst: Path, edit) -> Path:
    """A copy of the export whose parity reference was changed by `edit` (then re-hashed: a signed release)."""
    import shutil
    shutil.copytree(export, dst)
    manifest = read_manifest(dst)
    with np.load(dst / manifest.parity.file) as ref:
        arrays = {k: ref[k] for k in ref.files}
    edit(arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    (dst / manifest.parity.file).write_bytes(buf.getvalue())
    write_manifest(dst, msgspec.structs.replace(manifest, parity=msgspec.structs.replace(
        manifest.parity, sha256=sha256_file(dst / manifest.parity.file))))
    return dst


def test_a_version_failing_parity_here_is_refused_for_good(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    index = read_manifest(export).submodels[0].index
    bad = _resign(export, tmp_path / "bad", lambda a: a.__setitem__(f"logits_{index}", a[f"logits_{index}"] + 0.5))
    deliver(f, bad, 2)
    assert f.version == 1
    assert f.event.startswith(f"refused v2: parity failed on this device: submodel {index + 1} at batch 1 differs")
    assert 2 in f.state.refused and not f.store.has(2)
    assert Refusal(version=2, reason=f.state.refused[2]) in last_report(f).refused
    f.dispatch(T.deploy_rollout, rollout(SERVER, 3, 2))  # asked again: not fetched again
    assert f.transport.subscribed.count(T.deploy_release(2)) == 1


def test_a_version_that_fails_requests_rolls_itself_back(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path, health_requests=10)
    deliver(f, export, 1)
    first = f.serving.current()
    for _ in range(50):
        f.serving.observe(first, True, 0.002)
    deliver(f, export, 2)
    assert f.version == 2 and f.fallback is first
    second = f.serving.current()
    for i in range(10):
        f.serving.observe(second, i % 2 == 0, 0.002)
    f.tick()
    assert f.version == 1 and f.serving.current() is first  # the old runtime, kept in memory: no reload
    assert f.event == ("rolled back v2 -> v1: health check failed: 5 of 10 requests failed after the swap, 0 of 50 "
                       "before (allowed +5%)")
    assert 2 in f.state.refused and f.store.current == 1


def test_a_healthy_version_releases_the_old_runtime(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path, health_requests=5)
    deliver(f, export, 1)
    deliver(f, export, 2)
    for _ in range(5):
        f.serving.observe(f.serving.current(), True, 0.001)
    f.tick()
    assert (f.health, f.fallback, f.version) == ("ok", None, 2)


def test_a_canary_list_decides_who_takes_the_new_version(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    release, chunks = release_messages(SERVER, export, 2)
    f.dispatch(T.deploy_rollout, rollout(SERVER, 2, 1, canary=2, canary_devices=["someone-else"]))
    assert T.deploy_release(2) not in f.transport.subscribed and f.target == 1
    f.dispatch(T.deploy_rollout, rollout(SERVER, 3, 1, canary=2, canary_devices=["d1"]))
    assert T.deploy_release(2) in f.transport.subscribed and f.target == 2


def test_a_restart_serves_the_version_on_disk(export: Path, tmp_path: Path) -> None:
    deliver(make(tmp_path), export, 1)
    again = make(tmp_path)
    again.load_current()
    assert again.version == 1


def test_a_version_whose_stored_release_no_longer_loads_is_fetched_again(export: Path, tmp_path: Path) -> None:
    """A release.json kept from before the release format's version 3 (here: one whose `v` says 2) is refused
    on restart; the rollout that names that version fetches it again, re-verified, and serves it."""
    deliver(make(tmp_path), export, 1)
    stored = tmp_path / "models" / "versions" / "v1" / "release.json"
    stored.write_bytes(SERVER.sign(stored.read_bytes().replace(b'"v":3', b'"v":2', 1).rsplit(b',"sig"', 1)[0] + b"}"))
    again = make(tmp_path)
    again.load_current()
    assert again.version is None and "bad_version" in again.event
    release, chunks = release_messages(SERVER, export, 1)
    again.dispatch(T.deploy_rollout, rollout(SERVER, 1, 1))
    assert "fetching it again" in again.event and T.deploy_release(1) in again.transport.subscribed
    again.dispatch(T.deploy_release(1), release)
    for topic, message in chunks:
        again.dispatch(topic, message)
    assert again.version == 1


def test_reports_are_signed_by_the_device_key(export: Path, tmp_path: Path) -> None:
    f = make(tmp_path)
    deliver(f, export, 1)
    book = FleetBook(T, parse_public_key(SERVER.public_text), {"d1": f.cfg.device_key.public_text}.get)
    report = f.transport.on(T.deploy_status("d1"))[-1]
    other = Signer(Ed25519PrivateKey.generate())
    forged = other.sign(msgspec.structs.replace(f.report(), key=other.public_text, version=9, time=1e12).to_json())
    book.feed(T.deploy_status("d1"), forged)  # d1's id claimed before d1 reported: refused, d1 not hidden
    assert "d1" not in book.reports and book.rejected["key_mismatch"] == 1
    book.feed(T.deploy_status("d1"), report)
    assert book.reports["d1"].version == 1 and book.online() == ["d1"]
    book.feed(T.deploy_status("d1"), forged)
    assert book.reports["d1"].version == 1 and book.rejected["key_mismatch"] == 2



def test_only_a_devices_signed_last_will_of_its_current_connection_marks_it_offline(export: Path, tmp_path: Path) -> None:
    """Anyone can publish on deploy/status/d1: an unsigned "offline", a forged one, or d1's own will of an earlier
    connection replayed change nothing; d1's will of the connection it reports on does, and only d1's next
    connection brings it back (a replayed report of the closed connection does not)."""
    f = make(tmp_path)
    f.on_connected(100)
    old_will = offline_report(f.cfg, 100)
    f.on_connected(200)
    deliver(f, export, 1)
    book = FleetBook(T, parse_public_key(SERVER.public_text), {"d1": f.cfg.device_key.public_text}.get)
    report = f.transport.on(T.deploy_status("d1"))[-1]
    book.feed(T.deploy_status("d1"), report)
    other = Signer(Ed25519PrivateKey.generate())
    forged = other.sign(DeployReport(client="d1", federation="t", key=other.public_text, state="offline",
                                     connection=200).to_json())
    for payload in (DeployReport(client="d1", state="offline").to_json(), forged, old_will):
        book.feed(T.deploy_status("d1"), payload)
    assert book.online() == ["d1"] and book.reports["d1"].version == 1
    assert book.rejected == {"unsigned": 1, "key_mismatch": 1, "replayed": 1}
    book.feed(T.deploy_status("d1"), offline_report(f.cfg, 200))  # the broker publishes d1's will
    assert book.online() == [] and book.reports["d1"].state == "offline" and book.reports["d1"].version == 1
    book.feed(T.deploy_status("d1"), report)  # its last report replayed: the will closed that connection
    assert book.online() == [] and book.rejected["replayed"] == 2
    f.on_connected(300)
    book.feed(T.deploy_status("d1"), f.transport.on(T.deploy_status("d1"))[-1])
    assert book.online() == ["d1"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_messages_never_raise_and_something_always_serves(export: Path, tmp_path: Path, data: st.DataObject) -> None:
    """Random bytes, and valid messages (rollout, release, chunks) cut, extended or with a byte flipped,
    on every deploy topic: each is taken or refused with a count, never an exception."""
    f, valid = fuzz_target(export, tmp_path)
    topic = data.draw(st.sampled_from([T.deploy_rollout, T.deploy_release(2), *[t for t, _ in valid[2:5]],
                                       T.deploy_file(2, 200, 0), "nefl/t/elsewhere"]))
    base = data.draw(st.sampled_from([m for _, m in valid]))
    payload = data.draw(st.one_of(
        st.binary(max_size=300),
        st.builds(lambda cut: base[:cut], st.integers(0, len(base))),
        st.builds(lambda extra: base + extra, st.binary(min_size=1, max_size=50)),
        st.builds(lambda i, b: base[:i % len(base)] + bytes([b]) + base[i % len(base) + 1:],
                  st.integers(0, 1 << 20), st.integers(0, 255)),
    ))
    f.dispatch(topic, payload)
    assert f.version in (1, 2) and f.dropped["internal_error"] == 0


_FUZZ: dict[Path, tuple[Follower, list[tuple[str, bytes]]]] = {}


def fuzz_target(export: Path, tmp_path: Path) -> tuple[Follower, list[tuple[str, bytes]]]:
    """One follower serving v1 and fetching v2, shared by the fuzz examples (building one per example is
    slow), and the valid messages of that fetch to mutate."""
    root = tmp_path.parent / "fuzz"
    if root not in _FUZZ:
        root.mkdir(exist_ok=True)
        f = make(root)
        deliver(f, export, 1)
        release, chunks = release_messages(SERVER, export, 2)
        f.dispatch(T.deploy_rollout, rollout(SERVER, 2, 2))
        f.dispatch(T.deploy_release(2), release)
        _FUZZ[root] = f, [(T.deploy_rollout, rollout(SERVER, 2, 2)), (T.deploy_release(2), release), *chunks]
    return _FUZZ[root]


# -- the operator's side ----------------------------------------------------------------------------------
def _report(version: int, requests: int, errors: int, p95: float, before_p95: float | None = 2.0,
            before_errors: int = 0, **kw) -> DeployReport:
    before = None if before_p95 is None else VersionStats(version=version - 1, requests=200, errors=before_errors,
                                                          p95_ms=before_p95)
    return DeployReport(client="c", state="serving", version=version,
                        current=VersionStats(version=version, requests=requests, errors=errors, p95_ms=p95),
                        before=before, **kw)


RULE = CanaryRule(min_requests=30, max_p95_ratio=1.5, max_error_increase=0.02)


@pytest.mark.parametrize("report, decision, words", [
    (None, "wait", "no report"),
    (_report(3, 10, 0, 2.0), "wait", "10 of 30 requests"),
    (_report(3, 100, 0, 2.9), "promote", "100 requests, 0 errors, p95 2.9 ms vs 2.0 ms on v2"),
    (_report(3, 100, 0, 3.1), "rollback", "p95 3.1 ms on v3, 2.0 ms on v2 (x1.6 > x1.5)"),
    (_report(3, 100, 3, 2.0), "rollback", "error rate 3.0% on v3, 0.0% on v2 (allowed +2.0%)"),
    (_report(3, 100, 3, 2.0, before_errors=2), "promote", "3 errors"),
    (_report(3, 100, 0, 50.0, before_p95=None), "promote", "p95 50.0 ms"),  # nothing to compare latency with
    (_report(2, 100, 0, 2.0, refused=[Refusal(version=3, reason="refused v3: parity failed")]), "rollback",
     "refused v3: parity failed"),
])
def test_the_canary_rule(report: DeployReport | None, decision: str, words: str) -> None:
    verdict = judge_device("c", report, 3, RULE)
    assert verdict.decision == decision and words in verdict.why


def test_a_majority_of_canaries_decides() -> None:
    good, slow = _report(3, 100, 0, 2.0), _report(3, 100, 0, 9.0)
    assert judge({"a": good, "b": good}, ["a", "b"], 3, RULE).decision == "promote"
    assert judge({"a": slow}, ["a"], 3, RULE).decision == "rollback"  # a single canary decides alone
    assert judge({"a": good, "b": slow}, ["a", "b"], 3, RULE).decision == "wait"  # a tie: the operator decides
    assert judge({"a": good}, ["a", "b"], 3, RULE).decision == "wait"
    assert judge({"a": good, "b": good, "c": slow}, ["a", "b", "c"], 3, RULE).decision == "promote"


def test_one_lying_canary_does_not_promote_a_bad_version_alone() -> None:
    """The liar reports a bad version as fast and error-free; the two honest canaries measure it slow."""
    liar, slow = _report(3, 500, 0, 1.0), _report(3, 100, 0, 9.0)
    verdict = judge({"liar": liar, "b": slow, "c": slow}, ["b", "c", "liar"], 3, RULE)
    assert verdict.decision == "rollback" and "liar" not in verdict.why
    assert judge({"liar": liar, "b": slow}, ["b", "c", "liar"], 3, RULE).decision == "wait"  # c not heard yet
    good, lie = _report(3, 100, 0, 2.0), _report(3, 100, 50, 2.0)
    assert judge({"liar": lie, "b": good, "c": good}, ["b", "c", "liar"], 3, RULE).decision == "promote"


def _signed_report(key: Signer, client: str, **kw) -> bytes:
    return key.sign(DeployReport(client=client, federation="t", key=key.public_text, state="serving", time=1.0,
                                 **kw).to_json())


def test_reports_count_only_under_the_enrolled_key_and_made_up_ids_are_never_canaries() -> None:
    d1, d2, attacker = (Signer(Ed25519PrivateKey.generate()) for _ in range(3))
    book = FleetBook(T, parse_public_key(SERVER.public_text), {"d1": d1.public_text, "d2": d2.public_text}.get)
    stats = VersionStats(version=2, requests=500, errors=0, p95_ms=1.0)
    for made_up in ("zz", "a0", "00"):  # ids an attacker could grind against any function of the id
        book.feed(T.deploy_status(made_up), _signed_report(attacker, made_up, version=2, current=stats))
    book.feed(T.deploy_status("d2"), _signed_report(attacker, "d2", version=2, current=stats))  # another device's id
    book.feed(T.deploy_status("zz"), DeployReport(client="zz", state="offline").to_json())  # an unsigned last will
    assert book.reports == {} and book.rejected == {"not_enrolled": 3, "unsigned": 1, "key_mismatch": 1}
    book.feed(T.deploy_status("d1"), _signed_report(d1, "d1", version=1))
    book.feed(T.deploy_status("d2"), _signed_report(d2, "d2", version=1))
    assert book.online() == ["d1", "d2"]
    for seed in range(20):
        assert choose_canaries(book.online(), 0.5, [], book.enrolled, random.Random(seed))[0] in ("d1", "d2")
    assert {choose_canaries(book.online(), 0.5, [], book.enrolled, random.Random(s))[0] for s in range(20)} == {"d1", "d2"}
    with pytest.raises(DeployError, match="zz: not enrolled"):
        choose_canaries(book.online(), None, ["d1", "zz"], book.enrolled)


def test_enrolled_keys_follow_the_journal(tmp_path: Path) -> None:
    keys, key = KeyDir("t", tmp_path), Signer(Ed25519PrivateKey.generate()).public_text
    enrolled = EnrolledKeys(keys)
    assert enrolled("d1") is None  # no journal yet
    append(keys.journal, Grant(client="d1", created=1.0, key=key))
    assert enrolled("d1") == key and enrolled("d2") is None
    append(keys.journal, Revoke(client="d1", time=2.0))
    assert enrolled("d1") is None
    append(keys.journal, Grant(client="f1", role="follower", created=3.0, key=key))
    assert enrolled("f1") == key and enrolled.enrolment.key("f1") is None  # a follower reports, it never trains
    append(keys.journal, Revoke(client="f1", role="follower", time=4.0))
    assert enrolled("f1") is None


def test_an_old_rollout_state_moves_to_the_key_directory(tmp_path: Path) -> None:
    run, keys = tmp_path / "runs" / "t", KeyDir("t", tmp_path / "keys")
    save_state(run / "deploy", RolloutState(seq=4, stable=2))
    migrate_state(run, keys.rollout_dir)
    assert load_state(keys.rollout_dir).seq == 4 and not (run / "deploy" / "rollout.json").exists()
    migrate_state(run, keys.rollout_dir)  # nothing left to move
    save_state(run / "deploy", RolloutState(seq=1))
    with pytest.raises(DeployError, match="two rollout states"):
        migrate_state(run, keys.rollout_dir)


def test_rollout_status_without_a_state_says_so_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from aggregator.cli import app

    keys = KeyDir("t", tmp_path / "keys")
    keys.server_signer()
    result = CliRunner().invoke(app, ["rollout", "status", "--federation", "t", "--key-dir", str(tmp_path / "keys"),
                                      "--broker", "mqtt://127.0.0.1:1", "--checkpoint-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [(f"error: no rollout state in {keys.rollout_dir}: nothing was published with these keys; give "
                      "the --key-dir (or --state-dir) of the operator that ran `aggregator publish`")]


@given(online=st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), unique=True, min_size=1, max_size=30),
       fraction=st.floats(0.01, 1.0))
def test_canaries_are_the_fraction_of_online_devices_rounded_down(online: list[str], fraction: float) -> None:
    enrolled = {c: "k" for c in [*online, "x", "a"]}.get
    chosen = choose_canaries(online, fraction, [], enrolled)
    assert len(chosen) == max(1, min(k for k in range(len(online) + 2) if k + 1 > fraction * len(online) + 1e-9))
    assert set(chosen) <= set(online) and chosen == sorted(chosen)
    assert choose_canaries(online, fraction, ["x", "a", "x"], enrolled) == ["a", "x"]  # named devices win
    assert len(choose_canaries(["a", "b", "c"], 0.34, [], enrolled)) == 1


def test_an_export_without_parity_reference_cannot_be_released(export: Path, tmp_path: Path) -> None:
    import shutil
    shutil.copytree(export, tmp_path / "old")
    manifest = read_manifest(tmp_path / "old")
    write_manifest(tmp_path / "old", msgspec.structs.replace(
        manifest, parity=msgspec.structs.replace(manifest.parity, file=None, sha256=None)))
    with pytest.raises(DeployError, match="no parity reference"):
        build_release(tmp_path / "old", "t", 1, 16 * 1024)


def test_serving_swaps_between_requests() -> None:
    """A request holds the pair it started with: the swap never changes a request's runtime under it."""
    serving = Serving()
    a, b = Active(object(), 1), Active(object(), 2)  # type: ignore[arg-type]
    serving.swap(a)
    held = serving.current()
    serving.swap(b)
    serving.observe(held, True, 0.010)
    serving.observe(serving.current(), False, 0.020)
    assert serving.stats(1).requests == 1 and serving.stats(2).errors == 1
    assert held is a and serving.current() is b


def test_infer_on_a_followed_directory_uses_its_current_version(export: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edge_client.cli import app
    from tests.harness.rollout_helpers import png

    f = make(tmp_path)
    deliver(f, export, 1)
    deliver(f, export, 2)
    (tmp_path / "img.png").write_bytes(png(0))
    out = CliRunner().invoke(app, ["infer", "--models", str(tmp_path / "models"), "--threads", "1", str(tmp_path / "img.png")])
    assert out.exit_code == 0 and "submodel" in out.output, out.output
    assert followed_current(tmp_path / "models").name == "v2"


@settings(max_examples=300, deadline=None)
@given(client=st.sampled_from(["d1", "d2"]), payload=st.one_of(
    st.binary(max_size=400),
    st.builds(lambda s: s.encode(), st.sampled_from(['{"v":2,"type":"deploy_report","client":"d1","state":"offline"}',
                                                    '{"v":2,"type":"deploy_report","client":"d2","state":"serving"}',
                                                    '{"v":2,"type":"rollout","federation":"t","seq":1}', "{}", "[]"])),
    st.sampled_from([rollout(SERVER, 3, 1), rollout(SERVER, 3, 1, federation="x"), rollout(SERVER, 3, 1)[:-20]]),
    st.builds(lambda key, version, state, connection: key.sign(DeployReport(
        client="d1", federation="t", key=key.public_text, state=state, version=version, time=1.0,
        connection=connection).to_json()),
              st.sampled_from([SERVER, Signer(Ed25519PrivateKey.generate())]), st.integers(1, 5),
              st.sampled_from(["serving", "offline", "staging"]), st.integers(0, 2**53))))
def test_fuzzed_reports_and_rollouts_never_raise_on_the_operators_side(client: str, payload: bytes) -> None:
    book = FleetBook(T, parse_public_key(SERVER.public_text), {"d1": SERVER.public_text}.get)
    book.feed(T.deploy_status(client), payload)
    book.feed(T.deploy_rollout, payload)
    assert set(book.reports) <= {"d1"}
    assert book.rollout is None or book.rollout.federation == "t"


FORGER = Signer(Ed25519PrivateKey.generate())


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["serving", "offline"]), st.integers(0, 4), st.floats(0, 4),
                                st.booleans()), max_size=12))
def test_only_d1s_own_reports_move_it_and_a_will_closes_only_its_connection(steps) -> None:
    """Any sequence of d1's signed reports and wills (connections and times in any order) and forged ones: nothing
    raises; a forged one never changes d1's row; a will never closes a newer connection than the last report's,
    and after a will only a later connection brings d1 back."""
    book = FleetBook(T, parse_public_key(SERVER.public_text), {"d1": SERVER.public_text}.get)
    for state, connection, at, genuine in steps:
        key = SERVER if genuine else FORGER
        before = book.reports.get("d1")
        book.feed(T.deploy_status("d1"), key.sign(DeployReport(client="d1", federation="t", key=key.public_text,
                                                               state=state, time=at, connection=connection).to_json()))
        after = book.reports.get("d1")
        if not genuine or after is before or before is None:
            assert genuine or after is before
            continue
        assert connection >= before.connection
        if before.state == "offline" and after.state != "offline":
            assert connection > before.connection


def test_rollout_status_table_names_every_device_and_its_versions(capsys: pytest.CaptureFixture) -> None:
    from aggregator.rollout import fleet_view, show
    from nefl.protocol.messages import Rollout

    reports = {"d1": _report(2, 120, 1, 4.0, event="swapped v1 -> v2"),
               "d2": msgspec.structs.replace(_report(2, 80, 0, 3.0), state="offline")}
    show(fleet_view(Rollout(federation="t", seq=4, stable=2, revoked=[3], reason="v3 rolled back"), reports))
    out = capsys.readouterr().out
    assert "rollout #4: stable v2, revoked [3]" in out and "last change: v3 rolled back" in out
    assert "swapped v1 -> v2" in out and "offline" in out and "v1 (2.0)" in out


def test_the_dashboards_rollout_view_survives_an_unreadable_state(tmp_path: Path) -> None:
    from aggregator.rollout import RolloutWatcher
    from nefl.protocol.mqtt import parse_broker

    keys = KeyDir("t", tmp_path)
    keys.rollout_dir.mkdir(parents=True)
    (keys.rollout_dir / "rollout.json").write_text("{not json")
    watcher = RolloutWatcher(parse_broker("mqtt://127.0.0.1:1"), "t", SERVER.public_text, keys)
    assert watcher.fleet.book.seq_floor == 0 and watcher.snapshot() == {"rollout": None, "devices": []}
