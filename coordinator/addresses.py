"""HOST:PORT strings."""

from __future__ import annotations


def split_host_port(address: str) -> tuple[str, int]:
    """("0.0.0.0", 7000) from "0.0.0.0:7000"; IPv6 hosts keep their brackets ("[::]")."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 0.0.0.0:7000, or port 0 for any)")
    return host, int(port)
