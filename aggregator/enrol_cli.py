"""`aggregator enroll` and `aggregator revoke`: the operator's say on who takes part (docs/security.md,
"Enrolment"). Both append to the federation's enrolment journal in its key directory; a running
`aggregator serve` picks the change up within a second.
"""

from __future__ import annotations

import sys
import time

import typer

from aggregator.enrolment import EnrolmentPolicy, Grant, Revoke, Role, append
from aggregator.keys import KeyDir
from nefl.protocol.signing import KeyFileError, parse_public_key
from nefl.protocol.tokens import new_token
from nefl.protocol.topics import check_name
from nefl.support.cli_options import KeyOptions
from nefl.support.option_groups import SharedOption, grouped

# enroll's and revoke's: which kind of key the command is about (neither: a device's)
WorkerFlag = SharedOption(bool, "--worker", help="An aggregator worker's or site relay's key, not a device's.")
FollowerFlag = SharedOption(bool, "--follower", help="A rollout follower's key, not a device's.")

def _key_dir(keys: KeyOptions, client: str) -> KeyDir:
    try:
        check_name("id", client)
        return KeyDir(check_name("federation name", keys.federation), keys.key_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


@grouped
def enroll_command(
    client_id: str = typer.Argument(..., help="The device's --client-id (or, with --worker, the worker's or relay's id)."),
    public_key: str = typer.Option(None, "--public-key", help="Enrol this public key now instead of printing a join token (a "
                                   "device whose key you know; required for --worker: what `aggregator worker --print-key` prints)."),
    worker: WorkerFlag("Authorise an aggregator worker or site relay, not a device.") = False,
    follower: FollowerFlag("Enrol a device that only follows model rollouts (`edge-client serve --follow`): its "
                           "reports count, it never trains; needs --public-key.") = False,
    valid_hours: float = typer.Option(EnrolmentPolicy.token_ttl_s / 3600, "--valid-hours", min=0.01,
                                      help="How long the join token may be used."),
    *,
    where: KeyOptions,
) -> None:
    """Enrol a device (prints a one-time join token for `edge-client join --join-token`) or authorise a worker's key.
    Enrolling an id that is already pinned rotates its key once the device presents the new token."""
    keys = _key_dir(where, client_id)
    now = time.time()
    role = _role(worker, follower)
    try:
        if public_key is not None:
            parse_public_key(public_key)
            append(keys.journal, Grant(client=client_id, role=role, created=now, key=public_key.strip()))
            print(f"{role} {client_id} enrolled with key {public_key.strip()[:12]}...", file=sys.stderr)
            return
        if worker:
            raise ValueError("a worker is authorised by its key: give --public-key (`aggregator worker --print-key` prints it)")
        if follower:
            raise ValueError("a follower is enrolled by its key: give --public-key (the public half of its --device-key)")
        token, verifier = new_token(keys.server_signer().public_text)
        append(keys.journal, Grant(client=client_id, created=now, verifier=verifier, expires=now + valid_hours * 3600))
    except (KeyFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(token)
    print(f"one-time join token for {client_id}, valid {valid_hours:g} h: edge-client join --client-id {client_id} "
          f"--join-token TOKEN (or $NEFL_JOIN_TOKEN); it also tells the device the server key", file=sys.stderr)


@grouped
def revoke_command(
    client_id: str = typer.Argument(..., help="The device's (or, with --worker, the worker's) id."),
    worker: WorkerFlag("Revoke a worker's or relay's key, not a device's.") = False,
    follower: FollowerFlag("Revoke a rollout follower's key, not a device's.") = False,
    *,
    where: KeyOptions,
) -> None:
    """Revoke an id's key: its messages are refused from now on, also in a running federation (a device comes back
    only with a new `aggregator enroll`)."""
    keys = _key_dir(where, client_id)
    try:
        append(keys.journal, Revoke(client=client_id, role=_role(worker, follower), time=time.time()))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(f"{_role(worker, follower)} {client_id} revoked", file=sys.stderr)


def _role(worker: bool, follower: bool) -> Role:
    if worker and follower:
        print("error: --worker or --follower, not both", file=sys.stderr)
        raise typer.Exit(2)
    return "worker" if worker else "follower" if follower else "device"
