import numpy as np
import pytest

from protos import codec
from protos.tessera.v1 import common_pb2


def test_round_trip_preserves_values_and_shape() -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    assert np.array_equal(codec.decode(codec.encode(x)), x)
    ids = np.arange(5, dtype=np.int64)[None]
    assert np.array_equal(codec.decode(codec.encode(ids)), ids)


def test_bfloat16_travels_as_bit_patterns() -> None:
    bits = np.array([[0x3F80, 0x4000]], dtype=np.uint16)  # 1.0, 2.0
    out = codec.decode(codec.encode(bits, dtype="bfloat16"))
    assert out.dtype == np.uint16 and np.array_equal(out, bits)


@pytest.mark.parametrize(
    ("tensor", "kwargs", "message"),
    [
        (common_pb2.Tensor(dtype="float64", shape=[1], data=b"\0" * 8), {}, "not accepted"),
        (common_pb2.Tensor(dtype="float32", shape=[2], data=b"\0" * 4), {}, "needs 8 bytes"),
        (common_pb2.Tensor(dtype="float32", shape=[0], data=b""), {}, "positive"),
        (common_pb2.Tensor(dtype="float32", shape=[1] * 5, data=b"\0" * 4), {}, "dimensions"),
        (
            common_pb2.Tensor(dtype="float32", shape=[1, 3], data=b"\0" * 12),
            {"shape": (1, 4)},
            "dimension 1 must be 4",
        ),
        (
            common_pb2.Tensor(dtype="float32", shape=[1 << 20], data=b""),
            {"max_elements": 10},
            "exceed",
        ),
        (
            common_pb2.Tensor(dtype="int64", shape=[1], data=b"\0" * 8),
            {"allowed": codec.FLOAT_DTYPES},
            "not accepted",
        ),
    ],
)
def test_malformed_tensors_are_refused_with_a_reason(tensor, kwargs, message) -> None:
    with pytest.raises(codec.TensorError, match=message):
        codec.decode(tensor, **kwargs)


def test_non_finite_values_are_refused() -> None:
    x = np.array([1.0, np.nan], dtype=np.float32)
    with pytest.raises(codec.TensorError, match="NaN"):
        codec.decode(codec.encode(x))
    bf_inf = np.array([0x7F80], dtype=np.uint16)
    with pytest.raises(codec.TensorError, match="NaN"):
        codec.decode(codec.encode(bf_inf, dtype="bfloat16"))
    assert codec.decode(codec.encode(x), finite=False).shape == (2,)


def test_unsendable_dtype_is_named() -> None:
    with pytest.raises(codec.TensorError, match="float64"):
        codec.encode(np.zeros(2, dtype=np.float64))
