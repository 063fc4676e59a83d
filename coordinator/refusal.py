"""A request the coordinator refuses, with the gRPC status its caller gets."""

from __future__ import annotations

import grpc


class Refusal(Exception):
    """`code` is the gRPC status; `trailing_metadata` goes with it (the coordinator's
    clock, on a stale stamp: protos/coordinator_clock.py)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata
