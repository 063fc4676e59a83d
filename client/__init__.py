"""Tessera's thin client: list nodes and models, generate text through the swarm.

No torch here: grpcio, protobuf, numpy, cryptography and tokenizers only.
"""

from client.api import AsyncClient, Client, GeneratedToken, GenerationResult
from client.driver import DriverConfig, PipelineDriver
from client.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    ModelNotFound,
    PipelineError,
    RequestRejected,
    TesseraError,
)

__all__ = [
    "AsyncClient",
    "Client",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "DriverConfig",
    "GeneratedToken",
    "GenerationResult",
    "ModelNotFound",
    "PipelineDriver",
    "PipelineError",
    "RequestRejected",
    "TesseraError",
]
