"""A checker's catch-up: the driver's history chunks joined into as few requests as fit."""

from __future__ import annotations

import numpy as np

from client.route_history import RouteHistory, Span
from client.verification import CATCH_UP_CHUNK_TOKENS, StageVerifier, _joined
from protos import codec
from protos.tessera.v1 import common_pb2, stage_pb2


def ids(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.int64)[None, :]


def test_consecutive_chunks_of_one_dtype_become_one_request() -> None:
    chunks = [(0, ids(0, 5), "int64"), (5, ids(5, 1), "int64"), (6, ids(6, 1), "int64")]
    [(start, array, dtype)] = _joined(chunks)
    assert (start, dtype) == (0, "int64")
    np.testing.assert_array_equal(array, ids(0, 7))


def test_a_dtype_change_or_a_gap_starts_another_request() -> None:
    hidden = np.ones((1, 2, 4), np.float32)
    chunks = [
        (0, hidden, "float32"),
        (2, hidden.astype(np.float16), "float16"),
        (4, hidden.astype(np.float16), "float16"),
        (7, hidden.astype(np.float16), "float16"),  # positions 6 and 7 are not contiguous
    ]
    joined = _joined(chunks)
    assert [(s, a.shape[1], d) for s, a, d in joined] == [
        (0, 2, "float32"),
        (2, 4, "float16"),
        (7, 2, "float16"),
    ]


def test_no_request_grows_past_the_chunk_limit() -> None:
    step = CATCH_UP_CHUNK_TOKENS // 3 + 1
    chunks = [(i * step, ids(i * step, step), "int64") for i in range(6)]
    joined = _joined(chunks)
    assert all(a.shape[1] <= CATCH_UP_CHUNK_TOKENS for _, a, _ in joined)
    assert sum(a.shape[1] for _, a, _ in joined) == 6 * step
    assert [s for s, _, _ in joined] == [0, 2 * step, 4 * step]
    np.testing.assert_array_equal(
        np.concatenate([a for _, a, _ in joined], axis=1), ids(0, 6 * step)
    )


def test_a_checkers_catch_up_and_check_run_in_the_background_the_primarys_call_does_not() -> None:
    span = Span(0, 2)
    history = RouteHistory([span, Span(2, 4)])
    history.record(span, 0, ids(0, 5), "int64")
    request = stage_pb2.ForwardRequest(
        session_id="s", step=3, model="m", layers=common_pb2.LayerRange(start=0, end=2),
        start_pos=5, input=codec.encode(ids(5, 1)),
    )  # fmt: skip
    messages = StageVerifier._catch_up(span, 0, request, history)
    assert [m.start_pos for m in messages] == [0, 5]
    assert all(m.background for m in messages)
    assert not request.background  # the primary's request is sent as it was
