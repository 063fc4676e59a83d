"""The node's long-lived Ed25519 identity, kept as `node.key` in its data dir.

The node id is a digest of the public key, so keeping this file is what keeps a machine's
id (and its reputation and earnings) across restarts. Losing it makes a new node.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protos import identity

log = logging.getLogger(__name__)

KEY_FILE_NAME = "node.key"


class IdentityError(Exception):
    """The key file cannot be used. The message says how to fix it."""


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE_NAME


def load_or_create_key(data_dir: Path) -> Ed25519PrivateKey:
    """The key in DATA_DIR/node.key, created (mode 0600) on first run."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = key_path(data_dir)
    if path.exists():
        return _load_key(path)
    key = identity.generate_private_key()
    _write_private_file(path, identity.private_key_to_pem(key))
    log.info(
        "created a new node key at %s (node id %s); keep it to keep this id",
        path,
        identity.node_id(identity.public_key_bytes(key)),
    )
    return key


def _load_key(path: Path) -> Ed25519PrivateKey:
    _check_private(path)
    try:
        return identity.private_key_from_pem(path.read_bytes())
    except (ValueError, TypeError) as exc:
        raise IdentityError(
            f"{path} is not a valid Ed25519 private key ({exc}). Restore it from a backup, or "
            f"move it away to create a new identity (this node will then get a new id)."
        ) from exc


def _check_private(path: Path) -> None:
    # Same rule as ssh: a private key others can read is no longer private.
    if sys.platform == "win32":
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"{path} has permissions {mode:o}, so other users can read or change this node's "
            f"private key. Fix it with: chmod 600 {path}"
        )


def _write_private_file(path: Path, data: bytes) -> None:
    """Write atomically with mode 0600 from the first byte, so no reader sees a partial key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
