"""Comparing two nodes' outputs for the same input: dtype-aware tolerance and input digests.

The driver (sampled redundancy), the coordinator's verifier (arbitration, canaries) and the
benchmark all decide "same result or not" here, so an honest pair can never be judged
differently by two parts of the system.

Honest nodes differ: another GPU, another BLAS, float16 instead of float32. The measure is
the relative L2 error ||a - b|| / ||b||, compared with a tolerance for the looser of the
two nodes' (device kind, compute dtype), grown with the number of layers compared. The
numbers come from calibration on real runtime outputs (see docs/verification.md); zero
false positives is the requirement, so each tolerance sits well above the largest honest
error measured, and far below what a corruption or a lazy answer (zeros, echoed input)
produces.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from protos.tessera.v1 import common_pb2

# (device kind, compute dtype) -> relative L2 tolerance. Unknown pairs fall back to the
# dtype's row; an unknown dtype gets the loosest tolerance.
TOLERANCES: dict[tuple[str, str], float] = {
    ("cpu", "float32"): 1e-3,
    ("cuda", "float32"): 1e-3,
    ("cpu", "float16"): 3e-2,
    ("cuda", "float16"): 3e-2,
    ("cpu", "bfloat16"): 8e-2,
    ("cuda", "bfloat16"): 8e-2,
}
_BY_DTYPE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 8e-2}
LOOSEST = max(_BY_DTYPE.values())
# The tolerances above hold as calibrated for comparisons of up to this many layers: the
# deepest honest comparison measured on a GPU (bench/cuda_check.py, two stages of 11
# layers; bf16 sat at a quarter of its tolerance there). Each layer adds its own rounding
# to the residual stream, independent of the others', so honest differences grow like a
# random walk, with the square root of the depth: beyond this depth a tolerance grows the
# same way, and keeps the margin it was measured with (the tiny test model's 2-layer
# stages and the 11-layer GPU stages, 9x and 4x apart in bf16 margin, fit it).
CALIBRATED_LAYERS = 11
# ... but never past this: the tests' corruption (noise of 0.5 RMS on the hidden states)
# lands from 0.24 up (tests/verification/test_tolerance.py), and every step of growth is room
# a cheater's smaller perturbation could hide in. bf16 reaches it at 39 layers, where an
# honest pair's error, grown from the GPU measurement, is about 3.5e-2.
MAX_TOLERANCE = 0.15
_EMPTY_CHAIN = hashlib.sha256(b"tessera/v1/input-chain\n").digest()
DIGEST_BYTES = len(_EMPTY_CHAIN)


def depth_factor(layers: int) -> float:
    """How much a tolerance grows for a comparison of `layers` layers (1 up to
    CALIBRATED_LAYERS)."""
    return math.sqrt(max(layers, CALIBRATED_LAYERS) / CALIBRATED_LAYERS)


def tolerance(device_kind: str, dtype: str, *, layers: int) -> float:
    """The tolerance for one node's class on a comparison of `layers` layers."""
    base = TOLERANCES.get((device_kind, dtype), _BY_DTYPE.get(dtype, LOOSEST))
    return min(base * depth_factor(layers), max(base, MAX_TOLERANCE))


def pair_tolerance(a: tuple[str, str], b: tuple[str, str], *, layers: int) -> float:
    """Two honest nodes may each carry their own rounding: the looser one decides."""
    return max(tolerance(*a, layers=layers), tolerance(*b, layers=layers))


def as_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """A wire array as float32; bfloat16 bit patterns (uint16) are shifted into place."""
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def from_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse of as_float32 (bfloat16 by truncation, enough for test corruptions)."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return array.astype({"float16": np.float16}.get(dtype, np.float32))


def relative_error(a: np.ndarray, a_dtype: str, b: np.ndarray, b_dtype: str) -> float:
    """||a - b|| / ||b|| in float64; inf when shapes differ or either holds NaN/inf."""
    x = as_float32(a, a_dtype).astype(np.float64)
    y = as_float32(b, b_dtype).astype(np.float64)
    if x.shape != y.shape or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return float("inf")
    scale = max(float(np.linalg.norm(y)), float(np.linalg.norm(x)), 1e-12)
    return float(np.linalg.norm(x - y)) / scale


def input_chain(previous: bytes | None, array: np.ndarray, dtype: str) -> list[bytes]:
    """Digests of a node's input prefix after each position of ``array`` ([B, T, ...]).

    A stage output depends on every earlier input of the session (the KV cache), so what a
    node signs must commit to the whole prefix, not only to this call's tensor: otherwise a
    client could claim a different history and frame an honest node. Digest i chains the
    digest before it with the dtype and the bytes of position i for the whole batch, so a
    rollback to position p simply keeps the first p digests.
    """
    digest = previous or _EMPTY_CHAIN
    tag = dtype.encode() + b"\n"
    out: list[bytes] = []
    for position in range(array.shape[1]):
        row = np.ascontiguousarray(array[:, position]).tobytes()
        digest = hashlib.sha256(digest + tag + row).digest()
        out.append(digest)
    return out


def tensor_digest(*tensors: common_pb2.Tensor | None) -> bytes:
    """A digest of whole wire tensors (dtype, shape, bytes), in order; None counts as absent.

    A training micro-batch has no cache history: its output depends only on the tensors of
    the call (and the stage's weights at that version), so this is what a training stage
    signs as its input."""
    digest = hashlib.sha256(b"tessera/v1/tensor-digest\n")
    for tensor in tensors:
        if tensor is None:
            digest.update(b"-\n")
            continue
        shape = ",".join(str(int(n)) for n in tensor.shape)
        digest.update(f"{tensor.dtype}:{shape}:{len(tensor.data)}\n".encode())
        digest.update(tensor.data)
    return digest.digest()


def prefix_digest(chunks: list[tuple[np.ndarray, str]]) -> bytes:
    """The chain digest after a whole prefix given as (array, dtype) chunks in order."""
    digest: bytes | None = None
    for array, dtype in chunks:
        chain = input_chain(digest, array, dtype)
        if chain:
            digest = chain[-1]
    return digest or _EMPTY_CHAIN
