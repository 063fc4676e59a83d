"""Fixtures for training tests: a tiny checkpoint, a coordinator key, the stand-in store,
and real training stage nodes on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from data_plane.stage_harness import CoordinatorKeys
from training.training_harness import (
    StandInTrainingStore,
    TrainingNode,
    make_train_checkpoint,
    node_starter,
    running_store,
)


@pytest.fixture(scope="module", autouse=True)
def few_threads() -> Iterator[None]:
    # Tiny matrices gain nothing from threads, and the box is shared.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_train_checkpoint(tmp_path_factory.mktemp("train") / "checkpoint")


@pytest.fixture
def keys() -> CoordinatorKeys:
    return CoordinatorKeys()


@pytest.fixture
async def store() -> AsyncIterator[StandInTrainingStore]:
    async with running_store() as store:
        yield store


@pytest.fixture
async def start_node(
    checkpoint: Path, keys: CoordinatorKeys, store: StandInTrainingStore, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[TrainingNode]]]:
    """start_node([(0, 2)], **options) -> a running TrainingNode; all stopped at teardown."""
    async with node_starter(checkpoint, keys, store, tmp_path) as start:
        yield start
