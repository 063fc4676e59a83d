"""The training part of `tessera demo`: train from random weights, survive a kill -9, serve.

The task is counting in the character vocabulary: "klmnopqr" continues "stuv". A freshly
initialised model gets it right by chance (about 1 in 90); after a few dozen steps through
the three-stage pipeline it should be close to always right, which `tessera demo` measures
by generating through the swarm with the trained model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.api import Client
from client.datasets import TokenDataset
from client.demo_checkpoint import DemoShape, character_vocab, write_demo_checkpoint
from client.local_swarm import LocalSwarm

BASE = "demo-counter"
TRAINED = "demo-counter-trained"
SHAPE = DemoShape(layers=6, hidden=128, heads=4, kv_heads=2, intermediate=344, max_positions=256)
SEQ_LEN = 16
PROMPT_LEN = 8
ANSWER_LEN = 4


def layers_text(start: int, end: int) -> str:
    """A layer range [start, end) as the demo prints it: "layers 0-1", or "layer 5"."""
    return f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"


@dataclass(frozen=True)
class TrainingDemoResult:
    accuracy_before: float
    accuracy_after: float
    first_loss: float
    last_loss: float
    replans: int
    steps_redone: int
    seconds: float


def counting_dataset(examples: int = 600, seed: int = 0) -> TokenDataset:
    first, last = _char_ids()
    rng = np.random.default_rng(seed)
    starts = rng.integers(first, last - SEQ_LEN + 1, size=examples)
    rows = np.stack([np.arange(s, s + SEQ_LEN + 1) for s in starts]).astype(np.int32)
    return TokenDataset("counting", rows.reshape(-1), SEQ_LEN + 1)


def _char_ids() -> tuple[int, int]:
    """The id range of printable characters, consecutive in the demo's vocabulary."""
    vocab = character_vocab()
    return vocab[" "], vocab["~"]


def accuracy(client: Client, model: str, prompts: int = 24, seed: int = 1) -> tuple[float, str]:
    """Share of generated tokens that continue the count, and one example as text."""
    first, last = _char_ids()
    names = {i: c for c, i in character_vocab().items()}
    rng = np.random.default_rng(seed)
    correct = total = 0
    example = ""
    for start in rng.integers(first, last - PROMPT_LEN - ANSWER_LEN + 1, size=prompts):
        prompt = list(range(int(start), int(start) + PROMPT_LEN))
        result = client.generate_all(
            model, token_ids=prompt, max_new_tokens=ANSWER_LEN, stop_at_eos=False
        )
        want = list(range(prompt[-1] + 1, prompt[-1] + 1 + ANSWER_LEN))
        correct += sum(a == b for a, b in zip(result.token_ids, want, strict=False))
        total += ANSWER_LEN
        if not example:
            text = "".join(names.get(t, "?") for t in prompt)
            answer = "".join(names.get(t, "?") for t in result.token_ids)
            example = f"{text!r} -> {answer!r}"
    return correct / total, example


def run_training_demo(
    swarm: LocalSwarm,
    client: Client,
    workdir: Path,
    say: Callable[[str], None],
    *,
    steps: int = 40,
    kill_at: int = 25,
    wait_served: Callable[[Client, str], None],
) -> TrainingDemoResult:
    began = time.monotonic()
    checkpoint = write_demo_checkpoint(workdir / "counter-init", SHAPE, seed=11)
    swarm.add_model(checkpoint, BASE)
    say(
        f"   imported a randomly initialised model {BASE!r} ({SHAPE.layers} layers, "
        f"hidden {SHAPE.hidden})"
    )
    wait_served(client, BASE)
    before, example = accuracy(client, BASE)
    say(f"   before training: {before:.0%} of counting continuations right, e.g. {example}")

    data = counting_dataset()
    job = client.train(
        BASE,
        data,
        steps=steps,
        batch_size=16,
        seq_len=SEQ_LEN,
        lr=3e-3,
        micro_batches=4,
        checkpoint_every=10,
        output_model=TRAINED,
        seed=3,
    )
    say(f"   job {job.job_id}: {steps} steps of 16 sequences, 4 micro-batches in flight")
    first_loss = last_loss = 0.0
    killed = False
    replans = redone = 0
    for event in job.events(timeout_s=300):
        if event.kind == "step":
            last_loss = event.loss
            if event.step == 1:
                first_loss = event.loss
                stages = client.job(job.job_id).stages
                route = " -> ".join(
                    f"{_name(swarm, s.node_id)} [{layers_text(s.layers.start, s.layers.end)}]"
                    for s in stages
                )
                say(f"   stages: {route}")
            if event.step % 5 == 0 or event.step == 1:
                say(
                    f"   step {event.step:3d}  loss {event.loss:7.4f}  "
                    f"{event.tokens_per_s:6.0f} tokens/s"
                )
            if event.step == kill_at and not killed:
                killed = True
                victim_id = client.job(job.job_id).stages[1].node_id
                victim = swarm.node(victim_id)
                victim.kill9()
                say(f"   kill -9 {victim.name} (the middle stage) after step {kill_at}")
        elif event.kind == "checkpoint":
            say(
                f"   checkpoint at step {event.step}: every stage uploaded its weights and "
                "optimizer state"
            )
        elif event.kind == "replan":
            replans += 1
            redone += kill_at - event.step
            say(f"   the coordinator re-planned the stage: {_named(swarm, event.detail)}")
            say(f"   every stage rolled back to the last consistent checkpoint, step {event.step}")
    final = job.wait()
    say(
        f"   done: {final.step} steps, loss {first_loss:.3f} -> {last_loss:.3f}; trained weights "
        f"registered as model {TRAINED!r}"
    )
    wait_served(client, TRAINED)
    after, example = accuracy(client, TRAINED)
    say(f"   served by the swarm: {after:.0%} of counting continuations right, e.g. {example}")
    return TrainingDemoResult(
        before, after, first_loss, last_loss, replans, redone, time.monotonic() - began
    )


def _name(swarm: LocalSwarm, node_id: str) -> str:
    try:
        return swarm.node(node_id).name
    except KeyError:
        return node_id


def _named(swarm: LocalSwarm, text: str) -> str:
    for proc in swarm.processes:
        if proc.node_id:
            text = text.replace(proc.node_id, proc.name)
    return text
