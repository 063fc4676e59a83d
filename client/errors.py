"""Exceptions the client raises. Each message says what happened and what to do about it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from protos.dialing import tls_hint


class TesseraError(Exception):
    """Base class for every error the client library raises on purpose."""


class CoordinatorUnavailable(TesseraError):
    def __init__(self, address: str, detail: str) -> None:
        super().__init__(
            f"cannot reach the coordinator at {address} ({detail}{tls_hint(address, detail)})."
            " Is it running? Start one with `tessera-coordinator serve`, or point the client "
            "elsewhere with --coordinator HOST:PORT (grpcs://HOST:PORT over TLS) or the "
            "TESSERA_COORDINATOR environment variable."
        )
        self.address = address


class ModelNotFound(TesseraError):
    def __init__(self, name: str, known: Sequence[str]) -> None:
        listing = ", ".join(sorted(known)) if known else "none yet (import one with "
        if not known:
            listing += "`tessera-coordinator models add DIR`)"
        super().__init__(f"the coordinator has no model named {name!r}; known models: {listing}")
        self.name = name
        self.known = list(known)


class CoordinatorError(TesseraError):
    """The coordinator refused a request; ``code`` is the gRPC status it answered with."""

    def __init__(self, what: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{what} failed: {code.name}: {details}")
        self.code = code
        self.details = details


class RequestRejected(TesseraError):
    """A stage node refused the request itself; another node would refuse it too."""

    def __init__(self, node_id: str, span: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(
            f"node {node_id} rejected the request for layers {span}: {code.name}: {details}"
        )
        self.node_id = node_id
        self.code = code
        self.details = details


class PipelineError(TesseraError):
    """The pipeline could not be completed even after trying every fail-over option."""


class OutputTainted(PipelineError):
    """A node was proven, after the fact, to have computed a step wrong that no sampled
    check had covered: the session's history from that position on holds its output."""

    def __init__(
        self,
        node_id: str,
        layer_start: int,
        layer_end: int,
        position: int,
        prompt_length: int | None = None,
    ) -> None:
        # The step at `position` computed the token after it: the first one in doubt.
        first = None if prompt_length is None else max(0, position + 1 - prompt_length)
        suspect = f"position {position} on" if first is None else f"generated token {first} on"
        super().__init__(
            f"node {node_id} was proven to have computed layers [{layer_start}, {layer_end}) "
            f"wrong at position {position} of this session (a checker's catch-up replayed "
            "that step, and the coordinator's arbiter confirmed it; the node is banned now). "
            f"The text from {suspect} may be wrong: generate again, and the coordinator will "
            "route around that node"
        )
        self.node_id = node_id
        self.position = position
        self.first_suspect_token = first
