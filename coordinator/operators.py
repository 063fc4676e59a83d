"""Operator independence: which nodes may check (or arbitrate) each other's work.

One operator account can run many nodes, and its nodes could agree on a wrong answer, so
a node is never checked by a node of its own account. A node without an account is its
own operator (nothing ties it to any other), as registration allows.
"""

from __future__ import annotations


def same_operator(account: str, other: str) -> bool:
    """True when both nodes belong to one (named) operator account."""
    return bool(account) and account == other
