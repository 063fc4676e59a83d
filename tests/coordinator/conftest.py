"""Fixtures for coordinator tests; the helpers live in support/coordinator_harness.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.coordinator_harness import CHANNEL_OPTIONS, Harness, checks_commits, harness_settings
from support.mosquitto import mosquitto, mosquitto_broker  # noqa: F401 - fixtures

from coordinator.server import running_coordinator


@pytest.fixture
async def start_harness(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """Start an in-process coordinator with Settings overrides: `await start_harness(...)`."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> Harness:
            settings = harness_settings(tmp_path, **overrides)
            coordinator = await stack.enter_async_context(running_coordinator(settings))
            checks_commits(stack, coordinator)
            channel = grpc.aio.insecure_channel(coordinator.address, options=CHANNEL_OPTIONS)
            stack.push_async_callback(channel.close)
            return Harness(coordinator, channel)

        yield start


@pytest.fixture
async def harness(start_harness: Callable[..., Awaitable[Harness]]) -> Harness:
    return await start_harness()
