"""Read a safetensors header without torch or the safetensors package.

Format: 8 bytes little-endian header length N, N bytes of UTF-8 JSON mapping each tensor
name to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the data area
that starts at 8 + N), plus an optional "__metadata__" object of strings.
Every check happens before a single tensor byte is read, so a hostile file cannot make
us allocate or seek beyond what the file holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from coordinator.model_store.errors import CheckpointError

# The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100 * 1000 * 1000
METADATA_KEY = "__metadata__"

# Every dtype the format defines, so a file is parsed fully even if we later refuse a dtype.
FORMAT_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in a file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute, from the start of the file
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorSpan]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate the header of `path`; CheckpointError names the file and problem."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"the file has {size} bytes, too short for a header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise _bad(path, f"the header claims {header_len} bytes (limit {MAX_HEADER_BYTES})")
            if 8 + header_len > size:
                raise _bad(
                    path,
                    f"the header claims {header_len} bytes but the file has only {size}; "
                    "it is truncated",
                )
            raw = handle.read(header_len)
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(path, f"the header is not valid UTF-8 JSON ({err})") from err
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    data_start = 8 + header_len
    return SafetensorsHeader(
        path=path,
        tensors=_tensors(path, header, data_start, size - data_start),
        metadata=_metadata(path, header.get(METADATA_KEY)),
    )


def _tensors(
    path: Path, header: dict[str, object], data_start: int, data_size: int
) -> dict[str, TensorSpan]:
    spans: dict[str, TensorSpan] = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        if not isinstance(entry, dict):
            raise _bad(path, f"entry {name!r} is not an object")
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if dtype not in FORMAT_ITEMSIZE:
            raise _bad(path, f"tensor {name} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise _bad(path, f"tensor {name} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _bad(path, f"tensor {name} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_size:
            raise _bad(
                path,
                f"tensor {name} ends at byte {end} of the data area, which has only "
                f"{data_size} bytes; the file is truncated or its header is corrupt",
            )
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * FORMAT_ITEMSIZE[dtype]:
            raise _bad(
                path,
                f"tensor {name} of shape {shape} and dtype {dtype} needs "
                f"{count * FORMAT_ITEMSIZE[dtype]} bytes but data_offsets span {end - begin}",
            )
        spans[name] = TensorSpan(name, dtype, tuple(shape), path, data_start + begin, end - begin)
    _refuse_overlaps(path, spans, data_start)
    return spans


def _refuse_overlaps(path: Path, spans: dict[str, TensorSpan], data_start: int) -> None:
    ordered = sorted((s for s in spans.values() if s.nbytes), key=lambda s: s.offset)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.offset < before.offset + before.nbytes:
            raise _bad(path, f"tensors {before.name} and {after.name} overlap")


def _metadata(path: Path, raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise _bad(path, f"{METADATA_KEY} must map strings to strings")
    return dict(raw)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid safetensors file: {problem}")
