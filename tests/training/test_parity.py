"""Training through 3 real stage servers equals training in one process.

Same model, data, seed and hyper-parameters: one StageTrainer over all layers in this
process, against TrainingDriver pipelining micro-batches (1F1B) through 3 grpc.aio stage
servers on loopback. Losses agree within 1e-4 relative over 20 fp32 steps, and the final
state (parameters and AdamW moments, read back from the checkpoints the stages upload)
matches, for full-parameter and LoRA training.

The checkpoint store is ``StandInTrainingStore`` (tests/training/training_harness.py), which
stands in for the coordinator's TrainingStore: it really stores, hashes and serves bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from training.training_harness import (
    SPLIT,
    LocalReference,
    counting_batch,
    hyper,
    training_capability,
)

from client.training_driver import TrainingDriver
from node_agent.runtime.training import state_from_bytes

STEPS = 20


async def three_stage_driver(start_node, keys, job_id: str, h) -> tuple[TrainingDriver, list]:
    nodes = [await start_node([span]) for span in SPLIT]
    grants = [(node, s, e) for node, (s, e) in zip(nodes, SPLIT, strict=True)]
    driver = TrainingDriver(
        job_id=job_id,
        model="tiny-train",
        hops=[node.hop(s, e) for node, (s, e) in zip(nodes, SPLIT, strict=True)],
        capability=training_capability(keys, job_id, grants),
        hyper=h,
    )
    return driver, nodes


@pytest.mark.parametrize("mode", ["full", "lora"])
async def test_three_stages_train_like_one_process(
    mode: str, checkpoint: Path, keys, store, start_node
) -> None:
    h = hyper(mode)
    job_id = f"parity-{mode}"
    store.stages[job_id] = set(SPLIT)
    driver, _ = await three_stage_driver(start_node, keys, job_id, h)
    reference = LocalReference(checkpoint, h)
    try:
        assert await driver.open() == 0
        swarm_losses, local_losses = [], []
        for step in range(STEPS):
            tokens, labels = counting_batch(step)
            result = await driver.train_step(step, tokens, labels)
            assert result.step == step
            assert result.tokens == int((labels != -100).sum())
            assert len(result.stage_ms) == 3 and all(ms > 0 for ms in result.stage_ms)
            swarm_losses.append(result.loss)
            local_losses.append(reference.step(tokens, labels))
        np.testing.assert_allclose(swarm_losses, local_losses, rtol=1e-4)
        # The model learned something, so the comparison compares something.
        assert np.mean(swarm_losses[-3:]) < np.mean(swarm_losses[:3]) - 0.05

        digests = await driver.save_checkpoint(STEPS)
    finally:
        await driver.close()
    assert set(digests) == set(SPLIT)
    assert store.consistent(job_id, STEPS)
    swarm_state: dict[str, torch.Tensor] = {}
    for start, end in SPLIT:
        stored = store.stored[(job_id, STEPS, start, end)]
        assert stored.sha256 == digests[(start, end)]
        tensors, _ = state_from_bytes(stored.data)
        assert not set(tensors) & set(swarm_state), "two stages hold the same tensor"
        swarm_state.update(tensors)
    local_state = reference.state()
    assert set(swarm_state) == set(local_state)
    if mode == "lora":
        assert all("lora_" in name for name in swarm_state)
    for name, expected in local_state.items():
        torch.testing.assert_close(swarm_state[name], expected, rtol=1e-4, atol=1e-6, msg=name)
