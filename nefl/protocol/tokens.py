"""One-time join tokens: what `aggregator enroll` hands an operator and `edge-client join --join-token` uses.

A token is `nefl.FINGERPRINT.SECRET`: the fingerprint of the aggregator's public key (so a device that
holds a token knows which server key to trust, with no trust on first use) and a random secret. The
aggregator keeps only the secret's sha256 (the *verifier*), never the token. A device does not send the
token either: its announce carries a *proof*, an HMAC keyed with the verifier over the federation, its
client id and the device key it signs with. A proof read off the broker is therefore worth nothing: it
pins only that device key to that id, and only once (the aggregator marks the verifier used).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets

from nefl.protocol.signing import KeyFileError, parse_public_key, public_key_text

PREFIX = "nefl"
_TOKEN = re.compile(r"^nefl\.([0-9a-f]{32})\.([A-Za-z0-9_-]{32,64})$")
PROOF_CHARS = 44  # base64 of a 32-byte HMAC-SHA256


class TokenError(ValueError):
    """A join token that cannot be used (not one `aggregator enroll` printed)."""


def fingerprint(public_key: str) -> str:
    """128 bits of sha256 over the raw public key: what a token names and `edge-client join` logs."""
    try:
        raw = base64.b64decode(public_key_text(parse_public_key(public_key)))
    except KeyFileError:
        raise TokenError(f"{public_key[:60]!r} is not a server public key") from None
    return hashlib.sha256(raw).hexdigest()[:32]


def new_token(server_key: str) -> tuple[str, str]:
    """(token to hand to the device's operator, verifier the aggregator keeps)."""
    secret = secrets.token_urlsafe(32)
    return f"{PREFIX}.{fingerprint(server_key)}.{secret}", verifier_of(secret)


def parse_token(token: str) -> tuple[str, str]:
    """(server key fingerprint, secret) of a token, or TokenError naming the fix."""
    m = _TOKEN.match(token.strip())
    if m is None:
        raise TokenError("not a join token: use the nefl.<fingerprint>.<secret> line `aggregator enroll` printed")
    return m.group(1), m.group(2)


def verifier_of(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _message(federation: str, client: str, device_key: str) -> bytes:
    return f"nefl-enrol|{federation}|{client}|{device_key}".encode()


def proof(secret: str, federation: str, client: str, device_key: str) -> str:
    """What the device's announce carries: binds the token to this id and this device key."""
    key = bytes.fromhex(verifier_of(secret))
    return base64.b64encode(hmac.digest(key, _message(federation, client, device_key), "sha256")).decode()


def check_proof(verifier: str, presented: str, federation: str, client: str, device_key: str) -> bool:
    """Whether `presented` was made from the token whose verifier is `verifier`, for exactly this id and key."""
    try:
        key = bytes.fromhex(verifier)
        got = base64.b64decode(presented, validate=True)
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(hmac.digest(key, _message(federation, client, device_key), "sha256"), got)
