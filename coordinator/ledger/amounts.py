"""Credit amounts: integers in the smallest unit, bounded by SQLite's int64, never floats."""

from __future__ import annotations

import grpc

from coordinator.refusal import Refusal

INT64_MAX = (1 << 63) - 1


class LedgerError(Refusal):
    """A refused ledger operation."""


def check_amount(amount: object, what: str = "amount", *, allow_zero: bool = False) -> int:
    """`amount` as an int in [1, INT64_MAX] (or [0, ...] with allow_zero), else LedgerError."""
    # bool is an int in Python; True credits are a bug, not one unit.
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} must be a whole number of credit units, got {type(amount).__name__}",
        )
    low = 0 if allow_zero else 1
    if not low <= amount <= INT64_MAX:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} must be between {low} and {INT64_MAX} credit units, got {amount}",
        )
    return amount


def usage_charge(tokens: int, layers: int, price_per_1k: int) -> int:
    """Credits for `tokens` x `layers` at a price per 1,000 token-layers, rounded down (the
    client never pays for a fraction it did not use). Refused when it overflows int64."""
    charge = tokens * layers * price_per_1k // 1000
    if charge > INT64_MAX:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{tokens} tokens x {layers} layers at {price_per_1k} per 1k token-layers "
            "overflows the ledger's 64-bit amounts",
        )
    return charge


def quote_amount(max_tokens: int, stage_prices: list[tuple[int, int]]) -> int:
    """The most a session may cost: max_tokens x sum(layers x price) / 1000, rounded up,
    for [(layers, price per 1k token-layers)] of each stage."""
    total = sum(layers * price for layers, price in stage_prices) * max_tokens
    amount = -(-total // 1000)
    if amount > INT64_MAX:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the session's quote overflows the ledger's 64-bit amounts; ask for fewer tokens",
        )
    return amount
