"""The gRPC options every component dials another with, the data plane's window, and how
an address says whether it is dialed over TLS.

The coordinator is a hosted service reached over the internet: `tessera-coordinator serve
--tls-cert --tls-key` serves it over TLS, and every program that dials it is then given
`grpcs://HOST:PORT` instead of `HOST:PORT`. The certificate is checked against the
system's trusted roots, or against the PEM file `$TESSERA_CA_CERT` names (a private CA, or
a self-signed certificate, which is its own root). Stage nodes' data planes stay plain
gRPC: what crosses them is signed end to end (docs/protocol.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from protos import codec

TLS_SCHEME = "grpcs://"
CA_ENV = "TESSERA_CA_CERT"

MESSAGE_LIMITS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]

# A 512-token prefill chunk of hidden size 4096 in float32 is 8 MiB.
DATA_WINDOW_BYTES = 8 << 20
# gRPC sizes its receive window with a ping (BDP probe) when data arrives: on a decode
# stream that is frames and thread wake-ups beside nearly every reply. A fixed window as
# large as a prefill chunk's hidden states keeps big messages flowing without it (on
# loopback a 4 KiB round trip measured ~15% faster; 2 MiB ones alike within noise). For
# both ends of every data-plane stream: client, node server, node-to-node relay links.
DATA_WINDOW: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", DATA_WINDOW_BYTES),
]

# By default gRPC shares one connection per (address, options) among all the channels of
# a process, and with it the reconnect backoff of a failed one (up to two minutes). A new
# channel to a node that came up at the address of a dead one (a node restarted on its
# --listen port, or a new one given a recycled ephemeral port) then fails at once with
# "Connection refused" while any older channel to the dead node is still open. With a
# local pool, every channel dials for itself.
DIAL_OPTIONS: list[tuple[str, int]] = [
    *MESSAGE_LIMITS,
    ("grpc.use_local_subchannel_pool", 1),
]


def dialable(address: str) -> bool:
    """True for HOST:PORT or grpcs://HOST:PORT as gRPC dials it meant (port 1-65535, no
    other scheme). gRPC itself reads "localhost" as port 443 and "http://host:7000" as a
    host name, then fails with a resolver message that names neither mistake; every CLI
    checks with this first."""
    plain = host_port(address)
    host, sep, port = plain.rpartition(":")
    return "://" not in plain and bool(sep and host) and port.isdigit() and 0 < int(port) <= 65535


def uses_tls(address: str) -> bool:
    return address.startswith(TLS_SCHEME)


def host_port(address: str) -> str:
    """HOST:PORT of an address, without its grpcs:// scheme."""
    return address.removeprefix(TLS_SCHEME)


def channel_credentials() -> grpc.ChannelCredentials:
    """TLS credentials that trust the system's roots, or only $TESSERA_CA_CERT's."""
    path = os.environ.get(CA_ENV)
    if not path:
        return grpc.ssl_channel_credentials()
    try:
        roots = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(
            f"{CA_ENV}={path}: cannot read it ({err.strerror}); point it at the PEM "
            "certificate of the coordinator's CA (or at its self-signed certificate)"
        ) from None
    if b"-----BEGIN CERTIFICATE-----" not in roots:
        raise ValueError(f"{CA_ENV}={path} holds no PEM certificate")
    return grpc.ssl_channel_credentials(root_certificates=roots)


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to HOST:PORT (plain) or grpcs://HOST:PORT (TLS)."""
    if uses_tls(address):
        return grpc.aio.secure_channel(host_port(address), channel_credentials(), options)
    return grpc.aio.insecure_channel(address, options)


def sync_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to HOST:PORT (plain) or grpcs://HOST:PORT (TLS)."""
    if uses_tls(address):
        return grpc.secure_channel(host_port(address), channel_credentials(), options)
    return grpc.insecure_channel(address, options)


def tls_hint(address: str, details: str) -> str:
    """A hint to add to "cannot reach the coordinator" when the failure (gRPC's details)
    looks like a TLS mix-up; "" when it does not."""
    said = details.lower()
    if uses_tls(address):
        if any(word in said for word in ("handshake", "ssl", "certificate", "tsi_")):
            host = host_port(address).rpartition(":")[0]
            return (
                f"; it is dialed over TLS: check that the coordinator serves TLS (serve "
                f"--tls-cert), that its certificate names {host}, and, for a private CA or a "
                f"self-signed certificate, that {CA_ENV} holds it"
            )
        return ""
    if any(word in said for word in ("socket closed", "connection reset", "end of file")):
        return f"; if the coordinator serves TLS (serve --tls-cert), dial {TLS_SCHEME}{address}"
    return ""
