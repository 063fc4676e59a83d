"""The job runner's dataset cache: a download streams to a memory-mapped `.npy`, checked
shard by shard; a bad stream leaves nothing behind; a later resume reuses the file.

The streams here are what the coordinator's DownloadDataset sends (header, then each
shard's bytes in order, the same messages an upload sends); tests/jobs/test_datasets.py
downloads from a real coordinator.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from client import dataset_cache
from client.dataset_cache import CACHE_ENV, KEEP_DAYS, DatasetCache, default_cache_dir
from client.datasets import SHARD_TOKENS, TokenDataset, upload_messages
from client.errors import TesseraError
from protos.datasets import dataset_id
from protos.tessera.v1 import jobs_pb2

# Two shards, the second short, so that order, boundaries and the last shard all count.
TOKENS = (np.arange(SHARD_TOKENS + 3000, dtype=np.int64) * 7) % 50_000


async def _stream(messages: list[jobs_pb2.DatasetChunk]) -> AsyncIterator[jobs_pb2.DatasetChunk]:
    for message in messages:
        yield message


def _download(
    cache: DatasetCache, dataset: str, messages: list[jobs_pb2.DatasetChunk], progress=None
) -> TokenDataset:
    return asyncio.run(cache.download(dataset, _stream(messages), progress))


def _messages(dataset: TokenDataset) -> list[jobs_pb2.DatasetChunk]:
    return list(upload_messages(dataset))


def test_a_download_is_kept_mapped_and_reused(tmp_path: Path) -> None:
    dataset = TokenDataset("d", TOKENS)
    cache = DatasetCache(tmp_path)
    seen: list[tuple[str, int, int]] = []
    got = _download(cache, dataset.id, _messages(dataset), lambda *p: seen.append(p))

    assert np.array_equal(got.tokens, TOKENS) and got.example_len == 0
    assert isinstance(got.tokens, np.memmap)  # read from disk as batches need it
    assert got.id == dataset.id  # the same shards, hence the same id
    assert [p.name for p in cache.dir.iterdir()] == [f"{dataset.id}.npy"]
    total = len(TOKENS) * 4
    done = [d for _, d, _ in seen]
    assert done == sorted(done) and done[-1] == total and len(done) == 5  # 1 MiB messages
    assert {(what, all_) for what, _, all_ in seen} == {("downloading dataset", total)}

    again = cache.load(dataset.id)  # a later resume: no stream at all
    assert again is not None and np.array_equal(again.tokens, TOKENS)
    assert cache.load("0" * 64) is None


def test_fixed_length_examples_come_back_as_examples(tmp_path: Path) -> None:
    dataset = TokenDataset("rows", np.arange(600, dtype=np.int32) % 97, example_len=20)
    got = _download(DatasetCache(tmp_path), dataset.id, _messages(dataset))
    assert got.example_len == 20 and np.array_equal(got.tokens, dataset.tokens)
    assert DatasetCache(tmp_path).load(dataset.id).example_len == 20


def _corrupted(messages: list[jobs_pb2.DatasetChunk]) -> list[jobs_pb2.DatasetChunk]:
    bad = jobs_pb2.DatasetChunk()
    bad.CopyFrom(messages[2])
    bad.data.data = bytes([bad.data.data[0] ^ 1]) + bad.data.data[1:]
    return [*messages[:2], bad, *messages[3:]]


def _longer(messages: list[jobs_pb2.DatasetChunk]) -> list[jobs_pb2.DatasetChunk]:
    longer = jobs_pb2.DatasetChunk()
    longer.CopyFrom(messages[-1])
    longer.data.data += b"\0\0\0\0"
    return [*messages[:-1], longer]


def _past_the_end(messages: list[jobs_pb2.DatasetChunk]) -> list[jobs_pb2.DatasetChunk]:
    extra = jobs_pb2.DatasetChunk(data=jobs_pb2.DatasetData(shard=2, offset=0, data=b"\0" * 4))
    return [*messages, extra]


def _examples_do_not_divide() -> tuple[str, list[jobs_pb2.DatasetChunk]]:
    messages = _messages(TokenDataset("d", TOKENS))
    messages[0].header.example_len = 7  # the id below is honest about it
    shards = [(s.sha256, s.num_tokens) for s in messages[0].header.shards]
    return dataset_id(shards, 7), messages


HOSTILE = {
    "no header": lambda m: m[1:],
    "nothing at all": lambda m: [],
    "only the header": lambda m: m[:1],
    "a second header": lambda m: [m[0], m[1], m[0], *m[2:]],
    "out of order": lambda m: [m[0], m[2], m[1], *m[3:]],
    "a corrupt shard": _corrupted,
    "a truncated stream": lambda m: m[:-1],
    "a shard longer than announced": _longer,
    "a shard past the last": _past_the_end,
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_bad_stream_is_refused_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    dataset = TokenDataset("d", TOKENS)
    cache = DatasetCache(tmp_path)
    with pytest.raises(ValueError) as caught:
        _download(cache, dataset.id, HOSTILE[case](_messages(dataset)))
    assert "dataset" in str(caught.value)
    assert list(cache.dir.iterdir()) == []
    assert cache.load(dataset.id) is None


def test_another_datasets_header_or_bad_examples_are_refused(tmp_path: Path) -> None:
    cache = DatasetCache(tmp_path)
    other = TokenDataset("other", np.arange(100, dtype=np.int32))
    with pytest.raises(ValueError, match="another dataset's header"):
        _download(cache, TokenDataset("d", TOKENS).id, _messages(other))
    with pytest.raises(ValueError, match="not whole examples"):
        _download(cache, *_examples_do_not_divide())
    assert list(cache.dir.iterdir()) == []


def test_a_dataset_the_disk_cannot_hold_is_refused_before_a_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = TokenDataset("d", TOKENS)
    cache = DatasetCache(tmp_path)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    # As if the disk had only the spare room free: the dataset's bytes do not fit beside it.
    monkeypatch.setattr(dataset_cache, "SPARE_BYTES", free)
    with pytest.raises(TesseraError) as caught:
        _download(cache, dataset.id, _messages(dataset))
    assert CACHE_ENV in str(caught.value) and "MiB" in str(caught.value)
    assert list(cache.dir.iterdir()) == []


def test_unused_datasets_and_broken_downloads_are_pruned(tmp_path: Path) -> None:
    cache = DatasetCache(tmp_path)
    cache.dir.mkdir(parents=True)
    now = time.time()
    ages = {  # name: age in seconds
        "a" * 64 + ".npy": KEEP_DAYS * 86400 + 60,  # gone
        "b" * 64 + ".npy": KEEP_DAYS * 86400 - 60,  # kept
        "c" * 64 + ".1234abcd.part": 25 * 3600,  # a download that died a day ago: gone
        "d" * 64 + ".1234abcd.part": 60,  # another runner's, downloading now: kept
        "notes.txt": 365 * 86400,  # not ours: kept
    }
    for name, age in ages.items():
        (cache.dir / name).write_bytes(b"x")
        os.utime(cache.dir / name, (now - age, now - age))
    gone = cache.prune(now)
    assert sorted(p.name for p in gone) == ["a" * 64 + ".npy", "c" * 64 + ".1234abcd.part"]
    assert sorted(p.name for p in cache.dir.iterdir()) == sorted(
        ["b" * 64 + ".npy", "d" * 64 + ".1234abcd.part", "notes.txt"]
    )


def test_a_dataset_in_use_is_not_pruned(tmp_path: Path) -> None:
    dataset = TokenDataset("rows", np.arange(600, dtype=np.int32) % 97)
    cache = DatasetCache(tmp_path)
    _download(cache, dataset.id, _messages(dataset))
    path = cache.path(dataset.id)
    old = time.time() - KEEP_DAYS * 86400 - 60
    os.utime(path, (old, old))
    assert cache.load(dataset.id) is not None  # a resume uses it: its clock starts again
    assert cache.prune() == [] and path.exists()


def test_where_the_cache_lives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tessera"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tessera"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert DatasetCache().dir == tmp_path / "mine" / "datasets"
