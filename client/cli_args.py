"""argparse value checkers for the `tessera` commands (cli.py, jobs_cli.py, demo.py).

Each refuses a bad value while the arguments are parsed, so the mistake is reported as
"tessera SUBCOMMAND: error: argument --FLAG: ..." with that subcommand's usage, before a
coordinator is contacted or a file is uploaded.
"""

from __future__ import annotations

import argparse
import math

from protos.dialing import dialable

# The coordinator stores counts and prices as 64-bit integers; a bigger number would fail
# in protobuf with "Value out of range", which names no flag.
MAX_INT64 = (1 << 63) - 1
MAX_UINT32 = (1 << 32) - 1


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _bounded_int(text: str, low: int) -> int:
    value = _int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {low} or more, got {text}")
    if value > MAX_UINT32:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_UINT32}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    return _bounded_int(text, 0)


def credit_units(text: str) -> int:
    """A price cap in credit units: 0 (no cap) or more, within int64."""
    value = _int(text)
    if not 0 <= value <= MAX_INT64:
        raise argparse.ArgumentTypeError(
            f"must be 0 (no cap) or a whole number of credit units up to 2^63-1, got {text}"
        )
    return value


def seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_INT64:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to 2^63-1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most 1 (1 = no nucleus cut), got {text}"
        )
    return value


def token_ids(text: str) -> list[int]:
    """ "1,15,27" (spaces allowed) -> [1, 15, 27]."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(
            "is empty; give the prompt as comma-separated token ids, e.g. --token-ids 1,15,27"
        )
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers, e.g. 1,15,27; got {text!r}"
        ) from None
    negative = [i for i in ids if i < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"token ids are 0 or more, got {negative[0]}")
    return ids


def coordinator_address(text: str) -> str:
    """HOST:PORT of a coordinator to dial. gRPC would take "localhost" as port 443 and
    "http://host:7000" as a host name, then fail with a resolver message; say it here."""
    if not dialable(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT or grpcs://HOST:PORT; give the address "
            "`tessera-coordinator serve` logs as 'serving on HOST:PORT', e.g. 127.0.0.1:7000 "
            "or grpcs://coord.example.org:7000"
        )
    return text
