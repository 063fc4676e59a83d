"""The one error type of the node's data-plane services (Stage and TrainingStage)."""

from __future__ import annotations

import grpc


class StageError(Exception):
    """Ends the current call or stream with ``code`` and a message meant for a person."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
