"""The verifier: reputation, arbitration of reported mismatches, canaries, bans.

Kept import-light on purpose: the migrations import the table definitions from
``reputation`` while the database opens, before the rest of the coordinator exists.
"""

from __future__ import annotations

from typing import Any


def build(ctx: Any) -> Any:
    """COMPONENTS entry point (coordinator/server.py)."""
    from coordinator.verifier.service import Verifier

    return Verifier.from_context(ctx)
