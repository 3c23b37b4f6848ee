"""Issue 21's attacks on the control plane, replayed with real processes on mosquitto, anonymous and under
the password file + ACL of docs/security.md (where the broker already drops what the attacker may not
publish, and the aggregator's own checks are what is left).

  workers  `serve --workers 2`, two honest devices; an attacker subscribes to the default shared-subscription
           group (serve's workers draw a secret one: it costs nothing), an insider who knows the workers' group
           swallows updates as a silent member of it (under the ACL too: mosquitto's acl_file grants the
           subscription and drops the member's share), and a third forges receipts, partials (sums x1000,
           norms 1e-9) and summaries as a worker of its own and as the real workers.
  devices  plain `serve` under enrolment (tokens); before anyone joins, an attacker-signed server status is
           retained and the id of an honest device is claimed with the attacker's key; then a flood of made-up
           ids, forged receipts, an enrolled participant whose updates the bound refuses (1e30) and, after the
           run, its "finished" status and "end" replayed into the resumed run that a fresh device joins.

Every round must commit both honest devices' updates, in far less than its deadline, with each hostile
message counted under its reason (the numbers, against the issue's, are measured by
benchmarks/bench_control_plane.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nefl.nested.checkpoint import load_checkpoint
from nefl.protocol.signing import Signer
from nefl.protocol.tokens import fingerprint
from tests.harness.broker_acl import ACL, PASSWORD
from tests.harness.control_attacker import workers_group
from tests.harness.procs import Procs, finish, free_port, metrics, needs_mosquitto, wait_for

pytestmark = pytest.mark.slow
PROFILE = "resnet8-fmnist-w"
TIMEOUT = 60  # round deadline: every round here must close far sooner
CLI = [sys.executable, "-c", "from aggregator.cli import app; app()"]


def broker(procs: Procs, acl: bool, users: tuple[str, ...]) -> tuple[str, dict[str, list[str]]]:
    """mosquitto, anonymous or with a password per user and the ACL; (URL, each user's credential args)."""
    port = free_port()
    queue = "max_queued_messages 100000\n"  # mosquitto's default (1000) would drop most of a flood before the aggregator
    if not acl:
        procs.mosquitto(port, queue + "allow_anonymous true")
        return f"mqtt://127.0.0.1:{port}", {u: [] for u in users}
    passwd = procs.tmp / "passwd"
    for i, u in enumerate(users):
        subprocess.run(["mosquitto_passwd", "-b", *([] if i else ["-c"]), str(passwd), u, PASSWORD], check=True,
                       capture_output=True)
    (procs.tmp / "acl").write_text(ACL)
    procs.mosquitto(port, f"{queue}allow_anonymous false\npassword_file {passwd}\nacl_file {procs.tmp / 'acl'}")
    return f"mqtt://127.0.0.1:{port}", {u: ["--username", u, "--password", PASSWORD] for u in users}


def serve(procs: Procs, name: str, url: str, creds: list[str], rounds: int, *extra: str):
    return procs.start(name, [*CLI, "serve", "--profile", PROFILE, "--checkpoint-dir", str(procs.tmp / "run"),
                              "--broker", url, *creds, "--federation", "t", "--rounds", str(rounds), "--min-clients", "2",
                              "--round-timeout", str(TIMEOUT), "--join-wait", "8", "--batch-size", "16",
                              "--resend-after", "3", *extra])


def device(procs: Procs, name: str, url: str, creds: list[str], *extra: str, attack: tuple[str, ...] = ()):
    join = ["join", "--broker", url, "--client-id", name, "--threads", "1", "--federation", "t", "--max-samples", "64",
            "--max-submodel", "2", "--no-calibrate", "--partition", f"{1 + sum(map(ord, name)) % 8}/8", *creds, *extra]
    head = [sys.executable, "-m", "tests.harness.attack_device", *attack] if attack else \
        [sys.executable, "-c", "from edge_client.cli import app; app()"]
    return procs.start(name, [*head, *join])


def attacker(procs: Procs, name: str, url: str, creds: list[str], *args: str):
    return procs.start(name, [sys.executable, "-m", "tests.harness.control_attacker", *args, "--broker", url, "--profile", PROFILE,
                              "--client-id", name, *creds, "--report", str(procs.tmp / f"{name}.json")])


def report(procs: Procs, name: str) -> dict[str, int]:
    path = procs.tmp / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def enroll(procs: Procs, client: str) -> str:
    out = subprocess.run([*CLI, "enroll", client, "--federation", "t"], env=procs.env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def rejected(m: dict[int, dict], rounds: range) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in rounds:
        for reason, n in m[r]["rejected"].items():
            total[reason] = total.get(reason, 0) + n
    return total


def assert_honest_rounds(m: dict[int, dict], rounds: range, honest: set[str]) -> None:
    for r in rounds:
        assert m[r]["committed"] and honest <= set(m[r]["reported"]), m[r]
        assert m[r]["train_wall_s"] < TIMEOUT / 2, m[r]  # nobody held the round to its deadline


def assert_state_sane(procs: Procs) -> None:
    state = load_checkpoint(procs.tmp / "run").state.flat()
    assert all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 100 for t in state.values())


@pytest.mark.extended
@needs_mosquitto
@pytest.mark.timeout(300)
@pytest.mark.parametrize("acl", [False, True], ids=["anonymous", "acl"])
def test_forged_workers_and_a_silent_subscriber_cost_at_most_a_resend(procs, acl):
    url, creds = broker(procs, acl, ("aggregator", "c1", "c2", "evil"))
    attacker(procs, "outsider", url, creds["evil"], "silent")  # the default group, which serve's workers are not in
    attacker(procs, "forger", url, creds["evil"], "forge-workers")
    agg = serve(procs, "agg", url, creds["aggregator"], 3, "--clients-per-round", "2", "--workers", "2",
                "--worker-timeout", "10")
    attacker(procs, "silent", url, creds["evil"], "silent", "--group", wait_for(lambda: workers_group(agg), 60,
                                                                                  "the workers' group"))
    wait_for(lambda: "started" in report(procs, "silent"), 30, "the insider to subscribe")
    for c in ("c1", "c2"):
        device(procs, c, url, creds[c])
    finish(procs, "agg", 240)
    assert agg.returncode == 0
    m = metrics(procs.tmp)
    assert_honest_rounds(m, range(1, 4), {"c1", "c2"})
    assert_state_sane(procs)
    swallowed = report(procs, "silent").get("updates_swallowed", 0)
    lost = sum(m[r]["lost_to_unknown"] for r in range(1, 4))
    assert lost >= 1  # the insider's share of the updates, round robin over three members
    counted = rejected(m, range(1, 4))
    assert all(m[r]["workers"]["lost_updates"] == 0 for r in range(1, 4))
    seen_outside = report(procs, "outsider").get("updates_swallowed", 0)
    if acl:  # the broker dropped the insider's share unread, and the attacker's publications
        assert swallowed == 0 and seen_outside == 0 and "unauthorised_worker" not in counted
    else:
        assert lost == swallowed, (lost, swallowed)  # each swallowed update was noticed and resent, once
        assert seen_outside == 6  # a group of its own gets a copy of each update: without an ACL anyone reads them
        forged = report(procs, "forger")
        assert forged.get("receipts_forged", 0) and forged.get("partials_forged", 0)
        assert counted.get("unauthorised_worker", 0) >= 1 and counted.get("bad_signature", 0) >= 1, counted


@pytest.mark.extended
@needs_mosquitto
@pytest.mark.timeout(420)
@pytest.mark.parametrize("acl", [False, True], ids=["anonymous", "acl"])
def test_enrolment_and_run_identity_hold_against_a_hostile_broker(procs, acl):
    users = ("aggregator", "c1", "c2", "c3", "mal", "evil")
    url, creds = broker(procs, acl, users)
    tokens = {c: enroll(procs, c) for c in ("c1", "c2", "mal")}
    # before anyone joins: c2's id claimed with the attacker's key, and a flood of made-up ids (all retained)
    for what in (("claim", "c2"), ("flood", "1500")):
        assert attacker(procs, what[0], url, creds["evil"], *what).wait(120) == 0
    attacker(procs, "forger", url, creds["evil"], "forge-workers")  # plain serve listens to no worker topic
    attacker(procs, "capture", url, creds["evil"], "capture", str(procs.tmp / "old-run.json"))
    serve(procs, "agg", url, creds["aggregator"], 2, "--clients-per-round", "3")
    for c in ("c1", "c2"):
        device(procs, c, url, creds[c], "--join-token", tokens[c])
    # an enrolled participant whose every update the norm bound refuses
    device(procs, "mal", url, creds["mal"], "--join-token", tokens["mal"], attack=("scaled-flip", "1e30", "1"))
    finish(procs, "agg", 240)
    m = metrics(procs.tmp)
    assert_honest_rounds(m, range(1, 3), {"c1", "c2"})
    refused = [m[r].get("refused", {}).get("mal") for r in (1, 2) if "mal" in m[r]["participants"]]
    assert refused and all(why == "update_norm" for why in refused), refused
    counted = rejected(m, range(1, 3))
    assert counted.get("update_norm", 0) >= len(refused) and "stale_round" not in counted
    for c in ("c1", "c2"):
        finish(procs, c, 60)
    if not acl:
        assert counted.get("not_enrolled", 0) >= 1 + 1500, counted  # the claim of c2 and the flood, every one counted
        assert all("fake" not in c for r in (1, 2) for c in m[r]["participants"])
    # The run is over. Into the resumed run: its "finished" status and "end" replayed, then a live status signed by
    # the attacker's own key; a device that trusts on first use (enrolled by its key) joins fresh, and must neither
    # end nor pin the attacker's key
    server_key = subprocess.run([*CLI, "key", "--federation", "t"], env=procs.env, capture_output=True, text=True,
                                timeout=60, check=True).stdout.strip()
    c3 = Signer.load_or_create(procs.tmp / "fresh-cache" / "device-keys", "c3.key")  # c3 never saw either run
    subprocess.run([*CLI, "enroll", "c3", "--public-key", c3.public_text, "--federation", "t"], env=procs.env, check=True,
                   capture_output=True, timeout=60)
    serve(procs, "agg2", url, creds["aggregator"], 3, "--clients-per-round", "3", "--resume")
    wait_for(lambda: "waiting for clients" in procs.log("agg2"), 60, "the resumed aggregator")
    if not acl:
        assert (procs.tmp / "old-run.json").exists()
        assert attacker(procs, "replay", url, creds["evil"], "replay", str(procs.tmp / "old-run.json")).wait(60) == 0
    attacker(procs, "forge-status", url, creds["evil"], "forge-status", "0.5")  # republished every 0.5 s
    env, procs.env = procs.env, {**procs.env, "NEFL_CACHE_DIR": str(procs.tmp / "fresh-cache")}
    device(procs, "c3", url, creds["c3"])
    procs.env = env
    for c in ("c1", "c2"):
        device(procs, c, url, creds[c], "--join-token", tokens[c])
    finish(procs, "agg2", 240)
    m = metrics(procs.tmp)
    assert_honest_rounds(m, range(3, 4), {"c1", "c2", "c3"})
    finish(procs, "c3", 60)  # it ended with the real run, which it took part in
    pinned = next((procs.tmp / "fresh-cache" / "servers").glob("*.pub")).read_text().strip()
    assert pinned == server_key and f"fingerprint {fingerprint(server_key)}" in procs.log("c3")
    if not acl:
        assert "claims federation" in procs.log("c3")  # the attacker's key was seen, and not trusted
