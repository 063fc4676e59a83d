"""TLS for the coordinator's port: the files `serve --tls-cert --tls-key` accepts, what it
says about every wrong one (before it listens), and how an address says TLS.

tests/e2e/test_tls_e2e.py runs a whole swarm through a TLS coordinator.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from support.coordinator_cli import run_main
from support.tls_files import TlsFiles, write_tls_files

from coordinator.tls import TlsFileError, dial_host, load_server_tls
from protos import dialing


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tls"), dns=("coord.example.org",))


def test_a_good_pair_names_the_hosts_clients_may_dial(files: TlsFiles, tmp_path: Path) -> None:
    tls = load_server_tls(files.cert, files.key)
    assert tls.names == ("coord.example.org", "127.0.0.1")
    # Every interface is no host to dial: the address names the certificate's first name.
    assert dial_host("0.0.0.0", tls) == "coord.example.org"
    assert dial_host("[::]", tls) == "coord.example.org"
    assert dial_host("127.0.0.1", tls) == "127.0.0.1"
    wildcard = write_tls_files(tmp_path / "wildcard", dns=("*.example.org", "coord.example.org"))
    assert dial_host("0.0.0.0", load_server_tls(wildcard.cert, wildcard.key)) == "coord.example.org"


def _refused(cert: Path, key: Path, *words: str, now: dt.datetime | None = None) -> None:
    with pytest.raises(TlsFileError) as caught:
        load_server_tls(cert, key, now)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_every_wrong_file_is_named_with_what_to_do(files: TlsFiles, tmp_path: Path) -> None:
    _refused(tmp_path / "nope.pem", files.key, "cannot read the TLS certificate", "nope.pem")
    _refused(files.cert, tmp_path / "nope.key", "cannot read the TLS key")
    # The two swapped: neither file is what its flag asks for.
    _refused(files.key, files.cert, "holds no PEM certificate", "--tls-cert")
    (tmp_path / "junk.key").write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n")
    _refused(files.cert, tmp_path / "junk.key", "holds no PEM private key")

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "locked.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    _refused(files.cert, tmp_path / "locked.key", "is encrypted", "without a passphrase")
    other = write_tls_files(tmp_path / "other")
    _refused(files.cert, other.key, "is not the key of the certificate")

    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=40)  # the certificate has 30
    _refused(files.cert, files.key, "expired on", "renew it", now=later)
    nameless = write_tls_files(tmp_path / "nameless", dns=(), ips=())
    _refused(nameless.cert, nameless.key, "names no host", "subjectAltName")


def test_serve_says_what_is_wrong_before_it_listens(
    files: TlsFiles, tmp_path: Path, capsys
) -> None:
    base = ["serve", "--data-dir", str(tmp_path / "coordinator"), "--listen", "127.0.0.1:0"]
    code, _, err = run_main([*base, "--tls-cert", str(files.cert)], capsys)
    assert code == 2 and "needs both --tls-cert PEM" in err and "--tls-key PEM" in err
    code, _, err = run_main([*base, "--tls-key", str(files.key)], capsys)
    assert code == 2 and "needs both" in err
    code, _, err = run_main(
        [*base, "--tls-cert", str(files.key), "--tls-key", str(files.key)], capsys
    )
    assert code == 2 and "holds no PEM certificate" in err, err
    assert not (tmp_path / "coordinator" / "coordinator.addr").exists()


def test_an_address_says_whether_it_is_dialed_over_tls() -> None:
    for address in ("127.0.0.1:7000", "grpcs://coord.example.org:7000", "grpcs://[::1]:7000"):
        assert dialing.dialable(address), address
    for address in ("grpc://h:7000", "https://h:7000", "grpcs://h", "grpcs://:7000", "grpcs://"):
        assert not dialing.dialable(address), address
    assert dialing.uses_tls("grpcs://h:1") and not dialing.uses_tls("h:1")
    assert dialing.host_port("grpcs://h:1") == dialing.host_port("h:1") == "h:1"


def test_the_hint_names_the_likely_tls_mix_up() -> None:
    # What gRPC says when a plain client meets a TLS port, and a TLS one a wrong CA.
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:…: Socket closed"
    assert dialing.tls_hint("h:7000", closed) == (
        "; if the coordinator serves TLS (serve --tls-cert), dial grpcs://h:7000"
    )
    refused = "failed to connect to all addresses; last error: Connection refused"
    assert dialing.tls_hint("h:7000", refused) == ""  # nothing listens: TLS is not why
    handshake = "Tls handshake failed (TSI_PROTOCOL_FAILURE): CERTIFICATE_VERIFY_FAILED"
    hint = dialing.tls_hint("grpcs://h:7000", handshake)
    assert "certificate names h" in hint and dialing.CA_ENV in hint
    assert dialing.tls_hint("grpcs://h:7000", refused) == ""


def test_a_ca_file_that_is_not_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: TlsFiles
) -> None:
    monkeypatch.setenv(dialing.CA_ENV, str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="cannot read it"):
        dialing.aio_channel("grpcs://h:1")
    monkeypatch.setenv(dialing.CA_ENV, str(files.key))
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        dialing.sync_channel("grpcs://h:1")
    dialing.sync_channel("h:1").close()  # a plain address never reads it


def test_a_node_given_a_grpcs_coordinator_checks_its_ca_file_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from node_agent.cli import build_parser as node_parser

    monkeypatch.setenv(dialing.CA_ENV, str(tmp_path / "missing.pem"))
    for argv in (
        ["join", "--coordinator", "grpcs://h:7000", "--name", "n"],
        ["earnings", "--coordinator", "grpcs://h:7000", "--data-dir", str(tmp_path)],
    ):
        with pytest.raises(SystemExit) as exited:
            node_parser().parse_args(argv)
        assert exited.value.code == 2
        assert "cannot read it" in capsys.readouterr().err
    plain = node_parser().parse_args(["join", "--coordinator", "h:7000", "--name", "n"])
    assert plain.coordinator == "h:7000"  # a plain address never reads it
