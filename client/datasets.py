"""Token datasets on the client: read a file, cut it into shards, and make batches.

Files: `.npy` arrays of integer token ids, 1-D (a stream, cut into windows of seq_len + 1)
or 2-D (one fixed-length example per row), or text (`.txt` and anything else), encoded
with the model's tokenizer. No pickle is ever loaded (`allow_pickle=False`). A `.npy`
file is memory-mapped, not read: hashing and uploading it hold one 4 MiB shard at a time,
and a batch reads only its own windows, so a dataset may be larger than memory. A text
file is encoded whole in memory: tokenize a corpus larger than that to `.npy` first.

Batches are a pure function of (dataset, seq_len, batch_size, seed, step): sample indices
come from a permutation seeded by (seed, epoch), so a resumed job, or a bench run, sees
exactly the batches the first run would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from client.tokenizer import TextTokenizer
from protos.datasets import TOKEN_BYTES, TOKEN_DTYPE, dataset_id
from protos.tessera.v1 import jobs_pb2

SHARD_TOKENS = 1 << 20  # 4 MiB shards
CHUNK_BYTES = 1 << 20

Progress = Callable[[str, int, int], None]  # (what, bytes done, bytes in all)


@dataclass(eq=False)
class TokenDataset:
    name: str
    # Integer token ids, 1-D, in any integer dtype: a .npy file's memory map as it is
    # (batches and shards read only what they need), or an array in memory.
    tokens: np.ndarray
    example_len: int = 0  # 0: a plain stream
    _shard_list: list[tuple[str, int]] | None = field(default=None, init=False, repr=False)

    @property
    def shards(self) -> Iterator[np.ndarray]:
        """Each shard's ids as int32 little-endian, one shard in memory at a time."""
        for start in range(0, len(self.tokens), SHARD_TOKENS):
            yield np.asarray(self.tokens[start : start + SHARD_TOKENS]).astype(TOKEN_DTYPE)

    def shard_list(self, progress: Progress | None = None) -> list[tuple[str, int]]:
        """(sha256, tokens) of each shard, hashed once (a large file takes a while)."""
        if self._shard_list is None:
            listed, done, total = [], 0, len(self.tokens) * TOKEN_BYTES
            for shard in self.shards:
                listed.append((hashlib.sha256(shard.tobytes()).hexdigest(), len(shard)))
                done += shard.nbytes
                if progress is not None:
                    progress("hashing dataset", done, total)
            self._shard_list = listed
        return self._shard_list

    @property
    def id(self) -> str:
        return dataset_id(self.shard_list(), self.example_len)


def load_dataset(path: Path, tokenizer: TextTokenizer | None = None) -> TokenDataset:
    """Read FILE as token ids; ValueError says what is wrong with it."""
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    if path.suffix == ".npy":
        try:
            # Memory-mapped: a dataset may be larger than this machine's memory.
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError) as err:  # an empty file is an EOFError
            raise ValueError(
                f"{path} is not a plain .npy array of token ids ({err}); write one with numpy.save"
            ) from None
        if not isinstance(array, np.ndarray):  # np.load opens an .npz archive, whatever its name
            array.close()
            raise ValueError(
                f"{path} is an .npz archive of several arrays; save the token ids alone "
                "with numpy.save"
            )
        if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"{path} holds a {array.ndim}-D {array.dtype} array; give 1-D (a token stream) "
                "or 2-D (one example per row) integer token ids"
            )
        example_len = int(array.shape[1]) if array.ndim == 2 else 0
        tokens = array.reshape(-1)
    else:
        if tokenizer is None:
            raise ValueError(
                f"{path} is text, but the model has no tokenizer; give token ids as a .npy file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{path} is neither UTF-8 text nor a .npy file of token ids; give text, or "
                "token ids saved with numpy.save in a file named *.npy"
            ) from None
        tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
        example_len = 0
    if tokens.size == 0:
        raise ValueError(f"{path} holds no tokens")
    if tokens.min() < 0 or tokens.max() >= 2**31:
        raise ValueError(f"{path} holds token ids outside [0, 2^31)")
    return TokenDataset(path.stem[:128] or "dataset", tokens, example_len)


def upload_messages(
    dataset: TokenDataset, progress: Progress | None = None
) -> Iterator[jobs_pb2.DatasetChunk]:
    """The UploadDataset stream: header, then each shard's bytes in order."""
    shard_list = dataset.shard_list(progress)
    total, sent = len(dataset.tokens) * TOKEN_BYTES, 0
    yield jobs_pb2.DatasetChunk(
        header=jobs_pb2.DatasetHeader(
            name=dataset.name,
            shards=[jobs_pb2.DatasetShard(sha256=s, num_tokens=n) for s, n in shard_list],
            example_len=dataset.example_len,
        )
    )
    step = CHUNK_BYTES - CHUNK_BYTES % TOKEN_BYTES
    for index, shard in enumerate(dataset.shards):
        data = shard.tobytes()
        for offset in range(0, len(data), step):
            yield jobs_pb2.DatasetChunk(
                data=jobs_pb2.DatasetData(
                    shard=index, offset=offset, data=data[offset : offset + step]
                )
            )
            sent += min(step, len(data) - offset)
            if progress is not None:
                progress("uploading dataset", sent, total)


class BatchSampler:
    """Deterministic batches of [batch_size, seq_len] inputs and next-token labels."""

    def __init__(self, dataset: TokenDataset, seq_len: int, batch_size: int, seed: int) -> None:
        window = seq_len + 1
        if dataset.example_len and dataset.example_len != window:
            raise ValueError(
                f"the dataset's examples have {dataset.example_len} tokens; use seq_len "
                f"{dataset.example_len - 1}"
            )
        self.samples = len(dataset.tokens) // window
        if self.samples == 0:
            raise ValueError(f"the dataset has fewer than seq_len + 1 = {window} tokens")
        self._windows = dataset.tokens[: self.samples * window].reshape(self.samples, window)
        self.batch_size = batch_size
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.samples)
            self._orders = {epoch: order}  # keep one epoch: steps advance monotonically
        return order

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) int64 [batch_size, seq_len] for optimizer step `step`."""
        first = step * self.batch_size
        rows = []
        for position in range(first, first + self.batch_size):
            epoch, index = divmod(position, self.samples)
            rows.append(self._order(epoch)[index])
        windows = self._windows[np.asarray(rows)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]
