"""Nodes fetch tensors: GetManifest/FetchTensors over real gRPC, and the node's ShardFetcher."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors import safe_open
from support.checkpoints import make_checkpoint, random_weights, write_safetensors

from coordinator.model_store import open_checkpoint
from node_agent.shard_fetcher import FetchError, ShardFetcher, stage_tensor_names
from protos.tessera.v1 import common_pb2, coordinator_pb2


@pytest.fixture
async def served_model(store_server, tiny_checkpoint, upload_chunks):
    await store_server.add_model(upload_chunks(tiny_checkpoint, "tiny"))
    return store_server


async def _node(server) -> tuple[tuple[str, str], ...]:
    node = await server.register_node()
    return (("x-tessera-node-id", node.node_id), ("x-tessera-ticket", node.ticket.hex()))


async def _code(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return info.value


async def test_manifest_lists_every_tensor(served_model, tiny_checkpoint):
    manifest = await served_model.coordinator_api.GetManifest(
        common_pb2.ModelRef(name="tiny"), metadata=await _node(served_model)
    )
    checkpoint = open_checkpoint(tiny_checkpoint)
    assert manifest.num_layers == 3
    assert manifest.config_json == checkpoint.config_json
    assert [(t.name, t.sha256, t.dtype, tuple(t.shape), t.nbytes) for t in manifest.tensors] == [
        (t.name, t.sha256(), t.dtype, t.shape, t.nbytes) for t in checkpoint.tensors
    ]


async def test_node_calls_need_a_valid_ticket(served_model):
    ref = common_pb2.ModelRef(name="tiny")
    stub = served_model.coordinator_api
    error = await _code(lambda: stub.GetManifest(ref))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "x-tessera-ticket" in error.details()
    node = await served_model.register_node()
    forged = (("x-tessera-node-id", node.node_id), ("x-tessera-ticket", "00" * 32))
    error = await _code(lambda: stub.GetManifest(ref, metadata=forged))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "register again" in error.details()
    stranger = (("x-tessera-node-id", "n-unknown"), ("x-tessera-ticket", node.ticket.hex()))
    error = await _code(lambda: stub.GetManifest(ref, metadata=stranger))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    garbage = (("x-tessera-node-id", node.node_id), ("x-tessera-ticket", "not hex"))
    error = await _code(lambda: stub.GetManifest(ref, metadata=garbage))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    request = coordinator_pb2.FetchRequest(model="tiny", sha256=["0" * 64])
    error = await _code(lambda: stub.FetchTensors(request, metadata=forged))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_bad_fetch_requests_get_clear_errors(served_model):
    stub = served_model.coordinator_api
    meta = await _node(served_model)
    manifest = await stub.GetManifest(common_pb2.ModelRef(name="tiny"), metadata=meta)
    own = manifest.tensors[0].sha256
    cases = [
        (
            coordinator_pb2.FetchRequest(model="nope", sha256=[own]),
            grpc.StatusCode.NOT_FOUND,
            "'nope'",
        ),
        (coordinator_pb2.FetchRequest(model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "no sha256"),
        (
            coordinator_pb2.FetchRequest(model="tiny", sha256=["ab" * 32]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no tensor with sha256 " + "ab" * 32,
        ),
        (
            coordinator_pb2.FetchRequest(model="tiny", sha256=["../../etc/passwd"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not sha256",
        ),
        (
            coordinator_pb2.FetchRequest(model="tiny", sha256=[f"{i:064x}" for i in range(5000)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "at most 4096",
        ),
    ]
    for request, status, words in cases:
        error = await _code(lambda r=request: stub.FetchTensors(r, metadata=meta))
        assert error.code() == status, request
        assert words in error.details()
    error = await _code(lambda: stub.GetManifest(common_pb2.ModelRef(name="x"), metadata=meta))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    # ...and the store still serves.
    chunks = [
        c
        async for c in stub.FetchTensors(
            coordinator_pb2.FetchRequest(model="tiny", sha256=[own]), metadata=meta
        )
    ]
    assert b"".join(c.data for c in chunks).__len__() == manifest.tensors[0].nbytes


async def test_a_corrupt_blob_on_the_coordinator_is_reported(served_model):
    stub = served_model.coordinator_api
    meta = await _node(served_model)
    manifest = await stub.GetManifest(common_pb2.ModelRef(name="tiny"), metadata=meta)
    entry = manifest.tensors[1]
    blob = served_model.store.blobs.path(entry.sha256)
    blob.write_bytes(b"\0" * entry.nbytes)
    request = coordinator_pb2.FetchRequest(model="tiny", sha256=[entry.sha256])
    error = await _code(lambda: stub.FetchTensors(request, metadata=meta))
    assert error.code() == grpc.StatusCode.DATA_LOSS and entry.sha256 in error.details()
    blob.unlink()
    error = await _code(lambda: stub.FetchTensors(request, metadata=meta))
    assert error.code() == grpc.StatusCode.DATA_LOSS and "missing" in error.details()


async def _fetcher(server, data_dir: Path) -> ShardFetcher:
    """A fetcher for a node registered with `server`; the same node again after a restart.

    The node is kept on the server object itself: every test gets a new coordinator, which
    may well listen on a port an earlier test's coordinator used, so a cache keyed by the
    address handed a later test a node its coordinator had never heard of."""
    node = getattr(server, "fetch_node", None) or await server.register_node()
    server.fetch_node = node
    return ShardFetcher.for_data_dir(server.address, node.node_id, node.ticket, data_dir)


async def test_fetcher_gets_only_what_it_asks_for_and_caches_it(served_model, tmp_path):
    fetcher = await _fetcher(served_model, tmp_path / "node")
    manifest = await fetcher.fetch_manifest("tiny")
    names = stage_tensor_names(manifest, 1, 2)
    assert names == [n for n in manifest.tensors if n.startswith("model.layers.1.")]
    seen: list[tuple[int, int]] = []
    paths = await fetcher.ensure_tensors(
        "tiny", names, progress=True, on_progress=lambda d, t: seen.append((d, t))
    )
    wanted = sum(manifest.tensors[n].nbytes for n in names)
    assert fetcher.bytes_fetched == wanted
    assert seen[0] == (0, wanted) and seen[-1] == (wanted, wanted)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False))
    for name, path in paths.items():
        assert path.name == manifest.tensors[name].sha256
        assert path.stat().st_size == manifest.tensors[name].nbytes
    assert len(list((tmp_path / "node" / "cache" / "blobs").iterdir())) == len(names) + 1
    await fetcher.close()

    restarted = await _fetcher(served_model, tmp_path / "node")
    assert await restarted.ensure_tensors("tiny", names) == paths
    assert restarted.bytes_fetched == 0
    await restarted.close()


async def test_fetcher_refetches_a_corrupt_cached_blob(served_model, tmp_path):
    fetcher = await _fetcher(served_model, tmp_path / "node")
    manifest = await fetcher.fetch_manifest("tiny")
    names = stage_tensor_names(manifest, 0, 1)
    paths = await fetcher.ensure_tensors("tiny", names)
    await fetcher.close()
    victim = paths["model.layers.0.mlp.up_proj.weight"]
    good = victim.read_bytes()
    victim.write_bytes(b"\x01" + good[1:])
    truncated = paths["model.embed_tokens.weight"]
    truncated.write_bytes(truncated.read_bytes()[:10])

    restarted = await _fetcher(served_model, tmp_path / "node")
    await restarted.ensure_tensors("tiny", names)
    assert victim.read_bytes() == good
    embedding = manifest.tensors["model.embed_tokens.weight"].nbytes
    assert restarted.bytes_fetched == len(good) + embedding
    await restarted.close()


async def test_materialized_shard_loads_with_the_original_values(served_model, tmp_path):
    original = open_checkpoint(served_model_checkpoint := _checkpoint_dir(served_model))
    fetcher = await _fetcher(served_model, tmp_path / "node")
    last = await fetcher.materialize("tiny", 2, 3)
    assert last == tmp_path / "node" / "shards" / "tiny" / "2-3"
    assert (last / "config.json").read_text() == original.config_json
    with safe_open(str(last / "model.safetensors"), framework="np") as shard:
        names = set(shard.keys())
        assert names == {"model.norm.weight", "lm_head.weight"} | {
            t.name for t in original.tensors if t.layer == 2
        }
        reference = _load(served_model_checkpoint)
        for name in names:
            np.testing.assert_array_equal(shard.get_tensor(name), reference[name])
    first = await fetcher.materialize("tiny", 0, 1)
    with safe_open(str(first / "model.safetensors"), framework="np") as shard:
        assert "model.embed_tokens.weight" in shard.keys()
        assert "lm_head.weight" not in shard.keys()
    await fetcher.close()


async def test_materialize_reuses_an_intact_shard_and_rebuilds_a_damaged_one(
    served_model, tmp_path
):
    fetcher = await _fetcher(served_model, tmp_path / "node")
    shard = await fetcher.materialize("tiny", 0, 3)
    stamp = (shard / "model.safetensors").stat().st_mtime_ns
    fetched = fetcher.bytes_fetched
    await fetcher.close()

    restarted = await _fetcher(served_model, tmp_path / "node")
    progress: list[tuple[int, int]] = []
    again = await restarted.materialize(
        "tiny", 0, 3, on_progress=lambda d, t: progress.append((d, t))
    )
    assert again == shard and restarted.bytes_fetched == 0
    assert (shard / "model.safetensors").stat().st_mtime_ns == stamp
    assert progress == [(fetched, fetched)]

    data = bytearray((shard / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (shard / "model.safetensors").write_bytes(bytes(data))
    repaired = await restarted.materialize("tiny", 0, 3)
    assert restarted.bytes_fetched == 0  # rebuilt from the cache, nothing downloaded
    with safe_open(str(repaired / "model.safetensors"), framework="np") as loaded:
        reference = _load(_checkpoint_dir(served_model))
        for name in loaded.keys():
            np.testing.assert_array_equal(loaded.get_tensor(name), reference[name])
    assert not [p for p in shard.parent.iterdir() if p.name.startswith(".")]
    await restarted.close()


async def test_tied_embeddings_and_shared_blobs(server_factory, tmp_path, upload_chunks):
    server = await server_factory()
    path = make_checkpoint(tmp_path / "tied", "qwen2", num_layers=2, tie_word_embeddings=True)
    # Norms of exactly one, as freshly initialised models have: several tensors, one blob.
    config = json.loads((path / "config.json").read_text())
    weights = random_weights(config)
    for name, (dtype, array) in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = (dtype, np.ones_like(array))
    write_safetensors(path / "model.safetensors", weights)
    await server.add_model(upload_chunks(path, "tied"))
    assert len(server.blob_files()) == len(weights) - 4  # five norms share one blob

    fetcher = await _fetcher(server, tmp_path / "node")
    last = await fetcher.materialize("tied", 1, 2)
    with safe_open(str(last / "model.safetensors"), framework="np") as shard:
        assert "model.embed_tokens.weight" in shard.keys()  # the head is the embedding
        np.testing.assert_array_equal(
            shard.get_tensor("model.norm.weight"), np.ones(config["hidden_size"], np.float32)
        )
    await fetcher.close()


async def test_fetcher_errors_are_readable(served_model, tmp_path):
    fetcher = ShardFetcher.for_data_dir(served_model.address, "n-x", b"\1" * 32, tmp_path / "n")
    with pytest.raises(FetchError, match="register again"):
        await fetcher.fetch_manifest("tiny")
    await fetcher.close()
    fetcher = await _fetcher(served_model, tmp_path / "node")
    with pytest.raises(FetchError, match="no model named 'nope'"):
        await fetcher.materialize("nope", 0, 1)
    with pytest.raises(FetchError, match="outside model tiny"):
        await fetcher.materialize("tiny", 2, 9)
    with pytest.raises(FetchError, match="no tensor"):
        await fetcher.ensure_tensors("tiny", ["model.layers.7.mlp.up_proj.weight"])
    await fetcher.close()


async def test_fetcher_survives_a_stream_that_breaks(served_model, tmp_path):
    """The first FetchTensors call dies after one chunk; the retry fetches only the rest."""
    store = served_model.store
    real = store.fetch_tensors
    calls = 0

    async def flaky(request, context):
        nonlocal calls
        calls += 1
        sent = 0
        async for chunk in real(request, context):
            if calls == 1 and sent == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost")
            sent += 1
            yield chunk

    store.fetch_tensors = flaky
    fetcher = await _fetcher(served_model, tmp_path / "node")
    pauses: list[int] = []
    real_delay = fetcher.retry_pause.next_delay

    def counted_delay() -> float:
        delay = real_delay()
        pauses.append(fetcher.retry_pause.attempt)
        return delay

    fetcher.retry_pause.next_delay = counted_delay  # type: ignore[method-assign]
    manifest = await fetcher.fetch_manifest("tiny")
    names = stage_tensor_names(manifest, 0, 3)
    paths = await fetcher.ensure_tensors("tiny", names)
    assert calls == 2
    assert pauses == [1]  # one pause before the retry, then reset by the success
    for name in names:
        assert paths[name].stat().st_size == manifest.tensors[name].nbytes
    assert not list((tmp_path / "node" / "cache" / "blobs" / ".incoming").iterdir())
    assert fetcher.retry_pause.attempt == 0
    await fetcher.close()


def _checkpoint_dir(server) -> Path:
    return server.data_dir.parent / "tiny-llama"


def _load(directory: Path) -> dict[str, np.ndarray]:
    with safe_open(str(directory / "model.safetensors"), framework="np") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


async def test_blob_names_are_digests_only(tmp_path: Path) -> None:
    fetcher = ShardFetcher("127.0.0.1:1", "n", b"t", tmp_path / "cache")
    with pytest.raises(FetchError):
        fetcher.blob_path("../../etc/passwd")
    await fetcher.close()


async def test_the_node_runtime_loads_materialized_shards(server_factory, tmp_path, upload_chunks):
    import torch

    from node_agent.runtime import (
        load_model_config,
        load_stage_model,
        load_stage_tensors,
        tensor_names_for_stage,
    )

    server = await server_factory()
    source = make_checkpoint(
        tmp_path / "q", "qwen2", num_layers=4, tie_word_embeddings=True, dtype="BF16"
    )
    await server.add_model(upload_chunks(source, "q"))
    fetcher = await _fetcher(server, tmp_path / "node")
    manifest = await fetcher.fetch_manifest("q")
    config = load_model_config(source)
    for start, end in [(0, 1), (1, 3), (3, 4), (0, 4)]:
        first, last = start == 0, end == 4
        names = tensor_names_for_stage(config, start, end, first, last)
        assert set(stage_tensor_names(manifest, start, end)) == set(names)
        shard = await fetcher.materialize("q", start, end)
        got = load_stage_tensors(shard, names)
        want = load_stage_tensors(source, names)
        assert all(torch.equal(got[n], want[n]) for n in names)
        assert load_stage_model(shard, start, end).end == end
    await fetcher.close()
