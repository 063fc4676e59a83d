"""Signed training replies: every ForwardTrain / BackwardTrain answer is signed by its node
and checked by the TrainingDriver against the key the coordinator granted.

Real training stage servers on loopback (tests/training/training_harness.py) and, for the
coordinator's side, a real in-process coordinator whose job sessions carry the keys.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator, jc, start_jobs, tiny_model  # noqa: F401 - fixtures
from training.training_harness import (
    MODEL,
    SPLIT,
    counting_batch,
    hyper,
)
from verification.training_verification_harness import JOB, keyed_capability

from client.training_driver import StageFailed, StageOutOfSync, TrainingDriver
from node_agent import failpoints
from node_agent.training_server import TrainingStageServicer
from protos import identity, output_check
from protos.tessera.v1 import jobs_pb2

ROGUE_KEY = identity.generate_private_key()


class UnsignedServicer(TrainingStageServicer):
    """Answers correctly but strips the signature of its ForwardTrain replies while
    ``strip`` is set."""

    strip = True

    async def ForwardTrain(self, request, context):  # noqa: N802
        reply = await super().ForwardTrain(request, context)
        if self.strip:
            reply.signature = b""
        return reply


class ForeignKeyServicer(TrainingStageServicer):
    """Signs its BackwardTrain replies with a key the coordinator never granted."""

    async def BackwardTrain(self, request, context):  # noqa: N802
        reply = await super().BackwardTrain(request, context)
        reply.signature = ROGUE_KEY.sign(b"anything")
        return reply


class OtherInputServicer(TrainingStageServicer):
    """Claims, with a valid signature, to have computed on another input."""

    async def ForwardTrain(self, request, context):  # noqa: N802
        reply = await super().ForwardTrain(request, context)
        reply.input_digest = output_check.tensor_digest(None)
        payload = identity.training_loss_bytes(reply.loss, reply.label_tokens)
        if reply.HasField("output"):
            payload = reply.output.data
        job = self._jobs[request.job_id]
        signed = identity.training_payload(
            "forward", request.job_id, reply.step, reply.micro_batch, job.start, job.end,
            hashlib.sha256(payload).digest(), reply.input_digest,
        )  # fmt: skip
        reply.signature = self._ctx.private_key.sign(signed)
        return reply


class UnsignedNormServicer(TrainingStageServicer):
    """Strips the signature of its GradNorm replies."""

    async def GradNorm(self, request, context):  # noqa: N802
        reply = await super().GradNorm(request, context)
        reply.signature = b""
        return reply


class OtherClipServicer(TrainingStageServicer):
    """Applies half the clip coefficient it was sent (and signs what it applied)."""

    async def OptimizerStep(self, request, context):  # noqa: N802
        request.clip_coef /= 2
        return await super().OptimizerStep(request, context)


async def pipeline(start_train_node, keys, *, middle: dict | None = None, keyless: bool = False):
    nodes = [
        await start_train_node([span], **((middle or {}) if i == 1 else {}))
        for i, span in enumerate(SPLIT)
    ]
    grants = [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)]
    cap = keyed_capability(keys, grants, keyless=nodes[1].node_id if keyless else "")
    driver = TrainingDriver(
        job_id=JOB,
        model=MODEL,
        hops=[n.hop(s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)],
        capability=cap,
        hyper=hyper("lora"),
    )
    return driver, nodes


async def test_honest_replies_are_all_signed_and_verified(start_train_node, keys) -> None:
    driver, _ = await pipeline(start_train_node, keys)
    try:
        await driver.open()
        for step in range(2):
            await driver.train_step(step, *counting_batch(step))
    finally:
        await driver.close()
    # forward + backward, 3 stages, 2 micro-batches, 2 steps, and each stage's GradNorm
    # and OptimizerStep of each step: every reply checked.
    assert driver.signatures.keyed
    assert driver.signatures.checked == 2 * 3 * 2 * 2 + 2 * 3 * 2


@pytest.mark.parametrize(
    ("servicer", "words"),
    [
        (UnsignedServicer, "unsigned forward reply"),
        (ForeignKeyServicer, "backward reply whose signature does not verify"),
        (OtherInputServicer, "over another input"),
        (UnsignedNormServicer, "norm reply that is unsigned"),
        (OtherClipServicer, "step reply that is unsigned or whose signature does not verify"),
    ],
)
async def test_a_badly_signed_reply_is_a_failure_of_its_node(
    start_train_node, keys, servicer, words
) -> None:
    driver, nodes = await pipeline(start_train_node, keys, middle={"servicer_class": servicer})
    try:
        await driver.open()
        with pytest.raises(StageFailed, match=words) as info:
            await driver.train_step(0, *counting_batch(0))
    finally:
        await driver.close()
    # A node fault to re-plan, not a re-sync: the job runner moves the stage elsewhere.
    assert not isinstance(info.value, StageOutOfSync)
    assert info.value.index == 1 and info.value.node_id == nodes[1].node_id


async def test_a_node_the_capability_gives_no_key_is_a_failure(start_train_node, keys) -> None:
    driver, nodes = await pipeline(start_train_node, keys, keyless=True)
    try:
        await driver.open()
        with pytest.raises(StageFailed, match="no key for node") as info:
            await driver.train_step(0, *counting_batch(0))
    finally:
        await driver.close()
    assert info.value.node_id == nodes[1].node_id


async def test_after_a_bad_signature_the_replanned_job_matches_an_honest_run(
    start_train_node, keys, store
) -> None:
    """The unsigned node's stage moves to a spare, every stage restores the checkpoint,
    and the losses equal those of a run that never met the bad node."""
    store.stages[JOB] = set(SPLIT)
    honest_driver, _ = await pipeline(start_train_node, keys)
    try:
        await honest_driver.open()
        honest = [(await honest_driver.train_step(s, *counting_batch(s))).loss for s in range(4)]
    finally:
        await honest_driver.close()

    nodes = [
        await start_train_node([span], **({"servicer_class": UnsignedServicer} if i == 1 else {}))
        for i, span in enumerate(SPLIT)
    ]
    nodes[1].training.strip = False
    spare = await start_train_node([SPLIT[1]])
    grants = [(n, s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)] + [(spare, *SPLIT[1])]
    cap = keyed_capability(keys, grants)
    driver = TrainingDriver(
        job_id=JOB,
        model=MODEL,
        hops=[n.hop(s, e) for n, (s, e) in zip(nodes, SPLIT, strict=True)],
        capability=cap,
        hyper=hyper("lora"),
    )
    try:
        await driver.open()
        losses = [(await driver.train_step(s, *counting_batch(s))).loss for s in range(2)]
        digests = await driver.save_checkpoint(2)
        nodes[1].training.strip = True  # from now on the middle node sends unsigned replies
        with pytest.raises(StageFailed, match="unsigned") as info:
            await driver.train_step(2, *counting_batch(2))
        assert info.value.node_id == nodes[1].node_id
        driver.replace_hop(1, spare.hop(*SPLIT[1]), cap)
        assert await driver.open(restore_step=2, restore_sha256=digests) == 2
        losses += [(await driver.train_step(s, *counting_batch(s))).loss for s in (2, 3)]
    finally:
        await driver.close()
    assert losses == pytest.approx(honest, rel=1e-6)


async def test_a_forward_failpoint_tampers_before_signing(
    start_train_node, keys, monkeypatch
) -> None:
    """TESSERA_FAILPOINTS reaches ForwardTrain: the node signs the corrupted hidden states
    (or loss) it sends, so the signature verifies (a signed wrong output is evidence) and only
    redundant execution could tell; the losses visibly differ from an honest run's."""
    honest_driver, _ = await pipeline(start_train_node, keys)
    try:
        await honest_driver.open()
        honest = (await honest_driver.train_step(0, *counting_batch(0))).loss
    finally:
        await honest_driver.close()
    monkeypatch.setenv(failpoints.ENV_VAR, "corrupt=1.0,seed=3")
    driver, nodes = await pipeline(start_train_node, keys)
    try:
        await driver.open()
        tampered = (await driver.train_step(0, *counting_batch(0))).loss
    finally:
        await driver.close()
    first = nodes[0].training._failpoints
    assert first is not None and first.tampered == first.calls == 2  # both micro-batches
    last = nodes[2].training._failpoints
    assert last is not None and last.tampered == last.calls == 2  # it reports a wrong loss
    assert driver.signatures.checked == 3 * 2 * 2 + 3 * 2  # and GradNorm, OptimizerStep
    assert abs(tampered - honest) > 1e-3


async def test_the_coordinator_puts_node_keys_in_job_sessions(
    jc: JobsCoordinator,  # noqa: F811 - the fixture
) -> None:
    dataset = await jc.upload(np.arange(400, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id)
    session = await jc.stub.OpenTrainingSession(
        jobs_pb2.OpenTrainingSessionRequest(job_id=job.job_id)
    )
    claims = identity.open_capability(jc.coordinator.ctx.public_key, session.capability)
    assert claims is not None
    for grant, hop in zip(claims.grants, session.hops, strict=True):
        assert grant.public_key == jc.node(hop.node_id).public_key
        assert hop.public_key == grant.public_key
