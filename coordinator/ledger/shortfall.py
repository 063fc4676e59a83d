"""What a session's layers are billed at the least: the longest prefix any node held there.

A node cannot tell a check from a client call, so what a receipt bills (billed_tokens) is
the client's word, except where the node was a stage's primary at open (book._billable).
A client could send a stage's work to an alternate or a checker instead, and sign all of
it as checks. But a node's cache holds only what that node computed: a pipeline that got
to position p on a layer had some node compute every position before p there, and each
receipt says the longest prefix its node held (UsageReceipt.longest, signed by both).

So on every layer the client pays at least for the longest prefix any node held there.
Where its receipts bill less (a shortfall), the difference is billed to the nodes that
held the longest prefixes, each up to what it counted and was not billed for. An honest
client is never short: the nodes that served its pipeline billed every position they
computed for it, and a checker only ever holds a prefix the pipeline computed first
(docs/ledger.md, "Shortfall").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Where = tuple[str, int, int]  # node id, layer start, layer end


@dataclass(frozen=True)
class Held:
    """One (node, layers) of a session, as its newest receipts say."""

    node_id: str
    layer_start: int
    layer_end: int
    billed: int  # token positions x batch billed (the whole count for a primary at open)
    counted: int  # what the node computed there, checks included
    longest: int  # the longest prefix it held there (0: no evidence, e.g. training)

    @property
    def where(self) -> Where:
        return (self.node_id, self.layer_start, self.layer_end)


def shortfalls(rows: Iterable[Held]) -> dict[Where, int]:
    """Token-layers each (node, layers) is billed beyond its billed tokens; only those
    with some. Deterministic: the longest prefix first, then node id and layers."""
    rows = [r for r in rows if r.layer_start < r.layer_end]
    bounds = sorted({r.layer_start for r in rows} | {r.layer_end for r in rows})
    extra: dict[Where, int] = {}
    for low, high in zip(bounds, bounds[1:], strict=False):
        # Consecutive bounds: the same receipts cover every layer of [low, high).
        covering = [r for r in rows if r.layer_start <= low and high <= r.layer_end]
        short = max((r.longest for r in covering), default=0) - sum(r.billed for r in covering)
        for row in sorted(covering, key=lambda r: (-r.longest, r.where)):
            if short <= 0:
                break
            take = min(short, row.counted - row.billed)
            if take > 0:
                extra[row.where] = extra.get(row.where, 0) + take * (high - low)
                short -= take
    return extra
