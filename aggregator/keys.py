"""Where the aggregator side keeps its secrets: one directory per federation, apart from its data, so
copying or publishing a run directory (checkpoints, metrics, exports) never ships a private key.

    $NEFL_KEY_DIR (default ~/.config/nefl/keys)/FEDERATION/      mode 0700
        server.key          the aggregator's signing key (0600): devices and workers pin its public half
        enrolment.jsonl     the operator's grants and revocations (`aggregator enroll`, `revoke`), 0600
        incarnation         the run incarnation: +1 on every `serve` start, --resume included
        aggregation.secret  what the centre check's draws come from (0600), never --seed
        workers/ID.key      keys of the workers and relays started on this host (0600)
        rollout/rollout.json  the model rollout's state (`aggregator publish`, `aggregator rollout`)

Before this layout the server key lived in the run directory (`--checkpoint-dir`/server.key); `serve`,
`key` and the rollout commands move it here on first use (docs/security.md, "Moving an old key").
"""

from __future__ import annotations

import filecmp
import logging
import os
import secrets
import shutil
from pathlib import Path

from nefl.protocol.signing import KEY_FILE, KeyFileError, Signer
from nefl.support.fsio import atomic_write_bytes, atomic_write_text

KEY_DIR_ENV = "NEFL_KEY_DIR"
JOURNAL = "enrolment.jsonl"
INCARNATION = "incarnation"
RULE_SECRET = "aggregation.secret"
SECRET_BYTES = 32
log = logging.getLogger("aggregator.server")


def default_root() -> Path:
    return Path(os.environ.get(KEY_DIR_ENV) or "~/.config/nefl/keys").expanduser()


class KeyDir:
    """The key directory of one federation (created 0700 on first use)."""

    def __init__(self, federation: str, root: str | Path | None = None) -> None:
        self.federation = federation
        self.path = Path(root).expanduser() / federation if root else default_root() / federation

    def ensure(self) -> Path:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        return self.path

    @property
    def server_key(self) -> Path:
        return self.path / KEY_FILE

    @property
    def journal(self) -> Path:
        return self.path / JOURNAL

    @property
    def rollout_dir(self) -> Path:
        """The rollout's state (aggregator/deploy.py): one history per federation, next to the key that signs it."""
        return self.path / "rollout"

    def rule_secret(self) -> bytes:
        """The server's secret for the aggregation's draws (the centre check's sketch positions), made on first
        use and kept beside the server key (0600): an attacker who knows --seed and the code still cannot tell
        where the sketch looks."""
        path = self.path / RULE_SECRET
        try:
            secret = path.read_bytes()
            if len(secret) == SECRET_BYTES:
                return secret
            log.warning(f"{path}: not a {SECRET_BYTES}-byte secret; a new one replaces it")
        except FileNotFoundError:
            pass
        secret = secrets.token_bytes(SECRET_BYTES)
        self.ensure()
        atomic_write_bytes(path, secret, mode=0o600)
        return secret

    def server_signer(self, checkpoint_dir: str | Path | None = None, create: bool = True) -> Signer:
        """The server key, moved here first from `checkpoint_dir` where an older version kept it."""
        if checkpoint_dir is not None:
            self.migrate(Path(checkpoint_dir) / KEY_FILE)
        if not create and not self.server_key.is_file():
            raise KeyFileError(f"no server key in {self.path}: run this where `aggregator serve --federation "
                               f"{self.federation}` runs (or give its --key-dir)")
        self.ensure()
        return Signer.load_or_create(self.path)

    def migrate(self, old: Path) -> None:
        """An old server.key in a run directory: moved into the key directory, or refused when both differ."""
        if not old.is_file():
            return
        self.ensure()
        if self.server_key.is_file():
            if not filecmp.cmp(old, self.server_key, shallow=False):
                raise KeyFileError(f"two server keys: {old} (the old place) and {self.server_key}; keep the one your "
                                   f"devices pin (`aggregator key` prints it) and delete the other")
            old.unlink()
            return
        shutil.copyfile(old, self.server_key)
        os.chmod(self.server_key, 0o600)
        old.unlink()
        log.warning(f"moved the server key from {old} to {self.server_key} (keys no longer live in run directories)")

    def worker_key_path(self, worker_id: str) -> Path:
        return self.path / "workers" / f"{worker_id}.key"

    def worker_signer(self, worker_id: str, path: str | Path | None = None) -> Signer:
        """A worker's or relay's own key: `path`, or workers/ID.key here (created 0600 if missing)."""
        if path is None:
            self.ensure()
        key = Path(path) if path else self.worker_key_path(worker_id)
        return Signer.load_or_create(key.parent, key.name)

    def next_incarnation(self) -> int:
        """Count one more run of this federation under this key: what devices compare to refuse old runs."""
        self.ensure()
        f = self.path / INCARNATION
        try:
            last = int(f.read_text().strip() or 0)
        except FileNotFoundError:
            last = 0
        except ValueError:
            raise KeyFileError(f"{f} does not hold a number; restore it (devices refuse runs older than the "
                               "newest they saw)") from None
        atomic_write_text(f, f"{last + 1}\n", mode=0o600)
        return last + 1
