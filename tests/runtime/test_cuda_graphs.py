"""Decode steps as CUDA graphs (node_agent/runtime/cuda_graphs.py).

On the CPU: the exact code a graph captures (StageModel.static_decode over KVTensors,
positions as device tensors, a mask over the whole cache) computes what the eager step
computes, for every architecture variant and stage kind, across a rollback; a capture
that fails leaves the session eager and correct. On a CUDA GPU (skipped elsewhere): real
captured graphs replay to the eager results.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from node_agent.runtime import StageKVCache, StageModel, cuda_graphs, load_stage_model
from node_agent.runtime.cuda_graphs import (
    EAGER_STEPS_FIRST,
    DecodeGraph,
    live_graph_bytes,
    live_graphs,
)

PROMPT = 6
BATCH = 2
MAX_LEN = 24


def first_input(stage: StageModel, seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if stage.is_first:
        return torch.randint(0, stage.config.vocab_size, (BATCH, length), generator=generator)
    return torch.randn(BATCH, length, stage.config.hidden_size, generator=generator)


def eager_decode(
    stage: StageModel, cache: StageKVCache, x: torch.Tensor, position: int
) -> torch.Tensor:
    """forward with graphs out of the picture, whatever the device."""
    graphs, stage._graphs = stage._graphs, False
    try:
        return stage(x, cache, position)
    finally:
        stage._graphs = graphs


@pytest.mark.parametrize("span", [(0, 1), (1, 3), (3, 4), (0, 4)], ids=str)
@torch.inference_mode()
def test_the_captured_code_computes_what_the_eager_step_computes(
    tiny_checkpoint, any_variant, span
):
    stage = load_stage_model(tiny_checkpoint(any_variant).path, *span)
    eager, static = (stage.new_cache(MAX_LEN, BATCH) for _ in range(2))
    prompt = first_input(stage, seed=1, length=PROMPT)
    torch.testing.assert_close(stage(prompt, eager, 0), stage(prompt, static, 0))
    steps = first_input(stage, seed=2, length=MAX_LEN)
    graph: DecodeGraph | None = None
    # Decode 10 positions, then roll back to position 9 and decode a different future:
    # the positions past the rollback still hold stale K/V, which the mask must hide.
    positions = list(range(PROMPT, PROMPT + 10)) + list(range(9, 9 + 8))
    for step, position in enumerate(positions):
        x = steps[:, step : step + 1]
        if position < eager.length:
            eager.truncate(position)
            static.truncate(position)
        expected = eager_decode(stage, eager, x, position)
        if graph is None:
            graph = DecodeGraph(
                stage, static.tensors, x, position, last_position_only=False, capture=False
            )
        got = graph.run(x, position)
        static.commit(position + 1)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    for mine, theirs in zip(
        static._keys + static._values, eager._keys + eager._values, strict=True
    ):
        torch.testing.assert_close(mine[:, :, : eager.length], theirs[:, :, : eager.length])


@torch.inference_mode()
def test_last_position_only_on_the_captured_path(tiny_checkpoint):
    stage = load_stage_model(tiny_checkpoint("llama_gqa").path, 2, 4)
    eager, static = (stage.new_cache(MAX_LEN, BATCH) for _ in range(2))
    prompt = first_input(stage, seed=3, length=PROMPT)
    stage(prompt, eager, 0)
    stage(prompt, static, 0)
    x = first_input(stage, seed=4, length=1)
    expected = stage(x, eager, PROMPT, last_position_only=True)
    graph = DecodeGraph(stage, static.tensors, x, PROMPT, last_position_only=True, capture=False)
    got = graph.run(x, PROMPT)
    assert got.shape == (BATCH, 1, stage.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@torch.inference_mode()
def test_a_cpu_stage_never_tries_to_capture(tiny_checkpoint):
    stage = load_stage_model(tiny_checkpoint("llama_gqa").path, 0, 4)
    cache = stage.new_cache(MAX_LEN, 1)
    stage(first_input(stage, 5, PROMPT)[:1], cache, 0)
    for position in range(PROMPT, PROMPT + 6):
        stage(torch.tensor([[position]]), cache, position)
    assert cache.decode_graphs == {} and cache.decode_steps == 0


@torch.inference_mode()
def test_a_failed_capture_leaves_the_session_eager_and_correct(tiny_checkpoint, caplog):
    # A CPU build of torch cannot capture at all: the real failure path, not a simulated one.
    stage = load_stage_model(tiny_checkpoint("qwen2").path, 0, 4)
    reference = load_stage_model(tiny_checkpoint("qwen2").path, 0, 4)
    stage._graphs = True
    cache, expected_cache = stage.new_cache(MAX_LEN, 1), reference.new_cache(MAX_LEN, 1)
    prompt = first_input(stage, 6, PROMPT)[:1]
    stage(prompt, cache, 0)
    reference(prompt, expected_cache, 0)
    with caplog.at_level(logging.WARNING, logger="node_agent.runtime.cuda_graphs"):
        for position in range(PROMPT, PROMPT + EAGER_STEPS_FIRST + 4):
            x = torch.tensor([[position % stage.config.vocab_size]])
            torch.testing.assert_close(
                stage(x, cache, position), reference(x, expected_cache, position)
            )
    assert list(cache.decode_graphs.values()) == [None]  # tried once, then stayed eager
    warnings = [r for r in caplog.records if "could not capture a CUDA graph" in r.message]
    assert len(warnings) == 1
    assert cache.length == expected_cache.length == PROMPT + EAGER_STEPS_FIRST + 4


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """graphed_step's whole flow on the CPU: its 'capture' builds a capture-less graph,
    which runs the very code a GPU graph replays."""
    monkeypatch.setattr(cuda_graphs, "DecodeGraph", functools.partial(DecodeGraph, capture=False))

    def load(path, start: int, end: int) -> StageModel:
        stage = load_stage_model(path, start, end)
        stage._graphs = True
        return stage

    return load


@torch.inference_mode()
def test_a_session_decodes_eagerly_first_then_through_its_graph(tiny_checkpoint, graphs_on_cpu):
    path = tiny_checkpoint("llama_bias").path
    stage, reference = graphs_on_cpu(path, 1, 4), load_stage_model(path, 1, 4)
    cache, expected_cache = stage.new_cache(MAX_LEN, BATCH), reference.new_cache(MAX_LEN, BATCH)
    steps = first_input(stage, seed=8, length=PROMPT + 8)
    stage(steps[:, :PROMPT], cache, 0)
    reference(steps[:, :PROMPT], expected_cache, 0)
    for position in range(PROMPT, PROMPT + 8):
        x = steps[:, position : position + 1]
        got = stage(x, cache, position, last_position_only=True)
        expected = reference(x, expected_cache, position, last_position_only=True)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        assert cache.length == position + 1
    assert cache.decode_steps == EAGER_STEPS_FIRST
    assert [key[1] for key in cache.decode_graphs] == [True]  # one graph, last position only


@torch.inference_mode()
def test_a_node_keeps_a_bounded_number_of_graphs(tiny_checkpoint, graphs_on_cpu, monkeypatch):
    stage = graphs_on_cpu(tiny_checkpoint("llama_gqa").path, 0, 2)
    monkeypatch.setattr(cuda_graphs, "MAX_LIVE_GRAPHS", live_graphs() + 2)

    def decode(cache: StageKVCache) -> None:
        stage(torch.tensor([[1, 2, 3]]), cache, 0)
        for position in range(3, 3 + EAGER_STEPS_FIRST + 2):
            stage(torch.tensor([[position]]), cache, position)

    caches = [stage.new_cache(MAX_LEN, 1) for _ in range(3)]
    for cache in caches:
        decode(cache)
    graphs = [next(iter(c.decode_graphs.values())) for c in caches]
    assert graphs[0] is not None and graphs[1] is not None and graphs[2] is None
    before = live_graphs()
    del caches[0], graphs
    # No reference cycle: the graph goes the moment its cache does, without a collection.
    assert live_graphs() == before - 1
    newcomer = stage.new_cache(MAX_LEN, 1)
    decode(newcomer)
    assert next(iter(newcomer.decode_graphs.values())) is not None


@torch.inference_mode()
def test_graphs_stop_at_their_memory_budget(tiny_checkpoint, graphs_on_cpu, monkeypatch):
    stage = graphs_on_cpu(tiny_checkpoint("llama_gqa").path, 0, 2)
    mib = 2**20

    class TenMiBGraph(DecodeGraph):  # as if each graph's pool took 10 MiB of the GPU
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, capture=False, **kwargs)
            self.pool_bytes = 10 * mib

    monkeypatch.setattr(cuda_graphs, "DecodeGraph", TenMiBGraph)
    budget = live_graph_bytes() + 25 * mib  # room for two, not three
    monkeypatch.setattr(cuda_graphs, "graph_budget_bytes", lambda device: budget)
    caches = [stage.new_cache(MAX_LEN, 1) for _ in range(3)]
    for cache in caches:
        stage(torch.tensor([[1, 2, 3]]), cache, 0)
        for position in range(3, 3 + EAGER_STEPS_FIRST + 1):
            stage(torch.tensor([[position]]), cache, position)
    graphs = [next(iter(c.decode_graphs.values())) for c in caches]
    assert [g is not None for g in graphs] == [True, True, False]
    assert live_graph_bytes() == budget - 5 * mib
    del caches, graphs
    assert live_graph_bytes() == budget - 25 * mib


# ---- on a real GPU ---------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_sliding", "llama_tied"])
@torch.inference_mode()
def test_captured_graphs_replay_to_the_eager_results(tiny_checkpoint, variant, dtype):
    path = tiny_checkpoint(variant).path
    stages = [load_stage_model(path, s, e, device="cuda", dtype=dtype) for s, e in ((0, 2), (2, 4))]
    graphed = [s.new_cache(MAX_LEN, BATCH) for s in stages]
    eager = [s.new_cache(MAX_LEN, BATCH) for s in stages]
    positions = list(range(PROMPT, PROMPT + 12)) + list(range(10, 10 + 8))  # with a rollback
    tokens = torch.randint(
        0,
        stages[0].config.vocab_size,
        (BATCH, PROMPT + len(positions)),  # the prompt, then one input per step
        generator=torch.Generator().manual_seed(7),
    )

    def run(caches: list[StageKVCache], x: torch.Tensor, position: int, use_graphs: bool):
        for stage, cache in zip(stages, caches, strict=True):
            if position < cache.length:
                cache.truncate(position)
            x = stage(x, cache, position) if use_graphs else eager_decode(stage, cache, x, position)
        return x

    run(graphed, tokens[:, :PROMPT], 0, True)
    run(eager, tokens[:, :PROMPT], 0, False)
    scale = 1e-5 if dtype == torch.float32 else 2e-2
    for step, position in enumerate(positions):
        x = tokens[:, PROMPT + step : PROMPT + step + 1]
        got, expected = run(graphed, x, position, True), run(eager, x, position, False)
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < scale, f"step {step} at {position}: relative error {error:.1e}"
    for cache in graphed:
        captured = [g for g in cache.decode_graphs.values() if g is not None]
        assert captured and all(g.graph is not None and g.pool_bytes > 0 for g in captured)


@cuda
@torch.inference_mode()
def test_two_sessions_keep_their_own_graphs(tiny_checkpoint):
    stage = load_stage_model(tiny_checkpoint("llama_gqa").path, 0, 4, device="cuda", dtype="bf16")
    sessions = [stage.new_cache(MAX_LEN, 1) for _ in range(2)]
    references = [stage.new_cache(MAX_LEN, 1) for _ in range(2)]
    prompts = [torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[9, 8, 7, 6, 5, 4]])]
    for cache, reference, prompt in zip(sessions, references, prompts, strict=True):
        stage(prompt, cache, 0)
        stage(prompt, reference, 0)
    for position in range(PROMPT, PROMPT + 10):  # the sessions' steps interleave
        for index in (0, 1):
            x = torch.tensor([[(position * 7 + index) % stage.config.vocab_size]])
            got = stage(x, sessions[index], position)
            expected = eager_decode(stage, references[index], x, position)
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    graphs = [next(iter(c.decode_graphs.values())) for c in sessions]
    assert graphs[0] is not graphs[1] and all(g.graph is not None for g in graphs)
