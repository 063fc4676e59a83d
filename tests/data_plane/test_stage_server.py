"""The Stage server: real grpc.aio on loopback, a real tiny model, signed capabilities.

Every bad request must end with the right status and a message a person can act on, and
must not disturb any other session: after each one, an already open session continues
and a new one starts, on the same server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from data_plane.stage_harness import (
    HIDDEN,
    MODEL,
    NUM_LAYERS,
    OPTIONS,
    VOCAB,
    CoordinatorKeys,
    StageNode,
    reference_greedy,
    reference_logits,
)

from node_agent.stage_server import StageLimits, _to_torch, _to_wire
from protos import codec, identity, output_check
from protos.tessera.v1 import client_api_pb2, common_pb2, stage_pb2, stage_pb2_grpc

PROMPT = [1, 5, 9, 13, 20]


@dataclass
class Session:
    """One client stream to one node, for tests."""

    node: StageNode
    keys: CoordinatorKeys
    session_id: str
    channel: grpc.aio.Channel
    call: grpc.aio.StreamStreamCall | None = None
    step: int = 0
    sent_capability: bool = False

    @classmethod
    def open(cls, node: StageNode, keys: CoordinatorKeys, session_id: str) -> Session:
        return cls(node, keys, session_id, grpc.aio.insecure_channel(node.address, options=OPTIONS))

    def capability(self, **options) -> client_api_pb2.SignedCapability:
        grants = options.pop("grants", [(self.node.node_id, 0, NUM_LAYERS)])
        return self.keys.capability(self.session_id, grants, **options)

    def request(
        self,
        tensor: common_pb2.Tensor,
        *,
        start: int = 0,
        end: int = NUM_LAYERS,
        start_pos: int = 0,
        capability: client_api_pb2.SignedCapability | None = None,
        model: str = MODEL,
    ) -> stage_pb2.ForwardRequest:
        self.step += 1
        request = stage_pb2.ForwardRequest(
            session_id=self.session_id,
            step=self.step,
            model=model,
            layers=common_pb2.LayerRange(start=start, end=end),
            start_pos=start_pos,
            input=tensor,
        )
        if capability is not None:
            request.capability.CopyFrom(capability)
        elif not self.sent_capability:
            request.capability.CopyFrom(self.capability())
        self.sent_capability = True
        return request

    async def send(self, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardResponse:
        if self.call is None:
            self.call = stage_pb2_grpc.StageStub(self.channel).Forward()
        await self.call.write(request)
        response = await self.call.read()
        assert response is not grpc.aio.EOF
        return response

    async def tokens(self, ids: list[int], start_pos: int, **kw) -> stage_pb2.ForwardResponse:
        tensor = codec.encode(np.array([ids], dtype=np.int64))
        return await self.send(self.request(tensor, start_pos=start_pos, **kw))

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        await self.channel.close()


def logits_of(response: stage_pb2.ForwardResponse) -> np.ndarray:
    return codec.decode(response.output, allowed=frozenset({"float32"}))


def ids(values: list[int] | list[list[int]], dtype: str = "int64") -> common_pb2.Tensor:
    array = np.array(values)
    return codec.encode(array if array.ndim == 2 else array, dtype)


def hidden(length: int, fill: float = 0.1, width: int = HIDDEN) -> common_pb2.Tensor:
    return codec.encode(np.full((1, length, width), fill, dtype=np.float32))


@dataclass
class HeldForward:
    """A stage view whose forward blocks until released, recording each calling thread's
    nice value (Linux): a step that is still computing, on demand."""

    entered: threading.Event
    release: threading.Event
    nice: list[int]


def hold_forward(node: StageNode, start: int, end: int) -> HeldForward:
    stage = node.manager.find(MODEL, start, end).stage_for(start, end)
    held = HeldForward(threading.Event(), threading.Event(), [])
    original = stage.forward

    def slow_forward(*args, **kwargs):
        if sys.platform == "linux":
            held.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        held.entered.set()
        held.release.wait(30)
        return original(*args, **kwargs)

    stage.forward = slow_forward
    return held


# ---- the happy path ----------------------------------------------------------------------


async def test_prefill_and_decode_match_the_full_model_and_are_signed(
    start_node, keys, checkpoint
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-happy")
    response = await session.tokens(PROMPT, 0)
    np.testing.assert_allclose(
        logits_of(response)[0], reference_logits(checkpoint, PROMPT), rtol=1e-5, atol=1e-5
    )
    assert response.step == 1
    assert response.cache_length == len(PROMPT)
    assert response.compute_ms > 0
    digest = hashlib.sha256(response.output.data).digest()
    prefix = output_check.prefix_digest([(np.array([PROMPT], dtype=np.int64), "int64")])
    assert response.input_digest == prefix, "the signature must commit to the input prefix"
    payload = identity.output_payload("s-happy", 1, 0, NUM_LAYERS, digest, input_digest=prefix)
    assert identity.verify(node.public_key, response.signature, payload)
    assert not identity.verify(
        node.public_key,
        response.signature,
        identity.output_payload("s-happy", 2, 0, 4, digest, input_digest=prefix),
    )

    generated = []
    logits = logits_of(response)[0, -1]
    for position in range(len(PROMPT), len(PROMPT) + 6):
        token = int(np.argmax(logits))
        generated.append(token)
        response = await session.tokens([token], position)
        assert response.cache_length == position + 1
        logits = logits_of(response)[0, -1]
    assert generated == reference_greedy(checkpoint, PROMPT, 6)
    await session.close()


async def test_ping_echoes_payload_and_names_the_node(start_node) -> None:
    node = await start_node([])
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        reply = await stub.Ping(stage_pb2.PingRequest(payload=b"hello"))
        assert (reply.payload, reply.node_id) == (b"hello", node.node_id)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Ping(stage_pb2.PingRequest(payload=b"x" * (2 << 20)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_shard_serves_sub_spans_and_half_precision_inputs(
    start_node, keys, checkpoint
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-sub")
    first = await session.send(session.request(ids([PROMPT]), start=0, end=2))
    hidden_states = codec.decode(first.output)
    assert hidden_states.shape == (1, len(PROMPT), HIDDEN)
    second = await session.send(session.request(first.output, start=2, end=NUM_LAYERS))
    np.testing.assert_allclose(
        logits_of(second)[0], reference_logits(checkpoint, PROMPT), rtol=1e-5, atol=1e-5
    )
    # float16 and bfloat16 hidden states are accepted (and computed in float32 on CPU).
    bf16 = (hidden_states.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for tensor in (codec.encode(hidden_states.astype(np.float16)), codec.encode(bf16, "bfloat16")):
        replay = await session.send(session.request(tensor, start=2, end=NUM_LAYERS))
        np.testing.assert_allclose(logits_of(replay), logits_of(second), atol=0.05)
    await session.close()


async def test_concurrent_sessions_each_get_their_own_cache(start_node, keys, checkpoint) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    prompts = [[1 + i, 7 + 2 * i, 30 - i] for i in range(6)]

    async def generate(index: int, prompt: list[int]) -> list[int]:
        session = Session.open(node, keys, f"s-conc-{index}")
        response = await session.tokens(prompt, 0)
        out = []
        for position in range(len(prompt), len(prompt) + 5):
            token = int(np.argmax(logits_of(response)[0, -1]))
            out.append(token)
            response = await session.tokens([token], position)
        await session.close()
        return out

    results = await asyncio.gather(*(generate(i, p) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results, strict=True):
        assert result == reference_greedy(checkpoint, prompt, 5)
    assert node.manager.active_sessions() == len(prompts)
    assert node.manager.sample().active_sessions == len(prompts)


async def test_the_event_loop_stays_responsive_while_a_step_computes(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    held = hold_forward(node, 0, NUM_LAYERS)
    entered, release = held.entered, held.release
    session = Session.open(node, keys, "s-slow")
    step = asyncio.create_task(session.tokens(PROMPT, 0))
    assert await asyncio.to_thread(entered.wait, 30)
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        reply = await stage_pb2_grpc.StageStub(channel).Ping(
            stage_pb2.PingRequest(payload=b"still here"), timeout=5
        )
    assert reply.payload == b"still here"
    assert node.manager.sample().queue_length == 1
    release.set()
    assert (await step).cache_length == len(PROMPT)
    assert node.manager.sample().queue_length == 0
    await session.close()


async def test_a_check_runs_behind_the_pipeline_at_a_lower_priority(start_node, keys) -> None:
    """A node checks one span of a session for a verifier (``background``) while it serves
    another span of the same session in the pipeline: the pipeline's call must not wait for
    the check, and the check's thread yields the CPU (a higher nice value, on Linux)."""
    node = await start_node([(0, 2), (2, NUM_LAYERS)])
    held = hold_forward(node, 2, NUM_LAYERS)
    entered, release, nice = held.entered, held.release, held.nice
    checker = Session.open(node, keys, "s-shared")
    check = checker.request(hidden(len(PROMPT)), start=2)
    check.background = True
    pending = asyncio.create_task(checker.send(check))
    pipeline = Session.open(node, keys, "s-shared")
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        head = pipeline.request(ids([PROMPT]), end=2)
        answer = await asyncio.wait_for(pipeline.send(head), 10)
        assert answer.cache_length == len(PROMPT) and not pending.done()
        if sys.platform == "linux":
            assert nice and nice[0] > os.getpriority(os.PRIO_PROCESS, 0)
        release.set()
        assert (await pending).cache_length == len(PROMPT)
    finally:
        release.set()
        await checker.close()
        await pipeline.close()


async def test_a_call_cancelled_mid_compute_keeps_its_cache_until_the_compute_ends(
    start_node, keys, checkpoint
) -> None:
    """A checker's catch-up is cancelled by its client while the node computes it (on the
    background thread), and the client's next call on that cache comes at once on another
    stream: a fail-over's replay there. The model work cannot be stopped halfway, so the
    replay must wait for it, not run on the same cache at the same time."""
    node = await start_node([(0, 2)])
    stage = node.manager.find(MODEL, 0, 2).stage_for(0, 2)
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []
    original = stage.forward

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        name = threading.current_thread().name
        if name.startswith("tessera-check"):
            entered.set()
            release.wait(30)
        result = original(*args, **kwargs)
        order.append(name)
        return result

    stage.forward = forward
    grants = [(node.node_id, 0, 2)]
    checker = Session.open(node, keys, "s-cancelled")
    check = checker.request(ids([PROMPT]), end=2, capability=checker.capability(grants=grants))
    check.background = True
    pending = asyncio.create_task(checker.send(check))
    pipeline = Session.open(node, keys, "s-cancelled")
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await checker.close()
        replay = pipeline.request(ids([[*PROMPT, 3]]), end=2,
                                  capability=pipeline.capability(grants=grants))  # fmt: skip
        answer = asyncio.create_task(pipeline.send(replay))
        await asyncio.sleep(0.5)
        assert not answer.done(), "the replay ran while the cancelled call still computed"
        release.set()
        done = await asyncio.wait_for(answer, 10)
        assert done.cache_length == len(PROMPT) + 1
        assert len(order) == 2 and order[0].startswith("tessera-check")
        assert order[1].startswith("tessera-compute")
        # The cache holds the replay's positions: its next step goes on from there.
        pipeline_next = pipeline.request(ids([[4]]), end=2, start_pos=len(PROMPT) + 1)
        assert (await pipeline.send(pipeline_next)).cache_length == len(PROMPT) + 2
    finally:
        release.set()
        await pipeline.close()


# ---- bad input, one case at a time -----------------------------------------------------------


@dataclass(frozen=True)
class BadCase:
    name: str
    build: Callable[[Session], list[stage_pb2.ForwardRequest]]
    code: grpc.StatusCode
    message: str


def _other_key_capability(s: Session) -> client_api_pb2.SignedCapability:
    return s.capability(key=identity.generate_private_key())


def _without_input(request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardRequest:
    request.ClearField("input")
    return request


BAD_CASES = [
    BadCase(
        "float token ids",
        lambda s: [s.request(codec.encode(np.ones((1, 3), np.float32)))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype 'float32' is not accepted",
    ),
    BadCase(
        "token ids without a batch dimension",
        lambda s: [s.request(codec.encode(np.array([1, 2, 3], np.int64)))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected 2 dimensions",
    ),
    BadCase(
        "wrong hidden size",
        lambda s: [s.request(hidden(2, width=HIDDEN // 2), start=2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        f"dimension 2 must be {HIDDEN}",
    ),
    BadCase(
        "integer hidden states",
        lambda s: [s.request(codec.encode(np.ones((1, 2, HIDDEN), np.int64)), start=2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "is not accepted",
    ),
    BadCase(
        "NaN in hidden states",
        lambda s: [s.request(hidden(2, fill=float("nan")), start=2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "NaN or infinity",
    ),
    BadCase(
        "bytes do not match the shape",
        lambda s: [s.request(common_pb2.Tensor(dtype="int64", shape=[1, 3], data=b"\x00" * 8))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "needs 24 bytes, got 8",
    ),
    BadCase(
        "token id past the vocabulary",
        lambda s: [s.request(ids([[1, VOCAB]]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        f"token id {VOCAB} is outside the vocabulary",
    ),
    BadCase(
        "negative token id",
        lambda s: [s.request(ids([[-3, 1]]))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "token id -3 is outside the vocabulary",
    ),
    BadCase(
        "batch too large",
        lambda s: [s.request(ids([[1]] * 9))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "batch 9 is larger",
    ),
    BadCase(
        "an empty tensor",
        lambda s: [s.request(common_pb2.Tensor(), start=0)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype '' is not accepted",
    ),
    BadCase(
        "no input",
        lambda s: [_without_input(s.request(ids([[1]]), start=0))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "carries no input",
    ),
    BadCase(
        "empty layer range",
        lambda s: [s.request(hidden(1), start=2, end=2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "is empty",
    ),
    BadCase(
        "longer than the session's budget",
        lambda s: [s.request(ids([[1] * 129]))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "budget of 128 tokens",
    ),
    BadCase(
        "huge request",
        lambda s: [s.request(ids([[1] * 40000]))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "exceed the limit",
    ),
    BadCase(
        "beyond the model's context",
        lambda s: [s.request(ids([[1] * 300]), capability=s.capability(max_tokens=1000))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "model's context of 256",
    ),
    BadCase(
        "start_pos skips positions",
        lambda s: [s.request(ids([PROMPT])), s.request(ids([[3]]), start_pos=len(PROMPT) + 2)],
        grpc.StatusCode.FAILED_PRECONDITION,
        f"cache holds {len(PROMPT)} tokens",
    ),
    BadCase(
        "start_pos without a cache",
        lambda s: [s.request(ids([[3]]), start_pos=4)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "start_pos must be 0",
    ),
    BadCase(
        "no capability",
        lambda s: [
            stage_pb2.ForwardRequest(
                session_id=s.session_id,
                model=MODEL,
                input=ids([[1]]),
                layers=common_pb2.LayerRange(start=0, end=NUM_LAYERS),
            )
        ],
        grpc.StatusCode.UNAUTHENTICATED,
        "must carry the session's capability",
    ),
    BadCase(
        "forged capability",
        lambda s: [s.request(ids([[1]]), capability=_other_key_capability(s))],
        grpc.StatusCode.UNAUTHENTICATED,
        "does not verify",
    ),
    BadCase(
        "garbage capability",
        lambda s: [
            s.request(
                ids([[1]]),
                capability=client_api_pb2.SignedCapability(claims=b"\xff" * 9, signature=b"x" * 64),
            )
        ],
        grpc.StatusCode.UNAUTHENTICATED,
        "does not verify",
    ),
    BadCase(
        "expired capability",
        lambda s: [s.request(ids([[1]]), capability=s.capability(ttl_s=-5))],
        grpc.StatusCode.UNAUTHENTICATED,
        "token expired at",
    ),
    BadCase(
        "node not granted",
        lambda s: [s.request(ids([[1]]), capability=s.capability(grants=[("n-other", 0, 4)]))],
        grpc.StatusCode.PERMISSION_DENIED,
        "not among the nodes",
    ),
    BadCase(
        "layers outside the grant",
        lambda s: [s.request(ids([[1]]), capability=s.capability(grants=[(s.node.node_id, 0, 2)]))],
        grpc.StatusCode.PERMISSION_DENIED,
        "outside what the capability grants",
    ),
    BadCase(
        "capability for another session",
        lambda s: [
            s.request(
                ids([[1]]),
                capability=s.keys.capability("someone-else", [(s.node.node_id, 0, NUM_LAYERS)]),
            )
        ],
        grpc.StatusCode.PERMISSION_DENIED,
        "is for session 'someone-else'",
    ),
    BadCase(
        "capability for another model",
        lambda s: [s.request(ids([[1]]), model="other-model")],
        grpc.StatusCode.PERMISSION_DENIED,
        "is for model",
    ),
    BadCase(
        "no shard for the model",
        lambda s: [
            s.request(ids([[1]]), model="other-model", capability=s.capability(model="other-model"))
        ],
        grpc.StatusCode.NOT_FOUND,
        "no READY shard of 'other-model'",
    ),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c.name for c in BAD_CASES])
async def test_bad_requests_get_the_right_status_and_others_keep_working(
    start_node, keys, checkpoint, case
) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    bystander = Session.open(node, keys, "s-bystander")
    prefill = await bystander.tokens(PROMPT, 0)

    bad = Session.open(node, keys, "s-bad")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        for request in case.build(bad):
            await bad.send(request)
    assert err.value.code() == case.code, err.value.details()
    assert case.message in err.value.details()
    await bad.close()

    # The open session continues as if nothing happened...
    token = int(np.argmax(logits_of(prefill)[0, -1]))
    step = await bystander.tokens([token], len(PROMPT))
    expected = reference_logits(checkpoint, [*PROMPT, token])[-1]
    np.testing.assert_allclose(logits_of(step)[0, -1], expected, rtol=1e-5, atol=1e-5)
    await bystander.close()
    # ...and the failed session itself can start over on a new stream.
    retry = Session.open(node, keys, "s-bad")
    response = await retry.tokens(PROMPT, 0)
    np.testing.assert_allclose(
        logits_of(response)[0], reference_logits(checkpoint, PROMPT), rtol=1e-5, atol=1e-5
    )
    await retry.close()


async def test_refuses_everything_until_registered(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    node.ctx.coordinator_public_key = b""
    session = Session.open(node, keys, "s-early")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await session.tokens(PROMPT, 0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not registered" in err.value.details()
    await session.close()
    node.ctx.coordinator_public_key = keys.public
    session = Session.open(node, keys, "s-early")
    assert (await session.tokens(PROMPT, 0)).cache_length == len(PROMPT)
    await session.close()


async def test_draining_node_finishes_open_sessions_but_takes_no_new_ones(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    running = Session.open(node, keys, "s-running")
    await running.tokens(PROMPT, 0)
    node.ctx.stop_accepting_work()
    assert (await running.tokens([3], len(PROMPT))).cache_length == len(PROMPT) + 1
    newcomer = Session.open(node, keys, "s-new")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await newcomer.tokens(PROMPT, 0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in err.value.details()
    await running.close()
    await newcomer.close()


async def test_kv_budget_is_shared_and_exhaustion_is_reported(start_node, keys) -> None:
    # Each session reserves its max_tokens (128); a 300-token budget fits two.
    node = await start_node([(0, NUM_LAYERS)], kv_tokens_budget=300)
    sessions = [Session.open(node, keys, f"s-budget-{i}") for i in range(3)]
    await sessions[0].tokens(PROMPT, 0)
    await sessions[1].tokens(PROMPT, 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sessions[2].tokens(PROMPT, 0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV cache tokens" in err.value.details()
    assert node.manager.sample().kv_tokens_used == 256
    for session in sessions:
        await session.close()


# ---- session lifetime ------------------------------------------------------------------------


async def end_session(node: StageNode, request: stage_pb2.EndSessionRequest) -> None:
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        await stage_pb2_grpc.StageStub(channel).EndSession(request)


async def test_end_session_frees_the_cache(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-end")
    await session.tokens(PROMPT, 0)
    assert node.manager.sample().kv_tokens_used == 128
    request = stage_pb2.EndSessionRequest(session_id="s-end", capability=session.capability())
    await end_session(node, request)
    telemetry = node.manager.sample()
    assert (telemetry.kv_tokens_used, telemetry.active_sessions) == (0, 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await end_session(node, request)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no cache for session 's-end'" in err.value.details()
    # Continuing after the end is a precondition failure that says to replay from 0.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await session.tokens([3], len(PROMPT))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await session.close()


async def test_end_session_waits_for_every_running_step_of_the_session(start_node, keys) -> None:
    """Steps of one session on two spans hold two locks; EndSession takes all of them, so
    it never frees a cache a compute thread is still writing."""
    node = await start_node([(0, 2), (2, NUM_LAYERS)])
    held = hold_forward(node, 2, NUM_LAYERS)
    entered, release = held.entered, held.release
    head, tail = Session.open(node, keys, "s-two"), Session.open(node, keys, "s-two")
    try:
        await head.send(head.request(ids([PROMPT]), end=2))
        check = tail.request(hidden(len(PROMPT)), start=2)
        check.background = True
        running = asyncio.create_task(tail.send(check))
        assert await asyncio.to_thread(entered.wait, 30)
        request = stage_pb2.EndSessionRequest(session_id="s-two", capability=head.capability())
        ending = asyncio.create_task(end_session(node, request))
        await asyncio.sleep(0.2)
        assert not ending.done()  # held up by the step still computing on [2, 4)
        release.set()
        assert (await running).cache_length == len(PROMPT)
        await asyncio.wait_for(ending, 10)
        assert node.manager.active_sessions() == 0
    finally:
        release.set()
        await head.close()
        await tail.close()


async def test_end_session_needs_the_sessions_own_capability(start_node, keys) -> None:
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-mine")
    await session.tokens(PROMPT, 0)
    forged = keys.capability("s-mine", [], key=identity.generate_private_key())
    other = keys.capability("s-other", [])
    for capability, code in (
        (forged, grpc.StatusCode.UNAUTHENTICATED),
        (other, grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await end_session(
                node, stage_pb2.EndSessionRequest(session_id="s-mine", capability=capability)
            )
        assert err.value.code() == code
    assert node.manager.active_sessions() == 1
    await session.close()


async def test_idle_sessions_expire_and_free_their_cache(start_node, keys) -> None:
    node = await start_node(
        [(0, NUM_LAYERS)], idle_ttl_s=0.3, limits=StageLimits(expiry_interval_s=0.05)
    )
    idle = Session.open(node, keys, "s-idle")
    await idle.tokens(PROMPT, 0)
    assert node.manager.active_sessions() == 1
    deadline = time.monotonic() + 10
    while node.manager.active_sessions() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert node.manager.active_sessions() == 0
    assert node.manager.sample().kv_tokens_used == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await idle.tokens([3], len(PROMPT))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired after idling" in err.value.details()
    await idle.close()


# ---- wire conversion of half precision (what a CUDA node sends and receives) ---------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_hidden_states_travel_in_the_compute_dtype_and_back(dtype) -> None:
    values = torch.randn(2, 3, HIDDEN).to(dtype)
    wire = _to_wire(values, logits=False)
    assert wire.dtype == {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(
        dtype, "float32"
    )
    assert len(wire.data) == values.numel() * values.element_size()
    back = _to_torch(codec.decode(wire), wire.dtype)
    assert back.dtype == dtype
    assert torch.equal(back, values)


def test_logits_always_travel_as_float32() -> None:
    logits = torch.randn(1, 2, VOCAB).to(torch.bfloat16)
    wire = _to_wire(logits, logits=True)
    assert wire.dtype == "float32"
    np.testing.assert_array_equal(codec.decode(wire), logits.float().numpy())
