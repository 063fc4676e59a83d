"""TLS for the coordinator's gRPC port (`serve --tls-cert --tls-key`).

Nodes, clients and the admin CLI then dial `grpcs://HOST:PORT` and check the certificate
against their trusted roots (or `$TESSERA_CA_CERT`; protos/dialing.py). The files are
checked here, at start-up, so that a wrong file is a message naming it, not a handshake
every caller fails later with "SSL_ERROR_SSL".
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization


class TlsFileError(ValueError):
    """A certificate or key file that cannot serve; the message says what to do."""


@dataclass(frozen=True)
class ServerTls:
    credentials: grpc.ServerCredentials
    names: tuple[str, ...]  # the certificate's DNS names and IP addresses, as clients dial them


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise TlsFileError(f"cannot read the TLS {what} {path} ({err.strerror})") from None


def _names(certificate: x509.Certificate) -> tuple[str, ...]:
    try:
        alt = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    dns = alt.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)]
    return tuple(dns + [f"[{ip}]" if ":" in ip else ip for ip in ips])


def load_server_tls(cert_path: Path, key_path: Path, now: dt.datetime | None = None) -> ServerTls:
    """Credentials from a PEM certificate chain (the server's first) and its private key."""
    chain = _read(cert_path, "certificate")
    key_pem = _read(key_path, "key")
    try:
        certificates = x509.load_pem_x509_certificates(chain)
    except ValueError:
        raise TlsFileError(
            f"{cert_path} holds no PEM certificate (a file starting "
            "'-----BEGIN CERTIFICATE-----'); give --tls-cert the certificate chain, server first"
        ) from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TlsFileError(
            f"{key_path} is encrypted; the coordinator starts unattended, so give it the key "
            "without a passphrase (openssl pkey -in KEY -out KEY.plain), readable only by it"
        ) from None
    except ValueError:
        raise TlsFileError(
            f"{key_path} holds no PEM private key (a file starting '-----BEGIN PRIVATE KEY-----')"
        ) from None
    server = certificates[0]
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if key.public_key().public_bytes(encoding, public) != server.public_key().public_bytes(
        encoding, public
    ):
        raise TlsFileError(
            f"the key {key_path} is not the key of the certificate {cert_path}; give the pair "
            "that was issued together"
        )
    now = now or dt.datetime.now(dt.UTC)
    if server.not_valid_after_utc <= now:
        raise TlsFileError(
            f"the certificate {cert_path} expired on {server.not_valid_after_utc:%Y-%m-%d}; "
            "renew it"
        )
    names = _names(server)
    if not names:
        raise TlsFileError(
            f"the certificate {cert_path} names no host (no subjectAltName): clients check "
            "the host they dial against those names; issue it for the coordinator's DNS name"
        )
    credentials = grpc.ssl_server_credentials([(key_pem, chain)])
    return ServerTls(credentials, names)


def dial_host(listen_host: str, tls: ServerTls) -> str:
    """The host to put in the coordinator's address: the one it listens on, unless that is
    every interface, which no client can dial by name: then the certificate's first name."""
    try:
        wildcard = (
            listen_host in ("", "*") or ipaddress.ip_address(listen_host.strip("[]")).is_unspecified
        )
    except ValueError:
        wildcard = False
    if not wildcard:
        return listen_host
    # A wildcard name (*.example.org) is no host either: the first plain one, if any.
    return next((name for name in tls.names if not name.startswith("*")), tls.names[0])
