"""The node key: created once with private permissions, then reused (same node id)."""

import os
import stat
from pathlib import Path

import pytest

from node_agent import identity
from protos import identity as wire_identity


def _node_id(data_dir: Path) -> str:
    key = identity.load_or_create_key(data_dir)
    return wire_identity.node_id(wire_identity.public_key_bytes(key))


def test_first_run_creates_a_private_key_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    identity.load_or_create_key(data_dir)
    path = identity.key_path(data_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    # Written through a temp file and renamed: nothing else is left behind.
    assert sorted(p.name for p in data_dir.iterdir()) == ["node.key"]


def test_the_key_is_reused_so_the_node_id_is_stable(tmp_path: Path) -> None:
    first = _node_id(tmp_path)
    before = identity.key_path(tmp_path).read_bytes()
    assert _node_id(tmp_path) == first
    assert identity.key_path(tmp_path).read_bytes() == before


def test_different_data_dirs_are_different_nodes(tmp_path: Path) -> None:
    assert _node_id(tmp_path / "a") != _node_id(tmp_path / "b")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_others_can_read_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    identity.load_or_create_key(tmp_path)
    path = identity.key_path(tmp_path)
    os.chmod(path, mode)
    with pytest.raises(identity.IdentityError, match=f"chmod 600 {path}"):
        identity.load_or_create_key(tmp_path)


def test_a_corrupt_key_is_reported_not_replaced(tmp_path: Path) -> None:
    path = identity.key_path(tmp_path)
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(identity.IdentityError, match="not a valid Ed25519 private key"):
        identity.load_or_create_key(tmp_path)
    # Replacing it silently would throw away the node's id and earnings.
    assert path.read_bytes() == b"not a key"
