"""`tessera train --data FILE`: reading a dataset file, and every way one can be wrong.

Each mistake must come back as a ValueError that names the file and says what to give
instead (the CLI prints it and exits 2), never as a traceback.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from client.datasets import TokenDataset, load_dataset
from client.demo_checkpoint import character_vocab, write_tokenizer
from client.tokenizer import TextTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    write_tokenizer(path, character_vocab())
    loaded = load_tokenizer(path.read_bytes())
    assert loaded is not None
    return loaded


def test_a_token_stream_and_fixed_examples(tmp_path: Path) -> None:
    np.save(tmp_path / "stream.npy", np.arange(100, dtype=np.int64))
    stream = load_dataset(tmp_path / "stream.npy")
    assert stream.example_len == 0 and stream.tokens.tolist() == list(range(100))
    assert stream.name == "stream"
    # Mapped, not read: a dataset may be larger than memory. What travels is int32 all
    # the same, so the file's own dtype does not change the dataset's id.
    assert isinstance(stream.tokens, np.memmap) and stream.tokens.dtype == np.int64
    assert [s.dtype.str for s in stream.shards] == ["<i4"]
    assert stream.id == TokenDataset("other", np.arange(100, dtype=np.int32)).id

    np.save(tmp_path / "rows.npy", np.arange(60, dtype=np.uint16).reshape(6, 10))
    rows = load_dataset(tmp_path / "rows.npy")
    assert rows.example_len == 10 and rows.tokens.tolist() == list(range(60))
    assert isinstance(rows.tokens, np.memmap)


def test_text_is_encoded_with_the_models_tokenizer(
    tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    (tmp_path / "story.txt").write_text("ABC abc\n", encoding="utf-8")
    dataset = load_dataset(tmp_path / "story.txt", tokenizer)
    assert dataset.tokens.tolist() == tokenizer.encode("ABC abc\n")
    assert dataset.example_len == 0 and len(dataset.tokens) == 8


def refused(path: Path, *words: str, tokenizer: TextTokenizer | None = None) -> str:
    with pytest.raises(ValueError) as caught:
        load_dataset(path, tokenizer)
    message = str(caught.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, message
    return message


def test_a_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "nope.npy", "does not exist")


@pytest.mark.parametrize(
    "content",
    [
        b"",  # numpy raises EOFError for this one
        b"these bytes are not an array",
        b"\x93NUMPY\x01\x00\xff\xff" + b"x" * 20,  # a header that claims 64 KiB
    ],
)
def test_a_broken_npy_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "broken.npy").write_bytes(content)
    refused(tmp_path / "broken.npy", "not a plain .npy array", "numpy.save")


def test_a_truncated_npy_file(tmp_path: Path) -> None:
    np.save(tmp_path / "whole.npy", np.arange(1000))
    data = (tmp_path / "whole.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[: len(data) // 2])
    refused(tmp_path / "cut.npy", "not a plain .npy array")


def test_a_pickled_array_is_never_loaded(tmp_path: Path) -> None:
    np.save(tmp_path / "objects.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    refused(tmp_path / "objects.npy", "not a plain .npy array")


def test_an_npz_archive_named_npy(tmp_path: Path) -> None:
    np.savez(tmp_path / "several.npz", a=np.arange(3), b=np.arange(4))
    (tmp_path / "several.npz").rename(tmp_path / "several.npy")
    assert zipfile.is_zipfile(tmp_path / "several.npy")
    refused(tmp_path / "several.npy", ".npz archive", "numpy.save")


@pytest.mark.parametrize(
    "array",
    [np.ones(8, dtype=np.float32), np.ones((2, 2, 2), dtype=np.int64), np.array(5)],
    ids=["floats", "3-D", "0-D"],
)
def test_arrays_that_are_not_token_ids(tmp_path: Path, array: np.ndarray) -> None:
    np.save(tmp_path / "odd.npy", array)
    refused(tmp_path / "odd.npy", "1-D", "2-D", "integer token ids")


@pytest.mark.parametrize("bad", [-1, 2**31], ids=["negative", "too large"])
def test_ids_outside_the_range(tmp_path: Path, bad: int) -> None:
    np.save(tmp_path / "ids.npy", np.array([1, 2, bad], dtype=np.int64))
    refused(tmp_path / "ids.npy", "outside [0, 2^31)")


def test_empty_inputs(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    np.save(tmp_path / "none.npy", np.zeros(0, dtype=np.int64))
    refused(tmp_path / "none.npy", "holds no tokens")
    (tmp_path / "blank.txt").write_text("", encoding="utf-8")
    refused(tmp_path / "blank.txt", "holds no tokens", tokenizer=tokenizer)


def test_text_needs_a_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "story.txt").write_text("hello", encoding="utf-8")
    refused(tmp_path / "story.txt", "no tokenizer", ".npy")


def test_binary_data_that_is_not_npy(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    (tmp_path / "ids.bin").write_bytes(np.arange(300, dtype=np.int32).tobytes() + b"\xff\xfe")
    refused(tmp_path / "ids.bin", "neither UTF-8 text nor a .npy file", tokenizer=tokenizer)
