"""The pipeline driver: walks a session's route hop by hop and survives node failures.

Token ids go to the hop that starts at layer 0, each hop's hidden states go to the next,
and the last hop answers with logits. Every input is recorded per boundary in a
``RouteHistory`` before it is sent. When a hop fails (stream error, or no answer within
a deadline derived from that hop's recent step times), the driver takes the next
alternate of that stage, or asks the coordinator to ``Reroute`` the span, replays the
boundary's whole history from position 0 to rebuild the replacement's KV cache, and
carries on. The replay's last positions are the current step's output, so a fail-over
costs one replay and greedy output stays identical to a run without the failure.

A step is pushed when it can be (``DriverConfig.push``): the driver sends the token ids to
the first hop only, naming the rest of the route in ``relay_to``; each node hands its
output straight to the next, and the client gets every node's signed answer on the
``Deliveries`` subscription it holds there (client/deliveries.py). Hidden states then never
wait for the client between stages: 4 message transits a token through 3 stages instead of
6. The client still records, verifies and samples checks of every answer as it arrives, and
checks that each pushed node's signed input digest is that of the output the node before it
signed. Anything unusual (a late or missing answer, an error, a digest that differs) ends
the push at that stage, and the step goes on from there hop by hop, with the fail-over and
hedging below; a digest that differs ends pushing for the session.

Ring (``DriverConfig.ring``, a pushed decode step given a ``RingPlan``): the node that
ends the model also samples the next token itself (protos.sampling: the same draw for the
same logits, seed and position) and starts the next step at the first hop, naming the
route again: exo's ring, with the client off the token's critical path (3 transits a token
through 3 stages instead of 4, and no client round trip). The client still gets every
answer, samples its own token from the signed logits and yields only that. When it then
steps that token, it adopts the step the ring started: the first hop's signed input
digest must be that of the client's own token, else (a ring that drew another token, a
late or missing answer, any fail-over, hedge or rollback) the ring ends, the step is sent
again as usual, and a new ring starts ``ring_retry_steps`` steps later. A ring starts only
as many steps as the client asked for and stops at an end-of-sequence id, so it computes
nothing the client will not use. A route of one node goes round a ring by itself (the only
steps it pushes).

Consecutive stages whose primary is the same node run as one hop (one round trip instead
of several; the node's capability grants it every one of them). When such a merged hop
fails it is split back into its stages, each with its own alternates, before the replay.
Under verification a run is merged only when some independent replica of every one of
its stages can check the merged span: otherwise the merged hop could never be checked.

Sampled checks (client/verification.py) run beside the pipeline. A step settles them
before it returns, unless the caller defers them (``step(defer_checks=True)``, what
``Client.generate`` does): the step then returns at once and the checks settle later
(``settle_deferred``); when one rejects a primary, the session goes back to that step,
runs it again without the node, and the caller starts over from its corrected logits
(``Rollback``). A checker slower than the primary then costs the pipeline nothing, and the
caller still uses nothing a check has not passed before it leaves the library.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from client.acknowledgments import Acknowledger
from client.billing import UsageBook
from client.channels import ChannelPool
from client.deliveries import DeliveryLost, Subscription, Subscriptions
from client.errors import OutputTainted, PipelineError, RequestRejected
from client.hedging import HedgeEvent, hedge_delay, percentile, race
from client.records import FailoverEvent, HopRecord, Receipt, RollbackEvent, StageTiming
from client.route_history import RouteHistory, Span, covers
from client.step_reports import SendReport, StepReporter
from client.verification import NodeRejected, PendingCheck, StageVerifier
from protos import codec, usage_credit
from protos.quoting import shown
from protos.sampling import SamplingParams
from protos.tessera.v1 import client_api_pb2, common_pb2, ledger_pb2, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

# Any node would answer these the same way: retrying elsewhere only hides the bug.
CLIENT_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
# The node is fine but lost this session's cache (idle expiry, restart): replay it there.
REPLAY_SAME_NODE_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION})
# A merged hop refused as such (no one shard holds all its layers, or a node that checks
# grants one by one): its stages still work there, one hop each.
MERGE_REFUSED_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED})
# Steps in a row whose push a node could not hand on before the session stops pushing: one
# failure is a link being reopened, several are two nodes that cannot reach each other.
RELAY_BREAKS_TO_STOP = 3
HANDED_BACK_KEPT = 256

Rerouter = Callable[[client_api_pb2.RerouteRequest], Awaitable[client_api_pb2.RerouteResponse]]


@dataclass(frozen=True)
class DriverConfig:
    # Straggler deadline for a decode step: max(floor, factor x p95 of recent steps).
    deadline_floor_s: float = 5.0
    deadline_factor: float = 4.0
    # A node's first prefill chunk or replay for a hop has no reference time yet.
    cold_timeout_s: float = 120.0
    min_samples: int = 3
    # A decode step before min_samples ones were timed: max(this, deadline_factor x the
    # slowest prefill chunk or replay the node ran for the hop), at most cold_timeout_s.
    # A decode step does less than those (one position against many); the floor is wider
    # than deadline_floor_s for what a node's first steps may still set up (e.g. kernels
    # for a new shape). A node that hangs right after the prefill (a PC gone to sleep)
    # then costs this, not the cold timeout. The node's later prefill chunks and replays
    # get max(this, deadline_factor x its earlier ones scaled up to their size and
    # position: _Slot.bulk_estimate), at most cold_timeout_s.
    first_decode_floor_s: float = 15.0
    window: int = 32
    max_failovers_per_step: int = 6
    # A decode step whose stream to a node broke (UNAVAILABLE) after the node had answered
    # goes to that very node again first, on a new connection, when one opens within this
    # budget: a connection reset (a NAT rebinding, a Wi-Fi hiccup) then costs one round
    # trip, not a replay of the whole history on an alternate (0: fail over at once).
    resume_connect_s: float = 1.0
    max_chunk_tokens: int = 512
    # Headroom below the 64 MiB message limit for the protobuf envelope.
    message_budget_bytes: int = codec.MAX_MESSAGE_BYTES * 3 // 4
    end_session_timeout_s: float = 2.0
    # Run consecutive stages served by the same node as one hop.
    merge_same_node_hops: bool = True
    # Straggler hedging (client/hedging.py, docs/hedging.md): a decode call still running
    # after max(hedge_floor_s, hedge_factor x p95 of recent steps) is also sent to an
    # alternate, whose history is replayed first (up to hedge_max_replay_tokens); the first
    # answer wins. 0 turns hedging off.
    hedge_factor: float = 3.0
    # The floor keeps ordinary jitter (GC, a busy CPU) from hedging healthy calls.
    hedge_floor_s: float = 0.25
    hedge_max_replay_tokens: int = 512
    # Report the driver's timings of decode calls to the coordinator every this many calls
    # (and at close): its measured speed of each node. 0: never.
    report_every: int = 16
    # Push steps through the route (nodes hand hidden states on; see the module docstring).
    push: bool = True
    # How long a node may take to acknowledge the client's Deliveries subscription; a
    # node that does not is driven hop by hop instead.
    subscribe_timeout_s: float = 5.0
    # A node whose subscription failed (gone, restarting, overloaded) is driven hop by hop
    # for this many steps, then asked again.
    push_retry_steps: int = 32
    # Client.generate goes on to the next token while a step's sampled checks still run,
    # and yields a token only once every check it depends on has settled (a rejection
    # rolls the generation back to that step): a checker slower than the primary no
    # longer holds up the pipeline. False settles every step's checks before the next.
    defer_checks: bool = True
    # Once a call's primary has answered, its sampled check gets max(floor, factor x the
    # primary's time for the same work) more before the call goes unchecked and that
    # checker checks no more in the session (client/verification.py, ``_patience``): a
    # starved or hung checker costs a token seconds, not the 120 s check timeout.
    check_patience_floor_s: float = 10.0
    check_patience_factor: float = 8.0
    # Let the node that ends the model sample and start the next step (module docstring).
    ring: bool = True
    # How long the client waits for the first answer of a step a ring started before it
    # sends that step itself: max(this, deadline_factor x p95 of the first hop's steps).
    ring_wait_floor_s: float = 1.0
    # After a ring ends early, the session's steps go without one for this many steps,
    # then a new ring starts. 0: never again in the session.
    ring_retry_steps: int = 32


@dataclass(frozen=True)
class RingPlan:
    """What a ring needs to go on without the client: how to draw each token (a seed
    is required when sampling at a temperature: the client must draw the same), how many
    more steps it may start, and the tokens that end it."""

    params: SamplingParams
    steps: int
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"a ring's steps must be 0 or more, got {self.steps}")
        if self.params.temperature > 0 and self.params.seed is None:
            raise ValueError("a ring that samples at a temperature needs a seed")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    vocab_size: int


class HopFailure(Exception):
    """A hop did not answer usefully; another node (or a replay) may fix it."""

    def __init__(self, reason: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(reason)
        self.code = code


class RingMissed(HopFailure):
    """The step a ring should have started did not come back as the client's own: the
    client sends it itself, and blames no node."""


class _StaleReroute(Exception):
    """The coordinator routed a span back to the node that had just refused it: its view
    is from before that node's shard moved."""


@dataclass
class _Slot:
    """One position of the route: a span, the node serving it, and its spare nodes."""

    span: Span
    hop: HopRecord
    alternates: list[HopRecord]
    # Replicas granted only to re-run calls as verification checks (never a fail-over).
    checkers: list[HopRecord] = field(default_factory=list)
    call: grpc.aio.StreamStreamCall | None = None
    capability_version_sent: int = -1
    decode_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    # The multi-position calls (prefill chunks, replays) the node answered for this slot,
    # the newest ones: (seconds, positions x batch, the end position). The reference for
    # its first decode steps' deadline, and for its next chunks'.
    bulk_calls: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=16))
    # The route's stages this slot runs as one hop (empty: the slot is one stage).
    parts: tuple[_Slot, ...] = ()

    @property
    def bulk_seconds(self) -> float:
        """The slowest multi-position call the node answered for this slot (0: none)."""
        return max((seconds for seconds, _, _ in self.bulk_calls), default=0.0)

    def bulk_estimate(self, work: int, end: int) -> float | None:
        """An over-estimate of a call of ``work`` positions x batch ending at position
        ``end``, from the node's answered multi-position calls (None: none yet). Batched,
        a call costs at most in proportion to its work, and attention grows with the
        positions it reads, so each reference scales by both ratios when they exceed 1."""
        if not self.bulk_calls:
            return None
        return max(
            seconds * max(1.0, work / ref_work) * max(1.0, end / max(1, ref_end))
            for seconds, ref_work, ref_end in self.bulk_calls
        )

    def forget_timings(self) -> None:
        """Another node serves the slot now: what its deadlines were based on was not it."""
        self.decode_seconds.clear()
        self.bulk_calls.clear()

    def close_stream(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None
        self.capability_version_sent = -1


@dataclass
class _Request:
    """A Forward request and what checking its answer needs."""

    request: stage_pb2.ForwardRequest
    batch: int
    tokens: int
    replay: bool
    last_position_only: bool
    pending: PendingCheck | None = None  # a redundant check started with the call


@dataclass
class _Unsettled:
    """A call whose signed output went on down the pipeline while its sampled check runs:
    settled (and a mismatch acted on) before the step returns."""

    span: Span
    hop: HopRecord
    call: _Request
    response: stage_pb2.ForwardResponse
    pending: PendingCheck


@dataclass
class _RingNext:
    """The step a ring starts once the current one ends, and the route it goes round."""

    step: int
    start_pos: int
    route: tuple[tuple[Span, str, str], ...]
    # How many more steps the ring may start after that one.
    steps_left: int
    # Tokens the ring starts no step for: it ends there.
    stop_ids: tuple[int, ...]


@dataclass
class _Deferred:
    """A step that returned before its sampled checks settled (``step(defer_checks=True)``)."""

    start_pos: int
    ids: np.ndarray
    last_only: bool
    checks: list[_Unsettled]


@dataclass(frozen=True)
class Rollback:
    """A deferred check rejected a primary: the step at ``start_pos`` was run again
    without it, ``logits`` are its corrected output, and everything the caller derived
    from that step's first answer (the token it sampled, and every step after) is void.
    The event is in ``PipelineDriver.rollbacks``."""

    start_pos: int
    logits: np.ndarray


class PipelineDriver:
    """Drives one session. Use from one event loop; calls to ``step`` must not overlap."""

    def __init__(
        self,
        grant: client_api_pb2.SessionGrant,
        model: str,
        *,
        rerouter: Rerouter | None = None,
        channels: ChannelPool | None = None,
        config: DriverConfig | None = None,
        verifier: StageVerifier | None = None,
        report_step_times: SendReport | None = None,
    ) -> None:
        self.config = config or DriverConfig()
        # Checks signatures and samples redundant execution (client/verification.py).
        self.verifier = verifier
        self.session_id = grant.session_id
        self.model = model
        self.shape = ModelShape(grant.num_layers, grant.hidden_size, grant.vocab_size)
        self._capability = grant.capability
        self._capability_version = 0
        self.max_tokens = _claims(grant.capability).max_tokens
        self._slots = [_slot_from_stage(stage, self.config.window) for stage in grant.stages]
        self.stages = [slot.hop for slot in self._slots]  # as granted, before any merging
        if self.config.merge_same_node_hops:
            # Signed outputs (node keys in the grants) mean sampled checks: keep them possible.
            checked = verifier is not None and any(
                g.public_key for g in _claims(grant.capability).grants
            )
            self._slots = _merge_same_node(self._slots, self.config.window, checked=checked)
        self._check_route()
        self._history = RouteHistory([slot.span for slot in self._slots])
        self._rerouter = rerouter
        self._owns_channels = channels is None
        self._channels = channels or ChannelPool()
        self._excluded: set[str] = set()
        self._used: dict[str, HopRecord] = {s.hop.node_id: s.hop for s in self._slots}
        self._length = 0
        # False while a step is under way: a step that raised may have left inputs beyond
        # ``_length`` at some boundaries, which the next step must roll back.
        self._history_clean = True
        self._step = 0
        self._failovers_this_step = 0
        self._replayed_this_step: set[tuple[str, Span]] = set()
        self._resumed_this_step: set[tuple[str, Span]] = set()
        # Nodes that answered a call of this session on a span: a broken connection to one
        # of them is worth dialing again before failing it over (_retry_same_node).
        self._answered: set[tuple[str, Span]] = set()
        self.timings: list[StageTiming] = []
        self.failovers: list[FailoverEvent] = []
        self.receipts: list[Receipt] = []
        self.hedges: list[HedgeEvent] = []
        self.rollbacks: list[RollbackEvent] = []  # steps a deferred check sent back
        # Nodes a hedge found slow: never hedged on or asked to check again this session.
        self._demoted: set[str] = set()
        self.usage = UsageBook()  # tokens sent per hop and the nodes' usage receipts
        # A paid session's acknowledgments of the receipts (client/acknowledgments.py),
        # set by the client when the nodes hold it to a credit; None otherwise.
        self.acks: Acknowledger | None = None
        self._subscriptions = Subscriptions(
            self._channels, self.session_id, on_unclaimed=self._unclaimed
        )
        # Why this session stopped pushing steps (None: it pushes when it can).
        self.push_off: str | None = None if self.config.push else "turned off"
        self.pushed_steps = 0
        self._relay_breaks = 0  # pushes in a row a node could not hand on (relay_failed)
        # Why this session's ring last ended early (None: it never did).
        self.ring_off: str | None = None if self.config.ring else "turned off"
        # No new ring starts before this step (after one ended early).
        self._ring_paused_until = 0
        self.ring_steps = 0  # steps a ring started and the client adopted
        self._last_push_s = 0.0  # how long the last step pushed through the whole route took
        self._ring_next: _RingNext | None = None
        # The last step number the ring now running may start (see _end_ring).
        self._ring_last_step = 0
        # Steps rings were allowed to start, and which of their calls (node, step, layers)
        # the usage book counts already: a ring's call that the client did not adopt still
        # ran, and the node's receipt counts it (_unclaimed).
        self._ring_started: set[int] = set()
        self._ring_counted: set[tuple[str, int, int, int]] = set()
        # Calls (node, step, layers) the client sent itself after a node said it could not
        # hand them on, with their tokens: the hand-off may have gone through after all (or
        # the node's word was false), and then the node ran the step twice and its receipt
        # counts both (_unclaimed). The newest HANDED_BACK_KEPT only.
        self._handed_back: dict[tuple[str, int, int, int], int] = {}
        # Nodes whose subscription could not be opened, and the step from which to try
        # again: until then no step is pushed through them.
        self._unpushable: dict[str, int] = {}
        # This chunk's calls whose checks are still running, in pipeline order.
        self._unsettled: list[_Unsettled] = []
        # Steps returned before their checks settled, oldest first (settle_deferred).
        self._deferred: deque[_Deferred] = deque()
        self._reporter = (
            StepReporter(
                self.session_id,
                lambda: self._capability,
                report_step_times,
                every=self.config.report_every,
            )
            if report_step_times is not None and self.config.report_every > 0
            else None
        )

    # ---- public surface -------------------------------------------------------------

    @property
    def length(self) -> int:
        """Positions every hop holds in its cache for this session."""
        return self._length

    @property
    def route(self) -> list[HopRecord]:
        return [slot.hop for slot in self._slots]

    def received(self, hop: HopRecord, start: int, end: int, usage: ledger_pb2.SignedUsage) -> None:
        """A node's usage receipt came in, with its answer to a call or to a check: booked,
        and acknowledged when due (a paid session's)."""
        self.usage.received(hop.node_id, start, end, usage)
        if self.acks is not None:
            self.acks.noted(hop, start, end)

    @property
    def capability(self) -> client_api_pb2.SignedCapability:
        """The session's newest capability (a reroute renews it)."""
        return self._capability

    def report_at_least(self, node_id: str, start: int, end: int, tokens: int, ms: float) -> None:
        """Tell the coordinator (with the step times) that ``node_id`` took at least ``ms``
        for ``tokens`` tokens of layers [start, end): a straggler's call that was hedged,
        a checker given up on (``StageVerifier.on_late``)."""
        if self._reporter is None or tokens < 1:
            return
        if tokens > self.max_tokens:
            # The coordinator takes at most the session's tokens per entry (and refuses a
            # report with more); the same time per token is the same lower bound.
            ms, tokens = ms * self.max_tokens / tokens, self.max_tokens
        self._reporter.add(node_id, start, end, tokens, ms)

    async def step(
        self,
        token_ids: np.ndarray | Iterable[int],
        start_pos: int | None = None,
        *,
        last_only: bool = False,
        defer_checks: bool = False,
        ring: RingPlan | None = None,
    ) -> np.ndarray:
        """Run token ids through the pipeline and return float32 logits.

        ``token_ids`` is [T] or [B, T]. The result is [B, T, vocab], or [B, vocab] for the
        last position only with ``last_only`` (the last hop then sends only that position:
        a prefill's full logits would cost vocab x 4 bytes per token). ``start_pos``
        defaults to appending; an earlier position rolls every hop back first
        (speculative decoding, retries).

        With ``defer_checks`` (a step of one chunk) the logits come back as soon as the
        pipeline answered, signatures checked, while its sampled checks still run: a
        checker slower than the primary then no longer holds up the next step. The caller
        must treat what it derives from these logits as provisional until
        ``settle_deferred`` has settled the step (``unsettled_from``), and start over from
        a ``Rollback`` it returns.

        With ``ring`` (a step of one chunk, one sequence, ``last_only``) the last hop also
        draws the next token and starts the next step, up to ``ring.steps`` of them in
        all (module docstring): the caller then steps the token it draws itself, and the
        driver adopts the step the ring started when it is that very one.
        """
        self.raise_if_tainted()
        ids = self._check_tokens(token_ids)
        start = self._length if start_pos is None else start_pos
        if not 0 <= start <= self._length:
            raise ValueError(
                f"start_pos {start} must be within [0, {self._length}] (the tokens sent so far)"
            )
        total = start + ids.shape[1]
        if total > self.max_tokens:
            raise ValueError(
                f"the session was opened for {self.max_tokens} tokens; {total} do not fit. "
                "Open a session with a larger max_length."
            )
        if start < self._length or not self._history_clean:
            # Appending to a clean history needs no rollback; skipping it keeps a decode
            # step's cost from growing with the number of tokens sent so far.
            self._history.rollback(start)
        self._history_clean = False
        self._failovers_this_step = 0
        self._replayed_this_step.clear()
        self._resumed_this_step.clear()
        outputs: list[np.ndarray] = []
        chunk = self._chunk_tokens(ids.shape[0], last_only)
        defer = defer_checks and ids.shape[1] <= chunk
        if ids.shape[1] > chunk:
            ring = None
        for offset in range(0, ids.shape[1], chunk):
            piece = ids[:, offset : offset + chunk]
            logits = await self._walk(start + offset, piece, last_only, defer=defer, ring=ring)
            outputs.append(logits[:, -1] if last_only else logits)
        self._length = total
        self._history_clean = True
        if last_only:
            return outputs[-1]
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=1)

    def raise_if_tainted(self, prompt_length: int | None = None) -> None:
        """Raise OutputTainted when an audit proved that a node's unchecked answer, still in
        this session's history, was wrong (client/verification.py): going on would build
        on it, and rolling back cannot take back what the caller has already seen. With
        ``prompt_length`` the error names the first generated token in doubt."""
        finding = self.verifier.proven_wrong() if self.verifier is not None else None
        if finding is not None and finding.start_pos < self._length:
            raise OutputTainted(
                finding.node_id,
                finding.layer_start,
                finding.layer_end,
                finding.start_pos,
                prompt_length,
            )

    def unsettled_from(self) -> int | None:
        """The start position of the oldest step whose checks were deferred and have not
        settled (None: every step so far is settled). What the caller derived from a step
        that starts at or after it is still provisional."""
        return self._deferred[0].start_pos if self._deferred else None

    async def settle_deferred(self, *, wait: bool) -> Rollback | None:
        """Settle deferred steps oldest first: those whose checks have all answered, or
        (``wait``) all of them. None when every settled check agreed. When one rejected a
        primary, the node is replaced, that step is run again from the corrected output
        (the checks of the steps after it are dropped, their work is void) and the
        ``Rollback`` says where the caller must start over."""
        while self._deferred:
            entry = self._deferred[0]
            if not wait and not all(c.pending.ready() for c in entry.checks):
                return None
            self._deferred.popleft()
            self._unsettled = entry.checks
            rejected = await self._settle_checks()
            if rejected is not None:
                return await self._roll_back(entry, rejected)
        return None

    async def _roll_back(
        self, entry: _Deferred, rejected: tuple[_Unsettled, HopFailure]
    ) -> Rollback:
        self._drop_deferred()
        self._end_ring("a check sent the session back to an earlier step")
        length = entry.start_pos + int(entry.ids.shape[1])
        event = RollbackEvent(
            position=entry.start_pos,
            rejected_node_id=rejected[0].hop.node_id,
            discarded_positions=self._length - length,
            reason=str(rejected[1]),
        )
        self.rollbacks.append(event)
        log.warning(
            "a check of the step at position %d rejected node %s; %d positions computed "
            "after it are discarded and the step runs again without it",
            entry.start_pos, event.rejected_node_id, event.discarded_positions,
        )  # fmt: skip
        # Every hop's inputs after that step go; the step's own stay, for the replay.
        self._history.rollback(length)
        self._history_clean = False
        self._failovers_this_step = 0
        self._replayed_this_step.clear()
        self._resumed_this_step.clear()
        slot = self._slots[self._index_at(rejected[0].span.start)]
        try:
            if slot.span == rejected[0].span and slot.hop.node_id == rejected[0].hop.node_id:
                out, dtype = await self._redo_after(rejected, entry.start_pos, entry.last_only)
            else:
                # The node has left the route since (a fail-over): the step runs again
                # from the first stage, through what the route is now.
                self._excluded.add(rejected[0].hop.node_id)
                out, dtype = await self._run_through(
                    0, self.shape.num_layers, entry.start_pos, entry.ids, "int64",
                    self._next_step(), last_only=entry.last_only,
                )  # fmt: skip
            out, _ = await self._settled(out, dtype, entry.start_pos, entry.last_only)
        finally:
            self._cancel_unsettled()
        self._length = length
        self._history_clean = True
        return Rollback(entry.start_pos, out[:, -1] if entry.last_only else out)

    def _cancel_unsettled(self) -> None:
        """The checks of a chunk that raised (or was redone) are moot."""
        for unsettled in self._unsettled:
            unsettled.pending.cancel()
        self._unsettled.clear()

    def _drop_deferred(self) -> None:
        for entry in self._deferred:
            for unsettled in entry.checks:
                unsettled.pending.cancel()
        self._deferred.clear()

    async def _settled(
        self, out: np.ndarray, dtype: str, start_pos: int, last_only: bool
    ) -> tuple[np.ndarray, str]:
        """The chunk's output once each of its checks has passed: a rejected primary is
        replaced and every span after it runs again from the corrected output."""
        while (rejected := await self._settle_checks()) is not None:
            out, dtype = await self._redo_after(rejected, start_pos, last_only)
        return out, dtype

    async def close(self) -> None:
        """End the session on every node that served it (best effort) and close streams."""
        self._drop_deferred()
        if self.ring_off is not None and self._ring_started:
            await self._await_ring_answers()
        if self.acks is not None:
            await self.acks.close()  # the last receipts, which the nodes settle themselves
        for slot in self._slots:
            slot.close_stream()
        self._subscriptions.close()
        if self._reporter is not None:
            await self._reporter.close()
        request = stage_pb2.EndSessionRequest(
            session_id=self.session_id, capability=self._capability
        )

        async def end(hop: HopRecord) -> None:
            stub = stage_pb2_grpc.StageStub(self._channels.get(hop.address))
            try:
                await stub.EndSession(request, timeout=self.config.end_session_timeout_s)
            except grpc.aio.AioRpcError as err:
                # NOT_FOUND: never opened a cache there. Others: the node is gone anyway.
                log.debug("EndSession on %s: %s", hop.node_id, err.code().name)

        await asyncio.gather(*(end(hop) for hop in self._used.values()))
        if self._owns_channels:
            await self._channels.close()

    # ---- the walk -------------------------------------------------------------------

    async def _walk(
        self,
        start_pos: int,
        ids: np.ndarray,
        last_only: bool,
        *,
        defer: bool = False,
        ring: RingPlan | None = None,
    ) -> np.ndarray:
        """One chunk of token ids through the whole route: its logits.

        Every reply's signature is checked before its output goes on. A call drawn for a
        redundant check is compared once its checker answers, which may be after the
        pipeline went on: all of them are settled before the logits are returned, so a
        primary that loses is still replaced (and everything after it re-run from its
        corrected output) before the client uses anything. With ``defer`` they are kept
        for ``settle_deferred`` instead.
        """
        try:
            if self.acks is not None:  # at once, unless a node is owed half its credit
                await self.acks.ready((s.hop, s.span.start, s.span.end) for s in self._slots)
            step = self._next_step()
            ring_next, self._ring_next = self._ring_next, None
            if (
                self.push_off is None
                # One node serving the whole model pushes only to go round a ring by itself.
                and (len(self._slots) > 1 or self._may_ring(ring, ring_next, ids, last_only))
                and all(self._unpushable.get(s.hop.node_id, 0) <= step for s in self._slots)
            ):
                out, dtype = await self._push_through(
                    start_pos, ids, step, last_only, ring, ring_next
                )
            else:
                if ring_next is not None:
                    self._end_ring("the session goes on hop by hop")
                out, dtype = await self._run_through(
                    0, self.shape.num_layers, start_pos, ids, "int64", step, last_only=last_only
                )
            if defer and self._unsettled:
                self._deferred.append(_Deferred(start_pos, ids, last_only, self._unsettled))
                self._unsettled = []
            out, dtype = await self._settled(out, dtype, start_pos, last_only)
        finally:
            self._cancel_unsettled()
        return out

    async def _push_through(
        self,
        start_pos: int,
        ids: np.ndarray,
        step: int,
        last_only: bool,
        ring: RingPlan | None = None,
        ring_next: _RingNext | None = None,
    ) -> tuple[np.ndarray, str]:
        """One chunk pushed through the route (module docstring): its logits. Where the
        push breaks off, the rest of the step goes hop by hop from that stage. With
        ``ring`` the last hop also starts the next step; ``ring_next`` is the step a ring
        started, which this one adopts when it is that very step."""
        slots = list(self._slots)
        adopt = ring_next is not None and (
            (ring_next.step, ring_next.start_pos, ring_next.route, ids.shape)
            == (step, start_pos, _route_of(slots), (1, 1))
        )
        if ring_next is not None and adopt and int(ids[0, 0]) in ring_next.stop_ids:
            adopt = False  # the ring ended at this token by itself; a new one may start
        elif ring_next is not None and not adopt:
            self._end_ring(f"step {step} is not the one the ring started")
        launch = ring if not adopt and self._may_ring(ring, None, ids, last_only) else None
        ringing = adopt or launch is not None
        if launch is not None:
            self._ring_last_step = step + launch.steps
            self._ring_started.update(range(step + 1, self._ring_last_step + 1))
        subscriptions = await self._subscribe(slots if ringing else slots[1:], step)
        if subscriptions is None:
            self._end_ring("a node's subscription could not be had")
            return await self._run_through(
                0, self.shape.num_layers, start_pos, ids, "int64", step, last_only=last_only
            )
        first_subscription = subscriptions.pop(0) if ringing else None
        first = slots[0]
        self._history.record(first.span, start_pos, ids, "int64")
        call = self._request(first, start_pos, ids, "int64", step, False, last_only)
        answers = [
            sub.expect(step, s.span.start, s.span.end)
            for sub, s in zip(subscriptions, slots[1:], strict=True)
        ]

        def forget(first_index: int) -> None:
            later = zip(
                subscriptions[first_index:], slots[1 + first_index :], answers[first_index:],
                strict=True,
            )  # fmt: skip
            for sub, s, answer in later:
                sub.forget(step, s.span.start, s.span.end)
                if answer.done() and not answer.cancelled() and answer.exception() is None:
                    # It came before the client went on without it: that node ran the step.
                    self._unclaimed(s.hop.node_id, (step, s.span.start, s.span.end))

        failed_at = time.monotonic()
        try:
            if first_subscription is not None and adopt:
                response, wall = await self._adopted(first, first_subscription, call)
            else:
                pushed = _pushed(call.request, slots, last_only, launch)
                response, wall = await self._exchange(first, call, pushed)
            previous = failed_at + wall  # when the answer before the next one arrived
            x, dtype = await self._accept(first, call, response, wall)
            if response.relay_failed and len(slots) > 1:
                return await self._relay_broke(0, response.relay_failed, start_pos, x, dtype,
                                               step, last_only, forget)  # fmt: skip
        except (HopFailure, RequestRejected) as err:
            forget(0)
            self._end_ring(f"the first hop failed: {err}")
            if isinstance(err, HopFailure):
                return await self._resume_hop_by_hop(
                    0, start_pos, ids, "int64", step, last_only,
                    failure=None if isinstance(err, RingMissed) else (err, failed_at),
                )  # fmt: skip
            # Perhaps only the push was refused (a node that does not relay): the same call
            # hop by hop says whether the request itself is at fault.
            self._stop_pushing(f"node {first.hop.node_id} refused a pushed step: {err}")
            return await self._resume_hop_by_hop(0, start_pos, ids, "int64", step, last_only)
        for k, slot in enumerate(slots[1:], start=1):
            self._history.record(slot.span, start_pos, x, dtype)
            call = self._request(slot, start_pos, x, dtype, step, False, last_only)
            self._begin_call(slot, call)
            if adopt:
                self._ring_counted.add((slot.hop.node_id, step, slot.span.start, slot.span.end))
            wait_s, hedge = self._push_wait(slot, call, x)
            started = time.monotonic()
            try:
                async with asyncio.timeout(wait_s):
                    response, answered = await answers[k - 1]
                if response.input_digest != self._history.input_digest(slot.span):
                    # The node before it handed on something else than it signed (or this
                    # node ran something else): the client's own copy goes instead.
                    self._stop_pushing(
                        f"node {slot.hop.node_id} ran a pushed input other than the one node "
                        f"{slots[k - 1].hop.node_id} signed"
                    )
                    raise HopFailure("pushed input digest differs")
            except (TimeoutError, DeliveryLost, HopFailure) as err:
                if call.pending is not None:
                    call.pending.cancel()
                forget(k - 1)
                self._end_ring(f"the push stopped at layers {slot.span}")
                late = isinstance(err, TimeoutError)
                log.info(
                    "step %d: push stopped at layers %s (node %s): %s", step, slot.span,
                    slot.hop.node_id, f"no answer within {wait_s:.2f} s" if late else err,
                )  # fmt: skip
                if late and not hedge:  # past the straggler deadline: a failed node
                    straggler = HopFailure(f"straggler: no answer within {wait_s:.1f} s")
                    return await self._resume_hop_by_hop(
                        k, start_pos, x, dtype, step, last_only, failure=(straggler, started)
                    )
                return await self._resume_hop_by_hop(
                    k, start_pos, x, dtype, step, last_only, hedge_now=late
                )
            try:
                # Its wall time: from the answer before it to its own, as they reached the
                # client (a step's walls then add up to its whole time). Answers on two
                # streams may be read out of order, so never less than the node's own
                # compute time: a node can only make itself look slower with that, never
                # faster than the client measured (the coordinator's speed estimate).
                wall = max(answered - previous, response.compute_ms / 1000.0)
                x, dtype = await self._accept(slot, call, response, wall)
                previous = answered
            except HopFailure as failure:  # an answer that cannot be used: a failed node
                forget(k)
                self._end_ring(f"node {slot.hop.node_id} failed")
                return await self._resume_hop_by_hop(
                    k, start_pos, x, dtype, step, last_only, failure=(failure, answered)
                )
            if response.relay_failed and k < len(slots) - 1:
                return await self._relay_broke(k, response.relay_failed, start_pos, x, dtype,
                                               step, last_only, forget)  # fmt: skip
        self.pushed_steps += 1  # through the whole route
        self._relay_breaks = 0
        if response.relay_failed and (adopt or launch is not None):
            # The last hop could not start the next step: waiting for it would be in vain.
            self._end_ring(f"node {slots[-1].hop.node_id} could not start the next step: "
                           f"{shown(response.relay_failed, 200)}")  # fmt: skip
        self._last_push_s = time.monotonic() - failed_at
        if adopt:
            assert ring_next is not None
            self.ring_steps += 1
            left, stop_ids = ring_next.steps_left, ring_next.stop_ids
        elif launch is not None:
            left, stop_ids = launch.steps, launch.stop_ids
        else:
            left, stop_ids = 0, ()
        if left > 0 and self._ring_paused_until <= step:
            # The last hop is starting the next step as this one returns.
            self._ring_next = _RingNext(
                step + 1, start_pos + int(ids.shape[1]), _route_of(slots), left - 1, stop_ids
            )
        return x, dtype

    async def _relay_broke(
        self,
        index: int,
        reason: str,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        last_only: bool,
        forget: Callable[[int], None],
    ) -> tuple[np.ndarray, str]:
        """Slot ``index`` answered but could not hand its output on (its answer says why):
        the client sends the rest of the step itself at once rather than wait out a
        deadline. Nobody is failed over for it: the link between two nodes broke, or the
        next node is gone, which that call then finds out. ``forget`` stops waiting for
        the later slots' pushed answers (after they count as handed back: one that came
        already, or comes later, is work its node did)."""
        reason = shown(reason, 200)  # the node's words, of any length
        slot, after = self._slots[index], self._slots[index + 1]
        self._end_ring(f"node {slot.hop.node_id} could not relay")
        log.info("step %d: node %s could not relay to node %s (%s); the client sends it",
                 step, slot.hop.node_id, after.hop.node_id, reason)  # fmt: skip
        self._relay_breaks += 1
        if self._relay_breaks >= RELAY_BREAKS_TO_STOP:
            self._stop_pushing(
                f"{self._relay_breaks} pushes in a row could not be handed on (last: node "
                f"{slot.hop.node_id} to node {after.hop.node_id}: {reason})"
            )
        for later in self._slots[index + 1 :]:
            key = (later.hop.node_id, step, later.span.start, later.span.end)
            self._handed_back[key] = int(x.shape[0] * x.shape[1])
        while len(self._handed_back) > HANDED_BACK_KEPT:
            del self._handed_back[next(iter(self._handed_back))]
        forget(index)
        self._history.record(after.span, start_pos, x, dtype)
        return await self._resume_hop_by_hop(index + 1, start_pos, x, dtype, step, last_only)

    async def _adopted(
        self, first: _Slot, subscription: Subscription, call: _Request
    ) -> tuple[stage_pb2.ForwardResponse, float]:
        """The first hop's answer to the step a ring started: (it, its wall time). Its
        input must be the client's own token (the digest it signed says so)."""
        request = call.request
        # The wait is short: a missing answer may be the last hop's fault as much as the
        # first's, so nobody is failed over for it; the client just sends the step itself.
        # Until the first hop has decode times, the step before (that started the ring)
        # says how slow the machines are now.
        samples = first.decode_seconds
        typical = percentile(samples, 95.0) if samples else self._last_push_s
        wait_s = max(self.config.ring_wait_floor_s, self.config.deadline_factor * typical)
        started = time.monotonic()
        future = subscription.expect(request.step, first.span.start, first.span.end)
        try:
            try:
                async with asyncio.timeout(wait_s):
                    response, answered = await future
            except TimeoutError:
                subscription.forget(request.step, first.span.start, first.span.end)
                raise RingMissed(f"the ring's step was not back within {wait_s:.2f} s") from None
            except DeliveryLost as err:
                raise RingMissed(f"the ring's step failed: {err}") from err
            # It ran: counted, and (when drawn) checked, like any call.
            self._begin_call(first, call)
            span = first.span
            self._ring_counted.add((first.hop.node_id, request.step, span.start, span.end))
            if response.input_digest != self._history.input_digest(first.span):
                raise RingMissed("the ring started this step with another token than the client's")
        except RingMissed:
            if call.pending is not None:
                call.pending.cancel()
            raise
        # Never less than the node's compute time: the answer may have come before the
        # client asked for it.
        return response, max(answered - started, response.compute_ms / 1000.0)

    async def _resume_hop_by_hop(
        self,
        index: int,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        last_only: bool,
        *,
        hedge_now: bool = False,
        failure: tuple[HopFailure, float] | None = None,
    ) -> tuple[np.ndarray, str]:
        """Finish a step from slot ``index`` (its input recorded already) hop by hop; with
        ``failure`` (and when it failed), that slot's node failed and is replaced first."""
        end = self._slots[index].span.end
        if failure is not None:
            slot = self._slots[index]
            log.warning("node %s failed on layers %s: %s", slot.hop.node_id, slot.span, failure[0])
            x, dtype = await self._fail_over(
                index, failure[0], failure[1], start_pos, dtype, step, last_only
            )
        else:
            x, dtype = await self._call_or_recover(
                index, start_pos, x, dtype, step, False, last_only, hedge_now=hedge_now
            )
        return await self._run_through(
            end, self.shape.num_layers, start_pos, x, dtype, step, last_only=last_only
        )

    async def _subscribe(self, slots: list[_Slot], step: int) -> list[Subscription] | None:
        """The client's subscription at each of ``slots``' nodes; None when one cannot be
        had, and this step goes hop by hop."""
        try:
            return [
                await self._subscriptions.at(
                    s.hop.node_id,
                    s.hop.address,
                    self._capability,
                    self.config.subscribe_timeout_s,
                )  # fmt: skip
                for s in slots
            ]
        except DeliveryLost as err:
            if err.code == grpc.StatusCode.UNIMPLEMENTED:
                self._stop_pushing(str(err))  # a node from before the push pipeline
            else:  # perhaps a node that is gone: hop by hop fails it over
                self._unpushable[err.node_id] = step + self.config.push_retry_steps
            return None

    def _push_wait(self, slot: _Slot, call: _Request, x: np.ndarray) -> tuple[float, bool]:
        """How long a pushed answer may take before the step goes on without it, and
        whether it is then hedged (the hedging delay came first) rather than failed over
        (the straggler deadline)."""
        deadline = self._deadline(slot, call)
        delay = self._hedge_delay(slot, x, False)
        if delay is None or delay >= deadline:
            return deadline, False
        return delay, True

    def _may_ring(
        self,
        ring: RingPlan | None,
        ring_next: _RingNext | None,
        ids: np.ndarray,
        last_only: bool,
    ) -> bool:
        """Whether this step may start a ring, or adopt the one that started it."""
        if ring_next is not None:
            return True
        return (
            ring is not None
            and ring.steps > 0
            and self.config.ring
            and self._step >= self._ring_paused_until
            and last_only
            and ids.shape[0] == 1
        )

    async def _await_ring_answers(self) -> None:
        """A ring that ended early may have run steps whose answers are still on their
        way: the nodes' receipts count those steps, which the usage book learns only from
        the answers. Wait for them a little (never longer than ending the session may
        take), so that no honest node's receipt is left unsigned."""
        deadline = time.monotonic() + self.config.end_session_timeout_s
        while True:
            self._subscriptions.release_early()
            if not self.usage.uncovered() or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.01)

    def _unclaimed(self, node_id: str, key: tuple[int, int, int]) -> None:
        """A signed answer nobody took: if a ring ran it, the node did that work for this
        session, and its receipt may count it."""
        step, start, end = key
        counted = (node_id, step, start, end)
        tokens = self._handed_back.pop(counted, 0)
        if tokens:
            self.usage.sent(node_id, start, end, tokens)
        elif step in self._ring_started and counted not in self._ring_counted:
            self._ring_counted.add(counted)
            self.usage.sent(node_id, start, end, 1)  # a ring's step is one token

    def _end_ring(self, reason: str) -> None:
        """No step goes round this ring again: after anything unusual its steps may no
        longer be the ones the client needs. A new one may start ``ring_retry_steps``
        steps later.

        The ring's steps may still be going round, even ahead of the client. The client's
        own steps from now on are numbered past every step that ring may start, so each
        node runs those and drops what is left of the ring as stale, and no answer of the
        ring is ever taken for one of the client's."""
        running = self._ring_next is not None or self._step < self._ring_last_step
        self._ring_next = None
        self._step = max(self._step, self._ring_last_step)
        if not self.config.ring or not running:
            return
        retry = self.config.ring_retry_steps
        self._ring_paused_until = self._step + retry + 1 if retry > 0 else 2**62
        log.info(
            "session %s: the ring stops (%s); %s", self.session_id, reason,
            f"a new one may start in {retry} steps" if retry > 0 else "no other this session",
        )  # fmt: skip
        self.ring_off = reason

    def _stop_pushing(self, reason: str) -> None:
        if self.push_off is None:
            log.warning("session %s goes on hop by hop: %s", self.session_id, reason)
            self.push_off = reason

    async def _settle_checks(self) -> tuple[_Unsettled, HopFailure] | None:
        """Settle this chunk's checks in pipeline order: the first call whose primary lost,
        with the failure to recover from, or None when every check passed."""
        assert self.verifier is not None or not self._unsettled
        unsettled, self._unsettled = self._unsettled, []
        for n, entry in enumerate(unsettled):
            assert self.verifier is not None
            try:
                await self.verifier.settle(
                    entry.hop, entry.call.request, entry.response, self._history, entry.pending
                )
            except BaseException as err:
                # The calls after it ran on its output: their checks compare nothing useful.
                for later in unsettled[n + 1 :]:
                    later.pending.cancel()
                if not isinstance(err, NodeRejected):
                    raise
                return entry, HopFailure(str(err))
        return None

    async def _redo_after(
        self, rejected: tuple[_Unsettled, HopFailure], start_pos: int, last_only: bool
    ) -> tuple[np.ndarray, str]:
        """Replace the node a check rejected, replay its span, and run every later span
        again from the corrected output (their caches roll back to ``start_pos``)."""
        entry, failure = rejected
        self._end_ring(f"a check rejected node {entry.hop.node_id}")
        index = self._index_at(entry.span.start)
        slot = self._slots[index]
        if slot.span != entry.span or slot.hop.node_id != entry.hop.node_id:
            raise PipelineError(  # a driver bug: nothing else replaces a slot that answered
                f"layers {entry.span} changed hands before their check settled"
            )
        slot.close_stream()
        log.warning("node %s failed on layers %s: %s", entry.hop.node_id, slot.span, failure)
        dtype = entry.call.request.input.dtype
        out, out_dtype = await self._fail_over(
            index, failure, time.monotonic(), start_pos, dtype, entry.call.request.step,
            last_only,
        )  # fmt: skip
        return await self._run_through(
            entry.span.end, self.shape.num_layers, start_pos, out, out_dtype,
            self._next_step(), last_only=last_only,
        )  # fmt: skip

    async def _run_through(
        self,
        from_layer: int,
        to_layer: int,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        replay: bool = False,
        *,
        last_only: bool = False,
    ) -> tuple[np.ndarray, str]:
        """Send one chunk from boundary ``from_layer`` to ``to_layer``, recording inputs.

        With ``last_only`` the hop that ends at the last layer answers for the chunk's
        last position only ([B, 1, vocab]); every other hop answers every position.
        """
        layer = from_layer
        while layer < to_layer:
            index = self._index_at(layer)
            span = self._slots[index].span
            self._history.record(span, start_pos, x, dtype)
            x, dtype = await self._call_or_recover(
                index, start_pos, x, dtype, step, replay, last_only
            )
            layer = span.end
        return x, dtype

    async def _call_or_recover(
        self,
        index: int,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        replay: bool,
        last_only: bool,
        *,
        hedge_now: bool = False,
    ) -> tuple[np.ndarray, str]:
        """One hop's call, hedged when it may be (at once with ``hedge_now``: the node is
        already late with a pushed answer), failed over when it fails."""
        slot = self._slots[index]
        span = slot.span
        failed_at = time.monotonic()
        try:
            try:
                delay = self._hedge_delay(slot, x, replay)
                if delay is not None and hedge_now:
                    delay = 0.0
                if delay is None:
                    return await self._call(slot, start_pos, x, dtype, step, replay, last_only)
                return await self._call_hedged(slot, delay, start_pos, x, dtype, step, last_only)
            except RequestRejected as err:
                if not slot.parts or err.code not in MERGE_REFUSED_CODES:
                    raise
                raise HopFailure(f"{err.code.name}: {err.details}", err.code) from err
        except HopFailure as failure:
            log.warning("node %s failed on layers %s: %s", slot.hop.node_id, span, failure)
            return await self._fail_over(
                index, failure, failed_at, start_pos, dtype, step, last_only
            )

    async def _fail_over(
        self,
        index: int,
        failure: HopFailure,
        failed_at: float,
        start_pos: int,
        dtype: str,
        step: int,
        last_only: bool,
    ) -> tuple[np.ndarray, str]:
        """Replace slot ``index``'s node and replay its boundary's history there: the
        output of the chunk at ``start_pos`` that the failed call should have given."""
        span, failed = self._slots[index].span, self._slots[index].hop
        resumed = await self._retry_same_node(index, failure, failed_at, start_pos, step, last_only)
        if resumed is not None:
            return resumed
        via, replacements = await self._recover(index, failure)
        if self.verifier is not None:
            # A replacement may be a checker of the span with check work under way: that
            # must not land on its cache after the replay below.
            for slot in self._slots:
                if span.start <= slot.span.start and slot.span.end <= span.end:
                    await self.verifier.serving(slot.hop.node_id, slot.span)
        # The boundary history ends with the chunk that failed, so replaying it from 0
        # rebuilds the replacement's cache and yields this chunk's output as its tail.
        _, full, full_dtype = self._history.replay_input(self._slots[index].span)
        # Replaying the last span for a last-position step: only the very last position
        # counts, so no piece needs its (vocab-wide) logits for every position.
        trim = last_only and span.end == self.shape.num_layers
        chunk = self._chunk_tokens(full.shape[0], trim)
        parts: list[np.ndarray] = []
        out_dtype = dtype
        for offset in range(0, full.shape[1], chunk):
            piece = full[:, offset : offset + chunk]
            out, out_dtype = await self._run_through(
                span.start,
                span.end,
                offset,
                piece,
                full_dtype,
                self._next_step(),
                True,
                last_only=trim,
            )
            if trim:
                parts = [out]
            elif offset + piece.shape[1] > start_pos:
                parts.append(out[:, max(0, start_pos - offset) :])
        event = FailoverEvent(
            step=step,
            start=span.start,
            end=span.end,
            failed_node_id=failed.node_id,
            replacement_node_ids=tuple(replacements),
            via=via,
            reason=str(failure),
            stalled_ms=(time.monotonic() - failed_at) * 1000.0,
            replayed_tokens=int(full.shape[1]),
            position=start_pos,
        )
        self.failovers.append(event)
        log.warning(
            "layers %s: %s -> %s via %s, replayed %d tokens, stalled %.0f ms",
            span,
            failed.node_id,
            ", ".join(replacements),
            via,
            event.replayed_tokens,
            event.stalled_ms,
        )
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0], out_dtype

    async def _retry_same_node(
        self,
        index: int,
        failure: HopFailure,
        failed_at: float,
        start_pos: int,
        step: int,
        last_only: bool,
    ) -> tuple[np.ndarray, str] | None:
        """The failed step (a decode step or a prompt chunk) again on the same node, when
        only the connection to it broke (``resume_connect_s``); None when that is not worth
        a try, or the node cannot be reached again at once: the caller fails over. The
        node's cache still holds the session up to this step (or the step too, which it
        then computes again), so the step alone goes again (a node that lost the session
        answers FAILED_PRECONDITION, and a replay there follows). Likewise when a paid
        session's node refused the step for want of an acknowledgment, once it took one."""
        slot = self._slots[index]
        key = (slot.hop.node_id, slot.span)
        owed = (
            failure.code == grpc.StatusCode.FAILED_PRECONDITION
            and self.acks is not None
            and usage_credit.is_refusal(str(failure))
        )
        if (
            (not owed and (failure.code != grpc.StatusCode.UNAVAILABLE
                           or self.config.resume_connect_s <= 0))
            or key in self._resumed_this_step
            or key not in self._answered  # it never answered here: nothing to resume
            or self._history.length(slot.span) <= start_pos
        ):  # fmt: skip
            return None
        self._resumed_this_step.add(key)
        slot.close_stream()
        if owed:
            assert self.acks is not None
            if not await self.acks.settle_up(slot.hop, slot.span.start, slot.span.end):
                return None
            log.info("node %s wanted an acknowledgment (%s); sending step %d to it again",
                     slot.hop.node_id, failure, step)  # fmt: skip
        elif not await self._reconnects(slot.hop.address, self.config.resume_connect_s):
            return None
        else:
            log.info("node %s: the connection broke (%s); sending step %d to it again",
                     slot.hop.node_id, failure, step)  # fmt: skip
        failovers = len(self.failovers)
        _, full, full_dtype = self._history.replay_input(slot.span)
        tokens = int(full.shape[1]) - start_pos
        trim = last_only and slot.span.end == self.shape.num_layers
        out, out_dtype = await self._run_through(
            slot.span.start, slot.span.end, start_pos, full[:, start_pos:], full_dtype,
            self._next_step(), last_only=trim,
        )  # fmt: skip
        if len(self.failovers) == failovers:  # not failed over after all
            self.failovers.append(
                FailoverEvent(
                    step=step,
                    start=slot.span.start,
                    end=slot.span.end,
                    failed_node_id=key[0],
                    replacement_node_ids=(key[0],),
                    via="resume",
                    reason=str(failure),
                    stalled_ms=(time.monotonic() - failed_at) * 1000.0,
                    replayed_tokens=tokens,
                    position=start_pos,
                )
            )
        return out, out_dtype

    async def _reconnects(self, address: str, budget_s: float) -> bool:
        """Whether a connection to ``address`` opens within ``budget_s`` (a refused one
        fails at once)."""
        channel = self._channels.get(address)
        state = channel.get_state(try_to_connect=True)
        deadline = time.monotonic() + budget_s
        while state is not grpc.ChannelConnectivity.READY:
            left = deadline - time.monotonic()
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE or left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await channel.wait_for_state_change(state)
            except TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True

    async def _call(
        self,
        slot: _Slot,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        replay: bool,
        last_only: bool = False,
    ) -> tuple[np.ndarray, str]:
        call = self._request(slot, start_pos, x, dtype, step, replay, last_only)
        response, wall = await self._exchange(slot, call)
        return await self._accept(slot, call, response, wall)

    def _request(
        self,
        slot: _Slot,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        replay: bool,
        last_only: bool,
    ) -> _Request:
        last_position_only = last_only and slot.span.end == self.shape.num_layers
        request = stage_pb2.ForwardRequest(
            session_id=self.session_id,
            step=step,
            model=self.model,
            layers=common_pb2.LayerRange(start=slot.span.start, end=slot.span.end),
            start_pos=start_pos,
            input=codec.encode(x, dtype),
            last_position_only=last_position_only,
        )
        if slot.capability_version_sent != self._capability_version:
            request.capability.CopyFrom(self._capability)
        return _Request(request, int(x.shape[0]), int(x.shape[1]), replay, last_position_only)

    async def _exchange(
        self, slot: _Slot, call: _Request, wire: stage_pb2.ForwardRequest | None = None
    ) -> tuple[stage_pb2.ForwardResponse, float]:
        """One round trip on the slot's stream: (the answer, its wall time in seconds).
        ``wire``: what to send instead of ``call.request`` (a pushed step's first call)."""
        timeout = self._deadline(slot, call)
        self._begin_call(slot, call)
        started = time.monotonic()
        try:
            if slot.call is None:
                stub = stage_pb2_grpc.StageStub(self._channels.get(slot.hop.address))
                slot.call = stub.Forward()
            # asyncio.timeout, unlike wait_for, runs the round trip in this task: no extra
            # task and event-loop pass per hop.
            async with asyncio.timeout(timeout):
                response = await _round_trip(slot.call, wire or call.request)
        except TimeoutError:
            slot.close_stream()
            raise HopFailure(f"straggler: no answer within {timeout:.1f} s") from None
        except grpc.aio.AioRpcError as err:
            slot.close_stream()
            raise _classify(slot, err.code(), err.details() or "") from err
        except HopFailure:
            slot.close_stream()
            raise
        except Exception as err:  # a broken stream surfaces in several shapes
            call, slot.call = slot.call, None
            if call is not None and call.done():
                # The RPC ended between two steps (e.g. the node shut down): report its status.
                raise _classify(slot, await call.code(), await call.details() or "") from err
            slot.close_stream()
            raise HopFailure(f"stream broke: {type(err).__name__}: {err}") from err
        slot.capability_version_sent = self._capability_version
        return response, time.monotonic() - started

    def _begin_call(self, slot: _Slot, call: _Request) -> None:
        """What goes with every call as it starts, sent by the client or pushed."""
        if self.verifier is not None and call.pending is None:
            # A sampled redundant check starts now, so the checker computes alongside the
            # node (a check whose call fails runs out unused; the verifier keeps it apart).
            call.pending = self.verifier.begin(
                self._capability, slot.hop, self._checkers(slot), call.request, self._history,
                replay=call.replay,
            )  # fmt: skip
        self.usage.sent(slot.hop.node_id, slot.span.start, slot.span.end, call.batch * call.tokens)

    def _checkers(self, slot: _Slot) -> list[HopRecord]:
        # The stage's verification-only replicas count too, so that trimming alternates
        # (prefer=cheap) trims no checks. A node this session found slow is no fit
        # checker: each check would stall a token.
        return [h for h in (*slot.alternates, *slot.checkers) if h.node_id not in self._demoted]

    async def _accept(
        self,
        slot: _Slot,
        call: _Request,
        response: stage_pb2.ForwardResponse,
        wall: float,
    ) -> tuple[np.ndarray, str]:
        """Check an answer (its signature too) and record it; a bad one raises HopFailure.
        A sampled check of it is settled later, before the step returns (``_walk``)."""
        request, tokens, replay = call.request, call.tokens, call.replay
        step = request.step
        self.received(slot.hop, slot.span.start, slot.span.end, response.usage)
        output = self._check_output(
            slot, response, step, call.batch, tokens, request.start_pos, call.last_position_only
        )
        if self.verifier is not None:
            try:
                pending = self.verifier.check_reply(
                    self._capability, slot.hop, request, response, replay=replay,
                    pending=call.pending, history=self._history, wall_s=wall,
                )  # fmt: skip
            except NodeRejected as err:
                slot.close_stream()
                raise HopFailure(str(err)) from err
            if pending is not None:
                self._unsettled.append(_Unsettled(slot.span, slot.hop, call, response, pending))
        self._answered.add((slot.hop.node_id, slot.span))
        if tokens > 1:
            slot.bulk_calls.append((wall, call.batch * tokens, request.start_pos + tokens))
        if tokens == 1 and not replay:
            slot.decode_seconds.append(wall)
            if self._reporter is not None:
                self._reporter.add(
                    slot.hop.node_id, slot.span.start, slot.span.end, call.batch, wall * 1e3
                )
        self.timings.append(
            StageTiming(
                step=step,
                node_id=slot.hop.node_id,
                start=slot.span.start,
                end=slot.span.end,
                tokens=tokens,
                wall_ms=wall * 1000.0,
                compute_ms=response.compute_ms,
                replay=replay,
            )
        )
        self.receipts.append(
            Receipt(
                node_id=slot.hop.node_id,
                step=step,
                start=slot.span.start,
                end=slot.span.end,
                output_sha256=hashlib.sha256(response.output.data).digest(),
                signature=response.signature,
                input_digest=response.input_digest,
            )
        )
        return output, response.output.dtype

    def _check_output(
        self,
        slot: _Slot,
        response: stage_pb2.ForwardResponse,
        step: int,
        batch: int,
        tokens: int,
        start_pos: int,
        last_position_only: bool = False,
    ) -> np.ndarray:
        """A node that answers with the wrong thing is treated like one that failed."""
        if response.step != step:
            raise HopFailure(f"answered step {response.step} to a request for step {step}")
        if response.cache_length != start_pos + tokens:
            raise HopFailure(
                f"reports {response.cache_length} cached tokens, expected {start_pos + tokens}"
            )
        last = slot.span.end == self.shape.num_layers
        width = self.shape.vocab_size if last else self.shape.hidden_size
        positions = tokens
        if last_position_only and list(response.output.shape[1:2]) != [tokens]:
            positions = 1  # a node older than last_position_only answers every position
        try:
            output = codec.decode(
                response.output,
                allowed=frozenset({"float32"}) if last else codec.FLOAT_DTYPES,
                shape=(batch, positions, width),
                ndim=3,
                name="logits" if last else "hidden states",
            )
        except codec.TensorError as err:
            raise HopFailure(f"sent a malformed output: {err}") from err
        return output[:, -1:] if last_position_only else output

    # ---- hedging --------------------------------------------------------------------

    def _hedge_delay(self, slot: _Slot, x: np.ndarray, replay: bool) -> float | None:
        """When to hedge this call (None: not at all). Only decode steps of single-stage
        slots with an alternate, and only while the history is cheap enough to replay."""
        if replay or x.shape[1] != 1 or slot.parts or not self._hedge_target(slot):
            return None
        limit = min(self.config.hedge_max_replay_tokens, self._chunk_tokens(int(x.shape[0])))
        if self._history.length(slot.span) > limit:
            return None
        return hedge_delay(
            slot.decode_seconds,
            factor=self.config.hedge_factor,
            floor_s=self.config.hedge_floor_s,
            min_samples=self.config.min_samples,
        )

    def _hedge_target(self, slot: _Slot) -> HopRecord | None:
        unfit = self._excluded | self._demoted
        return next((h for h in slot.alternates if h.node_id not in unfit), None)

    async def _call_hedged(
        self,
        slot: _Slot,
        delay_s: float,
        start_pos: int,
        x: np.ndarray,
        dtype: str,
        step: int,
        last_only: bool,
    ) -> tuple[np.ndarray, str]:
        """Race the primary's round trip against a later one on an alternate; the winner's
        answer is then checked and verified like any other (the race is on the network and
        the nodes' compute only)."""
        alternate = self._hedge_target(slot)
        assert alternate is not None
        slow = slot.hop
        shadow = _Slot(span=slot.span, hop=alternate, alternates=[],
                       decode_seconds=deque(maxlen=self.config.window))  # fmt: skip
        trim = last_only and slot.span.end == self.shape.num_layers
        replayed = self._history.length(slot.span)
        primary = self._request(slot, start_pos, x, dtype, step, False, last_only)

        async def hedge() -> tuple[_Request, tuple[stage_pb2.ForwardResponse, float]]:
            # The alternate has no cache for this session: the whole boundary history goes
            # in one call, and its tail is this step's output.
            _, history, history_dtype = self._history.replay_input(slot.span)
            self._used.setdefault(alternate.node_id, alternate)
            call = self._request(shadow, 0, history, history_dtype, self._next_step(), True, trim)
            return call, await self._exchange(shadow, call)

        result = await race(
            self._exchange(slot, primary),
            hedge,
            delay_s,
            hedge_errors=(HopFailure, RequestRejected),
            primary_errors=(HopFailure,),
        )
        if not result.hedged:
            return await self._accept(slot, primary, *result.value)
        if result.alternate_won:
            # The alternate serves this hop from now on; the slow node is the last resort.
            slot.close_stream()
            slot.hop, slot.call = alternate, shadow.call
            slot.capability_version_sent = shadow.capability_version_sent
            slot.alternates = [h for h in slot.alternates if h != alternate] + [slow]
            slot.forget_timings()
            self._demoted.add(slow.node_id)
            if self.verifier is not None:
                self.verifier.avoid(slow.node_id)  # as a checker of other spans too
                # The alternate's cache is the pipeline's now (see _fail_over).
                await self.verifier.serving(alternate.node_id, slot.span, wait=False)
            # A lower bound of the slow call's time: the coordinator's router learns it.
            self.report_at_least(
                slow.node_id, slot.span.start, slot.span.end, int(x.shape[0]),
                result.answered_s * 1e3,
            )  # fmt: skip
        else:
            shadow.close_stream()
        event = HedgeEvent(
            step=step,
            start=slot.span.start,
            end=slot.span.end,
            slow_node_id=slow.node_id,
            alternate_node_id=alternate.node_id,
            winner="alternate" if result.alternate_won else "primary",
            hedged_after_ms=result.hedged_after_s * 1e3,
            answered_ms=result.answered_s * 1e3,
            replayed_tokens=replayed,
        )
        self.hedges.append(event)
        log.info(
            "layers %s: %s slower than %.0f ms, hedged on %s; %s answered first after %.0f ms",
            slot.span, slow.node_id, event.hedged_after_ms, alternate.node_id, event.winner,
            event.answered_ms,
        )  # fmt: skip
        if not result.alternate_won:
            return await self._accept(slot, primary, *result.value)
        assert result.hedge is not None
        out, out_dtype = await self._accept(slot, result.hedge, *result.value)
        return (out if trim else out[:, start_pos:]), out_dtype

    # ---- fail-over ------------------------------------------------------------------

    async def _recover(self, index: int, failure: HopFailure) -> tuple[str, list[str]]:
        """Replace the node of slot ``index``; returns (how, replacement node ids)."""
        slot = self._slots[index]
        failed = slot.hop
        slot.close_stream()
        self._failovers_this_step += 1
        if self._failovers_this_step > self.config.max_failovers_per_step:
            raise PipelineError(
                f"gave up on layers {slot.span} after {self.config.max_failovers_per_step} "
                f"fail-overs in one step; last error from {failed.node_id}: {failure}"
            )
        if failure.code == grpc.StatusCode.UNAVAILABLE and self._reporter is not None:
            self._reporter.unreachable(failed.node_id)  # the coordinator dials it back
        key = (failed.node_id, slot.span)
        if (
            failure.code in REPLAY_SAME_NODE_CODES
            and not usage_credit.is_residue_refusal(str(failure))  # it serves us nothing now
            and key not in self._replayed_this_step
        ):
            self._replayed_this_step.add(key)
            return "replay", [failed.node_id]
        if slot.parts:
            return await self._split(index, failure)
        self._excluded.add(failed.node_id)
        if self.verifier is not None:
            self.verifier.avoid(failed.node_id)  # as a checker of other spans too
        return await self._replace_node(index, failure)

    async def _replace_node(self, index: int, failure: HopFailure) -> tuple[str, list[str]]:
        """Move slot ``index`` to its next alternate that is not excluded, or reroute it."""
        slot = self._slots[index]
        slot.close_stream()
        slot.forget_timings()
        spare = [h for h in slot.alternates if h.node_id not in self._excluded]
        if spare:
            slot.hop, slot.alternates = spare[0], spare[1:]
            self._used.setdefault(slot.hop.node_id, slot.hop)
            return "alternate", [slot.hop.node_id]
        if failure.code == grpc.StatusCode.NOT_FOUND and self._rerouter is not None:
            # "No READY shard covers these layers": a re-plan moved the node's shard under
            # the session. The node did no wrong and may hold part of the span still (its
            # new shard), so the coordinator, which knows what it holds now, may route
            # over it again; only not for the very span it refused (a view from before
            # the move), which is then routed without it.
            refused = slot.hop
            self._excluded.discard(refused.node_id)
            try:
                return "reroute", await self._reroute(index, failure, refused=refused)
            except _StaleReroute:
                self._excluded.add(refused.node_id)
        return "reroute", await self._reroute(index, failure)

    async def _split(self, index: int, failure: HopFailure) -> tuple[str, list[str]]:
        """Split the merged slot ``index`` back into its stages.

        A refusal of the merged span keeps the node for each stage; any other failure
        excludes it, and every stage moves to its own alternate (or is rerouted).
        """
        merged = self._slots[index]
        parts = [
            _Slot(
                span=p.span,
                hop=p.hop,
                alternates=list(p.alternates),
                checkers=list(p.checkers),
                decode_seconds=deque(maxlen=self.config.window),
            )
            for p in merged.parts
        ]
        self._slots[index : index + 1] = parts
        self._history.replace(merged.span, [p.span for p in parts])
        if failure.code in MERGE_REFUSED_CODES:
            return "split", [merged.hop.node_id]
        self._excluded.add(merged.hop.node_id)
        how: set[str] = set()
        replacements: list[str] = []
        # From the last stage back: a reroute splices a chain in place of its stage, which
        # leaves the indices of the stages before it alone.
        for i in reversed(range(index, index + len(parts))):
            via, nodes = await self._replace_node(i, failure)
            how.add(via)
            replacements[:0] = nodes
        return "reroute" if "reroute" in how else "alternate", replacements

    async def _reroute(
        self, index: int, failure: HopFailure, refused: HopRecord | None = None
    ) -> list[str]:
        span = self._slots[index].span
        if self._rerouter is None:
            raise PipelineError(
                f"layers {span} lost node {self._slots[index].hop.node_id} ({failure}), no "
                "alternate is left and no coordinator is connected to reroute"
            )
        request = client_api_pb2.RerouteRequest(
            session_id=self.session_id,
            capability=self._capability,
            span=common_pb2.LayerRange(start=span.start, end=span.end),
            exclude_node_ids=sorted(self._excluded),
            reason=str(failure),
        )
        try:
            response = await self._rerouter(request)
        except grpc.aio.AioRpcError as err:
            raise PipelineError(
                f"layers {span} lost every node that served them ({failure}) and the "
                f"coordinator could not reroute: {err.code().name}: {err.details()}"
            ) from err
        hops = [_hop_record(h) for h in response.hops]
        chain = [Span(h.start, h.end) for h in hops]
        if refused is not None and any(
            h.node_id == refused.node_id and h.start <= span.start and span.end <= h.end
            for h in hops
        ):
            raise _StaleReroute(refused.node_id)
        if not covers(chain, span.start, span.end):
            raise PipelineError(
                f"the coordinator rerouted layers {span} to hops "
                f"{' '.join(map(str, chain)) or '(none)'}, which do not cover them exactly"
            )
        if any(h.node_id in self._excluded for h in hops):
            raise PipelineError(f"the coordinator rerouted layers {span} to an excluded node")
        if response.HasField("capability"):
            self._capability = response.capability
            self._capability_version += 1
        new_slots = [
            _Slot(span=s, hop=h, alternates=[], decode_seconds=deque(maxlen=self.config.window))
            for s, h in zip(chain, hops, strict=True)
        ]
        self._slots[index : index + 1] = new_slots
        self._history.replace(span, chain)
        for hop in hops:
            self._used.setdefault(hop.node_id, hop)
        return [h.node_id for h in hops]

    # ---- helpers --------------------------------------------------------------------

    def _deadline(self, slot: _Slot, call: _Request) -> float:
        samples = slot.decode_seconds
        if call.tokens != 1 or call.replay:
            end = call.request.start_pos + call.tokens
            reference = slot.bulk_estimate(call.batch * call.tokens, end)
        elif len(samples) < self.config.min_samples:
            reference = slot.bulk_seconds or None
        else:
            p95 = percentile(samples, 95.0)
            return max(self.config.deadline_floor_s, self.config.deadline_factor * p95)
        # Before its decode steps were timed, a node is judged by its multi-position calls.
        if reference is None:
            return self.config.cold_timeout_s
        wanted = self.config.deadline_factor * reference
        return min(self.config.cold_timeout_s, max(self.config.first_decode_floor_s, wanted))

    def _chunk_tokens(self, batch: int, last_only: bool = False) -> int:
        # The widest message a token causes: its logits, unless only the last position's
        # come back; then its hidden states (float32 at most).
        per_token = (
            self.shape.hidden_size
            if last_only
            else max(self.shape.vocab_size, self.shape.hidden_size)
        )
        widest = per_token * 4 * batch
        return max(1, min(self.config.max_chunk_tokens, self.config.message_budget_bytes // widest))

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _index_at(self, layer: int) -> int:
        for index, slot in enumerate(self._slots):
            if slot.span.start == layer:
                return index
        raise PipelineError(f"no hop of the route starts at layer {layer}")  # a driver bug

    def _check_route(self) -> None:
        spans = [slot.span for slot in self._slots]
        if not covers(spans, 0, self.shape.num_layers):
            raise PipelineError(
                f"the session's route {' '.join(map(str, spans)) or '(empty)'} does not cover "
                f"layers [0, {self.shape.num_layers}) contiguously"
            )

    def _check_tokens(self, token_ids: np.ndarray | Iterable[int]) -> np.ndarray:
        ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else list(token_ids))
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"token ids must be a non-empty [T] or [B, T] array, got {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        bad = (ids < 0) | (ids >= self.shape.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad][0])} is outside the vocabulary "
                f"[0, {self.shape.vocab_size})"
            )
        return ids.astype(np.int64)


def _classify(slot: _Slot, code: grpc.StatusCode, details: str) -> Exception:
    if code in CLIENT_FAULT_CODES:
        return RequestRejected(slot.hop.node_id, str(slot.span), code, details)
    return HopFailure(f"{code.name}: {details}", code)


async def _round_trip(
    call: grpc.aio.StreamStreamCall, request: stage_pb2.ForwardRequest
) -> stage_pb2.ForwardResponse:
    await call.write(request)
    response = await call.read()
    if response is grpc.aio.EOF:
        raise HopFailure("the node ended the stream without answering")
    return response


def _pushed(
    request: stage_pb2.ForwardRequest,
    slots: list[_Slot],
    last_only: bool,
    ring: RingPlan | None = None,
) -> stage_pb2.ForwardRequest:
    """What goes on the wire for a pushed step's first call: the call plus the rest of the
    route (and a ring round all of it). Checks, signatures and evidence use the call as
    the hop itself runs it."""
    pushed = stage_pb2.ForwardRequest()
    pushed.CopyFrom(request)
    pushed.last_position_only = last_only  # passed on to the hop that ends there
    hops = [
        stage_pb2.RelayHop(
            node_id=s.hop.node_id,
            address=s.hop.address,
            layers=common_pb2.LayerRange(start=s.span.start, end=s.span.end),
        )
        for s in slots
    ]
    pushed.relay_to.extend(hops[1:])
    if ring is not None:
        pushed.ring.route.extend(hops)
        pushed.ring.steps = ring.steps
        pushed.ring.temperature = ring.params.temperature
        pushed.ring.top_p = ring.params.top_p
        pushed.ring.seed = ring.params.seed or 0
        pushed.ring.stop_token_ids.extend(ring.stop_ids)
        pushed.ring.origin_step = request.step
    return pushed


def _route_of(slots: list[_Slot]) -> tuple[tuple[Span, str, str], ...]:
    return tuple((s.span, s.hop.node_id, s.hop.address) for s in slots)


def _claims(capability: client_api_pb2.SignedCapability) -> client_api_pb2.CapabilityClaims:
    # The client cannot check the signature (nodes do); it reads its own budget from it.
    claims = client_api_pb2.CapabilityClaims()
    claims.ParseFromString(capability.claims)
    return claims


def _hop_record(hop: client_api_pb2.Hop, span: Span | None = None) -> HopRecord:
    return HopRecord(
        node_id=hop.node_id,
        address=hop.address,
        start=span.start if span else hop.layers.start,
        end=span.end if span else hop.layers.end,
        relayed=hop.relayed,
    )


def _merge_same_node(slots: list[_Slot], window: int, *, checked: bool = False) -> list[_Slot]:
    """Join runs of consecutive slots whose primary is the same node into one slot each.

    With ``checked``, a run is joined only when some replica is granted every one of its
    stages (as alternate or checker): that replica checks the joined span, and a run
    nobody could check stays one hop per stage, each checked on its own.
    """
    runs: list[list[_Slot]] = []
    for slot in slots:
        previous = runs[-1][-1].hop if runs else None
        if previous is not None and (previous.node_id, previous.address) == (
            slot.hop.node_id,
            slot.hop.address,
        ):
            runs[-1].append(slot)
        else:
            runs.append([slot])
    merged: list[_Slot] = []
    for run in runs:
        if len(run) == 1:
            merged.append(run[0])
            continue
        span = Span(run[0].span.start, run[-1].span.end)
        hop = run[0].hop
        checkers = _covering_all(run, span)
        if checked and not checkers:
            merged.extend(run)
            continue
        merged.append(
            _Slot(
                span=span,
                hop=HopRecord(hop.node_id, hop.address, span.start, span.end, hop.relayed),
                alternates=[],  # on failure the slot splits; its stages have alternates
                checkers=checkers,
                decode_seconds=deque(maxlen=window),
                parts=tuple(run),
            )
        )
    return merged


def _covering_all(run: list[_Slot], span: Span) -> list[HopRecord]:
    """Replicas (other than the run's node) granted every stage of ``run``, as hops of
    the joined ``span``."""
    node = run[0].hop.node_id

    def replicas(slot: _Slot) -> dict[str, HopRecord]:
        return {h.node_id: h for h in (*slot.alternates, *slot.checkers) if h.node_id != node}

    first, *rest = [replicas(slot) for slot in run]
    common = [h for n, h in first.items() if all(n in r for r in rest)]
    return [HopRecord(h.node_id, h.address, span.start, span.end, h.relayed) for h in common]


def _slot_from_stage(stage: client_api_pb2.RouteStage, window: int) -> _Slot:
    span = Span(stage.layers.start, stage.layers.end)

    def covering(hops: Iterable[client_api_pb2.Hop]) -> list[HopRecord]:
        # A replica whose shard is wider than the stage can serve the stage's sub-span.
        return [
            _hop_record(h, span)
            for h in hops
            if h.layers.start <= span.start and span.end <= h.layers.end
        ]

    return _Slot(
        span=span,
        hop=_hop_record(stage.primary, span),
        alternates=covering(stage.alternates),
        checkers=covering(stage.checkers),
        decode_seconds=deque(maxlen=window),
    )
