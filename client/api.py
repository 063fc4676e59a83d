"""The user-facing client: list nodes and models, and generate text through the swarm.

    from client import Client

    with Client("coord.example.org:7000") as c:
        for token in c.generate("llama-tiny", prompt="Once upon a time", max_new_tokens=32):
            print(token.text, end="", flush=True)
        print(c.last_run.failovers)

``Client`` is synchronous (it runs an event loop on a private thread); ``AsyncClient`` is
the same API for asyncio code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client import billing
from client.acknowledgments import Acknowledger
from client.channels import CHANNEL_OPTIONS, ChannelPool
from client.dataset_cache import DatasetCache
from client.datasets import Progress, TokenDataset, load_dataset
from client.driver import DriverConfig, PipelineDriver, RingPlan
from client.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    ModelNotFound,
    TesseraError,
)
from client.hedging import HedgeEvent
from client.jobs import JobEvent, JobRunner, JobsApi, TrainingJob, TrainSpec
from client.records import FailoverEvent, HopRecord, RollbackEvent, StageTiming
from client.sampling import Sampler, SamplingParams
from client.tokenizer import TextTokenizer, load_tokenizer
from client.training_driver import TrainingDriverConfig
from client.verification import StageVerifier, VerificationStats
from protos import dialing, identity
from protos.coordinator_clock import StampClock
from protos.tessera.v1 import (
    client_api_pb2,
    client_api_pb2_grpc,
    common_pb2,
    jobs_pb2,
    ledger_pb2,
    ledger_pb2_grpc,
    node_pb2,
    verification_pb2,
    verification_pb2_grpc,
)

DEFAULT_COORDINATOR = "127.0.0.1:7000"
COORDINATOR_ENV = "TESSERA_COORDINATOR"

T = TypeVar("T")
log = logging.getLogger(__name__)
# Paid sessions settle every this many generated tokens by default (Client(settle_every=)):
# one call to the coordinator per 256 tokens, and a crash never loses the nodes more.
DEFAULT_SETTLE_EVERY = 256


def default_coordinator() -> str:
    return os.environ.get(COORDINATOR_ENV) or DEFAULT_COORDINATOR


@dataclass(frozen=True)
class GeneratedToken:
    index: int  # 0 for the first generated token
    id: int
    text: str  # the piece of text this token completes ("" without a tokenizer)
    stage_timings: tuple[StageTiming, ...]  # requests made to produce this token
    failovers: tuple[FailoverEvent, ...] = ()  # fail-overs that happened on the way


@dataclass
class GenerationResult:
    model: str
    session_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None when the model has no tokenizer
    route: list[HopRecord] = field(default_factory=list)  # the route at the end of the run
    initial_route: list[HopRecord] = field(default_factory=list)
    # The session's stages as the coordinator granted them: consecutive stages on one
    # node run as one hop of the route.
    granted_stages: list[HopRecord] = field(default_factory=list)
    timings: list[StageTiming] = field(default_factory=list)
    failovers: list[FailoverEvent] = field(default_factory=list)
    hedges: list[HedgeEvent] = field(default_factory=list)  # straggler hedges (hedging.py)
    finish_reason: str = ""  # "length" | "eos" | "error"
    wall_s: float = 0.0
    first_token_s: float = 0.0
    quote: int = 0  # credit units escrowed at open (0: a free session)
    settlement: ledger_pb2.Settlement | None = None  # what CloseSession charged and refunded
    periodic: list[ledger_pb2.Settlement] = field(default_factory=list)  # settle_every
    # The close with the counter-signed receipts: `settle(result)` re-sends it when the
    # coordinator could not be reached at the end of the run (settling is idempotent).
    close_request: client_api_pb2.CloseSessionRequest | None = None
    # Signature checks and sampled redundant execution (client/verification.py).
    verification: VerificationStats | None = None
    # Steps pushed through the route (nodes handing hidden states on, client/driver.py),
    # and why pushing stopped when it did (None: it never stopped).
    pushed_steps: int = 0
    push_off: str | None = None
    # Of those, steps a ring started (the last hop drew the token and sent it on) and the
    # client adopted; why the ring stopped, if it did.
    ring_steps: int = 0
    ring_off: str | None = None
    # Deferred checks that rejected a primary and sent the generation back to a step.
    rollbacks: list[RollbackEvent] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.wall_s - self.first_token_s
        decoded = len(self.token_ids) - 1
        return decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0

    def stage_summary(self) -> list[dict[str, Any]]:
        """Per hop of the final route: request count and mean/p95 wall and compute times."""
        summary = []
        for hop in self.route:
            rows = [
                t
                for t in self.timings
                if t.node_id == hop.node_id and (t.start, t.end) == (hop.start, hop.end)
            ]
            wall = np.array([t.wall_ms for t in rows]) if rows else np.zeros(1)
            compute = np.array([t.compute_ms for t in rows]) if rows else np.zeros(1)
            summary.append(
                {
                    "node_id": hop.node_id,
                    "address": hop.address,
                    "layers": [hop.start, hop.end],
                    "requests": len(rows),
                    "wall_ms_mean": round(float(wall.mean()), 3),
                    "wall_ms_p95": round(float(np.percentile(wall, 95)), 3),
                    "compute_ms_mean": round(float(compute.mean()), 3),
                }
            )
        return summary

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "session_id": self.session_id,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "route": [h.to_json() for h in self.route],
            "initial_route": [h.to_json() for h in self.initial_route],
            "granted_stages": [h.to_json() for h in self.granted_stages],
            "stages": self.stage_summary(),
            "timings": [t.to_json() for t in self.timings],
            "failovers": [f.to_json() for f in self.failovers],
            "hedges": [h.to_json() for h in self.hedges],
            "wall_s": round(self.wall_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "quote": self.quote,
            "charged": self.settlement.charged if self.settlement else 0,
            "refunded": self.settlement.refunded if self.settlement else 0,
            "verification": self.verification.to_json() if self.verification else None,
            "pushed_steps": self.pushed_steps,
            "push_off": self.push_off,
            "ring_steps": self.ring_steps,
            "ring_off": self.ring_off,
            "rollbacks": [r.to_json() for r in self.rollbacks],
        }


@dataclass(frozen=True)
class _Held:
    """A sampled token not yet yielded: the step it came from (its start position), and
    where the driver's timings and fail-overs stood before and after the step (a held
    token comes out after later steps ran: theirs are not its own)."""

    position: int
    token: int
    seen_timings: int
    seen_failovers: int
    timings_end: int
    failovers_end: int


@dataclass(frozen=True)
class _ModelHandle:
    detail: client_api_pb2.ModelDetail
    tokenizer: TextTokenizer | None
    eos_ids: frozenset[int]


class AsyncClient:
    """The asyncio client. Create and use it inside one running event loop."""

    def __init__(
        self,
        coordinator: str | None = None,
        *,
        account: str = "",
        timeout_s: float = 15.0,
        driver_config: DriverConfig | None = None,
        key: Ed25519PrivateKey | None = None,
        max_price: int = 0,
        prefer: str = "",
        settle_every: int = DEFAULT_SETTLE_EVERY,
        cache_dir: Path | None = None,
    ) -> None:
        self.coordinator = coordinator or default_coordinator()
        # A job runner's downloaded datasets (client/dataset_cache.py for the default).
        self.dataset_cache = DatasetCache(cache_dir)
        self.account = account
        # Paid sessions settle their usage every this many generated tokens (0: at close
        # only), so operators are paid as the session goes, the escrow shrinks, and a
        # client that dies before its close leaves at most this many tokens unpaid.
        self.settle_every = settle_every
        # With a key, sessions are paid: it signs the open and counter-signs usage receipts.
        self.key = key
        # What the coordinator's clock reads, learnt when it refuses a stale stamp.
        self.clock = StampClock()
        self.max_price = max_price
        self.prefer = prefer
        self.timeout_s = timeout_s
        self.driver_config = driver_config or DriverConfig()
        self._channel = dialing.aio_channel(self.coordinator, CHANNEL_OPTIONS)
        self._stub = client_api_pb2_grpc.ClientApiStub(self._channel)
        self._ledger = ledger_pb2_grpc.LedgerStub(self._channel)
        self._verification = verification_pb2_grpc.VerificationStub(self._channel)
        self._stage_channels = ChannelPool()
        self._models: dict[str, _ModelHandle] = {}
        self.last_run: GenerationResult | None = None
        self.jobs_api = JobsApi(self._channel, self._call, self.clock)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._stage_channels.close()
        await self._channel.close()

    # ---- directory ------------------------------------------------------------------

    async def nodes(self, include_offline: bool = False) -> list[node_pb2.NodeInfo]:
        request = client_api_pb2.ListNodesRequest(include_offline=include_offline)
        response = await self._call("listing nodes", self._stub.ListNodes, request)
        return list(response.nodes)

    async def models(self) -> list[client_api_pb2.ModelInfo]:
        response = await self._call("listing models", self._stub.ListModels, common_pb2.Empty())
        return list(response.models)

    async def model(self, name: str) -> client_api_pb2.ModelDetail:
        return (await self._model(name)).detail

    async def balance(self) -> ledger_pb2.AccountBalance:
        """This client's credit: available and escrowed (needs a key)."""
        if self.key is None:
            raise TesseraError("a balance belongs to a client key; create the client with key=")
        key = self.key
        return await self._call_stamped(
            "reading the balance",
            self._ledger.GetBalance,
            lambda: billing.balance_query(key, self.clock.now_ms()),
        )

    # ---- generation -----------------------------------------------------------------

    async def generate(
        self,
        model: str,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        stop_at_eos: bool = True,
        ring: bool = True,
    ) -> AsyncGenerator[GeneratedToken, None]:
        """Yield generated tokens as they come; ``last_run`` holds the full record after.

        With ``ring`` (and ``DriverConfig.ring``), the node that ends the model samples each
        next token itself and starts its step at once (client/driver.py, "Ring"): the
        client's round trip leaves the token's critical path. The client still samples
        every token itself from the signed logits and yields only its own draw; a ring
        that drew another token is stopped and that step is sent again.
        """
        if (prompt is None) == (token_ids is None):
            raise ValueError("pass exactly one of prompt= (text) or token_ids= (a list of ints)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed))
        handle = await self._model(model)
        prompt_ids = self._prompt_ids(handle, model, prompt, token_ids)
        positions = handle.detail.info.max_positions  # 0: an older coordinator, unknown
        if positions and len(prompt_ids) + max_new_tokens > positions:
            room = positions - len(prompt_ids)
            raise ValueError(
                f"model {model!r} holds {positions} positions, prompt and new tokens "
                f"together; this prompt has {len(prompt_ids)} tokens, so "
                + (f"at most {room} new tokens fit" if room > 0 else "it does not fit")
                + f" (asked for {max_new_tokens})"
            )
        open_request = client_api_pb2.OpenSessionRequest(
            model=model,
            max_length=len(prompt_ids) + max_new_tokens,
            account=self.account,
            max_price=self.max_price,
            prefer=self.prefer,
        )

        def signed() -> client_api_pb2.OpenSessionRequest:
            # A new stamp and nonce for every try: the coordinator takes a signed open once.
            if self.key is not None:
                billing.sign_open(open_request, self.key, self.clock.now_ms())
            return open_request

        grant = await self._call_stamped("opening a session", self._stub.OpenSession, signed)
        verifier = StageVerifier(
            grant.session_id, self._stage_channels, self._report,
            patience_floor_s=self.driver_config.check_patience_floor_s,
            patience_factor=self.driver_config.check_patience_factor,
        )  # fmt: skip
        driver = PipelineDriver(
            grant,
            model,
            rerouter=self._reroute,
            channels=self._stage_channels,
            config=self.driver_config,
            verifier=verifier,
            report_step_times=self._report_step_times,
        )
        verifier.on_check_sent = driver.usage.checked
        verifier.on_late = driver.report_at_least
        self._hold_to_credit(grant, driver, verifier)
        result = GenerationResult(
            model=model,
            session_id=grant.session_id,
            prompt_token_ids=list(prompt_ids),
            text="" if handle.tokenizer else None,
            route=driver.route,
            initial_route=driver.route,
            quote=grant.quote.amount,
            verification=verifier.stats,
            granted_stages=list(driver.stages),
        )
        # The driver's own lists, which it appends to: nothing is copied per token.
        result.timings, result.failovers = driver.timings, driver.failovers
        result.hedges, result.rollbacks = driver.hedges, driver.rollbacks
        self.last_run = result
        decoder = handle.tokenizer.stream(prompt_ids) if handle.tokenizer else None
        began = time.monotonic()
        result.finish_reason = "error"
        completed = False
        try:
            next_input: list[int] = list(prompt_ids)
            defer = self.driver_config.defer_checks
            # Sampled but not yet yielded: a token waits until every check of the steps
            # it depends on has settled (DriverConfig.defer_checks).
            held: deque[_Held] = deque()
            finished = False
            hedges_routed = 0

            def last_one(token: int) -> bool:
                return len(result.token_ids) + len(held) >= max_new_tokens or (
                    stop_at_eos and token in handle.eos_ids
                )

            ring_stops = tuple(sorted(handle.eos_ids)) if stop_at_eos else ()

            def ring_plan() -> RingPlan | None:
                # The ring starts exactly the steps this generation still needs after the
                # one now sent: one per token left to sample, less the token this step gives.
                steps = max_new_tokens - len(result.token_ids) - len(held) - 1
                if not ring or steps <= 0:
                    return None
                return RingPlan(sampler.params, steps, ring_stops)

            while True:
                if not finished:
                    seen_timings, seen_failovers = len(driver.timings), len(driver.failovers)
                    position = driver.length
                    driver.raise_if_tainted(len(prompt_ids))  # before the driver's own check
                    logits = await driver.step(
                        next_input, last_only=True, defer_checks=defer, ring=ring_plan()
                    )
                    token = sampler(logits[0], driver.length)
                    ends = len(driver.timings), len(driver.failovers)
                    held.append(_Held(position, token, seen_timings, seen_failovers, *ends))
                    finished = last_one(token)
                rollback = await driver.settle_deferred(wait=finished)
                if rollback is not None:
                    # The step at rollback.start_pos was run again without the node a
                    # check rejected: its token is drawn again, the ones after it are void.
                    while held[-1].position > rollback.start_pos:
                        held.pop()
                    void = held.pop()
                    assert void.position == rollback.start_pos, "a settled token was rolled back"
                    token = sampler(rollback.logits[0], driver.length)
                    held.append(
                        replace(
                            void,
                            token=token,
                            timings_end=len(driver.timings),
                            failovers_end=len(driver.failovers),
                        )
                    )
                    finished = last_one(token)
                    next_input = [token]
                    continue
                unsettled = driver.unsettled_from()
                while held and (unsettled is None or held[0].position < unsettled):
                    # An audit that proved a step wrong since: what follows it is not sound.
                    driver.raise_if_tainted(len(prompt_ids))
                    ready = held.popleft()
                    index = len(result.token_ids)
                    if index == 0:
                        result.first_token_s = time.monotonic() - began
                    result.token_ids.append(ready.token)
                    piece = decoder.push(ready.token) if decoder else ""
                    if result.text is not None:
                        result.text += piece
                    failovers = tuple(driver.failovers[ready.seen_failovers : ready.failovers_end])
                    if failovers or len(driver.hedges) != hedges_routed:
                        # A fail-over, or a hedge that the alternate won, moved a hop.
                        hedges_routed = len(driver.hedges)
                        result.route = driver.route
                    result.wall_s = time.monotonic() - began
                    yield GeneratedToken(
                        index=index,
                        id=ready.token,
                        text=piece,
                        stage_timings=tuple(driver.timings[ready.seen_timings : ready.timings_end]),
                        failovers=failovers,
                    )
                    if (
                        self.key is not None
                        and self.settle_every
                        and ((index + 1) % self.settle_every == 0)
                    ):
                        await self._settle_periodically(driver, grant, result)
                if finished and not held:
                    last = result.token_ids[-1]
                    result.finish_reason = (
                        "eos" if stop_at_eos and last in handle.eos_ids else "length"
                    )
                    break
                next_input = [token]
            if decoder is not None and result.text is not None:
                result.text += decoder.flush()
            completed = True
        finally:
            result.wall_s = time.monotonic() - began
            result.route = driver.route
            result.pushed_steps, result.push_off = driver.pushed_steps, driver.push_off
            result.ring_steps, result.ring_off = driver.ring_steps, driver.ring_off
            if driver.verifier is not None:
                await driver.verifier.finish()
            await driver.close()
            result.close_request = self._close_request(driver, grant)
            result.settlement = await self._end_session(result.close_request)
        if completed and driver.verifier is not None and driver.verifier.proven_wrong():
            # An audit that settled only as the session closed: the text is whole, not sound.
            result.finish_reason = "error"
            driver.raise_if_tainted(len(prompt_ids))

    async def generate_all(self, model: str, **kwargs: Any) -> GenerationResult:
        """Run ``generate`` to the end and return its record."""
        async for _ in self.generate(model, **kwargs):
            pass
        assert self.last_run is not None
        return self.last_run

    # ---- training (client/jobs.py) ---------------------------------------------------

    async def submit_training(
        self,
        model: str,
        data: str | Path | TokenDataset,
        spec: TrainSpec,
        progress: Progress | None = None,
    ) -> tuple[jobs_pb2.JobInfo, TokenDataset]:
        """Upload the dataset (once: the coordinator keeps it) and submit the job.
        ``progress(what, bytes done, bytes in all)`` follows hashing and uploading it."""
        handle = await self._model(model)
        if isinstance(data, TokenDataset):
            dataset = data
        else:  # checking a large file's ids takes a while: off the event loop
            dataset = await asyncio.to_thread(load_dataset, Path(data), handle.tokenizer)
        info = await self.jobs_api.upload_dataset(dataset, progress)
        # A job with a key is owned by it: nobody else can open its session and cut its
        # runner off (job ids are listed for all to see).
        owner = identity.public_key_bytes(self.key) if self.key is not None else b""
        return await self.jobs_api.submit(model, info.id, spec, owner), dataset

    async def run_job(
        self,
        job_id: str,
        *,
        dataset: TokenDataset | None = None,
        on_event: Callable[[JobEvent], None] | None = None,
        after_step: Callable[[int], Any] | None = None,
        driver_config: TrainingDriverConfig | None = None,
    ) -> jobs_pb2.JobInfo:
        """Drive the job to the end from its last consistent checkpoint (also --resume).
        ``driver_config``: the stage calls' timeouts and deadlines (defaults: a node that
        hangs mid-job is re-planned after max(30 s, 8x its recent calls)). Without
        ``dataset``, the job's comes from ``job_dataset``."""
        runner = JobRunner(self.jobs_api, job_id, self._stage_channels, dataset=dataset,
                           after_step=after_step, key=self.key, max_price=self.max_price,
                           driver_config=driver_config,
                           dataset_cache=self.dataset_cache)  # fmt: skip
        if on_event is not None:
            runner.on_event = on_event
        return await runner.run()

    async def job_dataset(self, job_id: str, progress: Progress | None = None) -> TokenDataset:
        """The job's dataset, memory-mapped from the dataset cache; downloaded there first
        when it is not yet (``progress(what, bytes done, bytes in all)`` follows that)."""
        job = await self.jobs_api.job(job_id)
        return await self.jobs_api.download_dataset(job.dataset_id, self.dataset_cache, progress)

    async def jobs(self, limit: int = 100) -> list[jobs_pb2.JobInfo]:
        return await self.jobs_api.jobs(limit)

    async def job(self, job_id: str) -> jobs_pb2.JobInfo:
        return await self.jobs_api.job(job_id)

    # ---- internals ------------------------------------------------------------------

    async def _model(self, name: str) -> _ModelHandle:
        handle = self._models.get(name)
        if handle is not None:
            return handle
        try:
            detail = await self._call(
                f"looking up model {name!r}", self._stub.GetModel, common_pb2.ModelRef(name=name)
            )
        except CoordinatorError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise
            known = [m.name for m in await self.models()]
            raise ModelNotFound(name, known) from err
        config = json.loads(detail.config_json) if detail.config_json else {}
        handle = _ModelHandle(
            detail=detail,
            tokenizer=load_tokenizer(detail.tokenizer_json),
            eos_ids=_eos_ids(config),
        )
        self._models[name] = handle
        return handle

    def _prompt_ids(
        self,
        handle: _ModelHandle,
        model: str,
        prompt: str | None,
        token_ids: Sequence[int] | None,
    ) -> list[int]:
        if token_ids is not None:
            ids = [int(t) for t in token_ids]
        else:
            if handle.tokenizer is None:
                raise TesseraError(
                    f"model {model!r} was imported without a tokenizer, so text prompts cannot "
                    "be encoded; pass token ids instead (--token-ids 1,2,3)"
                )
            ids = handle.tokenizer.encode(prompt or "")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = handle.detail.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if vocab and bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    async def _reroute(
        self, request: client_api_pb2.RerouteRequest
    ) -> client_api_pb2.RerouteResponse:
        return await self._stub.Reroute(request, timeout=self.timeout_s)

    async def _report_step_times(
        self, report: client_api_pb2.StepTimesReport
    ) -> client_api_pb2.StepTimesAck:
        return await self._stub.ReportStepTimes(report, timeout=self.timeout_s)

    async def _report(
        self, report: verification_pb2.VerificationReport
    ) -> verification_pb2.ReportVerdict:
        # A mismatch waits for the arbiter's replay: allow it more than a plain RPC.
        return await self._verification.Report(report, timeout=max(self.timeout_s, 120.0))

    def _hold_to_credit(
        self,
        grant: client_api_pb2.SessionGrant,
        driver: PipelineDriver,
        verifier: StageVerifier,
    ) -> None:
        """Where the session's nodes hold it to a credit, acknowledge their receipts as they
        come, the checkers' too (client/acknowledgments.py)."""
        claims = client_api_pb2.CapabilityClaims()
        claims.ParseFromString(grant.capability.claims)
        if self.key is None or not claims.usage_credit:
            return
        acks = driver.acks = Acknowledger(
            grant.session_id,
            claims.usage_credit,
            self.key,
            driver.usage,
            self._stage_channels,
            lambda: driver.capability,
        )

        async def before(hop: HopRecord, start: int, end: int) -> None:
            await acks.ready([(hop, start, end)])

        verifier.on_check_answered, verifier.before_check = driver.received, before

    def _close_request(
        self, driver: PipelineDriver, grant: client_api_pb2.SessionGrant
    ) -> client_api_pb2.CloseSessionRequest:
        request = client_api_pb2.CloseSessionRequest(
            session_id=grant.session_id, capability=grant.capability
        )
        if self.key is not None:
            request.usage.extend(driver.usage.countersign(grant.session_id, self.key))
        return request

    async def _settle_periodically(
        self,
        driver: PipelineDriver,
        grant: client_api_pb2.SessionGrant,
        result: GenerationResult,
    ) -> None:
        """Send the receipts counter-signed so far; the close settles the rest anyway, so
        a failure here only delays payment."""
        assert self.key is not None
        request = ledger_pb2.SettleUsageRequest(
            session_id=grant.session_id,
            usage=driver.usage.countersign(grant.session_id, self.key),
        )
        try:
            result.periodic.append(
                await self._call("settling usage", self._ledger.SettleUsage, request)
            )
        except (CoordinatorError, CoordinatorUnavailable) as err:
            log.warning("periodic settlement failed (the close will settle it): %s", err)

    async def _end_session(
        self, request: client_api_pb2.CloseSessionRequest
    ) -> ledger_pb2.Settlement | None:
        try:
            return await self.settle_request(request)
        except (CoordinatorError, CoordinatorUnavailable):
            # The session (and its escrow) expires on its own, and settle() can retry: a
            # failed close must not hide the result.
            return None

    async def settle_request(
        self, request: client_api_pb2.CloseSessionRequest
    ) -> ledger_pb2.Settlement | None:
        """Close a session with its receipts; None for a free one. Safe to repeat."""
        response = await self._call("closing the session", self._stub.CloseSession, request)
        return response.settlement if response.HasField("settlement") else None

    async def settle(self, result: GenerationResult) -> ledger_pb2.Settlement | None:
        """Retry the close of a run whose close did not reach the coordinator."""
        if result.close_request is None:
            raise TesseraError("this run never got to close its session")
        result.settlement = await self.settle_request(result.close_request)
        return result.settlement

    async def _call(self, what: str, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise self._failure(what, err) from err

    async def _call_stamped(self, what: str, method: Any, request: Callable[[], Any]) -> Any:
        """A call whose ``request()`` carries a signed time stamp: when the coordinator
        refuses it as stale, this client's clock is off; it takes the coordinator's time
        from the refusal and tries once more with a request stamped anew."""
        try:
            return await method(request(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            if not self.clock.learn(err):
                raise self._failure(what, err) from err
        return await self._call(what, method, request())

    def _failure(self, what: str, err: grpc.aio.AioRpcError) -> TesseraError:
        code = err.code()
        if never_reached(err, self._channel.get_state()):
            return CoordinatorUnavailable(self.coordinator, err.details() or code.name)
        return CoordinatorError(what, code, err.details() or "")


def never_reached(err: grpc.aio.AioRpcError, state: grpc.ChannelConnectivity) -> bool:
    """Whether the call failed for want of the coordinator (down, restarting, too slow)
    rather than by its answer. UNAVAILABLE over a working connection is its own answer
    (e.g. a model not served yet); over a broken one it means it was never reached. A
    refused connection says so itself: the channel may be READY again by the time it is
    asked, when the coordinator came back just then."""
    code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    refused = (err.details() or "").startswith("failed to connect to all addresses")
    return refused or state != grpc.ChannelConnectivity.READY


def _eos_ids(config: dict[str, Any]) -> frozenset[int]:
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        return frozenset({eos})
    if isinstance(eos, list):
        return frozenset(e for e in eos if isinstance(e, int))
    return frozenset()


class _LoopThread:
    """An event loop on a daemon thread, so synchronous callers can drive async code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="tessera-client", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C in the caller: stop the coroutine too, so its cleanup runs.
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class Client:
    """Synchronous client; see the module docstring for an example."""

    def __init__(
        self,
        coordinator: str | None = None,
        *,
        account: str = "",
        timeout_s: float = 15.0,
        driver_config: DriverConfig | None = None,
        key: Ed25519PrivateKey | None = None,
        max_price: int = 0,
        prefer: str = "",
        settle_every: int = DEFAULT_SETTLE_EVERY,
        cache_dir: Path | None = None,
    ) -> None:
        self._loop = _LoopThread()

        async def build() -> AsyncClient:
            return AsyncClient(
                coordinator,
                account=account,
                timeout_s=timeout_s,
                driver_config=driver_config,
                key=key,
                max_price=max_price,
                prefer=prefer,
                settle_every=settle_every,
                cache_dir=cache_dir,
            )

        self._async = self._loop.run(build())
        self.coordinator = self._async.coordinator

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        self._loop.run(self._async.close())
        self._loop.close()

    @property
    def last_run(self) -> GenerationResult | None:
        return self._async.last_run

    def nodes(self, include_offline: bool = False) -> list[node_pb2.NodeInfo]:
        return self._loop.run(self._async.nodes(include_offline))

    def models(self) -> list[client_api_pb2.ModelInfo]:
        return self._loop.run(self._async.models())

    def model(self, name: str) -> client_api_pb2.ModelDetail:
        return self._loop.run(self._async.model(name))

    def balance(self) -> ledger_pb2.AccountBalance:
        return self._loop.run(self._async.balance())

    def settle(self, result: GenerationResult) -> ledger_pb2.Settlement | None:
        return self._loop.run(self._async.settle(result))

    def generate(
        self,
        model: str,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        stop_at_eos: bool = True,
        run_ahead: bool = True,
    ) -> Iterator[GeneratedToken]:
        """Yield tokens as they are generated; see ``AsyncClient.generate``.

        The generation runs on the client's loop thread on its own: the next step starts as
        soon as a token is out, not when the caller asks for it, so a caller that takes its
        time with each token (printing, a UI) does not slow the pipeline. With
        ``run_ahead=False`` each step starts only when the caller asks for its token, and
        no ring runs (for a caller that times tokens one by one while other work takes
        turns with it, as bench/inference.py's swarm runs do). Leaving the
        loop early (``break``, an exception, Ctrl-C) stops the generation and ends its
        session either way.
        """
        stream = self._async.generate(
            model,
            prompt=prompt,
            token_ids=token_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_at_eos=stop_at_eos,
            # A ring computes the next token before the caller asks for it.
            ring=run_ahead,
        )
        if not run_ahead:
            yield from self._on_demand(stream)
            return
        # At most max_new_tokens items and an end mark: it cannot grow without bound.
        out: queue.SimpleQueue[tuple[GeneratedToken | None, BaseException | None]] = (
            queue.SimpleQueue()
        )
        ended = threading.Event()

        async def pump() -> None:
            try:
                async for token in stream:
                    out.put((token, None))
                out.put((None, None))
            except BaseException as err:  # handed to the caller's thread, as it was raised
                out.put((None, err))
                raise
            finally:
                await stream.aclose()
                ended.set()

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop.loop)
        try:
            while True:
                token, error = out.get()
                if error is not None:
                    raise error
                if token is None:
                    return
                yield token
        finally:
            if not future.done():
                future.cancel()  # the generation's own cleanup ends its session
            ended.wait(timeout=30.0)

    def _on_demand(self, stream: AsyncGenerator[GeneratedToken, None]) -> Iterator[GeneratedToken]:
        async def next_token() -> GeneratedToken:
            return await anext(stream)

        try:
            while True:
                try:
                    token = self._loop.run(next_token())
                except StopAsyncIteration:
                    return
                yield token
        finally:
            self._loop.run(stream.aclose())

    def generate_all(self, model: str, **kwargs: Any) -> GenerationResult:
        for _ in self.generate(model, **kwargs):
            pass
        assert self.last_run is not None
        return self.last_run

    # ---- training ---------------------------------------------------------------------

    def train(
        self,
        model: str,
        data: str | Path | TokenDataset,
        *,
        steps: int,
        batch_size: int,
        seq_len: int,
        lr: float,
        progress: Progress | None = None,
        **options: Any,
    ) -> TrainingJob:
        """Submit a training job and run it in the background; returns a watchable handle.

        `data` is a .npy of token ids or a text file (see client/datasets.py); `options` are
        the other TrainSpec fields (micro_batches, checkpoint_every, mode, lora_rank,
        lora_alpha, weight_decay, max_grad_norm, seed, output_model, account).
        `progress(what, bytes done, bytes in all)` follows hashing and uploading the data.
        """
        spec = TrainSpec(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, **options)
        info, dataset = self._loop.run(self._async.submit_training(model, data, spec, progress))
        return self._start_runner(info.job_id, dataset)

    def resume(self, job_id: str, progress: Progress | None = None) -> TrainingJob:
        """Continue a job whose runner went away, from its last consistent checkpoint.
        Its dataset comes from the dataset cache, or is downloaded there first
        (`progress` follows that)."""
        dataset = self._loop.run(self._async.job_dataset(job_id, progress))
        return self._start_runner(job_id, dataset)

    def jobs(self, limit: int = 100) -> list[jobs_pb2.JobInfo]:
        return self._loop.run(self._async.jobs(limit))

    def job(self, job_id: str) -> jobs_pb2.JobInfo:
        return self._loop.run(self._async.job(job_id))

    def _start_runner(self, job_id: str, dataset: TokenDataset) -> TrainingJob:
        events: queue.Queue[JobEvent | None] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(
            self._async.run_job(job_id, dataset=dataset, on_event=events.put), self._loop.loop
        )
        future.add_done_callback(lambda _: events.put(None))
        return TrainingJob(job_id, future, events)
