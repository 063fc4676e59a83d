"""Stage-side training engine: pipeline parity, learning, refusals, checkpoints, recompute."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.checkpoints import make_checkpoint

from node_agent.runtime import StageModel, load_model_config, load_stage_model
from node_agent.runtime.training import (
    NonFiniteGradientError,
    StageTrainer,
    StaleVersionError,
    TrainingInputError,
    UnknownMicroBatchError,
    clip_scale,
    state_from_bytes,
    state_to_bytes,
    training_memory,
)

NUM_LAYERS = 4
VOCAB = 64
SPLIT = [(0, 1), (1, 3), (3, 4)]
WHOLE = [(0, NUM_LAYERS)]
MICRO_BATCHES = 2
MICRO_BATCH_SIZE = 2
SEQ_LEN = 12
MAX_NORM = 0.5
HYPER = {"lr": 3e-3, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "seed": 7}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # These matrices are tiny: extra threads only add sync overhead, worst on a busy box.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("train") / "tiny",
        "llama",
        num_layers=NUM_LAYERS,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        seed=3,
    )


@pytest.fixture(scope="module")
def learnable_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like a pretrained model, embedding and head span O(1) logits, so frozen-base LoRA
    can fit the task too (with make_checkpoint's 0.02 init the logits barely move)."""
    gen = np.random.default_rng(5)
    wide = {
        name: ("F32", (0.5 * gen.standard_normal((VOCAB, 32))).astype("<f4"))
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    return make_checkpoint(
        tmp_path_factory.mktemp("learn") / "tiny",
        "llama",
        num_layers=NUM_LAYERS,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        seed=4,
        extra_tensors=wide,
    )


def make_trainers(
    model_dir: Path, bounds: list[tuple[int, int]], mode: str, **options: object
) -> list[StageTrainer]:
    kwargs = {**HYPER, "num_micro_batches": MICRO_BATCHES, "lora_rank": 4, "lora_alpha": 8.0}
    kwargs.update(options)
    return [
        StageTrainer(load_stage_model(model_dir, start, end), mode, **kwargs)
        for start, end in bounds
    ]


def counting_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches of the 'continue the count' task: next token = token + 1 (mod vocab)."""
    gen = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH_SIZE, 1), generator=gen)
    tokens = (starts + torch.arange(SEQ_LEN)) % VOCAB
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return list(zip(tokens.split(MICRO_BATCH_SIZE), labels.split(MICRO_BATCH_SIZE), strict=True))


def pipeline_step(
    trainers: list[StageTrainer], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, float]:
    """One optimizer step through the chained stages; returns (mean loss, clip scale)."""
    losses = []
    for mb, (tokens, labels) in enumerate(batches):
        x = tokens
        for trainer in trainers[:-1]:
            x = trainer.forward(mb, x)
        losses.append(float(trainers[-1].forward(mb, x, labels)))
    for mb in reversed(range(len(batches))):
        grad = None
        for trainer in reversed(trainers):
            grad = trainer.backward(mb, grad)
        assert grad is None  # the first stage's input is token ids
    scale = clip_scale(sum(t.grad_sq_norm() for t in trainers), MAX_NORM)
    versions = {t.step(scale, t.version) for t in trainers}
    assert len(versions) == 1
    return sum(losses) / len(losses), scale


def train(trainers: list[StageTrainer], steps: range) -> tuple[list[float], list[float]]:
    results = [pipeline_step(trainers, counting_batches(step)) for step in steps]
    return [loss for loss, _ in results], [scale for _, scale in results]


def all_weights(trainers: list[StageTrainer]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for trainer in trainers:
        merged.update(trainer.trained_weights())
        merged.update({k: v.detach() for k, v in trainer.trainable_parameters().items()})
    return merged


def assert_losses_match(actual: list[float], expected: list[float], rel: float) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - e) <= rel * abs(e), f"step {step}: loss {a} vs {e}"


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_three_stages_train_like_one(model_dir: Path, mode: str) -> None:
    single = make_trainers(model_dir, WHOLE, mode)
    split = make_trainers(model_dir, SPLIT, mode)
    single_losses, scales = train(single, range(20))
    split_losses, _ = train(split, range(20))

    assert any(s < 1.0 for s in scales), "clipping never engaged; the test would miss it"
    assert_losses_match(split_losses, single_losses, rel=1e-4)
    expected, actual = all_weights(single), all_weights(split)
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert single_losses[-1] < single_losses[0]


def test_single_stage_matches_plain_torch_loop(model_dir: Path) -> None:
    """The engine's AdamW, loss scaling and global clipping equal a textbook torch loop."""
    [trainer] = make_trainers(model_dir, WHOLE, "full")
    model = load_stage_model(model_dir, 0, NUM_LAYERS)
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": HYPER["weight_decay"]},
         {"params": plain, "weight_decay": 0.0}],
        lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], foreach=False,
    )  # fmt: skip
    expected = []
    for step in range(8):
        batches = counting_batches(step)
        losses = []
        for tokens, labels in reversed(batches):
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            (loss / MICRO_BATCHES).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(sum(losses) / len(losses))
    actual, _ = train([trainer], range(8))
    assert_losses_match(actual, expected, rel=1e-5)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(trainer.trained_weights()[name], tensor, msg=name)


def test_micro_batch_grads_sum_to_one_big_batch(model_dir: Path) -> None:
    trainers = make_trainers(model_dir, SPLIT, "full")
    batches = counting_batches(0)
    for mb, (tokens, labels) in enumerate(batches):
        x = tokens
        for trainer in trainers[:-1]:
            x = trainer.forward(mb, x)
        trainers[-1].forward(mb, x, labels)
        grad = None
        for trainer in reversed(trainers):
            grad = trainer.backward(mb, grad)

    model = load_stage_model(model_dir, 0, NUM_LAYERS)
    tokens = torch.cat([t for t, _ in batches])
    labels = torch.cat([lab for _, lab in batches])
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad for t in trainers for n, p in t.trainable_parameters().items()}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    total = sum(t.grad_sq_norm() for t in trainers)
    expected = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    assert total == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_loss_falls_on_counting_task(learnable_model_dir: Path, mode: str) -> None:
    trainers = make_trainers(learnable_model_dir, SPLIT, mode, lr=2e-2)
    losses, _ = train(trainers, range(25))
    assert losses[0] > 0.5 * math.log(VOCAB)  # starts far from the answer
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses


def test_refuses_bad_backward_and_stale_step(model_dir: Path) -> None:
    first, middle, last = make_trainers(model_dir, SPLIT, "full")
    tokens, labels = counting_batches(0)[0]
    hidden = middle.forward(0, first.forward(0, tokens))
    last.forward(0, hidden, labels)

    with pytest.raises(UnknownMicroBatchError, match="unknown micro-batch 5"):
        middle.backward(5, torch.zeros_like(hidden))
    with pytest.raises(TrainingInputError, match=r"grad_output is .* \[2, 12, 16\]"):
        middle.backward(0, torch.zeros(2, 12, 16))
    with pytest.raises(TrainingInputError, match="float64"):
        middle.backward(0, torch.zeros_like(hidden, dtype=torch.float64))
    with pytest.raises(TrainingInputError, match="send no grad_output"):
        last.backward(0, torch.zeros(()))
    with pytest.raises(TrainingInputError, match="already has a forward pending"):
        middle.forward(0, hidden)
    with pytest.raises(TrainingInputError, match="only the last stage takes labels"):
        middle.forward(1, hidden, labels)
    with pytest.raises(TrainingInputError, match=r"token ids in \[0, 64\)"):
        last.forward(1, hidden, labels + 100)

    grad = last.backward(0)
    assert grad is not None and grad.shape == hidden.shape

    # NaN from the wire: refused before autograd, nothing accumulated, still retryable.
    poisoned = grad.clone()
    poisoned[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="not applied"):
        middle.backward(0, poisoned)
    assert middle.grad_sq_norm() == 0.0 and middle.pending == [0]

    # A finite gradient that overflows inside the stage: refused, earlier grads untouched.
    middle.backward(0, grad)
    before = {n: p.grad.clone() for n, p in middle.trainable_parameters().items()}
    middle.forward(1, first.forward(1, tokens))
    with pytest.raises(NonFiniteGradientError, match="not applied"):
        middle.backward(1, torch.full_like(hidden, 3e38))
    for name, param in middle.trainable_parameters().items():
        assert torch.equal(param.grad, before[name]), name

    first.discard()
    with pytest.raises(StaleVersionError, match="stale version 3"):
        middle.step(1.0, 3)
    assert middle.step(1.0, 0) == 1
    with pytest.raises(StaleVersionError, match="stale version 0"):
        middle.step(1.0, 0)
    with pytest.raises(TrainingInputError, match="clip_scale must be finite"):
        middle.step(float("nan"), 1)
    middle.forward(2, hidden)
    with pytest.raises(TrainingInputError, match="still await backward"):
        middle.step(1.0, 1)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_checkpoint_resumes_to_identical_losses(model_dir: Path, mode: str) -> None:
    trainers = make_trainers(model_dir, SPLIT, mode)
    train(trainers, range(3))
    saved = [state_to_bytes(*t.state_dict()) for t in trainers]
    expected, _ = train(trainers, range(3, 8))

    resumed = make_trainers(model_dir, SPLIT, mode)
    for trainer, blob in zip(resumed, saved, strict=True):
        trainer.load_state_dict(*state_from_bytes(blob))
    assert [t.version for t in resumed] == [3, 3, 3]
    actual, _ = train(resumed, range(3, 8))
    assert actual == expected
    for name, tensor in all_weights(trainers).items():
        assert torch.equal(all_weights(resumed)[name], tensor), name


def test_checkpoint_for_another_stage_is_refused(model_dir: Path) -> None:
    first, middle, _ = make_trainers(model_dir, SPLIT, "full")
    tensors, metadata = first.state_dict()
    with pytest.raises(TrainingInputError, match="another stage"):
        middle.load_state_dict(tensors, metadata)
    with pytest.raises(TrainingInputError, match="not valid safetensors|too short|longer"):
        state_from_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    _, lora_meta = make_trainers(model_dir, [(0, 1)], "lora")[0].state_dict()
    with pytest.raises(TrainingInputError, match="'mode': 'lora'"):
        first.load_state_dict(tensors, lora_meta)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_recompute_gives_the_same_gradients(model_dir: Path, mode: str) -> None:
    kept = make_trainers(model_dir, SPLIT, mode)
    recomputed = make_trainers(model_dir, SPLIT, mode, recompute=True)
    batches = counting_batches(0)
    for trainers in (kept, recomputed):
        for mb, (tokens, labels) in enumerate(batches):
            x = tokens
            for trainer in trainers[:-1]:
                x = trainer.forward(mb, x)
            trainers[-1].forward(mb, x, labels)
        for mb in range(len(batches)):
            grad = None
            for trainer in reversed(trainers):
                grad = trainer.backward(mb, grad)
    for a, b in zip(kept, recomputed, strict=True):
        for name, param in a.trainable_parameters().items():
            torch.testing.assert_close(
                b.trainable_parameters()[name].grad, param.grad, rtol=0, atol=1e-7, msg=name
            )


def test_lora_export_serves_the_trained_model(model_dir: Path) -> None:
    trainers = make_trainers(model_dir, WHOLE, "lora", lr=2e-2)
    train(trainers, range(5))
    [trainer] = trainers
    tokens, _ = counting_batches(99)[0]
    with torch.no_grad():
        with_adapters = trainer.stage(tokens)
        config = load_model_config(model_dir)
        merged = StageModel(config, 0, NUM_LAYERS, True, True, trainer.trained_weights())
        served = merged(tokens)
        base = load_stage_model(model_dir, 0, NUM_LAYERS)(tokens)
    torch.testing.assert_close(served, with_adapters, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(served, base, atol=1e-3), "adapters had no effect"
    trainer.close()
    with torch.no_grad():
        torch.testing.assert_close(trainer.stage(tokens), base)


def stage_params(model_dir: Path, bounds: list[tuple[int, int]]) -> Iterator[StageModel]:
    for start, end in bounds:
        yield load_stage_model(model_dir, start, end)


@pytest.mark.parametrize("tied", [False, True])
def test_memory_estimate_counts_real_parameters(tmp_path: Path, tied: bool) -> None:
    path = make_checkpoint(
        tmp_path / "m", "llama", num_layers=4, vocab_size=VOCAB, tie_word_embeddings=tied
    )
    config = load_model_config(path)
    bounds = WHOLE if tied else SPLIT
    for stage in stage_params(path, bounds):
        full = training_memory(config, stage.start, stage.end, "full", 0, dtype_bytes=4)
        numel = sum(p.numel() for p in stage.parameters())
        assert full.weight_bytes == 4 * numel
        assert full.trainable_params == numel and full.optimizer_bytes == 8 * numel
        trainer = StageTrainer(stage, "lora", lora_rank=4)
        lora = training_memory(config, stage.start, stage.end, "lora", 4, dtype_bytes=4)
        adapters = sum(p.numel() for p in trainer.trainable_parameters().values())
        assert lora.trainable_params == adapters > 0
        assert lora.total(1000) > lora.total(1000, recompute=True, micro_batch_tokens=100)


def test_full_training_of_split_tied_model_is_refused(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "t", "llama", num_layers=2, tie_word_embeddings=True)
    with pytest.raises(TrainingInputError, match="tied embeddings"):
        StageTrainer(load_stage_model(path, 0, 1), "full")
    StageTrainer(load_stage_model(path, 0, 1), "lora")  # adapters leave the embedding frozen
