"""A refusal reaches the device, with real processes: mosquitto, `aggregator serve` under enrolment, a device
that joined with its token (on the coordinator's broker, or on a site broker behind `aggregator relay`), then
`aggregator revoke`: `edge-client join` exits with EXIT_REFUSED and one line naming the cause and the fix,
within a round."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from edge_client.join import EXIT_REFUSED
from tests.harness.procs import Procs, free_port, needs_mosquitto, wait_for

pytestmark = pytest.mark.slow
PROFILE = "resnet8-fmnist-w"
ROUND_S = 30
CLI = [sys.executable, "-c", "from aggregator.cli import app; app()"]


def aggregator(procs: Procs, *args: str) -> str:
    done = subprocess.run([*CLI, *args, "--federation", "t"], env=procs.env, capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout.strip()


@needs_mosquitto
@pytest.mark.timeout(240)
@pytest.mark.parametrize("behind_relay", [False, True], ids=["direct", "behind_relay"])
def test_a_revoked_device_is_told_and_join_exits_with_the_reason(procs, behind_relay):
    port = free_port()
    procs.mosquitto(port)
    url = f"mqtt://127.0.0.1:{port}"
    token = aggregator(procs, "enroll", "c1")
    procs.start("agg", [*CLI, "serve", "--profile", PROFILE, "--checkpoint-dir", str(procs.tmp / "run"), "--broker", url,
                        "--federation", "t", "--rounds", "50", "--min-clients", "2", "--round-timeout", str(ROUND_S),
                        "--join-wait", "600", "--batch-size", "16"])
    device_url = relay_site(procs, url) if behind_relay else url
    dev = procs.start("c1", [sys.executable, "-c", "from edge_client.cli import app; app()", "join", "--broker",
                             device_url, "--client-id", "c1", "--federation", "t", "--threads", "1", "--max-samples",
                             "64", "--no-calibrate", "--join-token", token])
    wait_for(lambda: "client c1 announced" in procs.log("agg"), 120, "c1 to enrol")
    aggregator(procs, "revoke", "c1")
    revoked = time.monotonic()
    try:
        rc = dev.wait(ROUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"join still running a round after the revocation:\n{procs.log('c1')[-3000:]}") from None
    took = time.monotonic() - revoked
    lines = [line for line in procs.log("c1").splitlines() if "refused this device" in line]
    assert rc == EXIT_REFUSED and took < ROUND_S, (rc, took)
    assert len(lines) == 1 and "revoked by the operator" in lines[0] and "aggregator enroll c1" in lines[0], lines
    assert "stays for the next run" not in procs.log("c1")


def relay_site(procs: Procs, upstream: str) -> str:
    """A site broker behind `aggregator relay` (its key authorised on the coordinator); returns the site's URL."""
    site = free_port()
    procs.mosquitto(site)
    relay = [*CLI, "relay", "--site-broker", f"mqtt://127.0.0.1:{site}", "--upstream", upstream, "--federation", "t",
             "--relay-id", "site-a"]
    env = procs.env
    procs.env = {**env, "NEFL_KEY_DIR": str(procs.tmp / "relay-keys")}  # the relay's own host
    try:
        key = subprocess.run([*relay, "--print-key"], env=procs.env, capture_output=True, text=True, timeout=60,
                             check=True).stdout.strip()
        procs.start("relay", relay)
    finally:
        procs.env = env
    aggregator(procs, "enroll", "site-a", "--worker", "--public-key", key)
    return f"mqtt://127.0.0.1:{site}"


@pytest.mark.extended
@needs_mosquitto
@pytest.mark.timeout(300)
def test_a_spent_token_enrols_no_one_in_a_fresh_run(procs):
    """Issue 42: a token spent in one run, replayed by someone else (another device key) into a fresh `serve` on the
    same key directory without --resume, is refused for good; the device that spent it still takes part."""
    port = free_port()
    procs.mosquitto(port)
    url = f"mqtt://127.0.0.1:{port}"
    token = aggregator(procs, "enroll", "c1")
    join = [sys.executable, "-c", "from edge_client.cli import app; app()", "join", "--broker", url, "--client-id", "c1",
            "--federation", "t", "--threads", "1", "--max-samples", "64", "--no-calibrate"]

    def serve(name: str) -> subprocess.Popen:  # a fresh run each time: its own checkpoint directory, no --resume
        return procs.start(name, [*CLI, "serve", "--profile", PROFILE, "--checkpoint-dir", str(procs.tmp / name),
                                  "--broker", url, "--federation", "t", "--rounds", "50", "--min-clients", "2",
                                  "--round-timeout", str(ROUND_S), "--join-wait", "600", "--batch-size", "16"])

    serve("run1")
    procs.start("c1", [*join, "--join-token", token])
    wait_for(lambda: "client c1 announced" in procs.log("run1"), 120, "c1 to enrol with its token")
    for name in ("c1", "run1"):
        procs.procs[name].kill()
        procs.procs[name].wait(10)

    serve("run2")
    env = procs.env
    procs.env = {**env, "NEFL_CACHE_DIR": str(procs.tmp / "thief-cache")}  # another host: its own device key
    try:
        thief = procs.start("thief", [*join, "--join-token", token])
    finally:
        procs.env = env
    try:
        rc = thief.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the spent token's replay was not refused:\n{procs.log('thief')[-3000:]}") from None
    lines = [line for line in procs.log("thief").splitlines() if "refused this device" in line]
    assert rc == EXIT_REFUSED and len(lines) == 1 and "spent already" in lines[0], (rc, procs.log("thief")[-3000:])
    procs.start("c1-again", join)  # the real device, its key pinned by the token it spent: no token needed
    wait_for(lambda: "client c1 announced" in procs.log("run2"), 120, "the real c1 to take part in the fresh run")
