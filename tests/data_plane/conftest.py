"""Fixtures for data-plane tests: a tiny checkpoint, a coordinator key, stage nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from data_plane.stage_harness import CoordinatorKeys, StageNode, make_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "checkpoint")


@pytest.fixture
def keys() -> CoordinatorKeys:
    return CoordinatorKeys()


@pytest.fixture
async def start_node(
    checkpoint: Path, keys: CoordinatorKeys, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[StageNode]]]:
    """start_node([(0, 2)], **options) -> a running StageNode; all stopped at teardown."""
    nodes: list[StageNode] = []

    async def start(shards: list[tuple[int, int]], **options: Any) -> StageNode:
        node = await StageNode.start(
            checkpoint, keys.public, shards, data_dir=tmp_path / f"node{len(nodes)}", **options
        )
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        await node.stop()
