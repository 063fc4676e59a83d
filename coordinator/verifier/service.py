"""The verifier component: reports in, verdicts and bans out, reputation in between.

- ``report``: a driver's comparisons. Agreements raise both nodes' reputation; a mismatch
  is arbitrated by a third replica of an independent operator, which the coordinator runs
  itself over the data plane. The node whose signed output the arbiter contradicts is
  proven wrong: its work is rejected, its record gets a failure, it is banned (node and
  key, through the registry) and the evidence is stored.
- ``describe_hop``: puts a node's key, account, compute dtype and current checking
  probability into every hop a session grant or reroute hands out.
- Canaries (coordinator/verifier/canaries.py) run on a timer.
- Listeners (the ledger) hear ``WorkRejected`` and ``FraudProven``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.model_store.errors import StoreError
from coordinator.node_state import NodeState
from coordinator.placement import compute_dtype
from coordinator.registry import NodeStateChanged, RegistryError
from coordinator.verifier.canaries import Canaries
from coordinator.verifier.evidence import (
    Mismatch,
    ReportError,
    check_audit,
    check_comparison,
    check_limits,
    check_mismatch,
    evidence_id,
    signature_key,
)
from coordinator.verifier.reputation import SLASHED_BANS, Reputation, Schedule
from coordinator.verifier.stage_runner import StageRunner
from coordinator.verifier.training_evidence import (
    MAX_AGREEMENTS,
    TrainingCase,
    check_agreement,
    check_dispute,
    dispute_id,
)
from coordinator.verifier.training_replay import TrainingReplayer
from protos import codec, identity, output_check, training_answers
from protos.tessera.v1 import client_api_pb2, node_pb2, training_pb2, verification_pb2

log = logging.getLogger("tessera.verifier")
Outcome = verification_pb2.Verdict.Outcome
MAX_ARBITERS_TRIED = 3


@dataclass(frozen=True)
class WorkRejected:
    """The node's output in this session was not used and must not be paid."""

    node_id: str
    session_id: str
    reason: str


@dataclass(frozen=True)
class FraudProven:
    """A signed output of the node was proven wrong; it is banned. Slash its escrow."""

    node_id: str
    account: str
    evidence_id: str
    reason: str


VerifierEvent = WorkRejected | FraudProven
Listener = Callable[[VerifierEvent], Any]


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    address: str
    account: str
    device_kind: str
    compute_dtype: str


def session_risk(
    session_id: str, calls: int, checked: int, mismatches: int, assumed_corruption: float
) -> verification_pb2.SessionRisk:
    """The bound the design promises: 1 - (1 - p*f)^n, with p the fraction checked."""
    p = checked / calls if calls else 0.0
    escape = (1.0 - p * assumed_corruption) ** calls
    return verification_pb2.SessionRisk(
        session_id=session_id,
        calls=calls,
        checked=checked,
        mismatches=mismatches,
        check_fraction=p,
        assumed_corruption=assumed_corruption,
        detection_probability=1.0 - escape,
        undetected_probability=escape,
    )


class Verifier:
    def __init__(self, ctx: Any, reputation: Reputation) -> None:
        self._ctx = ctx
        self.reputation = reputation
        # Checks are dressed like client sessions: same grants, keys and probabilities.
        self.runner = StageRunner(ctx.signing_key, describe=self.describe_hop)
        self.trainer = TrainingReplayer(ctx.signing_key, describe=self.describe_hop)
        self._listeners: list[Listener] = []
        self._keys: dict[str, bytes] = {}
        self.canaries = Canaries(self)
        self._canary_task: asyncio.Task[None] | None = None

    @classmethod
    def from_context(cls, ctx: Any) -> Verifier:
        settings = ctx.settings
        schedule = Schedule(warmup=settings.verify_warmup, p_min=settings.verify_min_probability)
        verifier = cls(ctx, Reputation(ctx.db, schedule))
        if ctx.planner is not None:
            ctx.planner.trust_cost = verifier.reputation.router_cost
        ctx.registry.add_listener(verifier._on_registry_event)
        return verifier

    def _on_registry_event(self, event: object) -> None:
        # A node whose ban an operator lifted earns trust again from the start: every call
        # of it is checked until it has a run of verified results, as a new node's.
        if (
            isinstance(event, NodeStateChanged)
            and event.old is NodeState.BANNED
            and event.new is not NodeState.BANNED
        ):
            self.reputation.start_over(event.node_id)

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        interval = self._ctx.settings.canary_interval_s
        if interval > 0:
            self._canary_task = asyncio.get_running_loop().create_task(
                self.canaries.run_forever(interval)
            )

    async def stop(self) -> None:
        if self._canary_task is not None:
            self._canary_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._canary_task
        await self.runner.close()

    # ---- listeners (the ledger subscribes here) ------------------------------------

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, event: VerifierEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # one bad subscriber must not stop a ban
                log.exception("verifier listener failed on %s", type(event).__name__)

    # ---- what other parts ask ------------------------------------------------------

    def trust(self, node_id: str) -> node_pb2.NodeTrust:
        return self.reputation.to_proto(node_id)

    def describe_hop(self, hop: client_api_pb2.Hop) -> None:
        facts = self.node_facts(hop.node_id)
        hop.public_key = self.public_key(hop.node_id)
        hop.check_probability = self.reputation.probability(hop.node_id)
        if facts is not None:
            hop.account = facts.account
            hop.device_kind = facts.device_kind
            hop.compute_dtype = facts.compute_dtype

    def node_facts(self, node_id: str) -> NodeFacts | None:
        view = self._ctx.registry.node(node_id)
        if view is None:
            return None
        caps = view.capabilities
        return NodeFacts(
            node_id, view.data_address, view.account, caps.device_kind, compute_dtype(caps)
        )

    def public_key(self, node_id: str) -> bytes:
        key = self._keys.get(node_id)
        if key is None:
            row = self._ctx.db.execute(
                "SELECT public_key FROM nodes WHERE node_id = ?", [node_id]
            ).fetchone()
            key = bytes(row[0]) if row and row[0] else b""
            if key:
                self._keys[node_id] = key
        return key

    def routable(self, node_id: str) -> bool:
        view = self._ctx.registry.node(node_id)
        return view is not None and view.state in (NodeState.ONLINE, NodeState.SUSPECT)

    # ---- RPCs ---------------------------------------------------------------------

    async def report(
        self, request: verification_pb2.VerificationReport, context: grpc.aio.ServicerContext
    ) -> verification_pb2.ReportVerdict:
        try:
            return await self._report(request)
        except ReportError as err:
            log.info("refused a verification report: %s: %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
            raise AssertionError("unreachable") from err

    async def get_session_risk(
        self, request: verification_pb2.SessionRiskRequest, context: grpc.aio.ServicerContext
    ) -> verification_pb2.SessionRisk:
        try:
            self._claims(request.session_id, request.capability)
        except ReportError as err:
            await context.abort(err.code, err.message)
        return self._risk(request.session_id)

    async def report_training_dispute(
        self, request: verification_pb2.TrainingDispute, context: grpc.aio.ServicerContext
    ) -> verification_pb2.Verdict:
        try:
            return await self._training_dispute(request)
        except ReportError as err:
            log.info("refused a training dispute: %s: %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
            raise AssertionError("unreachable") from err

    async def report_training_checks(
        self, request: verification_pb2.TrainingChecks, context: grpc.aio.ServicerContext
    ) -> verification_pb2.TrainingChecksAck:
        try:
            return self._training_checks(request)
        except ReportError as err:
            log.info("refused training checks: %s: %s", err.code.name, err.message)
            await context.abort(err.code, err.message)
            raise AssertionError("unreachable") from err

    # ---- reports ------------------------------------------------------------------

    def _claims(
        self, session_id: str, capability: client_api_pb2.SignedCapability
    ) -> client_api_pb2.CapabilityClaims:
        claims = identity.open_capability(self._ctx.public_key, capability)
        if claims is None:
            raise ReportError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the capability was not signed by this coordinator; report with the "
                "session's own capability",
            )
        if claims.session_id != session_id or not session_id:
            raise ReportError(
                grpc.StatusCode.PERMISSION_DENIED, "the capability belongs to another session"
            )
        if claims.expires_unix_ms < time.time() * 1000:
            raise ReportError(grpc.StatusCode.UNAUTHENTICATED, "the session's capability expired")
        return claims

    async def _report(
        self, request: verification_pb2.VerificationReport
    ) -> verification_pb2.ReportVerdict:
        claims = self._claims(request.session_id, request.capability)
        check_limits(request)
        checked: list[tuple[verification_pb2.Comparison, client_api_pb2.Hop, client_api_pb2.Hop]]
        checked = [(c, *check_comparison(claims, c)) for c in request.comparisons]
        for audit in request.audits:
            check_audit(claims, audit)
        mismatches = [check_mismatch(c, p, k) for c, p, k in checked if not c.agreed]
        # The replay guard is a read-then-write, and no await happens in between: two
        # reports can never both claim one signed output. One transaction for all of it.
        with self._ctx.db.atomic():
            self._claim_signatures(request)
            for comparison, _, _ in checked:
                if comparison.agreed:
                    self.reputation.verified(comparison.primary.node_id)
                    self.reputation.verified(comparison.checker.node_id)
            for audit in request.audits:
                self.reputation.verified(audit.primary.node_id)
            for node_id in self._claim_catch_ups(request):
                self.reputation.verified(node_id)
        # Arbitration runs a third node: reports of other sessions go on meanwhile.
        verdicts = [await self._arbitrate(claims, m) for m in mismatches]
        self._record_calls(request, len(mismatches))
        risk = self._risk(request.session_id)
        log.info(
            "session %s: %d calls, %.1f%% checked, %d mismatches; P(detect a node corrupting "
            "%.0f%% of outputs) = %.4f, undetected %.4f",
            risk.session_id, risk.calls, 100 * risk.check_fraction, risk.mismatches,
            100 * risk.assumed_corruption, risk.detection_probability,
            risk.undetected_probability,
        )  # fmt: skip
        return verification_pb2.ReportVerdict(verdicts=verdicts, risk=risk)

    def _claim_signatures(self, request: verification_pb2.VerificationReport) -> None:
        keys: list[str] = []
        for comparison in request.comparisons:
            keys += [signature_key(comparison.primary.signature)]
            keys += [signature_key(comparison.checker.signature)]
        keys += [signature_key(audit.primary.signature) for audit in request.audits]
        self._claim_keys(keys, request.session_id)

    def _claim_catch_ups(self, request: verification_pb2.VerificationReport) -> list[str]:
        """The checkers of the report's audits whose catch-up answer counts for the first
        time: one answer audits many steps, maybe reported in several reports, and earns
        its node trust once."""
        fresh: dict[str, str] = {}
        for audit in request.audits:
            key = signature_key(audit.checker.signature)
            if key not in fresh and not self._reported(key):
                fresh[key] = audit.checker.node_id
        self._record_reported(list(fresh), request.session_id)
        return list(fresh.values())

    def _claim_keys(self, keys: list[str], session_id: str) -> None:
        """Each signed output counts once: refuse a report that repeats one."""
        if len(set(keys)) != len(keys):
            raise ReportError(
                grpc.StatusCode.INVALID_ARGUMENT, "the report names one signed output twice"
            )
        if any(self._reported(key) for key in keys):
            raise ReportError(
                grpc.StatusCode.ALREADY_EXISTS,
                "this report repeats a signed output that was already reported; each "
                "output counts once",
            )
        self._record_reported(keys, session_id)

    def _reported(self, key: str) -> bool:
        return bool(
            self._ctx.db.execute(
                "SELECT 1 FROM reported_outputs WHERE signature_sha256 = ?", [key]
            ).fetchone()
        )

    def _record_reported(self, keys: list[str], session_id: str) -> None:
        now = int(time.time() * 1000)
        self._ctx.db["reported_outputs"].insert_all(
            [{"signature_sha256": k, "session_id": session_id, "ts_ms": now} for k in keys]
        )

    def _record_calls(self, request: verification_pb2.VerificationReport, mismatches: int) -> None:
        table = self._ctx.db["session_verification"]
        row = self._session_row(request.session_id)
        calls = sum(c.calls for c in request.calls) if request.calls else row["calls"]
        checked = sum(c.checked for c in request.calls) if request.calls else row["checked"]
        table.upsert(
            {
                "session_id": request.session_id,
                "calls": max(calls, row["calls"]),
                "checked": max(checked, row["checked"]),
                "mismatches": row["mismatches"] + mismatches,
                "updated_ms": int(time.time() * 1000),
            },
            pk="session_id",
        )

    def _session_row(self, session_id: str) -> dict[str, int]:
        row = self._ctx.db.execute(
            "SELECT calls, checked, mismatches FROM session_verification WHERE session_id = ?",
            [session_id],
        ).fetchone()
        if row is None:
            return {"calls": 0, "checked": 0, "mismatches": 0}
        return {"calls": row[0], "checked": row[1], "mismatches": row[2]}

    def _risk(self, session_id: str) -> verification_pb2.SessionRisk:
        row = self._session_row(session_id)
        return session_risk(
            session_id,
            row["calls"],
            row["checked"],
            row["mismatches"],
            self._ctx.settings.assumed_corruption,
        )

    # ---- training -----------------------------------------------------------------

    def _job_claims(
        self, job_id: str, capability: client_api_pb2.SignedCapability
    ) -> client_api_pb2.CapabilityClaims:
        jobs = self._ctx.jobs
        if jobs is None:
            raise ReportError(grpc.StatusCode.UNIMPLEMENTED, "this coordinator runs no jobs")
        try:
            jobs.manager.require_job(job_id)
        except StoreError as err:
            raise ReportError(err.code, err.message) from None
        return self._claims(job_id, capability)

    async def _training_dispute(
        self, dispute: verification_pb2.TrainingDispute
    ) -> verification_pb2.Verdict:
        claims = self._job_claims(dispute.job_id, dispute.capability)
        start, end = dispute.layers.start, dispute.layers.end
        manager = self._ctx.jobs.manager
        job, hyper, need = manager.training_facts(dispute.job_id, start, end)
        case = check_dispute(claims, dispute, hyper.micro_batches)
        if dispute.restore_step:
            part = manager.checkpoint_part(job.id, dispute.restore_step, start, end)
            if part is None or part.sha256 != dispute.restore_sha256:
                raise ReportError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the coordinator holds no checkpoint of layers [{start}, {end}) at step "
                    f"{dispute.restore_step} with that sha256; an arbiter cannot start there",
                )
        disputed = dispute.calls[-1]
        with self._ctx.db.atomic():
            signed = (disputed.primary.signature, disputed.checker.signature)
            self._claim_keys([signature_key(s) for s in signed], dispute.job_id)
        verdict = await self._arbitrate_training(case, job.model, hyper, need,
                                                 job.batch_size * job.seq_len)  # fmt: skip
        self._record_calls_mismatch(dispute.job_id)
        return verdict

    def _record_calls_mismatch(self, session_id: str) -> None:
        row = self._session_row(session_id)
        self._ctx.db["session_verification"].upsert(
            {"session_id": session_id, "calls": row["calls"], "checked": row["checked"],
             "mismatches": row["mismatches"] + 1, "updated_ms": int(time.time() * 1000)},
            pk="session_id",
        )  # fmt: skip

    async def _arbitrate_training(
        self,
        case: TrainingCase,
        model: str,
        hyper: training_pb2.TrainingHyper,
        need: int,
        max_tokens: int,
    ) -> verification_pb2.Verdict:
        dispute = case.dispute
        start, end = dispute.layers.start, dispute.layers.end
        manager = self._ctx.jobs.manager
        accounts = {a for a in (case.primary.account, case.checker.account) if a}
        excluded = {case.primary.node_id, case.checker.node_id}
        arbiters = [
            a for a in self._holders(model, start, end, excluded, accounts)
            if self._ctx.planner.free_bytes(a.node_id) >= need
        ]  # fmt: skip
        kind = case.disputed.kind
        for arbiter in arbiters[:MAX_ARBITERS_TRIED]:
            loan = self.trainer.new_job_id()
            manager.lend_checkpoint(loan, dispute.job_id, arbiter.node_id, start, end)
            try:
                reply = await self.trainer.replay(
                    loan, arbiter.node_id, arbiter.address, model, hyper, max_tokens, dispute
                )
            except (grpc.aio.AioRpcError, ConnectionError) as err:
                log.warning("training arbiter %s could not replay: %s", arbiter.node_id, err)
                continue
            finally:
                manager.end_loan(loan)
            answer = training_answers.answer_of(reply)
            if not self._signed_by(arbiter.node_id, loan, kind, case, reply, answer):
                log.warning("training arbiter %s answered unsigned or for another input",
                            arbiter.node_id)  # fmt: skip
                continue
            tol = training_answers.tolerance()
            agrees_p = training_answers.answer_error(kind, answer, dispute.primary_answer) <= tol
            agrees_c = training_answers.answer_error(kind, answer, dispute.checker_answer) <= tol
            if agrees_p != agrees_c:
                loser, winner = (case.primary, case.checker) if agrees_c else (
                    case.checker, case.primary)  # fmt: skip
                self.reputation.verified(winner.node_id)
                self.reputation.verified(arbiter.node_id)
                what = training_answers.KIND.Name(kind).lower()
                evidence = self.convict(
                    loser.node_id,
                    loser.account,
                    dispute.job_id,
                    "training-arbitration",
                    f"{what} of layers [{start}, {end}) at step {case.disputed.step} of job "
                    f"{dispute.job_id} contradicted by {winner.node_id} and arbiter "
                    f"{arbiter.node_id} (relative error {case.error:.3g}), replayed from "
                    f"checkpoint step {dispute.restore_step}",
                    dispute.SerializeToString(),
                    dispute_id(dispute),
                )
                return verification_pb2.Verdict(
                    outcome=Outcome.PRIMARY_WRONG if agrees_c else Outcome.CHECKER_WRONG,
                    arbiter_node_id=arbiter.node_id,
                    evidence_id=evidence,
                    detail=f"{loser.node_id} was wrong",
                )
            detail = "the arbiter agreed with " + ("both" if agrees_p else "neither")
            return self._unresolved_pair(
                dispute.job_id, case.primary.node_id, case.checker.node_id, detail,
                arbiter.node_id,
            )  # fmt: skip
        return self._unresolved_pair(
            dispute.job_id, case.primary.node_id, case.checker.node_id,
            "no independent arbiter could replay it", "",
        )  # fmt: skip

    def _signed_by(
        self,
        node_id: str,
        job_id: str,
        kind: int,
        case: TrainingCase,
        reply: Any,
        answer: verification_pb2.TrainingAnswer,
    ) -> bool:
        """The arbiter's answer carries its valid signature, over the disputed input."""
        sent = getattr(reply, "input_digest", b"")
        if sent != case.disputed.primary.input_digest:
            return False
        digest = hashlib.sha256(training_answers.answer_bytes(kind, answer)).digest()
        micro_batch = case.disputed.micro_batch if kind != training_answers.KIND.NORM else 0
        payload = identity.training_payload(
            training_answers.PASS_NAMES[kind],
            job_id, case.disputed.step, micro_batch, case.dispute.layers.start,
            case.dispute.layers.end, digest, sent,
        )  # fmt: skip
        return identity.verify(self.public_key(node_id), reply.signature, payload)

    def _training_checks(
        self, request: verification_pb2.TrainingChecks
    ) -> verification_pb2.TrainingChecksAck:
        claims = self._job_claims(request.job_id, request.capability)
        if len(request.agreements) > MAX_AGREEMENTS:
            raise ReportError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(request.agreements)} agreements in one report; send at most "
                f"{MAX_AGREEMENTS}",
            )
        pairs = [check_agreement(claims, a) for a in request.agreements]
        keys = [signature_key(s.signature) for a in request.agreements
                for s in (a.primary, a.checker)]  # fmt: skip
        with self._ctx.db.atomic():
            self._claim_keys(keys, request.job_id)
            for primary, checker in pairs:
                self.reputation.verified(primary)
                self.reputation.verified(checker)
        return verification_pb2.TrainingChecksAck(accepted=len(pairs))

    # ---- arbitration --------------------------------------------------------------

    async def _arbitrate(
        self, claims: client_api_pb2.CapabilityClaims, mismatch: Mismatch
    ) -> verification_pb2.Verdict:
        comparison = mismatch.comparison
        p, c = comparison.primary, comparison.checker
        start, end = p.layers.start, p.layers.end
        arbiters = self._arbiters(claims.model, start, end, mismatch)
        for arbiter in arbiters[:MAX_ARBITERS_TRIED]:
            try:
                run = await self.runner.run(
                    arbiter.node_id,
                    arbiter.address,
                    claims.model,
                    start,
                    end,
                    [*comparison.prefix, comparison.input],
                    last_position_only=comparison.last_position_only,
                    also_granted=[a.node_id for a in arbiters if a is not arbiter][:2],
                )
            except (grpc.aio.AioRpcError, ConnectionError) as err:
                log.warning("arbiter %s could not run: %s", arbiter.node_id, err)
                continue
            out = run.response.output
            if run.response.input_digest != p.input_digest or list(out.shape) != list(
                p.output.shape
            ):
                log.warning("arbiter %s answered for another input or shape", arbiter.node_id)
                continue
            answer = codec.decode(out, finite=False)
            arbiter_class = (arbiter.device_kind, arbiter.compute_dtype)
            agrees_p = output_check.relative_error(
                answer, out.dtype, mismatch.primary_output, p.output.dtype
            ) <= output_check.pair_tolerance(
                arbiter_class,
                (mismatch.primary.device_kind, mismatch.primary.compute_dtype),
                layers=end - start,
            )
            agrees_c = output_check.relative_error(
                answer, out.dtype, mismatch.checker_output, c.output.dtype
            ) <= output_check.pair_tolerance(
                arbiter_class,
                (mismatch.checker.device_kind, mismatch.checker.compute_dtype),
                layers=end - start,
            )
            if agrees_c != agrees_p:
                loser, winner = (p, c) if agrees_c else (c, p)
                loser_grant = mismatch.primary if agrees_c else mismatch.checker
                self.reputation.verified(winner.node_id)
                self.reputation.verified(arbiter.node_id)
                evidence = self.convict(
                    loser.node_id,
                    loser_grant.account,
                    claims.session_id,
                    "arbitration",
                    f"output of layers [{start}, {end}) at step {p.step} contradicted by "
                    f"{winner.node_id} and arbiter {arbiter.node_id} (relative error "
                    f"{mismatch.error:.3g} > {mismatch.tolerance:.3g})",
                    comparison.SerializeToString(),
                    evidence_id(comparison),
                )
                outcome = Outcome.PRIMARY_WRONG if agrees_c else Outcome.CHECKER_WRONG
                return verification_pb2.Verdict(
                    outcome=outcome,
                    arbiter_node_id=arbiter.node_id,
                    evidence_id=evidence,
                    detail=f"{loser.node_id} was wrong",
                )
            detail = "the arbiter agreed with " + ("both" if agrees_p else "neither")
            return self._unresolved(claims, mismatch, detail, arbiter.node_id)
        return self._unresolved(claims, mismatch, "no independent arbiter could run it", "")

    def _unresolved(
        self,
        claims: client_api_pb2.CapabilityClaims,
        mismatch: Mismatch,
        detail: str,
        arbiter_id: str,
    ) -> verification_pb2.Verdict:
        comparison = mismatch.comparison
        return self._unresolved_pair(
            claims.session_id, comparison.primary.node_id, comparison.checker.node_id, detail,
            arbiter_id,
        )  # fmt: skip

    def _unresolved_pair(
        self, session_id: str, primary: str, checker: str, detail: str, arbiter_id: str
    ) -> verification_pb2.Verdict:
        # Nobody is proven wrong, so nobody is banned; but the client could not use the
        # primary's output, and both nodes' records lose their streak.
        self.reputation.failed(primary)
        self.reputation.failed(checker)
        self._notify(WorkRejected(primary, session_id, f"unresolved mismatch: {detail}"))
        log.warning("mismatch %s vs %s unresolved: %s", primary, checker, detail)
        return verification_pb2.Verdict(
            outcome=Outcome.UNRESOLVED, arbiter_node_id=arbiter_id, detail=detail
        )

    def _arbiters(self, model: str, start: int, end: int, mismatch: Mismatch) -> list[NodeFacts]:
        excluded = {mismatch.primary.node_id, mismatch.checker.node_id}
        accounts = {a for a in (mismatch.primary.account, mismatch.checker.account) if a}
        return self._holders(model, start, end, excluded, accounts)

    def _holders(
        self, model: str, start: int, end: int, excluded: set[str], accounts: set[str]
    ) -> list[NodeFacts]:
        """Routable ready holders of [start, end), none of ``excluded`` or of one of
        ``accounts`` (independent of both disputing nodes), the most trusted first."""
        planner = self._ctx.planner
        holders = planner.ready_holders(model) if planner is not None else []
        found: list[NodeFacts] = []
        for holder in holders:
            if holder.node_id in excluded or not (holder.start <= start and end <= holder.end):
                continue
            facts = self.node_facts(holder.node_id)
            if facts is None or not self.routable(holder.node_id) or facts.account in accounts:
                continue
            found.append(NodeFacts(facts.node_id, holder.address, facts.account,
                                   facts.device_kind, facts.compute_dtype))  # fmt: skip
        # The most trusted arbiter first.
        found.sort(key=lambda f: (self.reputation.probability(f.node_id), f.node_id))
        return found

    # ---- verdicts -------------------------------------------------------------------

    def convict(
        self,
        node_id: str,
        account: str,
        session_id: str,
        kind: str,
        reason: str,
        payload: bytes,
        evidence: str,
        *,
        canary: bool = False,
    ) -> str:
        """A signed output of ``node_id`` is proven wrong: record, ban, tell listeners."""
        self._ctx.db["verification_evidence"].upsert(
            {
                "evidence_id": evidence,
                "kind": kind,
                "session_id": session_id,
                "accused_node_id": node_id,
                "outcome": "banned",
                "detail": json.dumps({"reason": reason}),
                "payload": payload,
                "ts_ms": int(time.time() * 1000),
            },
            pk="evidence_id",
        )
        self.reputation.failed(node_id, canary=canary)
        registry = self._ctx.registry
        view = registry.node(node_id)
        banned = view is not None and view.state is NodeState.BANNED
        if banned and self._slashed_in(node_id) == view.state_changed_ms:
            # Convicted already in this ban (e.g. two canaries of one round): one slashing.
            self._notify(WorkRejected(node_id, session_id, reason))
            return evidence
        # A ban that no conviction made (an operator's) slashed nothing: this proof does.
        log.error("FRAUD PROVEN: node %s (account %r): %s; %s (evidence %s)", node_id,
                  account, reason, "banned already" if banned else "banning it",
                  evidence[:16])  # fmt: skip
        if not banned:
            try:
                registry.ban(node_id, f"proven wrong output ({kind}): {reason}"[:200])
            except RegistryError as err:
                log.warning("could not ban %s: %s", node_id, err)
        self._notify(WorkRejected(node_id, session_id, reason))
        self._notify(FraudProven(node_id, account, evidence, reason))
        # Marked after the ledger heard of it: a crash in between may slash twice, never
        # not at all.
        after = registry.node(node_id)
        if after is not None and after.state is NodeState.BANNED:
            self._ctx.db[SLASHED_BANS].upsert(
                {"node_id": node_id, "ban_started_ms": after.state_changed_ms,
                 "evidence_id": evidence},
                pk="node_id",
            )  # fmt: skip
        return evidence

    def _slashed_in(self, node_id: str) -> int | None:
        """When the ban began that a conviction of ``node_id`` slashed last (kept in the
        database: a restarted coordinator must not slash the same ban again)."""
        row = self._ctx.db.execute(
            f"SELECT ban_started_ms FROM {SLASHED_BANS} WHERE node_id = ?", [node_id]
        ).fetchone()
        return None if row is None else int(row[0])
