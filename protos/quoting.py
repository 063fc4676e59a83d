"""How every component quotes a caller's string in an error message."""

from __future__ import annotations


def shown(value: str, limit: int = 80) -> str:
    """A caller's string, quoted and cut short. Error details travel in gRPC metadata, which
    a client refuses past 16 KiB: a message repeating a huge name or id would reach it as
    RESOURCE_EXHAUSTED "Stream removed" instead of the reason it was refused, and a
    shorter one would still echo the whole input back."""
    return repr(value if len(value) <= limit else value[:limit] + "...")
