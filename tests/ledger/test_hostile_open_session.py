"""ClientApi.OpenSession and ReportStepTimes over real gRPC on a priced swarm: malformed,
oversized and hostile requests (signatures by another key, another client's account,
timings of nodes the session was never routed to, more reports than the session has
tokens).

Anyone can call OpenSession, and a paid open escrows the signing client's credits. Each
refusal carries the right status and a short message, nothing is escrowed or measured,
and the coordinator goes on serving. The in-process coordinator with fake stage nodes is
the jobs tests' (tests/jobs/jobs_harness.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from jobs.jobs_harness import MODEL, JobsCoordinator, start_jobs, tiny_model  # noqa: F401
from support.hostile import huge, refused

from client import billing
from coordinator.sessions import MAX_STEP_TIMES
from protos import codec, identity
from protos.tessera.v1 import client_api_pb2, client_api_pb2_grpc, common_pb2

PRICE = 1000  # credit units per 1k token-layers, every node
MAX_LENGTH = 16
MODEL_POSITIONS = 256


@pytest.fixture
async def market(
    start_jobs: Callable[..., Awaitable[JobsCoordinator]],  # noqa: F811 - the fixture
) -> JobsCoordinator:
    served = await start_jobs(nodes=0, replicas=1)
    for index in range(3):
        await served.add_node(f"n{index}", price_per_1k_token_layers_units=PRICE)
    await served.ready(replicas=1)
    return served


def api(served: JobsCoordinator) -> client_api_pb2_grpc.ClientApiStub:
    return client_api_pb2_grpc.ClientApiStub(served.channel)


def funded(served: JobsCoordinator, amount: int = 10_000_000):
    key = identity.generate_private_key()
    served.coordinator.ctx.ledger.ledger.grant(billing.account_of(key), amount, "g1")
    return key


def escrowed(served: JobsCoordinator, key) -> int:
    return served.coordinator.ctx.ledger.ledger.client_balance(billing.account_of(key)).escrowed


def signed_open(key, **fields: object) -> client_api_pb2.OpenSessionRequest:
    fields.setdefault("model", MODEL)
    fields.setdefault("max_length", MAX_LENGTH)
    request = client_api_pb2.OpenSessionRequest(**fields)  # type: ignore[arg-type]
    billing.sign_open(request, key, int(time.time() * 1000))
    return request


async def test_open_session_refuses_malformed_oversized_and_hostile_requests(
    market: JobsCoordinator,
) -> None:
    client, stranger = funded(market), identity.generate_private_key()
    by_stranger = signed_open(client)
    by_stranger.client_signature = stranger.sign(identity.open_session_payload(by_stranger))
    altered = signed_open(client)
    altered.max_length = MAX_LENGTH + 1  # after signing
    cases = [
        (signed_open(client, max_length=0), grpc.StatusCode.INVALID_ARGUMENT, "max_length"),
        (signed_open(client, max_length=2**32 - 1), grpc.StatusCode.INVALID_ARGUMENT, "between"),
        # Past the model's positions (the test checkpoint's max_position_embeddings, 256):
        # refused at the start, not by every node at the step that crosses it.
        (
            signed_open(client, max_length=MODEL_POSITIONS + 1),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"holds at most {MODEL_POSITIONS} positions",
        ),
        (signed_open(client, prefer="sideways"), grpc.StatusCode.INVALID_ARGUMENT, "prefer"),
        (
            client_api_pb2.OpenSessionRequest(model=MODEL, max_length=8, account=huge("a")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "account",
        ),
        (signed_open(client, model=huge("m")), grpc.StatusCode.INVALID_ARGUMENT, "model name"),
        (by_stranger, grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (altered, grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (
            # Another client's account named with this key: nobody pays for someone else.
            client_api_pb2.OpenSessionRequest(
                model=MODEL,
                max_length=8,
                account=billing.account_of(stranger),
                client_public_key=identity.public_key_bytes(client),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not the account",
        ),
        (
            client_api_pb2.OpenSessionRequest(
                model=MODEL, max_length=8, client_public_key=huge("k").encode()
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "32-byte",
        ),
        (
            client_api_pb2.OpenSessionRequest(model=MODEL, max_length=8),
            grpc.StatusCode.FAILED_PRECONDITION,
            "client key",
        ),
        (
            client_api_pb2.OpenSessionRequest(model="m" * (codec.MAX_MESSAGE_BYTES + 10)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
    ]
    for request, code, words in cases:
        details = await refused(api(market).OpenSession(request, timeout=10), code, words)
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    assert escrowed(market, client) == 0

    # Still serving: a good open escrows its quote, and one of exactly the model's
    # positions (which GetModel tells the client) opens too.
    grant = await api(market).OpenSession(signed_open(client))
    assert escrowed(market, client) == grant.quote.amount > 0
    detail = await api(market).GetModel(common_pb2.ModelRef(name=MODEL))
    assert detail.info.max_positions == MODEL_POSITIONS
    # Within the positions but past the KV cache every shard is given (the harness's 64
    # tokens): refused too, naming the setting; exactly the cache opens.
    kv_tokens = market.coordinator.ctx.planner.kv_tokens
    await refused(
        api(market).OpenSession(signed_open(client, max_length=kv_tokens + 1), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"at most {kv_tokens} tokens of cache",
    )
    await api(market).OpenSession(signed_open(client, max_length=kv_tokens))


async def test_a_signed_open_is_accepted_once(market: JobsCoordinator) -> None:
    """A captured open request, replayed while its stamp is still fresh, would escrow the
    client's credits again: its nonce makes the same signed bytes good for one session."""
    client = funded(market)
    request = signed_open(client)
    grant = await api(market).OpenSession(request)
    held = escrowed(market, client)
    assert held == grant.quote.amount > 0
    details = await refused(
        api(market).OpenSession(request, timeout=10), grpc.StatusCode.ALREADY_EXISTS, "replay"
    )
    assert "new nonce" in details
    # Another request with that nonce, signed by the client: still the one nonce, refused.
    again = signed_open(client, max_length=MAX_LENGTH - 1)
    again.nonce = request.nonce
    again.client_signature = client.sign(identity.open_session_payload(again))
    await refused(
        api(market).OpenSession(again, timeout=10), grpc.StatusCode.ALREADY_EXISTS, "replay"
    )
    # A request without a nonce (an old client), or with a short one, is told what to do.
    for nonce in (b"", b"\x01" * 8):
        bare = signed_open(client)
        bare.nonce = nonce
        bare.client_signature = client.sign(identity.open_session_payload(bare))
        await refused(
            api(market).OpenSession(bare, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "update the client",
        )
    # A stranger cannot spend a nonce the client has not used yet: refused as unsigned, and
    # the client's request with that nonce still opens a session.
    fresh = signed_open(client)
    forged = signed_open(identity.generate_private_key())
    forged.client_public_key, forged.account = fresh.client_public_key, fresh.account
    forged.nonce = fresh.nonce
    await refused(
        api(market).OpenSession(forged, timeout=10), grpc.StatusCode.UNAUTHENTICATED, "not signed"
    )
    second = await api(market).OpenSession(fresh)
    assert second.session_id != grant.session_id
    assert escrowed(market, client) == held + second.quote.amount


async def test_report_step_times_refuses_bad_and_oversized_reports(
    market: JobsCoordinator,
) -> None:
    client = funded(market)
    grant = await api(market).OpenSession(signed_open(client))
    stage = grant.stages[0]
    node_id = stage.primary.node_id
    placement = market.coordinator.ctx.planner

    def step(**fields: object) -> client_api_pb2.StepTime:
        values: dict[str, object] = dict(node_id=node_id, layers=stage.layers, tokens=1)
        values["wall_ms"] = 5.0
        values.update(fields)
        return client_api_pb2.StepTime(**values)  # type: ignore[arg-type]

    def report(*steps: client_api_pb2.StepTime) -> client_api_pb2.StepTimesReport:
        return client_api_pb2.StepTimesReport(
            session_id=grant.session_id, capability=grant.capability, steps=list(steps)
        )

    cases = [
        (report(step(wall_ms=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "wall_ms"),
        (report(step(wall_ms=-1.0)), grpc.StatusCode.INVALID_ARGUMENT, "wall_ms"),
        (report(step(tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (report(step(tokens=MAX_LENGTH + 1)), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (
            report(step(layers=client_api_pb2.RouteStage().layers)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not granted",
        ),
        (report(step(node_id=huge("n"))), grpc.StatusCode.PERMISSION_DENIED, "route"),
        (
            report(*[step()] * (MAX_STEP_TIMES + 1)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"at most {MAX_STEP_TIMES}",
        ),
        # More calls to one node than the session has tokens: one client cannot drown a
        # node's measured speed.
        (report(*[step()] * (MAX_LENGTH + 1)), grpc.StatusCode.RESOURCE_EXHAUSTED, "budget"),
    ]
    for request, code, words in cases:
        details = await refused(api(market).ReportStepTimes(request, timeout=10), code, words)
        assert "\x1b" not in details and "\n" not in details  # quoted, never raw
    assert placement.speed(node_id).samples == 0, "a refused report counts nothing"

    # Still serving: a good report is taken.
    ack = await api(market).ReportStepTimes(report(step(), step()))
    assert ack.accepted == 2 and placement.speed(node_id).samples == 2
