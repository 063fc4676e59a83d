"""Errors of the model store. Every message names the file or tensor and says what to fix."""

from __future__ import annotations

import grpc

from coordinator.refusal import Refusal


class CheckpointError(ValueError):
    """A checkpoint (a directory, a file or an upload header) is unusable."""


class StoreError(Refusal):
    """A request the store refuses; carries the gRPC status the caller gets."""


def invalid(message: str) -> StoreError:
    return StoreError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> StoreError:
    return StoreError(grpc.StatusCode.NOT_FOUND, message)
