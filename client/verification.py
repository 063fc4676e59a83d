"""Driver-side verification: signed replies and sampled redundant execution.

Every stage reply must carry the node's Ed25519 signature over (session, step, layers,
input-prefix digest, sha256 of the output), checked with the key the coordinator put in
the session's capability. A missing or wrong signature is a failure of that node, and the
driver's fail-over takes it from there.

For a fraction of calls (the node's ``check_probability``, set by the coordinator from its
reputation) the same input also goes to an independent replica: another node of the
stage, never one of the same operator account. The replica first catches up on the
inputs its cache has not seen (it keeps the session's cache between checks, so that costs
only the tokens since its last check), then runs the very call the primary answered. The
two outputs are compared within the tolerance of the looser (device kind, dtype) of the
pair (protos.output_check). Agreements are reported in batches; a mismatch is reported at
once, with both signed outputs and the input prefix, and the coordinator's arbiter
decides. A primary that loses is rejected, so the driver fails over and replays on
another node: the client never keeps a wrong output, and greedy output equals an honest
run. (Client.generate lets the pipeline run ahead of the checks and holds each token back
until the checks it depends on have settled; a rejection rolls the generation back to the
step it concerned: client/driver.py.)

A catch-up is also an audit. The checker replays the positions it missed, so its answer
holds its own output for each of them, and the client holds the primary's signed output
for the same positions (the next hop's input). Every earlier step that had no check of its
own is compared there too, at no extra compute. The model's last hop answers logits, which
no hop takes as input: the client keeps those rows itself (client/kept_logits.py), and the
checker's catch-up answers a small probe per position (protos/logit_probes.py) besides the
whole row at its last position. A mismatch is settled like a check's: the
checker runs that very step again, and the two signed answers go to the arbiter. A primary
proven wrong that way is banned like any other, but the tokens that followed its answer
may have been yielded already; the driver stops the generation with ``OutputTainted``
instead of going on from a history it knows is wrong (docs/verification.md, "Audits").

A fail-over's replay is an audit too: the replacement recomputes every position of the
span, and the client holds what the failed node (or any earlier primary) signed for them.
Only a step that disagrees is settled differently: running it again on the replacement
would roll back the cache its pipeline calls use, so that waits for the session's end,
and a primary proven wrong then taints the generation as above.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np

from client.channels import ChannelPool
from client.kept_logits import KeptLogits
from client.records import HopRecord
from client.route_history import RouteHistory, Span
from protos import codec, identity, logit_probes, output_check
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    ledger_pb2,
    stage_pb2,
    stage_pb2_grpc,
    verification_pb2,
)

log = logging.getLogger(__name__)

Reporter = Callable[
    [verification_pb2.VerificationReport], Awaitable[verification_pb2.ReportVerdict]
]
Outcome = verification_pb2.Verdict.Outcome


T = TypeVar("T")
END_SESSION_TIMEOUT_S = 2.0
# A checker's catch-up goes in chunks of at most this many positions (the driver's prefill
# chunk), far below what a node accepts in one request.
CATCH_UP_CHUNK_TOKENS = 512
# On the model's last hop a catch-up call's probes make the checker compute a logits row
# per probed position: calls are cut so that those rows stay within this many bytes (a
# node refuses more than fit its output limit, 63 MiB).
PROBE_ROWS_BYTES = 32 << 20
# Audit agreements go to the coordinator (they earn the nodes trust) with the next report,
# or on their own once this many wait; at most AUDITS_PER_REPORT in one report.
AUDITS_TO_FLUSH = 256
AUDITS_PER_REPORT = 1024


@dataclass
class _CheckerStream:
    address: str
    call: grpc.aio.StreamStreamCall
    capability_sent: bytes = b""
    # The message written and not answered yet: (monotonic time written, its span, its
    # tokens). A checker given up on had not done that much work in that long.
    outstanding: tuple[float, Span, int] | None = None


class PendingCheck:
    """A redundant check under way: the checker runs the primary's call meanwhile.

    ``deadline`` (monotonic seconds) is how long the client waits for the checker once the
    primary has answered (``StageVerifier.check_reply``): past it the call goes unchecked
    instead of holding its token back."""

    def __init__(
        self,
        verifier: StageVerifier,
        checker: HopRecord,
        task: asyncio.Task[stage_pb2.ForwardResponse],
    ) -> None:
        self._verifier = verifier
        self.checker = checker
        self.task = task
        self.deadline = math.inf

    def ready(self) -> bool:
        """Settling it waits for nothing: the checker answered, or it is too late to."""
        return self.task.done() or time.monotonic() >= self.deadline

    def cancel(self) -> None:
        """The primary's call failed: its check is moot. A check cancelled mid-call closes
        its checker's stream itself (an answer may still be on its way); one still queued
        behind other work on that stream just leaves the queue."""
        if not self.task.done():
            self.task.cancel()


class NodeRejected(Exception):
    """The node's reply cannot be used: bad signature, or it lost an arbitration."""


class CheckerServes(Exception):
    """Check work not run: its checker serves that span in the pipeline now."""


@dataclass(frozen=True)
class _SignedStep:
    """A primary's signed answer for one step of a hop: what an audit compares a checker's
    catch-up with, and the evidence if they disagree. The output itself is the next hop's
    input, kept in the route history; on the model's last hop it is the logits of the
    step's last position, ``end_pos - 1``, kept apart (client/kept_logits.py)."""

    node_id: str
    step: int
    start_pos: int
    end_pos: int
    input_digest: bytes
    output_sha256: bytes
    signature: bytes

    def evidence(self, span: Span) -> verification_pb2.SignedOutput:
        return verification_pb2.SignedOutput(
            node_id=self.node_id,
            step=self.step,
            layers=common_pb2.LayerRange(start=span.start, end=span.end),
            input_digest=self.input_digest,
            output_sha256=self.output_sha256,
            signature=self.signature,
        )


@dataclass(frozen=True)
class AuditFinding:
    """A catch-up disagreed with a primary's earlier answer that had no check of its own,
    and the arbiter ruled (``outcome``: PRIMARY_WRONG, CHECKER_WRONG or UNRESOLVED)."""

    node_id: str
    layer_start: int
    layer_end: int
    step: int
    start_pos: int
    end_pos: int
    outcome: str

    def to_json(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "layers": [self.layer_start, self.layer_end],
            "step": self.step,
            "positions": [self.start_pos, self.end_pos],
            "outcome": self.outcome,
        }


@dataclass
class VerificationStats:
    """What this session's verification did, per node and in total."""

    calls: dict[str, int] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    # Per checker: checks given up on because it answered too long after the primary
    # (a starved or hung machine); its calls went unchecked and it checked no more.
    late: dict[str, int] = field(default_factory=dict)
    verdicts: list[verification_pb2.Verdict] = field(default_factory=list)
    risk: verification_pb2.SessionRisk | None = None
    # (primary, checker) pairs that were compared: two nodes of one operator never appear.
    pairs: list[tuple[str, str]] = field(default_factory=list)
    # The driver's step of every call a check was sent for (compared or not): which steps
    # had a second node computing beside the primary.
    check_steps: list[int] = field(default_factory=list)
    # The checkers' work, in layer-positions (positions x the span's layers): all of it, and
    # the part that only brought a checker's cache up to the checked call. A span's first
    # check in a session replays its whole history so far, so catch-ups, not the checked
    # calls themselves, are most of what checking costs.
    checker_layer_tokens: int = 0
    catch_up_layer_tokens: int = 0
    # Layer-positions of primaries' unchecked steps that a catch-up compared (audits), and
    # what the audits found (nothing, on an honest swarm).
    audited_layer_tokens: int = 0
    # Per node: its steps that an audit compared and found right (each at most once).
    audited: dict[str, int] = field(default_factory=dict)
    findings: list[AuditFinding] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        risk = self.risk
        return {
            "calls": sum(self.calls.values()),
            "checked": sum(self.checked.values()),
            "mismatches": self.mismatches,
            # Checks given up on, by checker: it answered too long after the primary.
            "late_checks": dict(self.late),
            "verdicts": [verification_pb2.Verdict.Outcome.Name(v.outcome) for v in self.verdicts],
            # The coordinator's figures: P(a node corrupting f of its outputs got through).
            "detection_probability": risk.detection_probability if risk else None,
            "undetected_probability": risk.undetected_probability if risk else None,
            "assumed_corruption": risk.assumed_corruption if risk else None,
            "checker_layer_tokens": self.checker_layer_tokens,
            "catch_up_layer_tokens": self.catch_up_layer_tokens,
            "audited_layer_tokens": self.audited_layer_tokens,
            "audited": sum(self.audited.values()),
            "audit_findings": [f.to_json() for f in self.findings],
        }


class StageVerifier:
    """Checks every reply of one session; samples some for redundant execution."""

    def __init__(
        self,
        session_id: str,
        channels: ChannelPool,
        reporter: Reporter | None = None,
        *,
        rng: random.Random | None = None,
        report_every: int = 32,
        timeout_s: float = 120.0,
        patience_floor_s: float = 10.0,
        patience_factor: float = 8.0,
    ) -> None:
        self.session_id = session_id
        # Once the primary has answered, its checker gets max(floor, factor x the
        # primary's time for the same work) more, up to ``timeout_s`` (``_patience``).
        self._patience_floor_s = patience_floor_s
        self._patience_factor = patience_factor
        self._channels = channels
        self._reporter = reporter
        self._rng = rng or random.Random()
        self._report_every = report_every
        self._timeout_s = timeout_s
        self._grants: dict[str, client_api_pb2.Hop] = {}
        self._keyed = False
        self._grants_from: bytes = b""
        self._capability = client_api_pb2.SignedCapability()
        # Positions of a checker's cache that match our history, per (node, span).
        self._synced: dict[tuple[str, Span], int] = {}
        self._unfit_checkers: set[str] = set()
        self._streams: dict[str, _CheckerStream] = {}
        self._pending: list[verification_pb2.Comparison] = []
        self._audits: list[verification_pb2.AuditAgreement] = []
        self._flushing: asyncio.Task[None] | None = None
        # Work on each checker's stream (checks, catch-ups) takes turns on a lock per node;
        # all of it is kept, so that the session's end can cancel what is left.
        self._turns: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        # Per checker node: the span of the work on its stream now, and that work.
        self._running: dict[str, tuple[Span, asyncio.Task[object]]] = {}
        # Per span: the node a fail-over or a hedge moved it to (``serving``), whose cache
        # for the span is the pipeline's now: no check work of the span goes to it.
        self._serving: dict[Span, str] = {}
        # Per span: (primary, checker or None) drawn for the span's next call.
        self._drawn: dict[Span, tuple[str, HopRecord | None]] = {}
        self.stats = VerificationStats()
        # Per hop: the primaries' signed answers an audit may compare (docstring), and the
        # steps that had a check of their own (an audit leaves those to it).
        self._signed_steps: dict[Span, list[_SignedStep]] = {}
        self._model = ""
        self._checked_steps: set[tuple[Span, int]] = set()
        # The last hop's unchecked answers (logits), by (span, step), until audited; kept
        # only for a span whose primary a checker may be drawn for.
        self._rows = KeptLogits()
        self._auditable: dict[Span, bool] = {}
        self._vocab = 0  # the width of the last hop's rows, once one came
        # (checker, span): a catch-up answer to compare again at the span's next call, its
        # last steps' primary answers having come in after it (``_audit``).
        self._late: dict[
            tuple[str, Span], tuple[HopRecord, stage_pb2.ForwardRequest, stage_pb2.ForwardResponse]
        ] = {}
        # Re-runs of a step an audit found wrong: the session's end waits for their verdicts.
        self._rechecks: set[asyncio.Task[None]] = set()
        # Steps a fail-over's replay doubted, to run again on its node when the session
        # ends (``_audit``): now it would roll back the cache the pipeline is using there.
        self._rechecks_at_end: list[tuple[HopRecord, Span, _SignedStep, RouteHistory]] = []
        # Told (node, layer start, layer end, tokens) of every check sent: the checker's
        # usage receipt counts them, and the client does not pay for them (client/billing).
        self.on_check_sent: Callable[[str, int, int, int], None] | None = None
        # Told (checker, layer start, layer end, its usage receipt) of every check answered,
        # and awaited (checker, layer start, layer end) before every check is sent: a paid
        # session acknowledges checkers' receipts too (client/acknowledgments.py).
        self.on_check_answered: (
            Callable[[HopRecord, int, int, ledger_pb2.SignedUsage], None] | None
        ) = None
        self.before_check: Callable[[HopRecord, int, int], Awaitable[None]] | None = None
        # Told (node, layer start, layer end, tokens, ms) of a checker given up on: it had
        # not answered a message of that many tokens in that long, a lower bound of its
        # time that the coordinator's measured speed of the node learns from (the driver's
        # ReportStepTimes), as it learns a hedged straggler's.
        self.on_late: Callable[[str, int, int, int, float], None] | None = None

    # ---- the hooks the driver calls around every call -------------------------------

    def begin(
        self,
        capability: client_api_pb2.SignedCapability,
        hop: HopRecord,
        alternates: list[HopRecord],
        request: stage_pb2.ForwardRequest,
        history: RouteHistory,
        *,
        replay: bool = False,
    ) -> PendingCheck | None:
        """Decide whether to check this call and, if so, send it to a checker now.

        Called as the request goes to the primary: the checker needs only the request and
        the history, so it computes while the primary does instead of after it. The draw
        does not depend on the reply, so it may come early: the draw for a span's NEXT
        call is made now too, and that checker catches up on the inputs its cache lacks,
        this call's included, while the pipeline runs. When the check comes, the checker
        runs one call, about as fast as the primary, instead of a catch-up first.
        """
        self._load_grants(capability)
        if not self._keyed:
            return None
        span = Span(request.layers.start, request.layers.end)
        for key in [k for k in self._synced if k[1] == span]:
            self._synced[key] = min(self._synced[key], request.start_pos)
        if replay:
            return None  # replays rebuild a cache after a fail-over; they are not sampled
        if request.last_position_only:
            # Worth keeping the last hop's rows for (``_keep_signed``) only if a catch-up
            # may come: a checker can be drawn for this primary.
            grant = self._grants.get(hop.node_id)
            self._auditable[span] = bool(
                grant is not None and grant.check_probability > 0
            ) and bool(self._fit_checkers(hop, alternates))
        for key in [k for k in self._late if k[1] == span]:
            late_checker, message, answer = self._late.pop(key)
            self._audit(late_checker, [message], [answer], history, again_later=False)
        drawn = self._drawn.pop(span, None)
        if drawn is None or drawn[0] != hop.node_id:
            checker = self._draw(hop, alternates)  # a span's first call, or a new primary
        else:
            checker = drawn[1]
            if checker is not None and checker.node_id in self._unfit_checkers:
                checker = None
        pending = None
        if checker is not None:
            check = checker
            task = self._queue(
                check, span, lambda: self._run_checker(check, span, request, history)
            )
            pending = PendingCheck(self, check, task)
            self.stats.check_steps.append(request.step)
            self._checked_steps.add((span, request.step))
        upcoming = self._draw(hop, alternates)
        self._drawn[span] = (hop.node_id, upcoming)
        if upcoming is not None and upcoming != checker:
            warm = upcoming
            self._queue(warm, span, lambda: self._warm_up(warm, span, request, history))
        return pending

    def _draw(self, hop: HopRecord, alternates: list[HopRecord]) -> HopRecord | None:
        """With the node's checking probability, a checker for one of its calls."""
        grant = self._grants.get(hop.node_id)
        if grant is None or self._rng.random() >= grant.check_probability:
            return None
        return self._pick_checker(hop, alternates)

    def _queue(
        self,
        checker: HopRecord,
        span: Span,
        work: Callable[[], Awaitable[T]],
        *,
        while_serving: bool = False,
    ) -> asyncio.Task[T]:
        """Run ``work`` (of ``span``) on the checker's stream once the work queued before
        it is done: one call at a time on a stream, in the order queued (the lock is fair).
        A task cancelled while it waits leaves the queue without breaking it; one cancelled
        in the middle of its calls closes the stream, whose next answer would be its own.
        Work whose turn comes once the checker serves the span raises CheckerServes,
        unless ``while_serving`` (it then sees to that itself)."""
        node_id = checker.node_id
        turn = self._turns.setdefault(node_id, asyncio.Lock())

        async def run() -> T:
            async with turn:
                if not while_serving and self._serving.get(span) == node_id:
                    raise CheckerServes(f"node {node_id} serves layers {span} in the pipeline")
                current = asyncio.current_task()
                assert current is not None
                self._running[node_id] = (span, current)
                try:
                    return await work()
                except asyncio.CancelledError:
                    self._close_stream(node_id)
                    raise
                finally:
                    self._running.pop(node_id, None)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)  # type: ignore[arg-type]

        def settled(done: asyncio.Task[T]) -> None:
            self._tasks.discard(done)  # type: ignore[arg-type]
            if not done.cancelled():
                done.exception()  # retrieved: a check nobody awaits is not "lost"

        task.add_done_callback(settled)
        return task

    def check_reply(
        self,
        capability: client_api_pb2.SignedCapability,
        hop: HopRecord,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
        *,
        replay: bool = False,
        pending: PendingCheck | None = None,
        history: RouteHistory | None = None,
        wall_s: float | None = None,
    ) -> PendingCheck | None:
        """Check the reply's signature now, before its output is used; raises
        NodeRejected when it must not be used. ``wall_s``: how long the primary took, from
        which the check's deadline is set (``_patience``).

        Returns the redundant check still to be settled (``pending``, None when there is
        none): the driver passes the output on and settles the check with ``settle``
        before the step's result is returned, so the checker's answer is awaited while
        the rest of the pipeline runs instead of on every hop's critical path.

        A ``replay`` (a fail-over rebuilding a replacement's cache) is also an audit, as a
        checker's catch-up is: the replacement recomputes positions whose outputs another
        node signed, and with ``history`` those are compared at no extra compute.
        """
        try:
            self._load_grants(capability)
            if not self._keyed:
                return None  # a coordinator without verification: nothing to check against
            output_sha256 = self._check_signature(hop.node_id, request, response)
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        if replay:
            if history is not None:
                self._audit(hop, [request], [response], history, again_later=False,
                            recheck_at_end=True)  # fmt: skip
            return None
        self.stats.calls[hop.node_id] = self.stats.calls.get(hop.node_id, 0) + 1
        self._keep_signed(hop.node_id, request, response, output_sha256)
        if pending is not None and wall_s is not None:
            pending.deadline = time.monotonic() + self._patience(pending.checker, request, wall_s)
        return pending

    def _patience(
        self, checker: HopRecord, request: stage_pb2.ForwardRequest, wall_s: float
    ) -> float:
        """How long to wait for a check once its primary answered in ``wall_s``: the
        factor times the primary's time, scaled by what the checker computes for it (the
        call, and the positions its cache still lacks, counted as if each cost as much as
        the call's: a catch-up is batched, so that is generous), never under the floor
        nor over the check timeout. A checker starved or hung by its machine then costs a
        token seconds, not the whole timeout; the call goes unchecked."""
        span = Span(request.layers.start, request.layers.end)
        positions = max(1, int(request.input.shape[1]))
        end = request.start_pos + positions
        behind = max(positions, end - self._synced.get((checker.node_id, span), 0))
        wanted = self._patience_factor * wall_s * behind / positions
        return min(self._timeout_s, max(self._patience_floor_s, wanted))

    def _keep_signed(
        self,
        node_id: str,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
        output_sha256: bytes,
    ) -> None:
        shape = list(response.output.shape)
        logits = request.last_position_only
        if len(shape) != 3 or (logits and shape[:2] != [1, 1]):
            return  # only batch 1 is audited on the last hop (probes read one row)
        self._model = request.model
        span = Span(request.layers.start, request.layers.end)
        start = request.start_pos
        kept = self._signed_steps.setdefault(span, [])
        # A step at an earlier position rolled the session back: what was kept from there on
        # is gone from the history too.
        at = bisect.bisect_left(kept, start, key=lambda r: r.start_pos)
        for gone in kept[at:]:
            self._rows.pop((span, gone.step))
        del kept[at:]
        kept.append(
            _SignedStep(
                node_id=node_id,
                step=response.step,
                start_pos=start,
                end_pos=start + int(request.input.shape[1]),
                input_digest=response.input_digest,
                output_sha256=output_sha256,
                signature=response.signature,
            )
        )
        if (
            logits
            and self._auditable.get(span, False)
            and (span, response.step) not in self._checked_steps
        ):
            self._rows.keep((span, response.step), response.output)
            self._vocab = int(shape[-1])

    async def settle(
        self,
        hop: HopRecord,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
        history: RouteHistory,
        pending: PendingCheck,
    ) -> None:
        """Compare the checker's answer with the primary's (whose signature
        ``check_reply`` accepted); raises NodeRejected when the primary must not be
        trusted. An unusable checker says nothing about the primary: it returns."""
        checker = pending.checker
        if not pending.task.done():
            left = pending.deadline - time.monotonic()
            await asyncio.wait({pending.task}, timeout=None if math.isinf(left) else max(0, left))
        if not pending.task.done():
            self._given_up(hop, pending)
            return
        try:
            checked = await pending.task
            if list(checked.output.shape) != list(response.output.shape):
                raise NodeRejected(
                    f"checker answered shape {list(checked.output.shape)}, the primary "
                    f"{list(response.output.shape)}"
                )
        except CheckerServes as err:  # the call goes unchecked; the checker did no wrong
            log.info("check of %s not run: %s", hop.node_id, err)
            return
        except Exception as err:  # a broken stream surfaces in several shapes
            # An unusable checker says nothing about the primary; don't ask it again.
            log.warning("checker %s could not check %s: %s", checker.node_id, hop.node_id, err)
            if checker.node_id not in self._running:
                # Work on a stream closes it itself when it fails; the stream there now may
                # be newer work's, which this would break under it.
                self._close_stream(checker.node_id)
            self._unfit_checkers.add(checker.node_id)
            return
        if checked.input_digest != response.input_digest:
            # The two caches saw different histories (e.g. a dtype-widened replay): their
            # outputs are not comparable, and not evidence of anything.
            log.info("checker %s holds another input history; not compared", checker.node_id)
            return
        await self._compare(hop, checker, request, response, checked, history)

    def _given_up(self, hop: HopRecord, pending: PendingCheck) -> None:
        checker = pending.checker.node_id
        log.warning(
            "checker %s did not answer in time (its deadline passed); the call of %s goes "
            "unchecked, and %s checks nothing more in this session",
            checker, hop.node_id, checker,
        )  # fmt: skip
        stream = self._streams.get(checker)
        if stream is not None and stream.outstanding is not None and self.on_late is not None:
            written, span, tokens = stream.outstanding
            stream.outstanding = None  # reported once, however many checks wait behind it
            waited_ms = (time.monotonic() - written) * 1e3
            self.on_late(checker, span.start, span.end, tokens, waited_ms)
        pending.cancel()  # mid-call, that closes its stream: the answer would be stale
        self._unfit_checkers.add(checker)
        self.stats.late[checker] = self.stats.late.get(checker, 0) + 1

    def avoid(self, node_id: str) -> None:
        """The driver left this node (a straggler it hedged away from, or one it failed
        over from): run no more checks on it in this session, including on the spans it
        was already drawn to check. Too slow for the pipeline, it would hold each checked
        token back; hung (a PC gone to sleep), for the whole patience. Checks already
        under way settle as they would."""
        self._unfit_checkers.add(node_id)

    async def serving(self, node_id: str, span: Span, *, wait: bool = True) -> None:
        """``node_id`` serves ``span`` in the pipeline from now on (a fail-over's or a
        hedge's replacement), so its cache for the span is the pipeline's. Check work of
        the span queued for it is dropped (a doubted step's re-run waits for the session's
        end), and with ``wait`` the work it runs now is waited for (cancelled past the
        check timeout): a catch-up that lands on that cache after the pipeline's replay
        would roll it back, and the next step would find positions missing."""
        self._serving[span] = node_id
        self._synced.pop((node_id, span), None)
        running = self._running.get(node_id)
        if wait and running is not None and running[0] == span:
            done, _ = await asyncio.wait({running[1]}, timeout=self._timeout_s)
            if not done:
                running[1].cancel()

    async def finish(self) -> verification_pb2.SessionRisk | None:
        """Settle what replays doubted, end the checkers' caches, send what is left to
        report; returns the coordinator's risk figures."""
        self._serving.clear()  # the pipeline is done with every cache
        for checker, span, step, history in self._rechecks_at_end:
            self._recheck_later(checker, span, step, history)
        self._rechecks_at_end.clear()
        await self._end_checker_sessions()
        if self._reporter is None or not self._keyed:
            return None  # nothing was checked: a coordinator without a verifier
        if self._flushing is not None:
            await self._flushing
        try:
            verdict = await self._report()
            while self._audits:  # more than one report holds
                verdict = await self._report()
        except grpc.aio.AioRpcError as err:
            log.warning("verification report failed: %s: %s", err.code().name, err.details())
            return None
        return verdict.risk

    async def _end_checker_sessions(self) -> None:
        for task in list(self._tasks):
            if task not in self._rechecks:
                task.cancel()
        if self._rechecks:
            # An audit's verdict is what bans a node that cheated unchecked: worth a wait.
            await asyncio.wait(list(self._rechecks), timeout=self._timeout_s)
            for task in list(self._rechecks):
                task.cancel()
        streams, self._streams = self._streams, {}
        request = stage_pb2.EndSessionRequest(
            session_id=self.session_id, capability=self._capability
        )

        async def end(stream: _CheckerStream) -> None:
            stream.call.cancel()
            stub = stage_pb2_grpc.StageStub(self._channels.get(stream.address))
            try:
                await stub.EndSession(request, timeout=END_SESSION_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:  # best effort: idle caches expire anyway
                log.debug("EndSession on checker: %s", err.code().name)

        await asyncio.gather(*(end(s) for s in streams.values()))

    # ---- signatures -----------------------------------------------------------------

    def _load_grants(self, capability: client_api_pb2.SignedCapability) -> None:
        if capability.signature == self._grants_from:
            return
        claims = client_api_pb2.CapabilityClaims()
        claims.ParseFromString(capability.claims)
        self._grants = {g.node_id: g for g in claims.grants}
        self._keyed = any(g.public_key for g in claims.grants)
        if not self._keyed:
            log.warning("the coordinator sent no node keys: stage replies go unverified")
        self._grants_from = capability.signature
        self._capability = capability

    def _check_signature(
        self,
        node_id: str,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
    ) -> bytes:
        """Raise NodeRejected unless ``node_id`` signed ``response`` to ``request``; returns
        the sha256 of its output, which the signature covers."""
        grant = self._grants.get(node_id)
        if grant is None or not grant.public_key:
            raise NodeRejected(f"the session's capability carries no key for node {node_id}")
        output_sha256 = hashlib.sha256(response.output.data).digest()
        payload = identity.output_payload(
            request.session_id,
            response.step,
            request.layers.start,
            request.layers.end,
            output_sha256,
            input_digest=response.input_digest,
        )
        if not response.signature:
            raise NodeRejected(f"node {node_id} sent an unsigned output")
        if len(response.input_digest) != output_check.DIGEST_BYTES:
            # Without it the signature would not commit to the input history.
            raise NodeRejected(f"node {node_id} signed no digest of its input history")
        if not identity.verify(grant.public_key, response.signature, payload):
            raise NodeRejected(f"node {node_id} sent an output whose signature does not verify")
        return output_sha256

    # ---- redundant execution --------------------------------------------------------

    def _pick_checker(self, hop: HopRecord, alternates: list[HopRecord]) -> HopRecord | None:
        """A random independent replica: another node and, where known, another operator."""
        fit = self._fit_checkers(hop, alternates)
        return self._rng.choice(fit) if fit else None

    def _fit_checkers(self, hop: HopRecord, alternates: list[HopRecord]) -> list[HopRecord]:
        primary = self._grants.get(hop.node_id)
        account = primary.account if primary is not None else ""
        return [
            h
            for h in alternates
            if h.node_id != hop.node_id
            and h.node_id not in self._unfit_checkers
            and h.node_id in self._grants
            and independent(account, self._grants[h.node_id].account)
        ]

    async def _run_checker(
        self,
        checker: HopRecord,
        span: Span,
        request: stage_pb2.ForwardRequest,
        history: RouteHistory,
    ) -> stage_pb2.ForwardResponse:
        key = (checker.node_id, span)
        for attempt in range(2):
            synced = 0 if attempt else self._synced.get(key, 0)
            try:
                messages = self._catch_up(
                    span, synced, request, history, limit=self._limit(request)
                )
                await self._add_probes(checker.node_id, span, messages[:-1])
                async with asyncio.timeout(self._timeout_s):
                    answers = await self._send(checker, messages, checks=1)
            except grpc.aio.AioRpcError as err:
                self._close_stream(checker.node_id)
                # Its cache expired since the last check: catch up from position 0 once.
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and synced and not attempt:
                    continue
                raise
            except (TimeoutError, NodeRejected):
                self._close_stream(checker.node_id)
                raise NodeRejected(f"checker {checker.node_id} did not answer") from None
            self._synced[key] = request.start_pos + request.input.shape[1]
            answer = answers[-1]
            self._check_signature(checker.node_id, request, answer)
            self._audit(checker, messages[:-1], answers[:-1], history)
            return answer
        raise AssertionError("unreachable")

    async def _warm_up(
        self,
        checker: HopRecord,
        span: Span,
        request: stage_pb2.ForwardRequest,
        history: RouteHistory,
    ) -> None:
        """Bring the checker's cache up to the end of ``request``'s input, for the check
        drawn for the span's next call."""
        key = (checker.node_id, span)
        messages = self._catch_up(
            span, self._synced.get(key, 0), request, history, final=False,
            limit=self._limit(request),
        )  # fmt: skip
        if not messages:
            return
        await self._add_probes(checker.node_id, span, messages)
        try:
            async with asyncio.timeout(self._timeout_s):
                answers = await self._send(checker, messages)
        except Exception as err:  # a broken stream surfaces in several shapes
            # The check that needed it catches up from position 0 on a new stream.
            log.info("checker %s could not catch up: %s", checker.node_id, err)
            self._close_stream(checker.node_id)
            self._synced.pop(key, None)
            return
        self._synced[key] = request.start_pos + request.input.shape[1]
        self._audit(checker, messages, answers, history)

    async def _send(
        self, checker: HopRecord, messages: list[stage_pb2.ForwardRequest], *, checks: int = 0
    ) -> list[stage_pb2.ForwardResponse]:
        """Write each message on the checker's stream (kept for the session, like the
        driver's own) and read its answer; the answers come back in order. All but the
        last ``checks`` messages are catch-ups."""
        stream = self._streams.get(checker.node_id)
        if stream is None:
            stub = stage_pb2_grpc.StageStub(self._channels.get(checker.address))
            stream = self._streams[checker.node_id] = _CheckerStream(
                checker.address, stub.Forward()
            )
        answers: list[stage_pb2.ForwardResponse] = []
        for n, message in enumerate(messages):
            shape, layers = message.input.shape, message.layers
            work = int(shape[0]) * int(shape[1]) * (layers.end - layers.start)
            self.stats.checker_layer_tokens += work
            if n < len(messages) - checks:
                self.stats.catch_up_layer_tokens += work
            if stream.capability_sent != self._capability.signature:
                message.capability.CopyFrom(self._capability)
                stream.capability_sent = self._capability.signature
            if self.before_check is not None:
                await self.before_check(checker, layers.start, layers.end)
            if self.on_check_sent is not None:
                self.on_check_sent(checker.node_id, layers.start, layers.end,
                                   int(shape[0]) * int(shape[1]))  # fmt: skip
            span = Span(layers.start, layers.end)
            stream.outstanding = (time.monotonic(), span, int(shape[0]) * int(shape[1]))
            try:
                await stream.call.write(message)
                read = await stream.call.read()
                stream.outstanding = None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # The call was cancelled, not this task: the stream was closed under this
                # work. The checker's answer is lost, not the generation.
                raise NodeRejected(f"the stream to checker {checker.node_id} was closed") from None
            if read is grpc.aio.EOF:
                raise NodeRejected(f"checker {checker.node_id} ended the stream")
            if self.on_check_answered is not None:
                self.on_check_answered(checker, layers.start, layers.end, read.usage)
            answers.append(read)
        return answers

    def _close_stream(self, node_id: str) -> None:
        stream = self._streams.pop(node_id, None)
        if stream is not None:
            stream.call.cancel()

    @staticmethod
    def _catch_up(
        span: Span,
        synced: int,
        request: stage_pb2.ForwardRequest,
        history: RouteHistory,
        *,
        final: bool = True,
        limit: int = CATCH_UP_CHUNK_TOKENS,
    ) -> list[stage_pb2.ForwardRequest]:
        """The inputs the checker's cache lacks before this call, then the call itself;
        without ``final``, every input up to the call's end instead (a catch-up only)."""
        last_only = request.last_position_only
        end = request.start_pos + (0 if final else request.input.shape[1])
        messages = [
            stage_pb2.ForwardRequest(
                session_id=request.session_id,
                step=request.step,
                model=request.model,
                layers=request.layers,
                start_pos=start,
                input=codec.encode(array, dtype),
                last_position_only=last_only,
                background=True,
            )
            for start, array, dtype in _joined(history.inputs(span, synced, end), limit)
        ]
        if not final:
            return messages
        call = stage_pb2.ForwardRequest()
        call.CopyFrom(request)
        call.ClearField("capability")
        # The checker's own pipeline calls (it serves other stages too) go first.
        call.background = True
        return [*messages, call]

    def _limit(self, request: stage_pb2.ForwardRequest) -> int:
        """Positions in one catch-up call: on the last hop, few enough that the rows its
        probes read fit PROBE_ROWS_BYTES."""
        if not request.last_position_only or not self._vocab:
            return CATCH_UP_CHUNK_TOKENS
        return max(1, min(CATCH_UP_CHUNK_TOKENS, PROBE_ROWS_BYTES // (4 * self._vocab)))

    async def _add_probes(
        self, checker_id: str, span: Span, messages: list[stage_pb2.ForwardRequest]
    ) -> None:
        """On the model's last hop, have the catch-up answer what an audit compares at each
        position whose primary answer is kept (protos/logit_probes.py). Not at a chunk's
        last position: its answer is that position's whole row anyway."""
        kept = self._signed_steps.get(span, [])
        for message in messages:
            if not message.last_position_only or int(message.input.shape[0]) != 1:
                continue
            start = message.start_pos
            end = start + int(message.input.shape[1])
            first = bisect.bisect_left(kept, start, key=lambda r: r.start_pos)
            for step in itertools.islice(kept, first, None):
                if step.end_pos >= end:
                    break
                if step.node_id == checker_id or (span, step.step) in self._checked_steps:
                    continue
                row = self._rows.row((span, step.step))
                if row is not None:
                    message.probes.append(logit_probes.probe_for(row, step.end_pos - 1 - start))
                    # A wide vocabulary's highest ids take a while: the pipeline goes first.
                    await asyncio.sleep(0)

    async def _compare(
        self,
        hop: HopRecord,
        checker: HopRecord,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
        checked: stage_pb2.ForwardResponse,
        history: RouteHistory,
    ) -> None:
        outcome = await self._judge(hop.node_id, checker, request, response, checked, history)
        if outcome is None or outcome == Outcome.CHECKER_WRONG:
            return
        # The primary lost, or nobody could tell: use neither answer; fail over instead.
        raise NodeRejected(
            f"node {hop.node_id} disagreed with checker {checker.node_id} on layers "
            f"[{request.layers.start}, {request.layers.end}); arbitration: "
            f"{Outcome.Name(outcome)}"
        )

    async def _judge(
        self,
        node_id: str,
        checker: HopRecord,
        request: stage_pb2.ForwardRequest,
        response: stage_pb2.ForwardResponse,
        checked: stage_pb2.ForwardResponse,
        history: RouteHistory,
    ) -> int | None:
        """Compare two signed answers to ``request``; None when they agree, else the
        arbiter's outcome (a checker proven wrong, or one nobody could judge, is not
        asked again). Raises NodeRejected when the primary signed for an input history the
        client never sent."""
        stats = self.stats
        stats.checked[node_id] = stats.checked.get(node_id, 0) + 1
        stats.pairs.append((node_id, checker.node_id))
        limit = self._tolerance(node_id, checker.node_id, request.layers.end - request.layers.start)
        error = output_check.relative_error(
            codec.decode(response.output, finite=False),
            response.output.dtype,
            codec.decode(checked.output, finite=False),
            checked.output.dtype,
        )
        comparison = verification_pb2.Comparison(
            primary=_signed(node_id, request, response, with_output=error > limit),
            checker=_signed(checker.node_id, request, checked, with_output=error > limit),
            agreed=error <= limit,
        )
        if error <= limit:
            self._pending.append(comparison)
            if len(self._pending) >= self._report_every and self._reporter is not None:
                await self._report_quietly()
            return None
        stats.mismatches += 1
        log.warning(
            "mismatch on layers [%d, %d) at step %d: %s vs %s, relative error %.3g > %.3g",
            request.layers.start, request.layers.end, request.step,
            node_id, checker.node_id, error, limit,
        )  # fmt: skip
        span = Span(request.layers.start, request.layers.end)
        chunks = history.inputs(span, 0, request.start_pos)
        prefix = [(array, dtype) for _, array, dtype in chunks]
        input_array = codec.decode(request.input, finite=False)
        if output_check.prefix_digest([*prefix, (input_array, request.input.dtype)]) != (
            response.input_digest
        ):
            raise NodeRejected(f"node {node_id} signed for an input history we never sent")
        comparison.prefix.extend(codec.encode(array, dtype) for array, dtype in prefix)
        comparison.input.CopyFrom(request.input)
        comparison.last_position_only = request.last_position_only
        self._pending.append(comparison)
        outcome = await self._arbitrate()
        if outcome != Outcome.PRIMARY_WRONG:
            self._unfit_checkers.add(checker.node_id)
        return outcome

    def _tolerance(self, primary: str, checker: str, layers: int) -> float:
        a, b = self._grants[primary], self._grants[checker]
        return output_check.pair_tolerance(
            (a.device_kind, a.compute_dtype), (b.device_kind, b.compute_dtype), layers=layers
        )

    # ---- audits: a catch-up compared with the steps it replays ----------------------

    def _audit(
        self,
        checker: HopRecord,
        messages: list[stage_pb2.ForwardRequest],
        answers: list[stage_pb2.ForwardResponse],
        history: RouteHistory,
        *,
        again_later: bool = True,
        recheck_at_end: bool = False,
    ) -> None:
        """Compare each catch-up answer with the primaries' signed answers for the steps it
        replayed that had no check of their own; a step that disagrees is run again on the
        checker, as a check, after the work queued on its stream (``recheck_at_end``: when
        the session ends, for a fail-over's replacement, whose cache the pipeline uses).
        Only a node of another operator than the step's vouches for it.

        A warm-up replays the call under way too, and may answer before its primary does:
        such an answer is kept (``again_later``) and compared once more at the span's next
        call, when the primary's answer is in (on the last hop: its logits; elsewhere: its
        output, as the next hop's input)."""
        spans = history.spans
        for message, answer in zip(messages, answers, strict=True):
            span = Span(message.layers.start, message.layers.end)
            last_hop = message.last_position_only
            following = history.following(span)
            if span not in spans or (following is None and not last_hop):
                continue  # a hop a fail-over has since split: nothing kept to compare with
            start = message.start_pos
            end = start + int(message.input.shape[1])
            try:
                digest = self._check_signature(checker.node_id, message, answer)
                replayed = codec.decode(answer.output, finite=False)
            except (NodeRejected, codec.TensorError) as err:
                log.info("checker %s: catch-up answer not usable for an audit: %s",
                         checker.node_id, err)  # fmt: skip
                continue
            width = 1 if last_hop else end - start
            if answer.input_digest != history.digest_after(span, end) or list(
                replayed.shape[:2]
            ) != [message.input.shape[0], width]:
                continue  # its cache holds another history: nothing to compare with
            kept = self._signed_steps.get(span, [])
            # Kept in position order: only the steps inside this answer's positions, so a
            # long session's audits do not rescan its whole history.
            first = bisect.bisect_left(kept, start, key=lambda r: r.start_pos)
            reached = start  # how far this answer's positions have a signed step kept
            vouching: verification_pb2.SignedOutput | None = None  # the checker's answer
            probed = _probe_answers(message, answer) if last_hop else {}
            for step in itertools.islice(kept, first, None):
                if step.start_pos >= end:
                    break
                reached = max(reached, step.end_pos)
                if (
                    not self._independent(step.node_id, checker.node_id)
                    or not start <= step.start_pos < step.end_pos <= end
                    or (span, step.step) in self._checked_steps
                    or step.input_digest != history.digest_after(span, step.end_pos)
                ):
                    continue
                if last_hop:
                    error = self._row_error(span, step, probed, answer, replayed, end)
                    if error is None:
                        continue  # not kept, or not probed: this catch-up cannot tell
                else:
                    primary = _kept_output(history, following, step)  # type: ignore[arg-type]
                    if primary is None:
                        # Not on the next hop's history yet, or never again (a rollback or
                        # a replay moved it on): a later look tells which.
                        reached = min(reached, step.start_pos)
                        continue
                    error = output_check.relative_error(
                        primary[0],
                        primary[1],
                        replayed[:, step.start_pos - start : step.end_pos - start],
                        answer.output.dtype,
                    )
                self.stats.audited_layer_tokens += (step.end_pos - step.start_pos) * (
                    span.end - span.start
                )
                self._checked_steps.add((span, step.step))  # audited once
                if error <= self._tolerance(step.node_id, checker.node_id, span.end - span.start):
                    self._rows.pop((span, step.step))
                    audited = self.stats.audited
                    audited[step.node_id] = audited.get(step.node_id, 0) + 1
                    if vouching is None:
                        vouching = _signed(
                            checker.node_id, message, answer, with_output=False, digest=digest
                        )
                    self._audits.append(
                        verification_pb2.AuditAgreement(
                            primary=step.evidence(span), checker=vouching
                        )
                    )
                    continue
                log.warning(
                    "audit: %s's %s disagrees with %s on layers %s at positions [%d, %d) "
                    "(relative error %.3g); running that step again on %s %s",
                    checker.node_id, "replay" if recheck_at_end else "catch-up", step.node_id,
                    span, step.start_pos, step.end_pos, error, checker.node_id,
                    "when the session ends" if recheck_at_end else "now",
                )  # fmt: skip
                if recheck_at_end:
                    self._rechecks_at_end.append((checker, span, step, history))
                else:
                    self._recheck_later(checker, span, step, history)
            if again_later and reached < end:
                self._late[(checker.node_id, span)] = (checker, message, answer)
        if len(self._audits) >= AUDITS_TO_FLUSH and self._reporter is not None:
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.ensure_future(self._report_quietly())

    def _independent(self, node_a: str, node_b: str) -> bool:
        """Two different nodes the capability names, not both run by one operator."""
        a, b = self._grants.get(node_a), self._grants.get(node_b)
        return (
            node_a != node_b
            and a is not None
            and b is not None
            and independent(a.account, b.account)
        )

    def _recheck_later(
        self, checker: HopRecord, span: Span, step: _SignedStep, history: RouteHistory
    ) -> None:
        """Queue ``_recheck`` on the checker's stream; the session's end waits for it."""
        task = self._queue(
            checker, span, lambda: self._recheck(checker, span, step, history), while_serving=True
        )
        self._rechecks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._rechecks.discard)  # type: ignore[arg-type]

    def _row_error(
        self,
        span: Span,
        step: _SignedStep,
        probed: dict[int, tuple[stage_pb2.LogitProbe, stage_pb2.ProbeAnswer | None]],
        answer: stage_pb2.ForwardResponse,
        replayed: np.ndarray,
        end: int,
    ) -> float | None:
        """How far a last-hop catch-up is from the primary's logits for ``step``: the whole
        row at the catch-up's last position, a probe answer before it; None when there is
        nothing to compare (the row was not kept, or no probe asked for it)."""
        row = self._rows.row((span, step.step))
        if row is None:
            return None
        if step.end_pos == end:
            return output_check.relative_error(
                row, "float32", replayed.reshape(-1), answer.output.dtype
            )
        asked = probed.get(step.end_pos - 1)
        if asked is None:
            return None
        probe, probe_answer = asked
        if probe_answer is None:
            return float("inf")  # asked for and not answered: a checker to doubt
        return logit_probes.probe_error(row, probe, probe_answer)

    async def _recheck(
        self, checker: HopRecord, span: Span, step: _SignedStep, history: RouteHistory
    ) -> None:
        """Run a step an audit doubted again on the checker, exactly as the primary ran it,
        and settle the two signed answers like a check's. A checker that serves the span
        in the pipeline now runs it when the session ends (it would roll its cache back)."""
        if self._serving.get(span) == checker.node_id:
            self._rechecks_at_end.append((checker, span, step, history))
            return
        if span not in history.spans:
            return  # a fail-over split the hop since: its history is kept per new hop
        primary = self._primary_output(span, step, history)
        self._rows.pop((span, step.step))
        chunks = history.inputs(span, step.start_pos, step.end_pos)
        if primary is None or sum(int(a.shape[1]) for _, a, _ in chunks) != (
            step.end_pos - step.start_pos
        ):
            return  # rolled back meanwhile: the step is gone from this session
        array = np.concatenate([a for _, a, _ in chunks], axis=1)
        request = stage_pb2.ForwardRequest(
            session_id=self.session_id,
            step=step.step,
            model=self._model,
            layers=common_pb2.LayerRange(start=span.start, end=span.end),
            start_pos=step.start_pos,
            input=codec.encode(array, chunks[0][2]),
            background=True,
            last_position_only=history.following(span) is None,
        )
        claimed = stage_pb2.ForwardResponse(
            step=step.step,
            output=codec.encode(*primary),
            input_digest=step.input_digest,
            signature=step.signature,
        )
        key = (checker.node_id, span)
        try:
            async with asyncio.timeout(self._timeout_s):
                # Its cache goes back to the step's start (start_pos below its length).
                (checked,) = await self._send(checker, [request], checks=1)
            self._synced[key] = step.end_pos
            self._check_signature(checker.node_id, request, checked)
            if checked.input_digest != step.input_digest:
                return  # it ran another history: no evidence either way
            outcome = await self._judge(step.node_id, checker, request, claimed, checked, history)
        except Exception as err:  # a broken stream surfaces in many shapes; NodeRejected
            log.warning("audit of %s on layers %s at positions [%d, %d) not settled: %s",
                        step.node_id, span, step.start_pos, step.end_pos, err)  # fmt: skip
            self._close_stream(checker.node_id)
            self._synced.pop(key, None)
            return
        if outcome is None:
            return  # the step itself agrees: the catch-up's difference was its batching
        finding = AuditFinding(
            node_id=step.node_id,
            layer_start=span.start,
            layer_end=span.end,
            step=step.step,
            start_pos=step.start_pos,
            end_pos=step.end_pos,
            outcome=Outcome.Name(outcome),
        )
        self.stats.findings.append(finding)
        log.warning("audit of node %s on layers %s at positions [%d, %d): %s",
                    step.node_id, span, step.start_pos, step.end_pos, finding.outcome)  # fmt: skip

    def _primary_output(
        self, span: Span, step: _SignedStep, history: RouteHistory
    ) -> tuple[np.ndarray, str] | None:
        """What ``step``'s primary signed, where the client still holds exactly that."""
        following = history.following(span)
        if following is not None:
            return _kept_output(history, following, step)
        tensor = self._rows.tensor((span, step.step))
        if tensor is None or hashlib.sha256(tensor.data).digest() != step.output_sha256:
            return None
        return codec.decode(tensor, finite=False), tensor.dtype

    def proven_wrong(self) -> AuditFinding | None:
        """The first audit that proved a primary wrong, if any: the session's history from
        its position on holds that node's wrong output."""
        return next((f for f in self.stats.findings if f.outcome == "PRIMARY_WRONG"), None)

    async def _arbitrate(self) -> int:
        if self._reporter is None:
            return Outcome.UNRESOLVED
        try:
            verdict = await self._report()
        except grpc.aio.AioRpcError as err:
            log.warning("mismatch report failed: %s: %s", err.code().name, err.details())
            return Outcome.UNRESOLVED
        if not verdict.verdicts:
            return Outcome.UNRESOLVED
        self.stats.verdicts.extend(verdict.verdicts)
        return verdict.verdicts[-1].outcome

    async def _report_quietly(self) -> None:
        try:
            await self._report()
        except grpc.aio.AioRpcError as err:
            log.warning("verification report failed: %s: %s", err.code().name, err.details())

    async def _report(self) -> verification_pb2.ReportVerdict:
        assert self._reporter is not None
        comparisons, self._pending = self._pending, []
        audits = self._audits[:AUDITS_PER_REPORT]
        del self._audits[:AUDITS_PER_REPORT]
        report = verification_pb2.VerificationReport(
            session_id=self.session_id,
            capability=self._capability,
            comparisons=comparisons,
            audits=audits,
            calls=[
                verification_pb2.NodeCalls(
                    node_id=node,
                    calls=calls,
                    # An audited step was compared with an independent replica's output too,
                    # and a wrong one would have been caught: it counts towards the risk.
                    checked=self.stats.checked.get(node, 0) + self.stats.audited.get(node, 0),
                )
                for node, calls in sorted(self.stats.calls.items())
            ],
        )
        verdict = await self._reporter(report)
        if verdict.HasField("risk"):
            self.stats.risk = verdict.risk
        return verdict


def _probe_answers(
    message: stage_pb2.ForwardRequest, answer: stage_pb2.ForwardResponse
) -> dict[int, tuple[stage_pb2.LogitProbe, stage_pb2.ProbeAnswer | None]]:
    """A last-hop catch-up's probes by the absolute position each asked about, with the
    checker's answer (None where it answered fewer than it was asked)."""
    answers = list(answer.probe_answers)
    return {
        message.start_pos + probe.position: (probe, answers[i] if i < len(answers) else None)
        for i, probe in enumerate(message.probes)
    }


def _joined(
    chunks: list[tuple[int, np.ndarray, str]], limit: int = CATCH_UP_CHUNK_TOKENS
) -> list[tuple[int, np.ndarray, str]]:
    """Consecutive chunks of one dtype as one, up to ``limit`` positions each.

    A checker that skipped k decode steps catches up in one forward pass instead of k round
    trips, each reading all of its weights again; it then answers the checked call about
    as fast as the primary does. The input digest chains position by position, so it is
    the same however the positions are grouped; the cache differs from the primary's by
    float rounding only, far inside the comparison's tolerance.
    """
    groups: list[list[tuple[int, np.ndarray, str]]] = []
    for chunk in chunks:
        start, array, dtype = chunk
        group = groups[-1] if groups else []
        length = sum(a.shape[1] for _, a, _ in group)
        if (
            group
            and dtype == group[0][2]
            and start == group[0][0] + length
            and length + array.shape[1] <= limit
        ):
            group.append(chunk)
        else:
            groups.append([chunk])
    return [
        (g[0][0], np.concatenate([a for _, a, _ in g], axis=1) if len(g) > 1 else g[0][1], g[0][2])
        for g in groups
    ]


def _kept_output(
    history: RouteHistory, following: Span, step: _SignedStep
) -> tuple[np.ndarray, str] | None:
    """The output ``step``'s node signed, as the next hop's input history still holds it;
    None when that history no longer holds exactly those bytes."""
    chunks = history.inputs(following, step.start_pos, step.end_pos)
    if not chunks or len({dtype for _, _, dtype in chunks}) != 1:
        return None
    array = np.concatenate([a for _, a, _ in chunks], axis=1)
    dtype = chunks[0][2]
    if array.shape[1] != step.end_pos - step.start_pos:
        return None
    if hashlib.sha256(codec.encode(array, dtype).data).digest() != step.output_sha256:
        return None
    return array, dtype


def independent(account_a: str, account_b: str) -> bool:
    """Two nodes may check each other unless one operator account runs both."""
    return not account_a or not account_b or account_a != account_b


def _signed(
    node_id: str,
    request: stage_pb2.ForwardRequest,
    response: stage_pb2.ForwardResponse,
    *,
    with_output: bool,
    digest: bytes | None = None,
) -> verification_pb2.SignedOutput:
    """``digest``: the output's sha256 where the signature check already computed it."""
    signed = verification_pb2.SignedOutput(
        node_id=node_id,
        step=response.step,
        layers=common_pb2.LayerRange(start=request.layers.start, end=request.layers.end),
        input_digest=response.input_digest,
        output_sha256=digest or hashlib.sha256(response.output.data).digest(),
        signature=response.signature,
    )
    if with_output:
        signed.output.CopyFrom(response.output)
    return signed
