"""The client key is the account: loading it, creating it, and every way the file can be
wrong. Each mistake is a ValueError naming the file (the CLI prints it and exits 2)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from client import cli
from client.billing import account_of, load_key
from protos import identity


def test_created_once_with_owner_only_access_then_loaded(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "client.key"
    created = load_key(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert account_of(load_key(path)) == account_of(created)
    assert account_of(load_key(path, create=True)) == account_of(created)  # never replaced


def refused(path: Path, *words: str) -> None:
    with pytest.raises(ValueError) as caught:
        load_key(path)
    message = str(caught.value)
    assert str(path) in message
    for word in words:
        assert word in message, message


def test_a_missing_key_is_not_created_unless_asked(tmp_path: Path) -> None:
    refused(tmp_path / "client.key", "no client key at", "tessera balance")
    assert not (tmp_path / "client.key").exists()


def test_a_directory(tmp_path: Path) -> None:
    refused(tmp_path, "cannot read the client key", "Is a directory")


def other_key_pem() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def passphrase_pem() -> bytes:
    return identity.generate_private_key().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )


@pytest.mark.parametrize(
    "content",
    [lambda: b"", lambda: b"not a key at all", other_key_pem, passphrase_pem],
    ids=["empty", "garbage", "an ECDSA key", "a key with a passphrase"],
)
def test_files_that_are_not_a_client_key(tmp_path: Path, content) -> None:
    path = tmp_path / "client.key"
    data = content()
    path.write_bytes(data)
    refused(path, "is not a Tessera client key", "--key")
    assert path.read_bytes() == data  # never overwritten: it may be someone's account


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--prompt", "hi", "--max-new-tokens", "1"],
        ["balance"],
    ],
    ids=["generate", "balance"],
)
def test_the_cli_says_what_is_wrong_with_the_key_file(tmp_path: Path, capsys, argv) -> None:
    # Refused before any coordinator is dialled: nothing listens on port 1.
    code = cli.main([*argv, "--coordinator", "127.0.0.1:1", "--key", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot read the client key {tmp_path}" in err and "Traceback" not in err
