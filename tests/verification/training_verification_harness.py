"""Fixtures for the training verification tests: real training stage servers on loopback
(tests/training/training_harness.py), the stand-in checkpoint store, and job capabilities
that carry each node's key, as the coordinator's job sessions do."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from data_plane.stage_harness import CoordinatorKeys
from training.training_harness import (
    MODEL,
    StandInTrainingStore,
    TrainingNode,
    make_train_checkpoint,
    node_starter,
    running_store,
)

from protos import identity
from protos.tessera.v1 import client_api_pb2

JOB = "job-signed"


@pytest.fixture(scope="module")
def train_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_train_checkpoint(tmp_path_factory.mktemp("train") / "checkpoint")


@pytest.fixture
async def store() -> AsyncIterator[StandInTrainingStore]:
    async with running_store() as store:
        yield store


@pytest.fixture
async def start_train_node(
    train_checkpoint: Path, keys: CoordinatorKeys, store: StandInTrainingStore, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[TrainingNode]]]:
    async with node_starter(train_checkpoint, keys, store, tmp_path) as start:
        yield start


def keyed_capability(
    keys: CoordinatorKeys,
    grants: list[tuple[TrainingNode, int, int]],
    *,
    keyless: str = "",
    trust: dict[str, float] | None = None,
) -> client_api_pb2.SignedCapability:
    """A job capability whose grants carry each node's key, as the coordinator's does
    (``keyless``: a node id whose key is left out; ``trust``: node id -> the
    check_probability the coordinator would grant)."""
    signed = keys.capability(JOB, [(n.node_id, s, e) for n, s, e in grants], model=MODEL)
    claims = client_api_pb2.CapabilityClaims()
    claims.ParseFromString(signed.claims)
    for grant, (node, _, _) in zip(claims.grants, grants, strict=True):
        if node.node_id != keyless:
            grant.public_key = identity.public_key_bytes(node.ctx.private_key)
        grant.check_probability = (trust or {}).get(node.node_id, 0.0)
    return identity.sign_capability(keys.key, claims)
