"""Ed25519 signatures on server-to-device messages, so a device can trust them on a broker without ACLs.

A signed message is the JSON body with one last field appended: `{...,"sig":"<base64>"}`. The
signature covers the body bytes exactly as sent (without that field), so nothing is re-encoded
or canonicalised: the receiver cuts the fixed-length suffix, verifies, and only then parses.
The body names its type, federation, run and round, which binds the signature to them.

The aggregator's key lives in its key directory (`server.key`, mode 0600, aggregator/keys.py), apart
from its checkpoints. Devices pin the
public key: given with `--server-key`, or trusted on first use and remembered in a pin file.
Keys are stored and parsed with `cryptography`; signing and verifying run in libsodium (PyNaCl), which
verifies an Ed25519 signature in about half OpenSSL's time (one per update on the ingest path) and refuses
small-order keys and non-canonical signatures.
The same scheme runs the other way: each device has a key of its own, signs its announce and its
update's header (once: it names the chunks' Merkle root, nefl/protocol/wire.py), and the aggregator pins the key of each client id on its first announce, so
on a broker without ACLs nobody can announce or upload under a device's id but that device.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import BadSignatureError

from nefl.protocol.messages import ClientStatus, MessageError
from nefl.support.fsio import atomic_write_bytes, atomic_write_text

KEY_FILE = "server.key"
_SIG_OPEN = b',"sig":"'
_SIG_B64 = 88  # base64 of a 64-byte Ed25519 signature
_SIG_SUFFIX = len(_SIG_OPEN) + _SIG_B64 + 2  # + '"}'
SIGNATURE_OVERHEAD = _SIG_SUFFIX - 1  # bytes signing adds to a message (its closing brace is reused)


class KeyFileError(ValueError):
    """A key file or key string that cannot be used."""


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A base64 raw key, as `aggregator key` prints it."""
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text.strip(), validate=True))
    except (binascii.Error, ValueError):
        raise KeyFileError(f"{text[:80]!r} is not an Ed25519 public key: pass what `aggregator key` prints") from None


def public_key_arg(value: str) -> Ed25519PublicKey:
    """--server-key: the key itself or the path of a file holding it (never used on network input)."""
    path = Path(value)
    return parse_public_key(path.read_text() if path.is_file() else value)


class Signer:
    """The aggregator's signing key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._secret = crypto_sign_seed_keypair(key.private_bytes_raw())[1]  # libsodium's form: seed || public key
        self.public_text = public_key_text(key.public_key())

    @classmethod
    def load_or_create(cls, directory: str | Path, name: str = KEY_FILE) -> "Signer":
        """The key `name` in `directory`, generated (0600) on first use so a restart keeps the peers' trust."""
        path = Path(directory) / name
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError) as e:
                raise KeyFileError(f"{path}: unreadable server key ({e}); restore it from a backup "
                                "(a new key means re-pinning every device)") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise KeyFileError(f"{path}: not an Ed25519 key")
            return cls(key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a fresh key directory is private
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        atomic_write_bytes(path, pem, mode=0o600)
        return cls(key)

    def sign(self, body: bytes) -> bytes:
        """`body` (a JSON object) with its signature appended as the last field."""
        if not body.endswith(b"}") or len(body) < 3:
            raise ValueError("only non-empty JSON objects are signed")
        sig = base64.b64encode(crypto_sign(body, self._secret)[:64])
        return body[:-1] + _SIG_OPEN + sig + b'"}'


def split_signed(payload: bytes) -> tuple[bytes, bytes] | None:
    """(body, signature) of a signed message, or None when it carries no signature field."""
    if len(payload) < _SIG_SUFFIX + 2:
        return None
    tail = payload[-_SIG_SUFFIX:]
    if not (tail.startswith(_SIG_OPEN) and tail.endswith(b'"}')):
        return None
    try:
        sig = base64.b64decode(tail[len(_SIG_OPEN):-2], validate=True)
    except binascii.Error:
        return None
    return payload[:-_SIG_SUFFIX] + b"}", sig


def verify(payload: bytes, key: Ed25519PublicKey) -> bytes:
    """The signed body of `payload`, or MessageError (unsigned / bad_signature)."""
    parts = split_signed(bytes(payload))
    if parts is None:
        raise MessageError("unsigned", "message carries no server signature")
    body, sig = parts
    try:
        crypto_sign_open(sig + body, key.public_bytes_raw())
    except BadSignatureError:
        raise MessageError("bad_signature", "signature does not match the pinned server key") from None
    return body


def verify_self_signed(payload: bytes, key_of: Callable[[bytes], str]) -> tuple[bytes, str]:
    """(body, key) of a message signed by the key it names (`key_of` reads it from the body): all that
    trust on first use can check, for the server's status on a device and a device's announce on the server."""
    parts = split_signed(bytes(payload))
    if parts is None:
        raise MessageError("unsigned", "message carries no signature")
    key = key_of(parts[0])
    try:
        public = parse_public_key(key)
    except KeyFileError:
        raise MessageError("bad_signature", "message names no usable public key") from None
    return verify(payload, public), key


class KeyPin:
    """The server key a device trusts: given, remembered from an earlier run, or learned on first use."""

    def __init__(self, key: Ed25519PublicKey | None, pin_file: Path | None) -> None:
        self.key = key
        self.pin_file = pin_file
        self.source = "given" if key is not None else "none"  # given, remembered (pin file) or first use
        if key is None and pin_file is not None and pin_file.is_file():
            self.key = public_key_arg(str(pin_file))
            self.source = "remembered"

    @property
    def text(self) -> str | None:
        return None if self.key is None else public_key_text(self.key)

    def learn(self, key_text: str) -> None:
        """Trust on first use: adopt `key_text` and remember it (only when nothing is pinned yet)."""
        if self.key is not None:
            raise ValueError("a server key is already pinned")
        self.key = parse_public_key(key_text)
        self.source = "first use"
        if self.pin_file is not None:
            self.pin_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.pin_file, key_text + "\n")


def status_message(key: Signer | None, state: str, seq: int) -> bytes:
    """The device's status for the connection stamped `seq`, signed by its key (the offline one is its will)."""
    body = ClientStatus(state=state, seq=seq).to_json()
    return body if key is None else key.sign(body)
