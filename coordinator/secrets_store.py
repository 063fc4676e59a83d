"""The coordinator's long-lived secrets on disk: its signing key and the admin token.

Both files are created on the first `serve`, mode 0600, written atomically (a crash never
leaves half a key), and reused afterwards so capability tokens and admin scripts keep
working across restarts.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protos import identity

log = logging.getLogger(__name__)

KEY_FILE = "coordinator.key"
ADMIN_TOKEN_FILE = "admin.token"
ADDRESS_FILE = "coordinator.addr"
# Generated admin tokens start with this, never with "-": a bare urlsafe token does 1 time
# in 64, and `--admin-token -x...` then reads as a missing value (a flaky test showed it).
ADMIN_TOKEN_PREFIX = "tsa_"


def write_private_file(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _tighten(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o); restricting it to 0600", path, mode)
        path.chmod(0o600)


def load_or_create_signing_key(data_dir: Path) -> Ed25519PrivateKey:
    path = data_dir / KEY_FILE
    if path.exists():
        _tighten(path)
        return identity.private_key_from_pem(path.read_bytes())
    key = identity.generate_private_key()
    write_private_file(path, identity.private_key_to_pem(key))
    log.info("created the coordinator signing key %s", path)
    return key


def load_or_create_admin_token(data_dir: Path) -> str:
    path = data_dir / ADMIN_TOKEN_FILE
    if path.exists():
        _tighten(path)
        token = path.read_text().strip()
        if token:
            return token
    token = new_admin_token()
    write_private_file(path, (token + "\n").encode())
    log.info("created the admin token %s", path)
    return token


def new_admin_token() -> str:
    return ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)


def write_address(data_dir: Path, address: str) -> None:
    """Publish where we listen, for admin commands and tests (not secret, but atomic)."""
    path = data_dir / ADDRESS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)
