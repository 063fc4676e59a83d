"""Free TCP ports on the loopback interface."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Servers that accept port 0 should use that instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def reserved_ports(count: int, host: str = "127.0.0.1") -> Iterator[list[int]]:
    """`count` distinct free ports, held (bound, not listening) until the block ends, so
    nothing else started inside the block (e.g. a proxy on port 0) can take one of them."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        yield ports


def free_port_range(count: int) -> tuple[int, int]:
    """A range of ``count`` ports nobody listens at, below the range the system hands out
    for port 0 (so no other socket of this run takes one meanwhile)."""
    for _ in range(200):
        low = random.randrange(20_000, 30_000)
        probes = []
        try:
            for port in range(low, low + count):
                probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return low, low + count - 1
    raise RuntimeError(f"no {count} free ports in a row")


def port_accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    """Poll until something accepts connections on host:port, or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_accepts(host, port):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing accepted connections on {host}:{port} within {timeout} s")
