"""A node fetching its shard from a coordinator whose FetchTensors stream lies.

The real store serves a real checkpoint over real gRPC; a wrapper tampers with its
chunks on the way out (a man in the middle, a broken disk, a buggy coordinator). The node
must never cache a byte that does not hash to the digest it asked for, must leave no
partial file behind, must retry, and must end with an error that says what went wrong.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from node_agent.backoff import Backoff
from node_agent.shard_fetcher import FetchError, ShardFetcher, stage_tensor_names
from protos.tessera.v1 import coordinator_pb2

Tamper = Callable[[int, list[coordinator_pb2.TensorChunk]], list[coordinator_pb2.TensorChunk]]


@pytest.fixture
async def served_model(store_server, tiny_checkpoint, upload_chunks):
    await store_server.add_model(upload_chunks(tiny_checkpoint, "tiny"))
    return store_server


def tamper_with(server, tamper: Tamper) -> list[int]:
    """Route every FetchTensors answer through ``tamper(call number, chunks)``."""
    real = server.store.fetch_tensors
    calls: list[int] = []

    async def tampered(request, context) -> AsyncIterator[coordinator_pb2.TensorChunk]:
        calls.append(len(calls) + 1)
        chunks = [chunk async for chunk in real(request, context)]
        for chunk in tamper(len(calls), chunks):
            yield chunk

    server.store.fetch_tensors = tampered
    return calls


async def fetch_first_stage(server, data_dir: Path) -> tuple[ShardFetcher, list[str], dict]:
    node = await server.register_node()
    fetcher = ShardFetcher.for_data_dir(server.address, node.node_id, node.ticket, data_dir)
    fetcher.attempts = 2
    fetcher.retry_pause = Backoff(base_s=0.01, cap_s=0.02)
    manifest = await fetcher.fetch_manifest("tiny")
    return fetcher, stage_tensor_names(manifest, 0, 1), manifest.tensors


def nothing_left_behind(data_dir: Path) -> None:
    incoming = data_dir / "cache" / "blobs" / ".incoming"
    assert not list(incoming.glob("*")), "a partial blob stayed on disk"


def altered(chunk: coordinator_pb2.TensorChunk, **fields: object) -> coordinator_pb2.TensorChunk:
    bad = coordinator_pb2.TensorChunk()
    bad.CopyFrom(chunk)
    for name, value in fields.items():
        setattr(bad, name, value)
    return bad


def flipped(chunk: coordinator_pb2.TensorChunk) -> coordinator_pb2.TensorChunk:
    return altered(chunk, data=bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:])


def always(change: Callable[[list], list]) -> Tamper:
    return lambda call, chunks: change(chunks)


STRANGER = coordinator_pb2.TensorChunk(sha256="ab" * 32, total_bytes=4, data=b"\0" * 4)
CASES: dict[str, tuple[Tamper, str]] = {
    "a flipped byte": (always(lambda c: [flipped(c[0]), *c[1:]]), "arrived with sha256"),
    "a blob nobody asked for": (always(lambda c: [STRANGER, *c]), "which was not asked for"),
    "a chunk at the wrong offset": (
        always(lambda c: [altered(c[0], offset=c[0].offset + 1), *c[1:]]),
        "expected offset 0 of",
    ),
    "bytes past the end": (
        always(lambda c: [*c[:-1], altered(c[-1], data=c[-1].data + b"\0" * 8)]),
        "bytes expected",
    ),
    "a stream that stops early": (always(lambda c: c[:-1]), "the stream ended without 1 blob"),
}


def cached_intact(fetcher: ShardFetcher, digest: str) -> bool:
    path = fetcher.blob_path(digest)
    return not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("case", list(CASES))
async def test_a_lying_stream_is_refused_and_nothing_bad_is_cached(
    served_model, tmp_path: Path, case: str
) -> None:
    tamper, words = CASES[case]
    calls = tamper_with(served_model, tamper)
    fetcher, names, tensors = await fetch_first_stage(served_model, tmp_path / "node")
    try:
        with pytest.raises(FetchError) as caught:
            await fetcher.ensure_tensors("tiny", names)
        assert "model tiny" in str(caught.value) and words in str(caught.value)
        assert len(calls) == 2  # retried once, as configured
        # Whatever is in the cache is what the manifest promised, byte for byte.
        assert all(cached_intact(fetcher, tensors[name].sha256) for name in names)
        nothing_left_behind(tmp_path / "node")
    finally:
        await fetcher.close()


async def test_one_bad_answer_is_retried_and_the_shard_arrives_intact(
    served_model, tmp_path: Path
) -> None:
    calls = tamper_with(served_model, lambda call, c: [flipped(c[0]), *c[1:]] if call == 1 else c)
    fetcher, names, tensors = await fetch_first_stage(served_model, tmp_path / "node")
    try:
        paths = await fetcher.ensure_tensors("tiny", names)
        assert calls == [1, 2]
        for name in names:
            assert paths[name] == fetcher.blob_path(tensors[name].sha256)
            assert paths[name].exists() and cached_intact(fetcher, tensors[name].sha256)
        nothing_left_behind(tmp_path / "node")
    finally:
        await fetcher.close()
