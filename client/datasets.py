"""Token datasets on the client: read a file, cut it into shards, and make batches.

Files: `.npy` arrays of integer token ids, 1-D (a stream, cut into windows of seq_len + 1)
or 2-D (one fixed-length example per row), or text (`.txt` and anything else), encoded
with the model's tokenizer. No pickle is ever loaded (`allow_pickle=False`).

Batches are a pure function of (dataset, seq_len, batch_size, seed, step): sample indices
come from a permutation seeded by (seed, epoch), so a resumed job, or a bench run, sees
exactly the batches the first run would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.tokenizer import TextTokenizer
from protos.datasets import TOKEN_BYTES, TOKEN_DTYPE, dataset_id
from protos.tessera.v1 import jobs_pb2

SHARD_TOKENS = 1 << 20  # 4 MiB shards
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class TokenDataset:
    name: str
    tokens: np.ndarray  # int32, 1-D
    example_len: int = 0  # 0: a plain stream

    @property
    def shards(self) -> list[np.ndarray]:
        return [self.tokens[i : i + SHARD_TOKENS] for i in range(0, len(self.tokens), SHARD_TOKENS)]

    def shard_list(self) -> list[tuple[str, int]]:
        return [
            (hashlib.sha256(s.astype(TOKEN_DTYPE).tobytes()).hexdigest(), len(s))
            for s in self.shards
        ]

    @property
    def id(self) -> str:
        return dataset_id(self.shard_list(), self.example_len)


def load_dataset(path: Path, tokenizer: TextTokenizer | None = None) -> TokenDataset:
    """Read FILE as token ids; ValueError says what is wrong with it."""
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
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
    return TokenDataset(path.stem[:128] or "dataset", tokens.astype(np.int32), example_len)


def upload_messages(dataset: TokenDataset) -> Iterator[jobs_pb2.DatasetChunk]:
    """The UploadDataset stream: header, then each shard's bytes in order."""
    shard_list = dataset.shard_list()
    yield jobs_pb2.DatasetChunk(
        header=jobs_pb2.DatasetHeader(
            name=dataset.name,
            shards=[jobs_pb2.DatasetShard(sha256=s, num_tokens=n) for s, n in shard_list],
            example_len=dataset.example_len,
        )
    )
    step = CHUNK_BYTES - CHUNK_BYTES % TOKEN_BYTES
    for index, shard in enumerate(dataset.shards):
        data = shard.astype(TOKEN_DTYPE).tobytes()
        for offset in range(0, len(data), step):
            yield jobs_pb2.DatasetChunk(
                data=jobs_pb2.DatasetData(
                    shard=index, offset=offset, data=data[offset : offset + step]
                )
            )


def tokens_from_chunks(chunks: list[jobs_pb2.DatasetChunk]) -> TokenDataset:
    """Rebuild a dataset from a DownloadDataset stream, checking every shard's digest."""
    if not chunks or not chunks[0].HasField("header"):
        raise ValueError("the dataset stream did not start with its header")
    header = chunks[0].header
    parts: list[bytearray] = [bytearray() for _ in header.shards]
    for chunk in chunks[1:]:
        data = chunk.data
        if data.shard >= len(parts) or data.offset != len(parts[data.shard]):
            raise ValueError("the dataset stream is out of order")
        parts[data.shard] += data.data
    for index, (part, shard) in enumerate(zip(parts, header.shards, strict=True)):
        if hashlib.sha256(part).hexdigest() != shard.sha256:
            raise ValueError(f"shard {index} of the downloaded dataset is corrupt")
    tokens = np.frombuffer(b"".join(parts), dtype=TOKEN_DTYPE).astype(np.int32)
    return TokenDataset(header.name, tokens, header.example_len)


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
