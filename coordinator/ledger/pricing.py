"""Prices, quotes and the client's route preference.

A node's price comes from its registration (Capabilities.price_per_1k_token_layers_units),
or the coordinator's default when it asks 0. A session's quote is what it may cost at
most: every stage at the dearest node that may serve it (the primary or an alternate it
could fail over to), for max_length tokens. `prefer="cheap"` routes by price and keeps
only alternates no dearer than their primary. With a budget (max_price) a fast route that
does not fit first drops its dearer alternates, then falls back to the cheap route.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grpc

from coordinator.ledger.amounts import INT64_MAX, LedgerError, quote_amount
from coordinator.ledger.book import NodeQuote
from coordinator.router import Holder, RttMs, Stage, route

PREFERENCES = ("fast", "cheap")

PriceOf = Callable[[str], NodeQuote]


def check_preference(prefer: str) -> str:
    prefer = prefer or "fast"
    if prefer not in PREFERENCES:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prefer must be one of {', '.join(PREFERENCES)} (or empty for fast), got {prefer!r}",
        )
    return prefer


def cheap_first(holders: Sequence[Holder], price_of: PriceOf) -> list[Holder]:
    """Holders whose route cost is their price; speed only breaks ties."""
    return [
        dataclasses.replace(h, ms_per_layer=price_of(h.node_id).price + h.ms_per_layer * 1e-3)
        for h in holders
    ]


def stage_nodes(stage: Stage) -> list[str]:
    return [stage.primary.node_id, *(a.node_id for a in stage.alternates)]


def quote_for(stages: Sequence[Stage], max_tokens: int, price_of: PriceOf) -> int:
    return quote_amount(
        max_tokens,
        [(s.end - s.start, max(price_of(n).price for n in stage_nodes(s))) for s in stages],
    )


def within_primary_price(stages: Sequence[Stage], price_of: PriceOf) -> list[Stage]:
    """The same route without alternates dearer than their stage's primary."""
    trimmed = []
    for s in stages:
        ceiling = price_of(s.primary.node_id).price
        keep = tuple(a for a in s.alternates if price_of(a.node_id).price <= ceiling)
        trimmed.append(dataclasses.replace(s, alternates=keep))
    return trimmed


def plan_route(
    boundaries: Sequence[int],
    holders: Sequence[Holder],
    *,
    max_tokens: int,
    max_price: int,
    prefer: str,
    price_of: PriceOf,
    rtt_ms: RttMs | None = None,
) -> tuple[list[Stage], int]:
    """The route for a session and its quote, within `max_price` (0 = no cap) if any
    route is. Raises NoRouteError (no replica) or LedgerError (over budget)."""
    if not 0 <= max_price <= INT64_MAX:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT, f"max_price must be >= 0, got {max_price}"
        )
    prefer = check_preference(prefer)

    def cheapest() -> list[Stage]:
        return route(boundaries, cheap_first(holders, price_of), rtt_ms=rtt_ms)

    if prefer == "cheap":
        # Price over speed, fail-over included: no alternate may cost more than its primary.
        stages = within_primary_price(cheapest(), price_of)
    else:
        stages = route(boundaries, holders, rtt_ms=rtt_ms)
    amount = quote_for(stages, max_tokens, price_of)
    if not max_price or amount <= max_price:
        return stages, amount
    candidates = [within_primary_price(stages, price_of)]
    if prefer != "cheap":
        candidates.append(within_primary_price(cheapest(), price_of))
    for candidate in candidates:
        amount = quote_for(candidate, max_tokens, price_of)
        if amount <= max_price:
            return candidate, amount
    raise LedgerError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the cheapest route costs up to {amount} credit units for {max_tokens} tokens, more "
        f"than your max_price of {max_price}; raise --max-price or ask for fewer tokens",
    )
