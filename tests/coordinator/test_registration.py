"""Register over real gRPC: the good path, and every way a registration can be wrong."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from support.coordinator_harness import GIB, Harness, good_capabilities
from support.ports import free_port

from coordinator.challenges import ChallengeStore
from coordinator.node_state import NodeState
from protos import codec, identity
from protos.tessera.v1 import coordinator_pb2, node_pb2, stage_pb2, stage_pb2_grpc

TIB = 1 << 40


async def expect_error(awaitable, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    for fragment in fragments:
        assert fragment in details, details
    return details


async def assert_still_serving(harness: Harness) -> None:
    node = harness.node("after-bad-input")
    reply = await node.register()
    assert reply.node_id == node.node_id


async def test_good_registration(harness: Harness) -> None:
    node = harness.node("rtx-box")
    reply = await node.register()

    assert reply.node_id == identity.node_id(node.public_key)
    assert reply.coordinator_public_key == harness.ctx.public_key
    assert len(reply.attach_ticket) == 32
    assert reply.heartbeat_interval_ms == 60_000
    assert reply.offline_after_ms == 180_000
    assert reply.reachable is False  # no data address given
    view = harness.registry.node(reply.node_id)
    assert view is not None
    assert (view.name, view.account, view.state) == ("rtx-box", "alice", NodeState.OFFLINE)
    assert view.capabilities.device_name == "NVIDIA GeForce RTX 3090"
    # Durable before the node heard back: the row is in SQLite already.
    row = harness.ctx.db.execute(
        "SELECT name, device_kind, memory_usable_bytes FROM nodes WHERE node_id = ?",
        [reply.node_id],
    ).fetchone()
    assert row == ("rtx-box", "cuda", 22 * GIB)


async def test_same_key_same_id_and_one_row(harness: Harness) -> None:
    node = harness.node("first-name")
    first = await node.register()
    node.name = "renamed"
    second = await node.register(capabilities=good_capabilities(matmul_tflops=40.0))

    assert first.node_id == second.node_id
    assert first.attach_ticket != second.attach_ticket  # a fresh ticket each time
    count = harness.ctx.db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
    assert count == 1
    view = harness.registry.node(first.node_id)
    assert view.name == "renamed" and view.capabilities.matmul_tflops == 40.0
    # Only the newest ticket is valid.
    assert harness.registry.check_ticket(first.node_id, second.attach_ticket)
    assert not harness.registry.check_ticket(first.node_id, first.attach_ticket)


async def test_bad_signature(harness: Harness) -> None:
    node = harness.node()
    request = node.request(await node.challenge())
    request.name = "changed-after-signing"
    await expect_error(
        node.stub.Register(request), grpc.StatusCode.UNAUTHENTICATED, "signature does not verify"
    )
    await assert_still_serving(harness)


async def test_signature_by_another_key(harness: Harness) -> None:
    node = harness.node()
    request = node.request(await node.challenge(), sign=False)
    identity.sign_register(identity.generate_private_key(), request)
    await expect_error(node.stub.Register(request), grpc.StatusCode.UNAUTHENTICATED, "signature")


async def test_missing_signature(harness: Harness) -> None:
    node = harness.node()
    request = node.request(await node.challenge(), sign=False)
    await expect_error(
        node.stub.Register(request), grpc.StatusCode.UNAUTHENTICATED, "missing signature"
    )
    await assert_still_serving(harness)


async def test_a_bad_signature_does_not_burn_the_nonce(harness: Harness) -> None:
    node = harness.node()
    nonce = await node.challenge()
    forged = node.request(nonce, sign=False)
    forged.signature = b"\x00" * 64
    await expect_error(node.stub.Register(forged), grpc.StatusCode.UNAUTHENTICATED)
    reply = await node.stub.Register(node.request(nonce))
    assert reply.node_id == node.node_id


async def test_reused_nonce(harness: Harness) -> None:
    node = harness.node()
    request = node.request(await node.challenge())
    await node.stub.Register(request)
    await expect_error(node.stub.Register(request), grpc.StatusCode.UNAUTHENTICATED, "already used")
    await assert_still_serving(harness)


async def test_unknown_nonce(harness: Harness) -> None:
    node = harness.node()
    await expect_error(
        node.stub.Register(node.request(b"\x01" * 32)), grpc.StatusCode.UNAUTHENTICATED, "nonce"
    )


async def test_expired_nonce(harness: Harness) -> None:
    now = [1000.0]
    harness.registry.challenges = ChallengeStore(ttl_s=60.0, clock=lambda: now[0])
    node = harness.node()
    nonce = await node.challenge()
    now[0] += 61.0
    await expect_error(
        node.stub.Register(node.request(nonce)), grpc.StatusCode.UNAUTHENTICATED, "expired"
    )
    # The expired nonce is gone for good, even if the clock went back.
    now[0] -= 61.0
    await expect_error(node.stub.Register(node.request(nonce)), grpc.StatusCode.UNAUTHENTICATED)
    await assert_still_serving(harness)


async def test_challenge_expiry_is_reported(harness: Harness) -> None:
    node = harness.node()
    reply = await node.stub.GetChallenge(
        coordinator_pb2.ChallengeRequest(public_key=node.public_key)
    )
    assert len(reply.nonce) == 32
    assert 55_000 < reply.expires_unix_ms - time.time() * 1000 <= 60_000


async def test_nonce_issued_for_another_key(harness: Harness) -> None:
    victim, thief = harness.node("victim"), harness.node("thief")
    nonce = await victim.challenge()
    await expect_error(
        thief.stub.Register(thief.request(nonce)),
        grpc.StatusCode.UNAUTHENTICATED,
        "different public key",
    )
    # The victim can still use its nonce.
    assert (await victim.stub.Register(victim.request(nonce))).node_id == victim.node_id


async def test_malformed_public_key(harness: Harness) -> None:
    await expect_error(
        harness.coordinator_stub.GetChallenge(coordinator_pb2.ChallengeRequest(public_key=b"x")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "32-byte",
    )
    await assert_still_serving(harness)


async def test_get_challenge_refuses_oversized_keys_and_outlasts_a_flood(harness: Harness) -> None:
    stub = harness.coordinator_stub
    # A megabyte of key is refused by its length, which is all the message repeats.
    details = await expect_error(
        stub.GetChallenge(coordinator_pb2.ChallengeRequest(public_key=b"k" * 1_000_000)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "32-byte",
        "1000000 bytes",
    )
    assert len(details) < 500
    await expect_error(
        stub.GetChallenge(coordinator_pb2.ChallengeRequest()), grpc.StatusCode.INVALID_ARGUMENT
    )
    oversized = coordinator_pb2.ChallengeRequest(public_key=b"k" * (codec.MAX_MESSAGE_BYTES + 10))
    await expect_error(stub.GetChallenge(oversized), grpc.StatusCode.RESOURCE_EXHAUSTED)
    # A flood of challenges, some for a victim's own key: the store stays bounded (the
    # oldest are forgotten), and the victim's challenge asked afterwards registers.
    harness.registry.challenges = ChallengeStore(ttl_s=60.0, max_pending=50)
    victim = harness.node("victim")
    flood = [identity.public_key_bytes(identity.generate_private_key()) for _ in range(150)]
    for key in flood + [victim.public_key] * 50:
        await stub.GetChallenge(coordinator_pb2.ChallengeRequest(public_key=key))
    assert len(harness.registry.challenges) == 50
    assert (await victim.register()).node_id == victim.node_id
    await assert_still_serving(harness)


def caps(**overrides):
    return good_capabilities(**overrides)


ABSURD = [
    # (description, request fields, field named in the error)
    ("negative memory wraps to 2^64-1", {"capabilities": caps(memory_total_bytes=2**64 - 1)},
     "memory_total_bytes"),
    ("17 TiB of device memory", {"capabilities": caps(memory_total_bytes=17 * TIB)},
     "memory_total_bytes"),
    ("usable above total", {"capabilities": caps(memory_usable_bytes=25 * GIB)},
     "memory_usable_bytes"),
    ("a million GPUs", {"capabilities": caps(device_count=10**6)}, "device_count"),
    ("a million cores", {"capabilities": caps(cpu_cores=10**6)}, "cpu_cores"),
    ("NaN tflops", {"capabilities": caps(matmul_tflops=float("nan"))}, "matmul_tflops"),
    ("infinite tflops", {"capabilities": caps(matmul_tflops=float("inf"))}, "matmul_tflops"),
    ("negative tflops", {"capabilities": caps(matmul_tflops=-1.0)}, "matmul_tflops"),
    ("a zettaflop", {"capabilities": caps(matmul_tflops=1e9)}, "matmul_tflops"),
    ("NaN bandwidth", {"capabilities": caps(memory_bandwidth_gbps=float("nan"))},
     "memory_bandwidth_gbps"),
    ("negative bandwidth", {"capabilities": caps(memory_bandwidth_gbps=-5.0)},
     "memory_bandwidth_gbps"),
    ("a petabyte/s", {"capabilities": caps(memory_bandwidth_gbps=1e6)}, "memory_bandwidth_gbps"),
    ("negative price", {"capabilities": caps(price_per_1k_token_layers=-0.5)},
     "price_per_1k_token_layers"),
    ("megabyte name", {"name": "x" * 1_000_000}, "name"),
    ("megabyte device name", {"capabilities": caps(device_name="G" * 1_000_000)},
     "device_name"),
    ("megabyte account", {"account": "a" * 1_000_000}, "account"),
    ("control characters in name", {"name": "evil\nname"}, "name"),
    ("empty name", {"name": ""}, "name"),
    ("shell in account", {"account": "bob; rm -rf /"}, "account"),
    ("weird region", {"capabilities": caps(region="<script>")}, "region"),
    ("unknown device kind", {"capabilities": caps(device_kind="quantum")}, "device_kind"),
    ("unknown dtype", {"capabilities": caps(dtypes=["float8"])}, "dtypes"),
    ("bad compute capability", {"capabilities": caps(compute_capability="eight")},
     "compute_capability"),
    ("bad active hours", {"capabilities": caps(
        limits=node_pb2.OwnerLimits(active_hours="25:00-26:00"))}, "active_hours"),
    ("missing capabilities", {"capabilities": None}, "capabilities"),
    ("data address without port", {"data_address": "example.org"}, "data_address"),
    ("data address port 0", {"data_address": "example.org:0"}, "data_address"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "field"), [(f, name) for _, f, name in ABSURD], ids=[d for d, _, _ in ABSURD]
)
async def test_absurd_registration_is_invalid_argument(
    harness: Harness, fields: dict, field: str
) -> None:
    node = harness.node()
    nonce = await node.challenge()
    if fields.get("capabilities", ...) is None:
        request = coordinator_pb2.RegisterRequest(
            public_key=node.public_key, nonce=nonce, name="no-caps"
        )
        identity.sign_register(node.key, request)
    else:
        request = node.request(nonce, **fields)
    details = await expect_error(node.stub.Register(request), grpc.StatusCode.INVALID_ARGUMENT)
    assert field in details.split(":")[0], details
    assert len(details) < 500  # never echoes a megabyte back
    assert harness.registry.node(node.node_id) is None
    await assert_still_serving(harness)


async def test_oversized_message_is_resource_exhausted(harness: Harness) -> None:
    node = harness.node()
    request = node.request(await node.challenge(), name="n" * (codec.MAX_MESSAGE_BYTES + 10))
    await expect_error(node.stub.Register(request), grpc.StatusCode.RESOURCE_EXHAUSTED)
    await assert_still_serving(harness)


async def test_banned_key_is_refused(harness: Harness) -> None:
    node = await harness.registered_node("cheater")
    harness.registry.ban(node.node_id, "proven fraud")
    await expect_error(node.register(), grpc.StatusCode.PERMISSION_DENIED, "banned")
    assert harness.registry.node(node.node_id).state is NodeState.BANNED
    await assert_still_serving(harness)


@pytest.mark.parametrize(
    ("version", "words"),
    [
        ("0.0.9", "is Tessera 0.0.9, and this coordinator takes 0.2.0 or newer"),
        ("0.1.7", "is Tessera 0.1.7"),
        ("", "says no version"),
        ("nightly", "says it is 'nightly'"),
        ("v" + "9" * 63, "says it is 'v999"),  # not a release, however high it looks
    ],
)
async def test_a_node_agent_older_than_the_minimum_is_told_to_upgrade(
    start_harness, version: str, words: str
) -> None:
    harness = await start_harness(min_agent_version="0.2.0")
    node = harness.node()
    refused = node.register(capabilities=good_capabilities(agent_version=version))
    details = await expect_error(refused, grpc.StatusCode.FAILED_PRECONDITION, words)
    assert "pip install -U 'tessera-swarm[node]'" in details and len(details) < 500, details
    assert harness.registry.node(node.node_id) is None
    # Still serving: the minimum itself, a later release, and a pre-release of one, are taken.
    for taken in ("0.2.0", "0.10.1", "1.0.0rc1"):
        other = harness.node()
        await other.register(capabilities=good_capabilities(agent_version=taken))
        assert harness.registry.node(other.node_id) is not None


async def test_a_banned_node_hears_of_its_ban_before_its_old_version(start_harness) -> None:
    harness = await start_harness(min_agent_version="0.2.0")
    node = harness.node()
    await node.register(capabilities=good_capabilities(agent_version="0.2.0"))
    harness.registry.ban(node.node_id, "proven fraud")
    old = node.register(capabilities=good_capabilities(agent_version="0.1.0"))
    await expect_error(old, grpc.StatusCode.PERMISSION_DENIED, "banned")  # upgrading won't help


class _StageStub(stage_pb2_grpc.StageServicer):
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    async def Ping(self, request, context):
        return stage_pb2.PingResponse(payload=request.payload, node_id=self.node_id)


async def _stage_server(node_id: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServicer_to_server(_StageStub(node_id), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_reachable_data_address(harness: Harness) -> None:
    node = harness.node()
    server, address = await _stage_server(node.node_id)
    try:
        reply = await node.register(data_address=address)
    finally:
        await server.stop(0)
    assert reply.reachable is True
    assert harness.registry.node(node.node_id).reachable is True


async def test_unreachable_data_address_still_registers(harness: Harness) -> None:
    node = harness.node()
    loop = asyncio.get_running_loop()
    started = loop.time()
    reply = await node.register(data_address=f"127.0.0.1:{free_port()}")
    assert reply.reachable is False
    assert loop.time() - started < 3.0  # the dial-back is bounded


async def test_data_address_of_somebody_else_is_not_reachable(harness: Harness) -> None:
    node = harness.node()
    server, address = await _stage_server("n-some-other-node")
    try:
        reply = await node.register(data_address=address)
    finally:
        await server.stop(0)
    assert reply.reachable is False


def test_challenge_store_is_bounded() -> None:
    store = ChallengeStore(ttl_s=60, max_pending=100)
    key = b"k" * 32
    nonces = [store.issue(key)[0] for _ in range(1000)]
    assert len(store) == 100
    store.check(nonces[-1], key)  # the newest are kept
    with pytest.raises(Exception, match="unknown"):
        store.check(nonces[0], key)


def test_challenge_store_drops_expired_entries_on_issue() -> None:
    now = [0.0]
    store = ChallengeStore(ttl_s=1, max_pending=100, clock=lambda: now[0])
    for _ in range(50):
        store.issue(b"k" * 32)
    now[0] = 5.0
    store.issue(b"k" * 32)
    assert len(store) == 1
