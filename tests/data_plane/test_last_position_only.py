"""ForwardRequest.last_position_only: the last hop answers one position, not every one.

A prefill's logits for every prompt position are vocab x 4 bytes per token that sampling
never reads. The driver asks the hop ending at the last layer for the last position only
whenever its caller wants only that (``step(..., last_only=True)``), also while it
replays a replacement after a fail-over.
"""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
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
    session_grant,
)

from client.driver import DriverConfig, PipelineDriver
from node_agent.stage_server import StageServicer
from protos import codec, identity, output_check
from protos.tessera.v1 import common_pb2, stage_pb2, stage_pb2_grpc

PROMPT = [1, 5, 9, 13, 20, 7]


class RecordingServicer(StageServicer):
    """Remembers (layers, tokens, last_position_only) of every request it answers."""

    async def _forward_one(self, request, stream):
        seen = getattr(self, "seen", [])
        self.seen = seen
        seen.append(
            (
                request.layers.start,
                request.layers.end,
                request.input.shape[1],
                request.last_position_only,
            )
        )
        return await super()._forward_one(request, stream)


class OldServicer(StageServicer):
    """A node from before last_position_only: it never reads the field."""

    async def _forward_one(self, request, stream):
        request.last_position_only = False
        return await super()._forward_one(request, stream)


async def forward(
    node: StageNode,
    keys: CoordinatorKeys,
    session_id: str,
    requests: list[tuple[int, int, common_pb2.Tensor, int, bool]],
) -> list[stage_pb2.ForwardResponse]:
    """Send (start, end, input, start_pos, last_position_only) requests on one stream."""
    capability = keys.capability(session_id, [(node.node_id, 0, NUM_LAYERS)])
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        call = stage_pb2_grpc.StageStub(channel).Forward()
        responses = []
        for step, (start, end, tensor, start_pos, last_only) in enumerate(requests, 1):
            request = stage_pb2.ForwardRequest(
                session_id=session_id,
                step=step,
                model=MODEL,
                layers=common_pb2.LayerRange(start=start, end=end),
                start_pos=start_pos,
                input=tensor,
                last_position_only=last_only,
            )
            if step == 1:
                request.capability.CopyFrom(capability)
            await call.write(request)
            responses.append(await call.read())
        call.cancel()
        return responses


def token_tensor(ids: list[int]) -> common_pb2.Tensor:
    return codec.encode(np.array([ids], dtype=np.int64))


# ---- the stage server ----------------------------------------------------------------------


async def test_the_last_stage_answers_the_last_position_signed(start_node, keys, checkpoint):
    node = await start_node([(0, NUM_LAYERS)])
    prefill, decode = await forward(
        node,
        keys,
        "s-last",
        [
            (0, NUM_LAYERS, token_tensor(PROMPT[:-1]), 0, True),
            (0, NUM_LAYERS, token_tensor(PROMPT[-1:]), len(PROMPT) - 1, True),
        ],
    )
    reference = reference_logits(checkpoint, PROMPT)
    for response, position in ((prefill, len(PROMPT) - 2), (decode, len(PROMPT) - 1)):
        logits = codec.decode(response.output, allowed=frozenset({"float32"}))
        assert logits.shape == (1, 1, VOCAB)
        np.testing.assert_allclose(logits[0, 0], reference[position], rtol=1e-5, atol=1e-5)
        digest = hashlib.sha256(response.output.data).digest()
        prefix = output_check.prefix_digest(
            [(np.array([PROMPT[: position + 1]], dtype=np.int64), "int64")]
        )
        payload = identity.output_payload(
            "s-last", response.step, 0, NUM_LAYERS, digest, input_digest=prefix
        )
        assert identity.verify(node.public_key, response.signature, payload)
    # The cache still holds every position, not just the one answered.
    assert (prefill.cache_length, decode.cache_length) == (len(PROMPT) - 1, len(PROMPT))


async def test_last_position_only_before_the_last_layer_is_refused(start_node, keys):
    node = await start_node([(0, 2)])
    capability = keys.capability("s-mid", [(node.node_id, 0, 2)])
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        call = stage_pb2_grpc.StageStub(channel).Forward()
        await call.write(
            stage_pb2.ForwardRequest(
                capability=capability,
                session_id="s-mid",
                step=1,
                model=MODEL,
                layers=common_pb2.LayerRange(start=0, end=2),
                input=token_tensor(PROMPT),
                last_position_only=True,
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "last_position_only" in err.value.details()
    assert "end before the model's last layer (4)" in err.value.details()
    # The node keeps serving: the same request without the flag is answered.
    [response] = await forward(node, keys, "s-mid-2", [(0, 2, token_tensor(PROMPT), 0, False)])
    assert response.output.shape == [1, len(PROMPT), HIDDEN]


# ---- the driver ----------------------------------------------------------------------------


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "hop-by-hop"])
async def test_the_driver_asks_only_the_last_hop_and_only_when_told(
    start_node, keys, checkpoint, push
):
    a = await start_node([(0, 2)], servicer_class=RecordingServicer)
    b = await start_node([(2, 4)], servicer_class=RecordingServicer)
    grant = session_grant(keys, [(0, 2, a, []), (2, 4, b, [])])
    driver = PipelineDriver(grant, MODEL, config=DriverConfig(push=push))
    reference = reference_logits(checkpoint, [*PROMPT, 3])
    last = await driver.step(PROMPT, last_only=True)
    np.testing.assert_allclose(last[0], reference[len(PROMPT) - 1], rtol=1e-5, atol=1e-5)
    every = await driver.step([3])
    assert every.shape == (1, 1, VOCAB)
    np.testing.assert_allclose(every[0, 0], reference[-1], rtol=1e-5, atol=1e-5)
    # A pushed step carries the flag through the first hop, which passes it on to the
    # last (the node refuses it unless relay_to ends at the last layer).
    assert a.servicer.seen == [(0, 2, len(PROMPT), push), (0, 2, 1, False)]
    assert b.servicer.seen == [(2, 4, len(PROMPT), True), (2, 4, 1, False)]
    assert driver.pushed_steps == (2 if push else 0)
    await driver.close()


async def test_prefill_chunks_are_sized_by_the_hidden_state_when_logits_stay_home(
    start_node, keys, checkpoint
):
    a = await start_node([(0, NUM_LAYERS)], servicer_class=RecordingServicer)
    # Room for 3 tokens of hidden states per message but only 1 token of logits.
    config = DriverConfig(message_budget_bytes=HIDDEN * 4 * 3 + 1)
    assert VOCAB * 4 > config.message_budget_bytes // 2
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, a, [])]), MODEL, config=config)
    logits = await driver.step(PROMPT, last_only=True)
    np.testing.assert_allclose(
        logits[0], reference_logits(checkpoint, PROMPT)[-1], rtol=1e-5, atol=1e-5
    )
    assert [tokens for _, _, tokens, _ in a.servicer.seen] == [3, 3]
    await driver.close()


async def test_a_last_hop_replayed_after_a_failure_still_answers_one_position(
    start_node, keys, checkpoint
):
    a = await start_node([(0, 2)])
    b = await start_node([(2, 4)])
    spare = await start_node([(2, 4)], servicer_class=RecordingServicer)
    driver = PipelineDriver(session_grant(keys, [(0, 2, a, []), (2, 4, b, [spare])]), MODEL)
    logits = await driver.step(PROMPT, last_only=True)
    tokens = [int(np.argmax(logits[0]))]
    for _ in range(5):
        if len(tokens) == 3:
            await b.server.stop(0)
        logits = await driver.step(tokens[-1:], last_only=True)
        tokens.append(int(np.argmax(logits[0])))
    assert tokens == reference_greedy(checkpoint, PROMPT, 6)
    [event] = driver.failovers
    assert (event.failed_node_id, event.replacement_node_ids) == (b.node_id, (spare.node_id,))
    # The replay rebuilt the whole cache but shipped only the last position's logits.
    assert spare.servicer.seen[0] == (2, 4, len(PROMPT) + 3, True)
    await driver.close()


async def test_a_node_that_ignores_the_field_is_still_understood(start_node, keys, checkpoint):
    old = await start_node([(0, NUM_LAYERS)], servicer_class=OldServicer)
    driver = PipelineDriver(session_grant(keys, [(0, NUM_LAYERS, old, [])]), MODEL)
    logits = await driver.step(PROMPT, last_only=True)
    np.testing.assert_allclose(
        logits[0], reference_logits(checkpoint, PROMPT)[-1], rtol=1e-5, atol=1e-5
    )
    assert driver.failovers == []
    await driver.close()
