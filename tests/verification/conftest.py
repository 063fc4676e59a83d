"""Verification tests reuse the data-plane fixtures (tiny checkpoint, coordinator key,
in-process stage nodes) and run an in-process coordinator like the coordinator tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from data_plane.conftest import checkpoint, keys, start_node
from support.coordinator_harness import CHANNEL_OPTIONS, Harness, checks_commits, harness_settings
from verification.training_verification_harness import start_train_node, store, train_checkpoint

from coordinator.server import running_coordinator

__all__ = [
    "checkpoint",
    "keys",
    "start_harness",
    "start_node",
    "start_train_node",
    "store",
    "train_checkpoint",
]


@pytest.fixture
async def start_harness(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """``await start_harness(**settings_overrides)`` -> a running in-process coordinator."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> Harness:
            settings = harness_settings(tmp_path / "coordinator", **overrides)
            coordinator = await stack.enter_async_context(running_coordinator(settings))
            checks_commits(stack, coordinator)
            channel = grpc.aio.insecure_channel(coordinator.address, options=CHANNEL_OPTIONS)
            stack.push_async_callback(channel.close)
            return Harness(coordinator, channel)

        yield start
