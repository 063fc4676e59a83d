"""RouteHistory: the fail-over bookkeeping (the unit Petals issue #587 shows is easy to break)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.route_history import HistoryError, RouteHistory, Span, covers, to_float32

HIDDEN = 3
SPANS = [Span(0, 2), Span(2, 5), Span(5, 6)]


def hidden(start_pos: int, length: int, tag: float = 0.0) -> np.ndarray:
    """Hidden states whose values encode their position, so misplacement shows."""
    positions = np.arange(start_pos, start_pos + length, dtype=np.float32)
    return np.broadcast_to(positions[None, :, None] + tag, (1, length, HIDDEN)).copy()


def tokens(start_pos: int, length: int) -> np.ndarray:
    return np.arange(start_pos, start_pos + length, dtype=np.int64)[None, :] % 50


def record(history: RouteHistory, span: Span, start_pos: int, length: int) -> None:
    if span.start == 0:
        history.record(span, start_pos, tokens(start_pos, length), "int64")
    else:
        history.record(span, start_pos, hidden(start_pos, length), "float32")


# ---- properties ------------------------------------------------------------------------

# An operation: ("send", span index, how far back from the end to start, length) or
# ("rollback", fraction of the current length to keep).
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("send"),
            st.integers(0, len(SPANS) - 1),
            st.integers(0, 4),
            st.integers(1, 5),
        ),
        st.tuples(st.just("rollback"), st.floats(0, 1), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_replay_is_exactly_the_effective_sequence_sent(ops) -> None:
    history = RouteHistory(SPANS)
    # The model: per boundary, the value currently valid at each position. Each send gets
    # its own tag, so a chunk kept at the wrong place or a stale overwrite shows.
    model: dict[Span, list[float]] = {span: [] for span in SPANS}
    for number, op in enumerate(ops):
        if op[0] == "send":
            _, index, back, length = op
            span = SPANS[index]
            start_pos = max(0, len(model[span]) - back)
            if span.start == 0:
                chunk = (tokens(start_pos, length) + number) % 50
                history.record(span, start_pos, chunk, "int64")
            else:
                chunk = hidden(start_pos, length, tag=1000.0 * number)
                history.record(span, start_pos, chunk, "float32")
            values = [float(v) for v in chunk.reshape(length, -1)[:, 0]]
            model[span] = model[span][:start_pos] + values
        else:
            longest = max(len(p) for p in model.values())
            keep = int(op[1] * longest)
            history.rollback(keep)
            model = {span: p[:keep] for span, p in model.items()}
        for span in SPANS:
            assert history.length(span) == len(model[span])
    for span in SPANS:
        expected = model[span]
        if not expected:
            with pytest.raises(HistoryError):
                history.replay_input(span)
            continue
        start_pos, replay, dtype = history.replay_input(span)
        assert start_pos == 0
        assert dtype == ("int64" if span.start == 0 else "float32")
        assert replay.shape[:2] == (1, len(expected))
        assert [float(v) for v in replay.reshape(len(expected), -1)[:, 0]] == expected


@settings(max_examples=100, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=10),
    cut=st.integers(0, 40),
)
def test_replay_equals_concatenation_of_chunks_sent(chunks, cut) -> None:
    history = RouteHistory(SPANS)
    span = SPANS[1]
    rng = np.random.default_rng(len(chunks) * 100 + cut)
    sent = []
    position = 0
    for length in chunks:
        chunk = rng.standard_normal((1, length, HIDDEN)).astype(np.float32)
        history.record(span, position, chunk, "float32")
        sent.append(chunk)
        position += length
    _, replay, _ = history.replay_input(span)
    np.testing.assert_array_equal(replay, np.concatenate(sent, axis=1))
    keep = min(cut, position)
    history.rollback(keep)
    assert history.length(span) == keep
    if keep:
        np.testing.assert_array_equal(
            history.replay_input(span)[1], np.concatenate(sent, axis=1)[:, :keep]
        )


@settings(max_examples=100, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 4), min_size=0, max_size=2, unique=True),
    sent=st.integers(1, 12),
)
def test_replacing_a_hop_by_a_chain_keeps_the_route_covered(cuts, sent) -> None:
    history = RouteHistory(SPANS)
    for span in SPANS:
        record(history, span, 0, sent)
    old = SPANS[1]  # [2, 5)
    bounds = sorted({old.start, *[old.start + c for c in cuts if old.start + c < old.end], old.end})
    chain = [Span(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    history.replace(old, chain)
    assert covers(history.spans, 0, 6)
    assert history.spans == [SPANS[0], *chain, SPANS[2]]
    # The chain's first hop has the same input as the old hop; inner boundaries start empty.
    np.testing.assert_array_equal(history.replay_input(chain[0])[1], hidden(0, sent))
    for inner in chain[1:]:
        assert history.length(inner) == 0
    # Hops outside the replaced span are untouched.
    assert history.length(SPANS[0]) == sent and history.length(SPANS[2]) == sent
    # Rebuilding an inner boundary the way the driver does: record the replay's output at 0.
    for inner in chain[1:]:
        history.record(inner, 0, hidden(0, sent, tag=0.5), "float32")
        assert history.length(inner) == sent


# ---- examples and errors ---------------------------------------------------------------


def test_a_gap_is_refused_and_leaves_history_unchanged() -> None:
    history = RouteHistory(SPANS)
    record(history, SPANS[1], 0, 3)
    with pytest.raises(HistoryError, match="gap"):
        record(history, SPANS[1], 4, 1)
    assert history.length(SPANS[1]) == 3


def test_resending_from_an_earlier_position_overwrites_the_tail() -> None:
    history = RouteHistory(SPANS)
    history.record(SPANS[1], 0, hidden(0, 4), "float32")
    history.record(SPANS[1], 2, hidden(2, 1, tag=100.0), "float32")
    _, replay, _ = history.replay_input(SPANS[1])
    assert replay.shape[1] == 3
    np.testing.assert_array_equal(replay[0, :, 0], [0.0, 1.0, 102.0])


def test_recording_copies_the_callers_buffer() -> None:
    history = RouteHistory(SPANS)
    buffer = hidden(0, 2)
    history.record(SPANS[1], 0, buffer, "float32")
    buffer[:] = -1
    np.testing.assert_array_equal(history.replay_input(SPANS[1])[1], hidden(0, 2))


def test_mixed_float_dtypes_widen_to_float32_exactly() -> None:
    history = RouteHistory(SPANS)
    values = np.array([[[1.5, -2.25, 3.0]]], dtype=np.float32)
    bf16_bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact in bf16
    history.record(SPANS[1], 0, bf16_bits, "bfloat16")
    history.record(SPANS[1], 1, values.astype(np.float16), "float16")
    history.record(SPANS[1], 2, values, "float32")
    _, replay, dtype = history.replay_input(SPANS[1])
    assert dtype == "float32"
    np.testing.assert_array_equal(replay, np.concatenate([values] * 3, axis=1))
    np.testing.assert_array_equal(to_float32(bf16_bits, "bfloat16"), values)


@pytest.mark.parametrize(
    ("span", "array", "dtype", "message"),
    [
        (SPANS[0], hidden(0, 2), "float32", "takes token ids"),
        (SPANS[1], tokens(0, 2), "int64", "takes hidden states"),
        (SPANS[1], hidden(0, 2).astype(np.float64), "float64", "cannot travel"),
        (SPANS[0], np.zeros((1, 2), dtype=np.float32), "float32", "does not fit"),
        (Span(0, 3), tokens(0, 2), "int64", "not part of the route"),
    ],
)
def test_malformed_records_are_refused(span, array, dtype, message) -> None:
    history = RouteHistory(SPANS)
    with pytest.raises(HistoryError, match=message):
        history.record(span, 0, array, dtype)


def test_batch_or_hidden_size_cannot_change_mid_sequence() -> None:
    history = RouteHistory(SPANS)
    history.record(SPANS[1], 0, hidden(0, 2), "float32")
    with pytest.raises(HistoryError, match="does not continue"):
        history.record(SPANS[1], 2, np.zeros((2, 1, HIDDEN), dtype=np.float32), "float32")


def test_replacement_must_cover_the_span_exactly() -> None:
    history = RouteHistory(SPANS)
    with pytest.raises(HistoryError, match="cover it exactly"):
        history.replace(SPANS[1], [Span(2, 4)])
    with pytest.raises(HistoryError, match="not contiguous"):
        history.replace(SPANS[1], [Span(2, 3), Span(4, 5)])
    with pytest.raises(HistoryError, match="not part of the route"):
        history.replace(Span(1, 5), [Span(1, 5)])
    assert history.spans == SPANS


def test_a_route_must_start_at_zero_and_be_contiguous() -> None:
    with pytest.raises(HistoryError):
        RouteHistory([Span(1, 3)])
    with pytest.raises(HistoryError):
        RouteHistory([Span(0, 2), Span(3, 4)])
    with pytest.raises(ValueError):
        Span(2, 2)
