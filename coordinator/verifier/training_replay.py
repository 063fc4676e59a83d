"""The coordinator as a training client: it replays a dispute's log on an arbiter node.

The arbiter gets a fresh job id and a capability the coordinator signs for it, dressed
like any job's (the node's key and trust facts in its grant, the job's token budget), so
it cannot tell an arbitration from a job. It opens the stage from the checkpoint both
disputing nodes started from (downloaded from the coordinator's TrainingStore under a
loan: JobManager.lend_checkpoint) or from the model's weights at step 0, then runs the
logged calls in order over the TrainingStage data plane. Its answer to the last call
comes back with its signature over it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.verifier.stage_runner import OPTIONS
from protos import identity
from protos.tessera.v1 import (
    client_api_pb2,
    common_pb2,
    training_pb2,
    training_pb2_grpc,
    verification_pb2,
)

KIND = verification_pb2.TrainingCall.Kind
TOKEN_TTL_S = 3600.0


class TrainingReplayer:
    def __init__(
        self,
        signing_key: Ed25519PrivateKey,
        describe: Callable[[client_api_pb2.Hop], None] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self._key = signing_key
        self._describe = describe
        self._timeout_s = timeout_s

    def new_job_id(self) -> str:
        return "j" + secrets.token_hex(8)  # shaped like a job's id

    async def replay(
        self,
        job_id: str,
        node_id: str,
        address: str,
        model: str,
        hyper: training_pb2.TrainingHyper,
        max_tokens: int,
        dispute: verification_pb2.TrainingDispute,
    ) -> Any:
        """Run the dispute's calls on the node under ``job_id``; its reply to the last."""
        layers = dispute.layers
        capability = self._capability(job_id, model, node_id, layers, max_tokens)
        async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
            stub = training_pb2_grpc.TrainingStageStub(channel)
            opened = await stub.OpenTraining(
                training_pb2.OpenTrainingRequest(
                    capability=capability,
                    job_id=job_id,
                    model=model,
                    layers=layers,
                    hyper=hyper,
                    restore_step=dispute.restore_step,
                    restore_sha256=dispute.restore_sha256,
                ),  # fmt: skip
                timeout=self._timeout_s,
            )
            if opened.step != dispute.restore_step:
                raise ConnectionError(f"node {node_id} opened at step {opened.step}")
            try:
                reply = None
                for call in dispute.calls:
                    reply = await self._run(stub, capability, job_id, call)
                return reply
            finally:
                try:
                    await stub.CloseTraining(
                        training_pb2.CloseTrainingRequest(capability=capability, job_id=job_id),
                        timeout=5.0,
                    )
                except grpc.aio.AioRpcError:
                    pass  # the node drops idle jobs on its own

    async def _run(
        self,
        stub: training_pb2_grpc.TrainingStageStub,
        capability: client_api_pb2.SignedCapability,
        job_id: str,
        call: verification_pb2.TrainingCall,
    ) -> Any:
        timeout = self._timeout_s
        if call.kind == KIND.FORWARD:
            forward = training_pb2.TrainForwardRequest(
                capability=capability, job_id=job_id, step=call.step,
                micro_batch=call.micro_batch, input=call.input,
            )  # fmt: skip
            if call.HasField("labels"):
                forward.labels.CopyFrom(call.labels)
            return await stub.ForwardTrain(forward, timeout=timeout)
        if call.kind == KIND.BACKWARD:
            backward = training_pb2.TrainBackwardRequest(
                capability=capability, job_id=job_id, step=call.step, micro_batch=call.micro_batch
            )
            if call.HasField("input"):
                backward.grad_output.CopyFrom(call.input)
            return await stub.BackwardTrain(backward, timeout=timeout)
        if call.kind == KIND.NORM:
            norm = training_pb2.GradNormRequest(
                capability=capability, job_id=job_id, step=call.step
            )
            return await stub.GradNorm(norm, timeout=timeout)
        step = training_pb2.OptimizerStepRequest(
            capability=capability, job_id=job_id, step=call.step, clip_coef=call.clip_coef
        )
        return await stub.OptimizerStep(step, timeout=timeout)

    def _capability(
        self,
        job_id: str,
        model: str,
        node_id: str,
        layers: common_pb2.LayerRange,
        max_tokens: int,
    ) -> client_api_pb2.SignedCapability:
        now = int(time.time() * 1000)
        hop = client_api_pb2.Hop(node_id=node_id, layers=layers)
        if self._describe is not None:
            self._describe(hop)
        claims = client_api_pb2.CapabilityClaims(
            session_id=job_id,
            model=model,
            grants=[hop],
            issued_unix_ms=now,
            expires_unix_ms=now + int(TOKEN_TTL_S * 1000),
            max_tokens=max_tokens,
        )
        return identity.sign_capability(self._key, claims)
