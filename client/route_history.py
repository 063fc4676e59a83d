"""What the driver sent to each pipeline boundary, so a replacement node can be rebuilt.

The route splits the model's layers [0, L) into contiguous hops. The input of the hop that
starts at layer ``a`` is the same whichever node serves it: token ids when ``a == 0``,
hidden states leaving layer ``a - 1`` otherwise. So history is kept per *boundary* (the
start layer of a hop), and a hop that fails is rebuilt by replaying its boundary's history
from position 0 on the replacement.

This is the bookkeeping Petals gets wrong after fail-over (issue #587): positions drift
when a replay is recorded as if it were new input. Here every record states its position,
an earlier position first truncates (rollback / replay), and a later one is refused, so
the stored chunks always cover [0, length) exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protos import codec, output_check

TOKEN_DTYPES = frozenset({"int64", "int32"})


@dataclass(frozen=True, order=True)
class Span:
    """Half-open layer range [start, end) served by one hop."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"a hop span needs 0 <= start < end, got [{self.start}, {self.end})")

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


class HistoryError(ValueError):
    """A record would break the contiguity of a boundary's history."""


@dataclass
class _Chunk:
    start_pos: int
    array: np.ndarray  # [B, T] token ids or [B, T, H] hidden states
    dtype: str  # wire dtype (bfloat16 arrays are uint16 bit patterns)

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.array.shape[1]


class _BoundaryHistory:
    def __init__(self) -> None:
        self.chunks: list[_Chunk] = []
        # The node's input-prefix digest after each position (protos.output_check): what a
        # node that ran exactly these inputs signs. A pushed step checks it, because there
        # the previous node, not the client, handed the input on.
        self.digests: list[bytes] = []

    @property
    def length(self) -> int:
        return self.chunks[-1].end_pos if self.chunks else 0

    def truncate(self, length: int) -> None:
        if length >= self.length:
            return  # nothing to cut: appending must not cost more as the sequence grows
        del self.digests[length:]
        kept: list[_Chunk] = []
        for chunk in self.chunks:
            if chunk.end_pos <= length:
                kept.append(chunk)
            elif chunk.start_pos < length:
                cut = length - chunk.start_pos
                kept.append(_Chunk(chunk.start_pos, chunk.array[:, :cut], chunk.dtype))
        self.chunks = kept

    def append(self, start_pos: int, array: np.ndarray, dtype: str) -> None:
        if start_pos > self.length:
            raise HistoryError(
                f"input at position {start_pos} would leave a gap: only positions "
                f"[0, {self.length}) were sent so far"
            )
        self.truncate(start_pos)
        if self.chunks:
            first = self.chunks[0].array
            if first.shape[0] != array.shape[0] or first.shape[2:] != array.shape[2:]:
                raise HistoryError(
                    f"input of shape {list(array.shape)} does not continue earlier inputs of "
                    f"shape {list(first.shape)} (batch and hidden size must stay the same)"
                )
            if (dtype in TOKEN_DTYPES) != (self.chunks[0].dtype in TOKEN_DTYPES):
                raise HistoryError("token ids and hidden states cannot share a boundary")
        # Copy: callers reuse their buffers, and a replay must see exactly what was sent.
        self.chunks.append(_Chunk(start_pos, np.array(array, copy=True), dtype))
        previous = self.digests[-1] if self.digests else None
        self.digests.extend(output_check.input_chain(previous, array, dtype))

    def concatenated(self) -> tuple[np.ndarray, str]:
        dtypes = {c.dtype for c in self.chunks}
        if len(dtypes) == 1:
            dtype = dtypes.pop()
            return np.concatenate([c.array for c in self.chunks], axis=1), dtype
        if dtypes <= TOKEN_DTYPES:
            return np.concatenate([c.array.astype(np.int64) for c in self.chunks], axis=1), "int64"
        # Nodes with different compute dtypes served this boundary (e.g. a CPU alternate for
        # a GPU node): widen everything to float32, which holds float16/bfloat16 exactly.
        parts = [to_float32(c.array, c.dtype) for c in self.chunks]
        return np.concatenate(parts, axis=1), "float32"


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a wire array to float32; bfloat16 bit patterns are shifted into place."""
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


class RouteHistory:
    """Per-boundary input history for a route that covers layers [0, num_layers)."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self._spans = _check_cover(list(spans))
        self._boundaries: dict[int, _BoundaryHistory] = {
            s.start: _BoundaryHistory() for s in self._spans
        }

    @property
    def spans(self) -> list[Span]:
        return list(self._spans)

    @property
    def num_layers(self) -> int:
        return self._spans[-1].end

    def length(self, span: Span) -> int:
        """Positions recorded for the input of ``span``."""
        return self._boundary(span).length

    def record(self, span: Span, start_pos: int, array: np.ndarray, dtype: str) -> None:
        """Record an input sent to ``span`` at ``start_pos``; an earlier position truncates."""
        want_ndim = 2 if span.start == 0 else 3
        if array.ndim != want_ndim or array.shape[1] == 0:
            kind = "token ids [B, T]" if span.start == 0 else "hidden states [B, T, H]"
            raise HistoryError(f"span {span} takes {kind}, got shape {list(array.shape)}")
        if (span.start == 0) != (dtype in TOKEN_DTYPES):
            raise HistoryError(f"dtype {dtype} does not fit the input of span {span}")
        if dtype not in codec.ALL_DTYPES:
            raise HistoryError(f"dtype {dtype!r} cannot travel on the wire")
        self._boundary(span).append(start_pos, array, dtype)

    def input_digest(self, span: Span) -> bytes:
        """The input-prefix digest a node serving ``span`` signs after every input
        recorded so far (b"" before any)."""
        digests = self._boundary(span).digests
        return digests[-1] if digests else b""

    def digest_after(self, span: Span, length: int) -> bytes | None:
        """The input-prefix digest after the first ``length`` positions recorded for
        ``span`` (b"" for none; None past what was recorded)."""
        digests = self._boundary(span).digests
        if not 0 <= length <= len(digests):
            return None
        return digests[length - 1] if length else b""

    def following(self, span: Span) -> Span | None:
        """The hop after ``span`` in the route (None for the last): its input is
        ``span``'s output."""
        return next((s for s in self._spans if s.start == span.end), None)

    def replay_input(self, span: Span) -> tuple[int, np.ndarray, str]:
        """(0, everything sent to ``span`` so far in position order, wire dtype)."""
        history = self._boundary(span)
        if not history.chunks:
            raise HistoryError(f"nothing was sent to span {span} yet; there is nothing to replay")
        array, dtype = history.concatenated()
        return 0, array, dtype

    def inputs(self, span: Span, start: int, end: int) -> list[tuple[int, np.ndarray, str]]:
        """The chunks sent to ``span`` covering positions [start, end), as (start_pos, array,
        dtype), cut to that range: what a verifying replica's cache lacks."""
        out = []
        for chunk in self._boundary(span).chunks:
            low, high = max(start, chunk.start_pos), min(end, chunk.end_pos)
            if low < high:
                cut = chunk.array[:, low - chunk.start_pos : high - chunk.start_pos]
                out.append((low, cut, chunk.dtype))
        return out

    def replace(self, span: Span, chain: Sequence[Span]) -> None:
        """Swap ``span`` for a chain of hops covering exactly the same layers.

        The chain's first hop inherits the boundary history unchanged (same input). Its
        internal boundaries start empty: the driver fills them by running the replay
        through the chain and recording each hop's output as the next hop's input.
        """
        chain = list(chain)
        if span not in self._spans:
            raise HistoryError(f"span {span} is not part of the route {self._describe()}")
        if not chain or chain[0].start != span.start or chain[-1].end != span.end:
            raise HistoryError(
                f"a replacement for {span} must cover it exactly, got "
                f"{', '.join(map(str, chain)) or 'nothing'}"
            )
        _check_contiguous(chain)
        index = self._spans.index(span)
        self._spans[index : index + 1] = chain
        for inner in chain[1:]:
            self._boundaries[inner.start] = _BoundaryHistory()

    def rollback(self, length: int) -> None:
        """Forget every position >= ``length`` at every boundary (e.g. rejected drafts)."""
        if length < 0:
            raise HistoryError(f"cannot roll back to a negative length ({length})")
        for history in self._boundaries.values():
            history.truncate(length)

    def _boundary(self, span: Span) -> _BoundaryHistory:
        if span not in self._spans:
            raise HistoryError(f"span {span} is not part of the route {self._describe()}")
        return self._boundaries[span.start]

    def _describe(self) -> str:
        return " ".join(str(s) for s in self._spans)


def covers(spans: Sequence[Span], start: int, end: int) -> bool:
    """True when ``spans`` are contiguous and cover exactly [start, end)."""
    if not spans or spans[0].start != start or spans[-1].end != end:
        return False
    return all(left.end == right.start for left, right in zip(spans, spans[1:], strict=False))


def _check_contiguous(spans: list[Span]) -> None:
    for left, right in zip(spans, spans[1:], strict=False):
        if left.end != right.start:
            raise HistoryError(f"hops {left} and {right} are not contiguous")


def _check_cover(spans: list[Span]) -> list[Span]:
    if not spans or spans[0].start != 0:
        raise HistoryError("a route must start at layer 0")
    _check_contiguous(spans)
    return spans
