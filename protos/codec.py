"""Tensor codec: numpy arrays <-> tessera.v1.Tensor, with the validation every receiver needs.

numpy has no bfloat16, so bfloat16 travels as its raw 16-bit pattern and decodes to a
uint16 array; torch users reinterpret it with `tensor.view(torch.bfloat16)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from protos.tessera.v1 import common_pb2

# gRPC's default receive limit is 4 MiB; our servers and channels raise it to this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_DIMS = 4

_NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
INT_DTYPES = frozenset({"int64", "int32"})
ALL_DTYPES = frozenset(_NUMPY_DTYPES)


class TensorError(ValueError):
    """A tensor on the wire is malformed. The message says what to fix."""


def itemsize(dtype: str) -> int:
    return _NUMPY_DTYPES[dtype].itemsize


def encode(array: np.ndarray, dtype: str | None = None) -> common_pb2.Tensor:
    """Encode a numpy array. Pass dtype="bfloat16" for a uint16 array of bf16 bit patterns."""
    if dtype is None:
        dtype = next(
            (
                n
                for n, d in _NUMPY_DTYPES.items()
                if d == array.dtype.newbyteorder("<") and n != "bfloat16"
            ),
            "",
        )
        if not dtype:
            raise TensorError(
                f"dtype {array.dtype} cannot be sent; use one of {sorted(ALL_DTYPES)}"
            )
    wire = _NUMPY_DTYPES[dtype]
    data = np.ascontiguousarray(array, dtype=wire).tobytes()
    return common_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=data)


def decode(
    tensor: common_pb2.Tensor,
    *,
    allowed: frozenset[str] = ALL_DTYPES,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    max_elements: int | None = None,
    finite: bool = True,
    name: str = "tensor",
) -> np.ndarray:
    """Decode and validate. `shape` entries of None are free; `finite` rejects NaN/inf."""
    if tensor.dtype not in allowed:
        raise TensorError(
            f"{name}: dtype {tensor.dtype!r} is not accepted; expected one of {sorted(allowed)}"
        )
    dims = list(tensor.shape)
    if len(dims) > MAX_DIMS or (ndim is not None and len(dims) != ndim):
        want = ndim if ndim is not None else f"at most {MAX_DIMS}"
        raise TensorError(f"{name}: expected {want} dimensions, got shape {dims}")
    if any(d <= 0 for d in dims):
        raise TensorError(f"{name}: every dimension must be positive, got shape {dims}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(dims, shape, strict=False)):
            if want is not None and got != want:
                raise TensorError(f"{name}: dimension {i} must be {want}, got shape {dims}")
    elements = math.prod(dims)
    if max_elements is not None and elements > max_elements:
        raise TensorError(f"{name}: {elements} elements exceed the limit of {max_elements}")
    expected = elements * itemsize(tensor.dtype)
    if len(tensor.data) != expected:
        raise TensorError(
            f"{name}: shape {dims} of {tensor.dtype} needs {expected} bytes, got {len(tensor.data)}"
        )
    array = np.frombuffer(tensor.data, dtype=_NUMPY_DTYPES[tensor.dtype]).reshape(dims)
    if finite and tensor.dtype in FLOAT_DTYPES and not _all_finite(array, tensor.dtype):
        raise TensorError(f"{name}: contains NaN or infinity")
    return array


def _all_finite(array: np.ndarray, dtype: str) -> bool:
    if dtype == "bfloat16":
        # exponent bits all ones means inf or NaN
        return not bool(np.any((array & 0x7F80) == 0x7F80))
    return bool(np.isfinite(array).all())
