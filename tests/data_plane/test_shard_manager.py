"""ShardManager: status reports, failures with reasons, load-before-drop, drop after in-flight,
and a dropped shard's live sessions passing to the shard that holds their layers now."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from data_plane.stage_harness import MODEL, NUM_LAYERS, reference_greedy, session_grant
from data_plane.test_driver import NEW_TOKENS, PROMPT, greedy

from client.driver import PipelineDriver
from node_agent.shard_manager import DirectorySource, ShardManager, cache_key
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2

S = node_pb2


def assign_cmd(start: int, end: int, *, num_layers: int = NUM_LAYERS, budget: int = 512):
    return coordinator_pb2.AssignShard(
        model=MODEL,
        layers=common_pb2.LayerRange(start=start, end=end),
        dtype="float32",
        kv_tokens_budget=budget,
        num_layers=num_layers,
    )


def drop_cmd(start: int, end: int) -> coordinator_pb2.DropShard:
    return coordinator_pb2.DropShard(
        model=MODEL, layers=common_pb2.LayerRange(start=start, end=end)
    )


class GatedSource:
    """Hands out a directory only when the test opens the gate; reports byte progress."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def fetch(self, cmd, progress) -> Path:
        self.started.set()
        progress(0, 1000)
        progress(400, 1000)
        await self.gate.wait()
        progress(1000, 1000)
        return self.directory


async def test_assign_reports_each_state_until_ready(checkpoint) -> None:
    manager = ShardManager(DirectorySource(checkpoint))
    statuses: list[node_pb2.ShardStatus] = []
    await manager.assign(assign_cmd(1, 3), statuses.append)
    states = [s.state for s in statuses]
    assert states == [
        S.SHARD_STATE_ASSIGNED,
        S.SHARD_STATE_FETCHING,
        S.SHARD_STATE_FETCHING,
        S.SHARD_STATE_LOADING,
        S.SHARD_STATE_READY,
    ]
    assert all((s.model, s.layers.start, s.layers.end) == (MODEL, 1, 3) for s in statuses)
    assert statuses[-1].progress == 1.0
    shard = manager.find(MODEL, 1, 3)
    assert shard is not None and manager.find(MODEL, 2, 3) is shard
    assert manager.find(MODEL, 0, 3) is None and manager.find("other", 1, 3) is None
    assert shard.weight_bytes > 0 and manager.memory_bytes() == shard.weight_bytes
    telemetry = manager.sample()
    assert (telemetry.kv_tokens_budget, telemetry.kv_tokens_used) == (512, 0)
    # Assigning again what is already loaded answers READY at once.
    statuses.clear()
    await manager.assign(assign_cmd(1, 3), statuses.append)
    assert [s.state for s in statuses] == [S.SHARD_STATE_READY]
    manager.close()


async def test_progress_is_reported_while_fetching(checkpoint) -> None:
    source = GatedSource(checkpoint)
    manager = ShardManager(source)
    statuses: list[node_pb2.ShardStatus] = []
    task = asyncio.create_task(manager.assign(assign_cmd(0, 2), statuses.append))
    await asyncio.wait_for(source.started.wait(), 10)
    fetching = [s for s in statuses if s.state == S.SHARD_STATE_FETCHING]
    assert [(s.progress, s.bytes_fetched) for s in fetching][-1] == (0.4, 400)
    source.gate.set()
    await asyncio.wait_for(task, 30)
    assert statuses[-1].state == S.SHARD_STATE_READY
    assert statuses[-1].bytes_fetched == 1000
    manager.close()


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (assign_cmd(2, 2), "is empty"),
        (assign_cmd(2, 9), "exceeds the model's 4 layers"),
        (assign_cmd(0, 2, num_layers=6), "has 6 layers but its config.json says 4"),
    ],
)
async def test_impossible_assignments_fail_with_a_reason(checkpoint, command, message) -> None:
    manager = ShardManager(DirectorySource(checkpoint))
    statuses: list[node_pb2.ShardStatus] = []
    await manager.assign(command, statuses.append)
    assert statuses[-1].state == S.SHARD_STATE_FAILED
    assert message in statuses[-1].error
    assert manager.shards() == []
    manager.close()


async def test_a_broken_checkpoint_fails_and_the_manager_keeps_working(
    checkpoint, tmp_path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    manager = ShardManager(DirectorySource(broken))
    statuses: list[node_pb2.ShardStatus] = []
    await manager.assign(assign_cmd(0, 2), statuses.append)
    assert statuses[-1].state == S.SHARD_STATE_FAILED
    assert "not supported" in statuses[-1].error
    manager._source = DirectorySource(checkpoint)  # the operator fixes the files
    await manager.assign(assign_cmd(0, 2), statuses.append)
    assert statuses[-1].state == S.SHARD_STATE_READY
    manager.close()


async def test_new_shards_load_next_to_old_ones_and_drop_is_explicit(checkpoint) -> None:
    manager = ShardManager(DirectorySource(checkpoint))
    await manager.assign(assign_cmd(0, 2), lambda s: None)
    await manager.assign(assign_cmd(0, 3), lambda s: None)
    assert sorted((s.key.start, s.key.end) for s in manager.shards()) == [(0, 2), (0, 3)]
    # The narrowest shard that holds the layers serves them.
    assert manager.find(MODEL, 0, 2).key.end == 2
    await manager.drop(drop_cmd(0, 2))
    assert manager.find(MODEL, 0, 2).key.end == 3
    await manager.drop(drop_cmd(0, 2))  # dropping twice is harmless
    manager.close()


async def test_drop_waits_for_in_flight_calls(checkpoint) -> None:
    manager = ShardManager(DirectorySource(checkpoint))
    await manager.assign(assign_cmd(0, NUM_LAYERS), lambda s: None)
    shard = manager.find(MODEL, 0, NUM_LAYERS)
    cache = shard.open_cache("s@0-4", 0, NUM_LAYERS, 16, 1)
    assert cache.max_len == 16
    # 16 tokens x 4 layers x K and V x 2 KV heads x head_dim 8 x 4 bytes.
    assert manager.memory_bytes() == shard.weight_bytes + 16 * 4 * 2 * 2 * 8 * 4
    shard.enter()  # a forward call is running
    drop = asyncio.create_task(manager.drop(drop_cmd(0, NUM_LAYERS)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert manager.find(MODEL, 0, NUM_LAYERS) is None  # hidden from new calls at once
    assert not drop.done()  # but not freed under the running call
    assert shard.kv_tokens_used() == 16
    shard.leave()
    await asyncio.wait_for(drop, 10)
    assert shard.kv_tokens_used() == 0
    manager.close()


async def test_drop_while_loading_discards_the_shard(checkpoint) -> None:
    source = GatedSource(checkpoint)
    manager = ShardManager(source)
    statuses: list[node_pb2.ShardStatus] = []
    task = asyncio.create_task(manager.assign(assign_cmd(0, 2), statuses.append))
    await asyncio.wait_for(source.started.wait(), 10)
    await manager.drop(drop_cmd(0, 2))
    source.gate.set()
    await asyncio.wait_for(task, 30)
    assert manager.find(MODEL, 0, 2) is None
    # Nothing after the drop: the agent reports DROPPED, and READY/FAILED would contradict it.
    assert [s.state for s in statuses][-1] == S.SHARD_STATE_FETCHING
    manager.close()


@pytest.mark.parametrize(
    "budget, replays",
    [(4096, []), (32, ["replay"])],
    ids=["cache-handed-over", "no-room-so-replayed"],
)
async def test_a_replan_that_widens_a_nodes_range_mid_generation(
    start_node, keys, checkpoint, budget, replays
) -> None:
    a = await start_node([(0, 2)])
    b = await start_node([(2, NUM_LAYERS)])
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, NUM_LAYERS, b, [])]), MODEL)

    async def replan() -> None:
        # What the agent does when a re-plan moves it to [0, 3): load it beside [0, 2),
        # then drop [0, 2) while the session is mid-generation. The session reserved 128
        # tokens on [0, 2): a budget of 32 has no room for its cache.
        await a.assign(0, 3, kv_tokens_budget=budget)
        await a.manager.drop(drop_cmd(0, 2))
        heir = a.manager.find(MODEL, 0, 2)
        assert (heir.key.start, heir.key.end) == (0, 3)
        assert (heir.kv_tokens_used() > 0) == (not replays)  # the cache came along

    tokens = await greedy(driver, PROMPT, NEW_TOKENS, after_step={3: replan})
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    # Handed over, the next call finds the session's cache on the new shard: no replay.
    assert [(e.failed_node_id, e.via) for e in driver.failovers] == [
        (a.node_id, via) for via in replays
    ]
    await driver.close()


async def test_a_handed_over_cache_forgets_the_graphs_of_the_dropped_shard(checkpoint) -> None:
    manager = ShardManager(DirectorySource(checkpoint))
    await manager.assign(assign_cmd(0, 2), lambda s: None)
    await manager.assign(assign_cmd(0, 3), lambda s: None)
    old = manager.find(MODEL, 0, 2)
    heir = next(s for s in manager.shards() if s.key.end == 3)
    key = cache_key("s", 0, 2)
    cache = old.open_cache(key, 0, 2, 16, 1)
    # Graph entries as runtime/cuda_graphs.py keys them: (id of the stage view, last only).
    cache.decode_graphs[(id(old.stage_for(0, 2)), True)] = "holds the old shard's weights"
    new_graph = (id(heir.stage_for(0, 2)), True)
    cache.decode_graphs[new_graph] = "captured over the new shard"
    await manager.drop(drop_cmd(0, 2))
    assert manager.find(MODEL, 0, 2) is heir
    assert heir.cache(key, 0, 2) is cache
    assert list(cache.decode_graphs) == [new_graph]
    assert old.kv_tokens_used() == 0
    manager.close()
