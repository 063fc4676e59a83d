"""Sanity checks on what a node claims about itself at registration.

Everything here is attacker-controlled input: every bound is explicit, and a violation names
the field so an operator can see at once what their agent sent wrong.
"""

from __future__ import annotations

import math
import re

from protos.tessera.v1 import coordinator_pb2, node_pb2

TIB = 1 << 40
MAX_MEMORY_BYTES = 16 * TIB
MAX_DEVICE_COUNT = 64
MAX_CPU_CORES = 4096
MAX_TFLOPS = 10_000.0
MAX_BANDWIDTH_GBPS = 100_000.0  # an H200 streams 4,800
MAX_PRICE = 1e9
MAX_SESSIONS = 1_000_000
MAX_STRING_CHARS = 256
DEVICE_KINDS = frozenset({"cpu", "cuda", "mps", "rocm", "xpu"})
COMPUTE_DTYPES = frozenset({"float32", "float16", "bfloat16"})

# \w is Unicode-aware: operators may name machines in their own language.
_NAME_RE = re.compile(r"^\w[\w .:@()+'\-]{0,63}$")
_ACCOUNT_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.@+\-]{0,127})?$")
_REGION_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-/]{0,63})?$")
_VERSION_RE = re.compile(r"^[\w.+\-]{0,64}$")
_COMPUTE_CAPABILITY_RE = re.compile(r"^(\d{1,2}\.\d{1,2})?$")
_ACTIVE_HOURS_RE = re.compile(r"^(([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d)?$")
_HOST_PORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253}):(\d{1,5})$")


class InvalidField(ValueError):
    """A registration field is out of bounds; str() is the message for the node's operator."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def _string(field: str, value: str, pattern: re.Pattern[str] | None, expected: str) -> None:
    if len(value) > MAX_STRING_CHARS:
        raise InvalidField(
            field, f"must be at most {MAX_STRING_CHARS} characters, got {len(value)}"
        )
    if not value.isprintable():
        raise InvalidField(field, "must not contain control characters")
    if pattern is not None and not pattern.match(value):
        raise InvalidField(field, f"{value!r} is not {expected}")


def _at_most(field: str, value: int, limit: int, unit: str = "") -> None:
    if value > limit:
        raise InvalidField(field, f"{value}{unit} is more than the maximum of {limit}{unit}")


def _finite_range(field: str, value: float, limit: float) -> None:
    if not math.isfinite(value):
        raise InvalidField(field, f"must be a finite number, got {value}")
    if value < 0 or value > limit:
        raise InvalidField(field, f"must be between 0 and {limit:g}, got {value:g}")


def validate_address(field: str, address: str) -> None:
    if not address:
        return
    _string(field, address, _HOST_PORT_RE, "HOST:PORT")
    port = int(_HOST_PORT_RE.match(address).group(2))  # type: ignore[union-attr]
    if not 1 <= port <= 65535:
        raise InvalidField(field, f"port {port} is not between 1 and 65535")


def validate_capabilities(caps: node_pb2.Capabilities, prefix: str = "capabilities") -> None:
    p = prefix + "."
    if caps.device_kind not in DEVICE_KINDS:
        raise InvalidField(
            p + "device_kind", f"{caps.device_kind[:40]!r} is not one of {sorted(DEVICE_KINDS)}"
        )
    _string(p + "device_name", caps.device_name, None, "")
    _at_most(p + "device_count", caps.device_count, MAX_DEVICE_COUNT)
    _at_most(p + "memory_total_bytes", caps.memory_total_bytes, MAX_MEMORY_BYTES, " bytes")
    _at_most(p + "memory_usable_bytes", caps.memory_usable_bytes, MAX_MEMORY_BYTES, " bytes")
    if caps.memory_total_bytes and caps.memory_usable_bytes > caps.memory_total_bytes:
        raise InvalidField(
            p + "memory_usable_bytes",
            f"{caps.memory_usable_bytes} is more than memory_total_bytes "
            f"({caps.memory_total_bytes})",
        )
    _string(p + "compute_capability", caps.compute_capability, _COMPUTE_CAPABILITY_RE,
            'MAJOR.MINOR like "8.6", or empty on CPU')  # fmt: skip
    _at_most(p + "cpu_cores", caps.cpu_cores, MAX_CPU_CORES)
    _at_most(p + "ram_bytes", caps.ram_bytes, MAX_MEMORY_BYTES, " bytes")
    _finite_range(p + "matmul_tflops", caps.matmul_tflops, MAX_TFLOPS)
    _finite_range(p + "memory_bandwidth_gbps", caps.memory_bandwidth_gbps, MAX_BANDWIDTH_GBPS)
    _string(p + "region", caps.region, _REGION_RE,
            'a region like "eu-west" (letters, digits, ._-/)')  # fmt: skip
    _finite_range(p + "price_per_1k_token_layers", caps.price_per_1k_token_layers, MAX_PRICE)
    limits = caps.limits
    _at_most(p + "limits.max_memory_bytes", limits.max_memory_bytes, MAX_MEMORY_BYTES, " bytes")
    _at_most(p + "limits.max_sessions", limits.max_sessions, MAX_SESSIONS)
    _string(p + "limits.active_hours", limits.active_hours, _ACTIVE_HOURS_RE,
            'empty or "HH:MM-HH:MM"')  # fmt: skip
    _string(p + "agent_version", caps.agent_version, _VERSION_RE, "a version like 0.1.0")
    if len(caps.dtypes) > len(COMPUTE_DTYPES):
        raise InvalidField(p + "dtypes", f"lists {len(caps.dtypes)} dtypes; there are only 3")
    for dtype in caps.dtypes:
        if dtype not in COMPUTE_DTYPES:
            raise InvalidField(
                p + "dtypes", f"{dtype[:40]!r} is not one of {sorted(COMPUTE_DTYPES)}"
            )


def validate_registration(request: coordinator_pb2.RegisterRequest) -> None:
    """Raise InvalidField for the first field that is malformed or absurd."""
    _string(
        "name",
        request.name,
        _NAME_RE,
        "a name of 1-64 letters, digits, spaces or .:@()+'- starting with a letter or digit",
    )
    _string("account", request.account, _ACCOUNT_RE,
            "an account name (letters, digits, ._@+-; up to 128 characters)")  # fmt: skip
    validate_address("data_address", request.data_address)
    if not request.HasField("capabilities"):
        raise InvalidField("capabilities", "missing; the node agent must report its hardware")
    validate_capabilities(request.capabilities)
