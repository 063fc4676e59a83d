"""MQTT broker URLs, as the coordinator's and the node agent's `--mqtt` take them.

`mqtt://[user:pass@]HOST[:1883]`, or `mqtts://[user:pass@]HOST[:8883]` for TLS, which
hosted brokers (HiveMQ Cloud, EMQX Cloud) require along with a login. TLS checks the
broker's certificate against the system's roots and, when `$TESSERA_CA_CERT` names a PEM
file, that private CA as well. A URL is printed without its password; a password in a
command line is visible to every user of the machine (`ps`), so `mqtts://USER@HOST` takes
it from `$TESSERA_MQTT_PASSWORD` instead.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from protos.dialing import CA_ENV

PASSWORD_ENV = "TESSERA_MQTT_PASSWORD"
PLAIN_PORT = 1883
TLS_PORT = 8883


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:  # never the password: this goes into logs
        user = f"{self.username}@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        context = ssl.create_default_context()
        ca = os.environ.get(CA_ENV)
        if ca:
            try:
                context.load_verify_locations(cafile=ca)
            except (OSError, ssl.SSLError) as err:
                raise ValueError(
                    f"{CA_ENV}={ca}: not a readable PEM certificate ({err}); point it at the "
                    "certificate of the CA that signed the broker's"
                ) from None
        return context


def parse_broker_url(url: str, bare: bool = True) -> BrokerAddress:
    """A broker's address; ``bare`` also takes HOST[:PORT] without a scheme (as mqtt://)."""
    if "://" not in url and bare:
        url = "mqtt://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "tcp", "mqtts", "ssl") or not parts.hostname:
        raise ValueError(
            f"{url!r} is not a broker URL; use mqtt://HOST[:PORT] or mqtts://HOST[:PORT] (TLS), "
            "with USER:PASSWORD@ before HOST for a broker that wants a login"
        )
    tls = parts.scheme in ("mqtts", "ssl")
    try:
        port = parts.port or (TLS_PORT if tls else PLAIN_PORT)
    except ValueError as exc:
        raise ValueError(f"{url!r} has a bad port: {exc}") from exc
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if username and password is None:
        password = os.environ.get(PASSWORD_ENV) or None
    return BrokerAddress(parts.hostname, port, tls, username, password)
