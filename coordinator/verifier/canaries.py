"""Canaries: spot-check inputs the coordinator sends to nodes, with known right answers.

They catch lazy nodes (zeros, echoed input, stale answers) even when no client samples
them. Each (model, layer range) has a small pool of canaries, derived from a seed: token
ids for a range that starts at layer 0, hidden states otherwise. A round picks one canary
per stage of the model's layout and sends it to every ready holder covering that stage,
over the ordinary data plane with a capability that looks like any client's
(coordinator/verifier/stage_runner.py).

The reference answer is not computed by the coordinator: it is established the first time
two holders of independent operators agree on it, and then stored (``canary_references``).
From then on an answer that disagrees with it is a signed wrong output on a known input:
the node is convicted like a loser of arbitration. Holders that answered before the
reference existed are judged as soon as it does. Agreement is measured with the same
tolerance as everywhere else, so honest nodes of other hardware and dtypes pass; the
honest errors seen per (device kind, dtype) pair are logged at debug level to calibrate
it (see docs/verification.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from protos import codec, output_check
from protos.tessera.v1 import common_pb2

if TYPE_CHECKING:
    from coordinator.verifier.service import NodeFacts, Verifier

log = logging.getLogger("tessera.verifier.canaries")

POOL = 8  # canaries per (model, layer range)
# Warn when an honest pair's error passes this share of its tolerance.
CALIBRATION_WARNING = 0.2
TOKENS = 8  # positions per canary


@dataclass
class _Answer:
    facts: NodeFacts
    output: np.ndarray
    dtype: str
    signature: bytes
    session_id: str
    # A reference must be real work: not zeros, and not the canary's input handed back.
    plausible: bool
    layers: int  # how many layers the canary ran through (its tolerance grows with them)


@dataclass
class _Reference:
    output: np.ndarray
    dtype: str
    agreed_by: list[tuple[str, str, str]]  # (node id, device kind, compute dtype)

    def tolerance(self, facts: NodeFacts, layers: int) -> float:
        mine = (facts.device_kind, facts.compute_dtype)
        return max(
            output_check.pair_tolerance(mine, (k, d), layers=layers) for _, k, d in self.agreed_by
        )


class Canaries:
    def __init__(self, verifier: Verifier) -> None:
        self._verifier = verifier
        self._rng = random.Random()
        self._references: dict[str, _Reference] = {}
        self._pending: dict[str, list[_Answer]] = {}
        self._calibration: dict[str, dict[str, Any]] = {}
        self.rounds = 0

    async def run_forever(self, interval_s: float) -> None:
        self._load()
        while True:
            # Jitter: canaries must not arrive on a clock a node could learn.
            await asyncio.sleep(interval_s * self._rng.uniform(0.5, 1.5))
            try:
                await self.run_round()
            except Exception:  # the loop must outlive any one bad round
                log.exception("canary round failed")

    def _load(self) -> None:
        db = self._verifier._ctx.db
        for row in db["canary_references"].rows:
            array = np.frombuffer(row["data"], codec_dtype(row["dtype"])).reshape(
                json.loads(row["shape"])
            )
            self._references[row["key"]] = _Reference(
                array, row["dtype"], [tuple(x) for x in json.loads(row["agreed_by"])]
            )

    async def run_round(self) -> None:
        """One canary to every ready holder of every (model, layer range)."""
        ctx = self._verifier._ctx
        store, planner = ctx.model_store, ctx.planner
        if store is None or planner is None:
            return
        self.rounds += 1
        for record in store.models():
            # Canaries run the stages routes use, so a middle stage gets hidden states.
            cuts = planner.boundaries(record.name) or [0, record.num_layers]
            ranges: dict[tuple[int, int], list[NodeFacts]] = {}
            for holder in planner.ready_holders(record.name):
                facts = self._verifier.node_facts(holder.node_id)
                if facts is None or not self._verifier.routable(holder.node_id):
                    continue
                for start, end in zip(cuts, cuts[1:], strict=False):
                    if holder.start <= start and end <= holder.end:
                        ranges.setdefault((start, end), []).append(facts)
            for (start, end), holders in ranges.items():
                index = self._rng.randrange(POOL)
                key = f"{record.name}:{start}:{end}:{index}"
                chunk = canary_input(key, start, record.hidden_size, record.vocab_size)
                await asyncio.gather(
                    *(self._probe(key, record.name, start, end, chunk, h, holders) for h in holders)
                )

    async def _probe(
        self,
        key: str,
        model: str,
        start: int,
        end: int,
        chunk: common_pb2.Tensor,
        facts: NodeFacts,
        holders: list[NodeFacts],
    ) -> None:
        # Granted alongside, as a route's alternates would be.
        others = [h.node_id for h in holders if h.node_id != facts.node_id]
        try:
            run = await self._verifier.runner.run(
                facts.node_id,
                facts.address,
                model,
                start,
                end,
                [chunk],
                also_granted=self._rng.sample(others, min(2, len(others))),
            )
        except (grpc.aio.AioRpcError, ConnectionError) as err:
            log.info("canary to %s did not run: %s", facts.node_id, err)
            return
        out = run.response.output
        try:
            array = codec.decode(out, finite=False)
        except codec.TensorError as err:
            log.warning("canary answer of %s is malformed: %s", facts.node_id, err)
            return
        plausible = bool(np.any(array)) and not _echoes(array, out.dtype, chunk)
        answer = _Answer(
            facts, array, out.dtype, run.response.signature, run.session_id, plausible, end - start
        )
        self._judge(key, answer)

    def _judge(self, key: str, answer: _Answer) -> None:
        reference = self._references.get(key)
        if reference is not None:
            self._against(key, reference, answer)
            return
        pending = self._pending.setdefault(key, [])
        for other in pending:
            if not (answer.plausible and other.plausible):
                continue
            if other.facts.node_id == answer.facts.node_id:
                continue
            if other.facts.account and other.facts.account == answer.facts.account:
                continue  # one operator's nodes never vouch for each other
            tolerance = output_check.pair_tolerance(
                (answer.facts.device_kind, answer.facts.compute_dtype),
                (other.facts.device_kind, other.facts.compute_dtype),
                layers=answer.layers,
            )
            error = output_check.relative_error(
                answer.output, answer.dtype, other.output, other.dtype
            )
            if error <= tolerance:
                peer = (other.facts.device_kind, other.facts.compute_dtype)
                self._calibrate(answer.facts, [peer], error, tolerance)
                reference = self._establish(key, other, answer)
                for earlier in pending:
                    if earlier is not other:
                        self._against(key, reference, earlier)
                self._verifier.reputation.verified(answer.facts.node_id, canary=True)
                self._verifier.reputation.verified(other.facts.node_id, canary=True)
                del self._pending[key]
                return
        pending.append(answer)

    def _calibrate(
        self, facts: NodeFacts, peers: list[tuple[str, str]], error: float, tolerance: float
    ) -> None:
        """Record the honest error of a passing pair, per (device kind, dtype) pair: the
        data the tolerances are calibrated from. An honest error creeping towards its
        tolerance is a false positive in the making, and is said loudly, each time the
        pair's largest error grows: a GPU bf16 pair sits near a quarter of its tolerance on
        every canary (bench/cuda_check.py), which once is news and each time is noise."""
        mine = (facts.device_kind, facts.compute_dtype)
        for peer in peers:
            key = pair_key(mine, peer)
            row = self._calibration.get(key, {"comparisons": 0, "max_error": 0.0})
            new_high = error > row["max_error"]
            row = {
                "pair": key,
                "comparisons": row["comparisons"] + 1,
                "max_error": max(row["max_error"], error),
                # The tolerance of the comparison that set max_error (it grows with depth).
                "tolerance": tolerance if new_high else row.get("tolerance", tolerance),
                "updated_ms": int(time.time() * 1000),
            }
            self._calibration[key] = row
            self._verifier._ctx.db["canary_calibration"].upsert(row, pk="pair")
            if new_high and error > tolerance * CALIBRATION_WARNING:
                log.warning(
                    "honest canary error %.3g on %s is over %.0f%% of its tolerance %.3g: "
                    "widen the tolerance for this pair before it flags honest nodes",
                    error, key, 100 * CALIBRATION_WARNING, tolerance,
                )  # fmt: skip

    def _establish(self, key: str, first: _Answer, second: _Answer) -> _Reference:
        agreed = [
            (a.facts.node_id, a.facts.device_kind, a.facts.compute_dtype) for a in (first, second)
        ]
        reference = _Reference(first.output, first.dtype, agreed)
        self._references[key] = reference
        self._verifier._ctx.db["canary_references"].upsert(
            {
                "key": key,
                "dtype": first.dtype,
                "shape": json.dumps(list(first.output.shape)),
                "data": np.ascontiguousarray(first.output).tobytes(),
                "agreed_by": json.dumps(agreed),
                "ts_ms": int(time.time() * 1000),
            },
            pk="key",
        )
        log.info("canary %s: reference agreed by %s and %s", key, agreed[0][0], agreed[1][0])
        return reference

    def _against(self, key: str, reference: _Reference, answer: _Answer) -> None:
        facts = answer.facts
        error = output_check.relative_error(
            answer.output, answer.dtype, reference.output, reference.dtype
        )
        tolerance = reference.tolerance(facts, answer.layers)
        log.debug(
            "canary %s on %s (%s, %s): relative error %.3g (tolerance %.3g)",
            key, facts.node_id, facts.device_kind, facts.compute_dtype, error, tolerance,
        )  # fmt: skip
        if error <= tolerance:
            peers = [(kind, dtype) for _, kind, dtype in reference.agreed_by]
            self._calibrate(facts, peers, error, tolerance)
            self._verifier.reputation.verified(facts.node_id, canary=True)
            return
        evidence = hashlib.sha256(answer.signature + key.encode()).hexdigest()
        self._verifier.convict(
            facts.node_id,
            facts.account,
            answer.session_id,
            "canary",
            f"canary {key}: relative error {error:.3g} against the reference agreed by "
            f"{', '.join(n for n, _, _ in reference.agreed_by)} (tolerance {tolerance:.3g})",
            np.ascontiguousarray(answer.output).tobytes(),
            evidence,
            canary=True,
        )


def pair_key(a: tuple[str, str], b: tuple[str, str]) -> str:
    """'cpu/float32~cuda/float16': one row per unordered (device kind, dtype) pair."""
    return "~".join(sorted(f"{kind}/{dtype}" for kind, dtype in (a, b)))


def _echoes(array: np.ndarray, dtype: str, chunk: common_pb2.Tensor) -> bool:
    if list(chunk.shape) != list(array.shape) or chunk.dtype not in codec.FLOAT_DTYPES:
        return False
    sent = codec.decode(chunk)
    return output_check.relative_error(array, dtype, sent, chunk.dtype) < 1e-3


def codec_dtype(dtype: str) -> np.dtype:
    return np.dtype({"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype])


def canary_input(key: str, start: int, hidden_size: int, vocab_size: int) -> common_pb2.Tensor:
    """The canary's input tensor, the same every time for one key."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    if start == 0:
        return codec.encode(rng.integers(0, vocab_size, (1, TOKENS), dtype=np.int64), "int64")
    hidden = rng.standard_normal((1, TOKENS, hidden_size)).astype(np.float32)
    return codec.encode(hidden, "float32")
