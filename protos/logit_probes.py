"""Logit probes: how an audit of the model's last hop compares a checker with a primary.

Audits compare a checker's catch-up with what each primary signed at the same positions
(client/verification.py). For hidden states the client already holds the primary's output
(the next hop's input) and the checker answers every position. The last hop answers
logits, vocab-wide: a catch-up of n positions answering n full rows would cost n x vocab x
4 bytes (1 MiB a position for a 262k vocabulary), so the checker answers a probe per
position instead (ForwardRequest.probes): its own TOP_K highest logits, its logits at the
token ids the client names (the primary's highest there), and the log-sum-exp of the row.

That is what a cheat on the last hop would have to change. Raising a token the model
would not pick makes it one of the primary's highest: the checker reports its own value
there. Lowering the token it would pick leaves that token among the checker's highest:
the client reads the primary's value there. Moving mass into the tail moves the
log-sum-exp. The values are compared as one vector, with the relative error and the
dtype-aware tolerance every other comparison uses (protos.output_check); the top of the
row is where the largest logits are, so rounding weighs no more there than in a full row.

A disagreement proves nothing by itself (probe answers are not signed): the client runs
that very step again on the checker, and the two signed full rows go to the arbiter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protos import output_check
from protos.tessera.v1 import stage_pb2

TOP_K = 8  # the node's own highest logits a probe answer carries
MAX_PROBE_IDS = 64  # token ids one probe may name


def highest(row: np.ndarray, k: int = TOP_K) -> list[int]:
    """The ids of the ``k`` highest values of a 1-D row, highest first (ties by id)."""
    k = min(k, row.shape[0])
    if k <= 0:
        return []
    part = np.argpartition(-row, k - 1)[:k]
    return [int(i) for i in sorted(part, key=lambda i: (-float(row[i]), int(i)))]


def logsumexp(row: np.ndarray) -> float:
    values = row.astype(np.float64)
    top = float(values.max())
    return top + float(np.log(np.exp(values - top).sum()))


def answer_problem(
    answer: stage_pb2.ProbeAnswer, probe: stage_pb2.LogitProbe, vocab: int
) -> str | None:
    """Why ``answer`` cannot answer ``probe`` (None when it can)."""
    if answer.position != probe.position:
        return f"answers position {answer.position}, the probe asked for {probe.position}"
    if len(answer.top_ids) != len(answer.top_logits) or len(answer.top_ids) > TOP_K:
        return "its highest ids and values do not pair up"
    if len(answer.top_ids) < min(TOP_K, vocab):
        return f"it names {len(answer.top_ids)} highest logits, not {min(TOP_K, vocab)}"
    if any(i >= vocab for i in answer.top_ids) or len(set(answer.top_ids)) != len(answer.top_ids):
        return "its highest ids repeat or lie outside the vocabulary"
    if len(answer.probed_logits) != len(probe.token_ids):
        return f"{len(answer.probed_logits)} probed logits for {len(probe.token_ids)} ids"
    return None


def probe_error(
    primary_row: np.ndarray, probe: stage_pb2.LogitProbe, answer: stage_pb2.ProbeAnswer
) -> float:
    """Relative error between a primary's full logits row at the probed position and a
    checker's probe answer there; inf for an answer that does not fit the probe."""
    row = np.asarray(primary_row, dtype=np.float32).reshape(-1)
    if answer_problem(answer, probe, row.shape[0]) is not None:
        return float("inf")
    ids = [*answer.top_ids, *probe.token_ids]
    theirs = np.array([*answer.top_logits, *answer.probed_logits, answer.logsumexp])
    ours = np.append(row[ids].astype(np.float64), logsumexp(row))
    return output_check.relative_error(ours, "float64", theirs, "float64")


def probe_for(row: np.ndarray, position: int) -> stage_pb2.LogitProbe:
    """The probe an audit sends for a primary's row at ``position``: its highest ids."""
    return stage_pb2.LogitProbe(position=position, token_ids=highest(row))


def positions_problem(
    probes: Sequence[stage_pb2.LogitProbe], tokens: int, vocab: int
) -> str | None:
    """Why a request's probes cannot be answered (None when they can)."""
    previous = -1
    for probe in probes:
        if probe.position <= previous or probe.position >= tokens:
            return (
                f"probe positions must increase strictly within the input's {tokens} "
                f"position(s); got {probe.position} after {previous}"
            )
        previous = probe.position
        if len(probe.token_ids) > MAX_PROBE_IDS:
            return f"a probe names {len(probe.token_ids)} token ids; at most {MAX_PROBE_IDS}"
        bad = next((i for i in probe.token_ids if i >= vocab), None)
        if bad is not None:
            return f"probed token id {bad} is outside the vocabulary [0, {vocab})"
    return None
