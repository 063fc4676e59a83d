"""Decode steps on a GPU as captured CUDA graphs: one launch a step instead of hundreds.

On an H200 (bench/cuda_check.py, first run) eager decoding of a 1.1B-parameter model in
bf16 ran at 16 ms a token, streaming its weights at 135 GB/s of the card's ~4,300: the
GPU sat waiting for Python to launch each layer's kernels one by one. A graph records the
kernels of one decode step of one stage over one session's KV cache once, then replays
them with a single launch.

What a graph needs, and how the stage provides it (StageModel.static_decode):
  * fixed shapes and addresses: the input is copied into a buffer the graph owns; the
    cache is preallocated, so its tensors never move; the step attends to every cache
    position with a mask instead of to a slice as long as the prefix;
  * no host values inside: the position lives in a 0-d device tensor, and the cache is
    written at it with index_copy_, so one graph serves every later step.

A session's first few single-position steps run eagerly (a short session never pays for a
capture), then the next one is captured. Anything that goes wrong while capturing leaves
that session eager, with a warning: a graph is only ever a faster way to the same result.
A graph goes with its session's cache; past MAX_LIVE_GRAPHS live ones, or once their pools
hold GRAPH_MEMORY_FRACTION of the GPU's memory, new sessions decode eagerly.
TESSERA_CUDA_GRAPHS=0 in the node's environment turns graphs off.

Measured with bench/cuda_check.py on an H200, 1.1B Llama shape, batch 1, bf16: decode at
289 tokens/s with graphs, 64 eager, 51 for transformers' eager code on the same card.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from node_agent.runtime.kv_cache import KVTensors, StageKVCache

if TYPE_CHECKING:
    from node_agent.runtime.stage_model import StageModel

log = logging.getLogger(__name__)

# Eager single-position steps a session runs before its next one is captured.
EAGER_STEPS_FIRST = 2
# Each graph keeps a memory pool of its own for the step's intermediates (32 MiB for a
# 22-layer stage of a 1.1B model on an H200), outside the KV budget the coordinator plans
# with, so what live graphs hold is bounded: at most this many, and at most this share of
# the GPU's memory (an 8 GB card keeps under 250 MB for them). Past either, new sessions
# decode eagerly.
MAX_LIVE_GRAPHS = 64
GRAPH_MEMORY_FRACTION = 0.03
# Two threads capturing at once would see each other's work in their graphs.
_CAPTURING = threading.Lock()


class _LiveGraphs:
    """How many graphs are live and the bytes their pools hold; a graph leaves the count
    when it is collected, which is when its session's cache goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.bytes = 0
        self.largest = 0  # the best guess at the next graph's pool

    def admits(self, budget_bytes: float) -> bool:
        with self._lock:
            return self.count < MAX_LIVE_GRAPHS and self.bytes + self.largest <= budget_bytes

    def add(self, graph: DecodeGraph) -> None:
        size = graph.pool_bytes
        with self._lock:
            self.count += 1
            self.bytes += size
            self.largest = max(self.largest, size)
        weakref.finalize(graph, self._remove, size)

    def _remove(self, size: int) -> None:
        with self._lock:
            self.count -= 1
            self.bytes -= size


_live = _LiveGraphs()


def live_graphs() -> int:
    return _live.count


def live_graph_bytes() -> int:
    return _live.bytes


def graph_budget_bytes(device: torch.device) -> float:
    """The most the pools of all live graphs on this device may hold."""
    if device.type != "cuda":
        return math.inf
    return GRAPH_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory


def graphs_enabled() -> bool:
    return os.environ.get("TESSERA_CUDA_GRAPHS", "1").strip().lower() not in ("0", "off", "no")


class DecodeGraph:
    """One stage's single-position step over one session's cache, captured or (capture
    False, the CPU tests' way to run exactly the captured code) run as it is."""

    def __init__(
        self,
        stage: StageModel,
        tensors: KVTensors,
        x: torch.Tensor,
        start_pos: int,
        *,
        last_position_only: bool,
        capture: bool = True,
    ) -> None:
        self.stage = stage
        self.tensors = tensors
        self.last_position_only = last_position_only
        dtype = torch.int64 if stage.is_first else stage.dtype
        self.x = torch.empty(x.shape, dtype=dtype, device=stage.device)
        self.position = torch.zeros((), dtype=torch.int64, device=stage.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.pool_bytes = 0  # the GPU memory the graph's private pool took
        if capture:
            self._capture(x, start_pos)

    def run(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        self._load(x, start_pos)
        if self.graph is None:
            return self._step()
        with torch.cuda.device(self.stage.device):  # replays on that GPU's current stream
            self.graph.replay()
        assert self.out is not None
        # The graph writes into the same buffer every step; the caller may keep its output.
        return self.out.clone()

    def _load(self, x: torch.Tensor, start_pos: int) -> None:
        self.x.copy_(x)
        self.position.fill_(start_pos)

    def _step(self) -> torch.Tensor:
        return self.stage.static_decode(
            self.x, self.tensors, self.position, last_position_only=self.last_position_only
        )

    def _capture(self, x: torch.Tensor, start_pos: int) -> None:
        device = self.stage.device
        self._load(x, start_pos)
        # torch.cuda.graph captures on a stream of the *current* GPU, while a stage's kernels
        # go to its own GPU's stream: on cuda:1 with cuda:0 current the capture would record
        # nothing, and every replay would hand back the first step's output.
        with _CAPTURING, torch.cuda.device(device):
            # Kernel selection and the allocator's first requests must happen before the
            # capture, on a side stream as torch asks. The warm-up writes this very step's
            # K/V, which the replay then writes again, identically.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's work (a check on the background thread) may
            # go on while this thread captures; only this thread's calls are recorded.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                # Inside: entering emptied the allocator's cache, so what is reserved from
                # here on is the graph's pool (or, over-counted, another thread's work).
                before = torch.cuda.memory_reserved(device)
                self.out = self._step()
            self.pool_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        self.graph = graph


def forget_graphs_over(cache: StageKVCache, stages: Iterable[StageModel]) -> None:
    """Drop the cache's graphs captured over ``stages`` (a dropped shard's views, once the
    cache has passed to another shard): they hold that shard's weights, and once those are
    freed a new stage could reuse an old one's id and match its graph."""
    ids = {id(stage) for stage in stages}
    for key in [k for k in cache.decode_graphs if k[0] in ids]:
        del cache.decode_graphs[key]


def graphed_step(
    stage: StageModel,
    cache: StageKVCache,
    x: torch.Tensor,
    start_pos: int,
    last_position_only: bool,
) -> torch.Tensor | None:
    """The step's output from the session's graph, or None: run it eagerly (too early in the
    session, or capturing failed before). The caller has validated x and the position."""
    key = (id(stage), last_position_only)
    graph = cache.decode_graphs.get(key)
    if graph is None:
        if key in cache.decode_graphs or cache.decode_steps < EAGER_STEPS_FIRST:
            cache.decode_steps += 1
            return None
        if not _live.admits(graph_budget_bytes(stage.device)):
            log.info(
                "%d CUDA graphs hold %.0f MiB, the most a node keeps; a new session's layers "
                "[%d, %d) decode without one",
                live_graphs(),
                live_graph_bytes() / 2**20,
                stage.start,
                stage.end,
            )
            cache.decode_graphs[key] = None
            return None
        try:
            graph = DecodeGraph(
                stage, cache.tensors, x, start_pos, last_position_only=last_position_only
            )
        except Exception as err:  # a faster path only: the session goes on eagerly
            log.warning(
                "could not capture a CUDA graph of layers [%d, %d); this session decodes "
                "without one: %s: %s",
                stage.start,
                stage.end,
                type(err).__name__,
                err,
            )
            cache.decode_graphs[key] = None
            return None
        _live.add(graph)
        cache.decode_graphs[key] = graph
    return graph.run(x, start_pos)
