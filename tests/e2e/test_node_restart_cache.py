"""A restarted node reuses its on-disk shard cache: nothing is downloaded again."""

from __future__ import annotations

import time

import pytest
from support.checkpoints import make_checkpoint

from client.api import Client
from client.local_swarm import LocalSwarm
from protos.tessera.v1 import node_pb2

pytestmark = pytest.mark.slow


def ready_shard(client: Client, node_id: str) -> node_pb2.ShardStatus | None:
    for node in client.nodes():
        if node.node_id == node_id:
            for shard in node.shards:
                if shard.state == node_pb2.SHARD_STATE_READY:
                    return shard
    return None


def wait_ready(client: Client, node_id: str, timeout_s: float = 90.0) -> node_pb2.ShardStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shard = ready_shard(client, node_id)
        if shard is not None:
            return shard
        time.sleep(0.2)
    raise AssertionError(f"node {node_id} never reported a READY shard")


def test_restarted_node_loads_its_shard_from_the_cache(tmp_path):
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        "qwen2",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=80,
        seed=1,
    )
    with LocalSwarm(tmp_path / "swarm", coordinator_args=["--heartbeat-interval", "1"]) as swarm:
        swarm.start_coordinator()
        node = swarm.start_node("solo")
        swarm.wait_registered([node])
        swarm.add_model(checkpoint, "tiny-qwen")
        with Client(swarm.address) as client:
            first = wait_ready(client, node.node_id)
            assert first.bytes_downloaded > 0, "the first load must come over the network"
            assert first.bytes_downloaded == first.bytes_fetched
            before = client.generate_all(
                "tiny-qwen", token_ids=[3, 4, 5], max_new_tokens=5, stop_at_eos=False
            ).token_ids

            node.kill9()
            again = swarm.start_node("solo")
            swarm.wait_registered([again])
            assert again.node_id == node.node_id, "the same key keeps the same id"
            second = wait_ready(client, again.node_id)
            assert second.bytes_fetched == first.bytes_fetched
            assert second.bytes_downloaded == 0, "a restart must not download the shard again"
            after = client.generate_all(
                "tiny-qwen", token_ids=[3, 4, 5], max_new_tokens=5, stop_at_eos=False
            ).token_ids
            assert after == before
