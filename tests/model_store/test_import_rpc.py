"""AddModel / RemoveModel / ListModels / GetModel over real gRPC, good and hostile uploads."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from support.checkpoints import make_checkpoint

from coordinator.model_store import StoreLimits
from protos.tessera.v1 import admin_pb2, common_pb2

HUGE_NAME = "model.extra\x00\r\n\x1b[2J" + "x" * 100_000


EMPTY = common_pb2.Empty()


async def _add(server, messages):
    return await server.add_model(messages)


async def _refused(server, messages) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        await _add(server, messages)
    # Nothing of a refused import may be listed or left on disk, and the store still serves.
    listed = await server.client_api.ListModels(EMPTY)
    assert [m.name for m in listed.models if m.name == "bad"] == []
    assert list((server.data_dir / "blobs" / "incoming").iterdir()) == []
    return info.value


async def test_add_list_get_and_re_add(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "tiny")
    info = await _add(store_server, messages)
    assert (info.name, info.architecture, info.num_layers) == ("tiny", "LlamaForCausalLM", 3)
    assert info.has_tokenizer and info.total_bytes > 0 and len(info.sha256) == 64
    assert not info.available and info.unavailable_reason == "no node has loaded it yet"
    assert list(info.ready_replicas) == [0, 0, 0]
    assert abs(info.added_unix_ms - time.time() * 1000) < 60_000

    listed = await store_server.client_api.ListModels(EMPTY)
    assert [m.name for m in listed.models] == ["tiny"]
    per_layer, outside = store_server.store.layer_bytes("tiny")  # what the planner sizes by
    assert len(set(per_layer)) == 1 and sum(per_layer) + outside == info.total_bytes
    detail = await store_server.client_api.GetModel(common_pb2.ModelRef(name="tiny"))
    assert detail.config_json == (tiny_checkpoint / "config.json").read_text()
    assert detail.tokenizer_json == (tiny_checkpoint / "tokenizer.json").read_bytes()

    with pytest.raises(grpc.RpcError) as info_again:
        await _add(store_server, messages)
    assert info_again.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "--replace" in info_again.value.details()


async def test_admin_calls_need_the_admin_token(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "bad")
    for metadata in [None, (("authorization", "Bearer wrong"),)]:
        with pytest.raises(grpc.RpcError) as info:
            await store_server.add_model(messages, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    listed = await store_server.client_api.ListModels(EMPTY)
    assert list(listed.models) == [] and store_server.blob_files() == []


async def test_replace_swaps_weights_and_frees_old_blobs(store_server, tmp_path, upload_chunks):
    first = make_checkpoint(tmp_path / "v1", "llama", seed=1)
    second = make_checkpoint(tmp_path / "v2", "llama", seed=2)
    old = await _add(store_server, upload_chunks(first, "m"))
    old_blobs = set(store_server.blob_files())
    new = await _add(store_server, upload_chunks(second, "m", replace=True))
    assert new.sha256 != old.sha256
    assert not old_blobs & set(store_server.blob_files())
    listed = await store_server.client_api.ListModels(EMPTY)
    assert [(m.name, m.sha256) for m in listed.models] == [("m", new.sha256)]


async def test_identical_weights_are_stored_once(store_server, tiny_checkpoint, upload_chunks):
    await _add(store_server, upload_chunks(tiny_checkpoint, "a"))
    blobs = store_server.blob_files()
    disk = sum(p.stat().st_size for p in blobs)
    await _add(store_server, upload_chunks(tiny_checkpoint, "b"))
    assert store_server.blob_files() == blobs
    assert sum(p.stat().st_size for p in blobs) == disk

    await store_server.admin.RemoveModel(common_pb2.ModelRef(name="a"), metadata=store_server.auth)
    assert store_server.blob_files() == blobs  # still used by "b"
    await store_server.admin.RemoveModel(common_pb2.ModelRef(name="b"), metadata=store_server.auth)
    assert store_server.blob_files() == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await store_server.admin.RemoveModel(
            common_pb2.ModelRef(name="b"), metadata=store_server.auth
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_hash_mismatch_is_refused_and_names_the_tensor(
    store_server, tiny_checkpoint, upload_chunks
):
    messages = upload_chunks(tiny_checkpoint, "bad")
    victim = messages[5].data
    victim.data = bytes([victim.data[0] ^ 1]) + victim.data[1:]
    error = await _refused(store_server, messages)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert victim.name in error.details() and "sha256" in error.details()
    assert store_server.blob_files() == []


async def test_stream_ending_early_commits_nothing(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "bad")
    last = messages[-1].data.name
    error = await _refused(store_server, messages[:-1])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert last in error.details() and "nothing was imported" in error.details()
    assert store_server.blob_files() == []


async def test_tensor_sent_twice_is_refused(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "bad", chunk_bytes=1 << 20)
    error = await _refused(store_server, [*messages[:3], messages[2], *messages[3:]])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {messages[2].data.name} was sent twice" in error.details()


async def test_interleaved_and_out_of_order_chunks_are_refused(
    store_server, tiny_checkpoint, upload_chunks
):
    messages = upload_chunks(tiny_checkpoint, "bad", chunk_bytes=500)
    assert messages[1].data.name == messages[2].data.name  # the embedding spans chunks
    skipped = [messages[0], messages[2], *messages[3:]]
    error = await _refused(store_server, skipped)
    assert "expected 0" in error.details()
    other = next(m for m in messages[1:] if m.data.name != messages[1].data.name)
    interleaved = [messages[0], messages[1], other, *messages[2:]]
    error = await _refused(store_server, interleaved)
    assert "incomplete" in error.details()


@pytest.mark.parametrize(
    ("tamper", "status", "words"),
    [
        (
            lambda h: h.tensors[3].__setattr__("nbytes", h.tensors[3].nbytes * 1000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "declares",
        ),
        (
            lambda h: h.tensors.append(h.tensors[1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "appears twice",
        ),
        (lambda h: h.tensors.pop(4), grpc.StatusCode.INVALID_ARGUMENT, "lacks 1 tensor"),
        (
            lambda h: h.tensors.add(
                name="model.extra", dtype="F32", shape=[1], nbytes=4, sha256="0" * 64
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "model.extra",
        ),
        (
            lambda h: h.tensors.add(
                name=HUGE_NAME, dtype="F32", shape=[1], nbytes=4, sha256="0" * 64
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "does not use",
        ),
        (
            lambda h: [
                h.tensors.add(name=HUGE_NAME, dtype="F32", shape=[1], nbytes=4, sha256="0" * 64)
                for _ in range(2)
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "appears twice",
        ),
        (
            lambda h: h.tensors[0].__setattr__("dtype", "I64"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "I64",
        ),
        (
            lambda h: h.tensors[0].shape.__setitem__(slice(None), [7, 7]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "[7, 7]",
        ),
        (
            lambda h: h.tensors[0].__setattr__("sha256", "XYZ"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "hex",
        ),
        (
            lambda h: h.__setattr__("name", "../etc"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not allowed",
        ),
        (
            lambda h: h.__setattr__("config_json", "{"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not valid JSON",
        ),
        (
            lambda h: h.__setattr__("config_json", json.dumps({"architectures": ["BertModel"]})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "BertModel",
        ),
        (
            lambda h: h.__setattr__("tokenizer_json", b"\xff\xfe"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tokenizer_json",
        ),
    ],
)
async def test_bad_headers_are_refused_before_any_data(
    store_server, tiny_checkpoint, upload_chunks, tamper, status, words
):
    messages = upload_chunks(tiny_checkpoint, "bad")
    tamper(messages[0].header)
    error = await _refused(store_server, messages)
    assert error.code() == status
    assert words in error.details()
    assert len(error.details()) < 500  # a caller's huge names are cut, never echoed whole


async def test_header_must_come_first_and_only_once(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "bad")
    error = await _refused(store_server, messages[1:])
    assert "first AddModel message must be the header" in error.details()
    error = await _refused(store_server, [messages[0], messages[0]])
    assert "only the first" in error.details()
    error = await _refused(store_server, [])
    assert "empty AddModel stream" in error.details()
    unknown = admin_pb2.AddModelChunk(data=admin_pb2.TensorData(name="nope", data=b"1"))
    error = await _refused(store_server, [messages[0], unknown])
    assert "'nope'" in error.details()


async def test_model_above_the_size_limit_is_refused(
    server_factory, tiny_checkpoint, upload_chunks
):
    server = await server_factory(limits=StoreLimits(max_model_bytes=1000))
    error = await _refused(server, upload_chunks(tiny_checkpoint, "bad"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 1000 bytes" in error.details()


async def test_cancelled_upload_leaves_nothing(store_server, tiny_checkpoint, upload_chunks):
    messages = upload_chunks(tiny_checkpoint, "bad", chunk_bytes=200)
    half_sent = asyncio.Event()

    async def stalling():
        for i, message in enumerate(messages):
            if i == len(messages) // 2:
                half_sent.set()
                await asyncio.Event().wait()  # the uploader hangs; then it is cancelled
            yield message

    call = store_server.admin.AddModel(stalling(), metadata=store_server.auth)
    await asyncio.wait_for(half_sent.wait(), 10)
    incoming = store_server.data_dir / "blobs" / "incoming"
    await _until(lambda: any(incoming.iterdir()))
    call.cancel()
    await _until(lambda: not any(incoming.iterdir()))
    assert store_server.blob_files() == []
    assert "bad" not in store_server.store.catalog.all_digests()
    listed = await store_server.client_api.ListModels(EMPTY)
    assert list(listed.models) == []


async def test_a_restart_cleans_up_after_a_crash(
    server_factory, tmp_path, tiny_checkpoint, upload_chunks
):
    data_dir = tmp_path / "coordinator"
    first = await server_factory(data_dir)
    await _add(first, upload_chunks(tiny_checkpoint, "kept"))
    kept = first.blob_files()
    await first.stop()
    # What a kill -9 mid-import leaves: a partial file and a published but unlisted blob.
    (data_dir / "blobs" / "incoming" / "x.part").write_bytes(b"partial")
    orphan = data_dir / "blobs" / "ab" / ("c" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"orphan")
    second = await server_factory(data_dir)
    assert second.blob_files() == kept
    listed = await second.client_api.ListModels(EMPTY)
    assert [m.name for m in listed.models] == ["kept"]


async def test_availability_comes_from_the_planner(server_factory, tiny_checkpoint, upload_chunks):
    coverage = {"m": [2, 0, 0]}
    server = await server_factory(coverage=lambda name: coverage[name])
    info = await _add(server, upload_chunks(tiny_checkpoint, "m"))
    assert not info.available and info.unavailable_reason == "layers 1-2 have no ready replica"
    coverage["m"] = [1, 1, 3]
    detail = await server.client_api.GetModel(common_pb2.ModelRef(name="m"))
    assert detail.info.available and list(detail.info.ready_replicas) == [1, 1, 3]
    assert detail.info.unavailable_reason == ""


async def test_unknown_model_lists_the_known_ones(store_server, tiny_checkpoint, upload_chunks):
    await _add(store_server, upload_chunks(tiny_checkpoint, "tiny"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await store_server.client_api.GetModel(common_pb2.ModelRef(name="huge"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'huge'" in info.value.details() and "tiny" in info.value.details()


async def test_concurrent_import_of_the_same_name_is_refused(
    store_server, tiny_checkpoint, upload_chunks
):
    messages = upload_chunks(tiny_checkpoint, "m")
    release = asyncio.Event()

    async def slow():
        yield messages[0]
        await release.wait()
        for message in messages[1:]:
            yield message

    first = asyncio.ensure_future(store_server.admin.AddModel(slow(), metadata=store_server.auth))
    await _until(lambda: "m" in store_server.store._importing)
    with pytest.raises(grpc.RpcError) as info:
        await _add(store_server, messages)
    assert info.value.code() == grpc.StatusCode.ABORTED
    release.set()
    assert (await first).name == "m"


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_helpers_make_distinct_checkpoints(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
