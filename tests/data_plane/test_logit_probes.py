"""ForwardRequest.probes: the last hop's logits at chosen positions, for audits.

A checker catching up on the model's last layers answers, besides the last position's row,
a probe per earlier position: its highest logits, its logits at the ids the client names
and the row's log-sum-exp (protos/logit_probes.py). Real stage servers on loopback; the
reference is the whole model's logits computed in this process.
"""

from __future__ import annotations

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
    reference_logits,
)
from data_plane.test_last_position_only import forward, token_tensor

from node_agent.stage_server import StageLimits
from protos import codec, logit_probes
from protos.tessera.v1 import common_pb2, stage_pb2, stage_pb2_grpc

PROMPT = [1, 5, 9, 13, 20, 7, 2, 11]


def probe(position: int, ids: list[int]) -> stage_pb2.LogitProbe:
    return stage_pb2.LogitProbe(position=position, token_ids=ids)


async def ask(
    node: StageNode,
    keys: CoordinatorKeys,
    session_id: str,
    request: stage_pb2.ForwardRequest,
) -> stage_pb2.ForwardResponse:
    """One call on a fresh stream; raises the node's error."""
    request.capability.CopyFrom(keys.capability(session_id, [(node.node_id, 0, NUM_LAYERS)]))
    request.session_id = session_id
    request.model = MODEL
    request.step = 1
    async with grpc.aio.insecure_channel(node.address, options=OPTIONS) as channel:
        call = stage_pb2_grpc.StageStub(channel).Forward()
        await call.write(request)
        response = await call.read()
        call.cancel()
    return response


def last_hop_call(ids: list[int], *probes: stage_pb2.LogitProbe) -> stage_pb2.ForwardRequest:
    return stage_pb2.ForwardRequest(
        layers=common_pb2.LayerRange(start=0, end=NUM_LAYERS),
        input=token_tensor(ids),
        last_position_only=True,
        probes=list(probes),
    )


async def test_probe_answers_are_the_logits_at_the_probed_positions(start_node, keys, checkpoint):
    node = await start_node([(0, NUM_LAYERS)])
    reference = reference_logits(checkpoint, PROMPT)
    asked = [probe(0, [3, 4]), probe(2, []), probe(5, [VOCAB - 1, 0, 7])]
    response = await ask(node, keys, "s-probe", last_hop_call(PROMPT, *asked))
    # The signed answer is still the last position's row, as without probes.
    row = codec.decode(response.output)
    assert row.shape == (1, 1, VOCAB)
    np.testing.assert_allclose(row[0, 0], reference[-1], rtol=1e-5, atol=1e-5)
    assert response.cache_length == len(PROMPT)
    assert [a.position for a in response.probe_answers] == [0, 2, 5]
    for asked_probe, answer in zip(asked, response.probe_answers, strict=True):
        truth = reference[asked_probe.position]
        assert list(answer.top_ids) == logit_probes.highest(truth)
        np.testing.assert_allclose(answer.top_logits, truth[list(answer.top_ids)], atol=1e-5)
        np.testing.assert_allclose(
            answer.probed_logits, truth[list(asked_probe.token_ids)], atol=1e-5
        )
        assert answer.logsumexp == pytest.approx(logit_probes.logsumexp(truth), abs=1e-4)
        # What the client computes from the primary's own row agrees.
        assert logit_probes.probe_error(truth, asked_probe, answer) < 1e-5


async def test_a_probe_at_the_last_position_answers_from_the_row_itself(
    start_node, keys, checkpoint
):
    node = await start_node([(0, NUM_LAYERS)])
    last = len(PROMPT) - 1
    response = await ask(node, keys, "s-last", last_hop_call(PROMPT, probe(last, [1])))
    truth = reference_logits(checkpoint, PROMPT)[last]
    [answer] = response.probe_answers
    assert answer.position == last
    assert list(answer.top_ids) == logit_probes.highest(truth)
    assert logit_probes.probe_error(truth, probe(last, [1]), answer) < 1e-5


async def test_probes_on_the_first_hop_of_two_are_answered_by_the_last(
    start_node, keys, checkpoint
):
    first = await start_node([(0, 2)])
    last = await start_node([(2, NUM_LAYERS)])
    [hidden] = await forward(first, keys, "s-two", [(0, 2, token_tensor(PROMPT), 0, False)])
    assert hidden.output.shape == [1, len(PROMPT), HIDDEN]
    capability = keys.capability("s-two", [(last.node_id, 2, NUM_LAYERS)])
    request = stage_pb2.ForwardRequest(
        capability=capability,
        session_id="s-two",
        step=2,
        model=MODEL,
        layers=common_pb2.LayerRange(start=2, end=NUM_LAYERS),
        input=hidden.output,
        last_position_only=True,
        probes=[probe(1, [2])],
    )
    async with grpc.aio.insecure_channel(last.address, options=OPTIONS) as channel:
        call = stage_pb2_grpc.StageStub(channel).Forward()
        await call.write(request)
        response = await call.read()
        call.cancel()
    truth = reference_logits(checkpoint, PROMPT)[1]
    [answer] = response.probe_answers
    assert logit_probes.probe_error(truth, probe(1, [2]), answer) < 1e-5


BAD_PROBES = {
    "not the last layer": (
        dict(end=2, last_position_only=False),
        "probes read logits: set them only on a call of batch 1 whose layers end at the "
        "model's last layer (4)",
    ),
    "without last_position_only": (dict(last_position_only=False), "last_position_only=False"),
    "batch of 2": (dict(batch=2), "batch 2"),
    "position past the input": (
        dict(probes=[probe(len(PROMPT), [])]),
        f"probe positions must increase strictly within the input's {len(PROMPT)} position(s)",
    ),
    "positions repeat": (
        dict(probes=[probe(1, []), probe(1, [])]),
        "got 1 after 1",
    ),
    "positions go back": (dict(probes=[probe(3, []), probe(2, [])]), "got 2 after 3"),
    "too many ids": (
        dict(probes=[probe(0, [1] * (logit_probes.MAX_PROBE_IDS + 1))]),
        f"at most {logit_probes.MAX_PROBE_IDS}",
    ),
    "id outside the vocabulary": (
        dict(probes=[probe(0, [VOCAB])]),
        f"probed token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
    ),
    "huge id": (
        dict(probes=[probe(0, [2**32 - 1])]),
        "is outside the vocabulary",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PROBES), ids=list(BAD_PROBES))
async def test_bad_probes_are_refused_and_the_node_keeps_serving(
    start_node, keys, checkpoint, case
):
    node = await start_node([(0, 2), (0, NUM_LAYERS)])
    changes, message = BAD_PROBES[case]
    end = changes.get("end", NUM_LAYERS)
    batch = changes.get("batch", 1)
    request = stage_pb2.ForwardRequest(
        layers=common_pb2.LayerRange(start=0, end=end),
        input=codec.encode(np.array([PROMPT] * batch, dtype=np.int64)),
        last_position_only=changes.get("last_position_only", True),
        probes=changes.get("probes", [probe(0, [1])]),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ask(node, keys, f"s-bad-{len(case)}", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # Refused before anything ran: the same session then starts at position 0 as if new.
    response = await ask(node, keys, f"s-bad-{len(case)}", last_hop_call(PROMPT, probe(0, [])))
    assert response.cache_length == len(PROMPT)
    truth = reference_logits(checkpoint, PROMPT)[0]
    assert logit_probes.probe_error(truth, probe(0, []), response.probe_answers[0]) < 1e-5


async def test_more_probes_than_rows_of_logits_fit_are_refused(start_node, keys, checkpoint):
    # Room for 3 rows of logits in one answer: 3 probes are read, 4 are not.
    limits = StageLimits(max_output_bytes=3 * VOCAB * 4)
    node = await start_node([(0, NUM_LAYERS)], limits=limits)
    four = [probe(p, []) for p in range(4)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ask(node, keys, "s-many", last_hop_call(PROMPT[:4], *four))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 probes in one call" in err.value.details()
    assert "at most 3 rows of logits per call" in err.value.details()
    response = await ask(node, keys, "s-many", last_hop_call(PROMPT[:4], *four[:3]))
    reference = reference_logits(checkpoint, PROMPT[:4])
    for asked, answer in zip(four, response.probe_answers, strict=False):
        assert logit_probes.probe_error(reference[asked.position], asked, answer) < 1e-5
