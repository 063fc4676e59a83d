"""Loads and unloads the model shards the coordinator assigns to this node.

``assign`` reports ASSIGNED -> FETCHING (with progress) -> LOADING -> READY, or FAILED with
the reason. A new shard is loaded next to the old ones; nothing is dropped until the
coordinator says so, which lets the planner load before it drops. Shards are keyed by
(model, start, end) and serve any sub-span of their layers. ``drop`` hides a shard from new
requests at once and frees it after its in-flight calls finish. Its sessions' KV caches pass
to the shard that holds their layers now, when there is one: a re-plan that widens or moves
a node's range (it loads the new shard, then drops the old) does not cost the sessions
running through that node a replay of their history.

The manager is also a telemetry source (sessions, KV cache tokens, queue length) and owns
the compute threads: one for the calls pipelines wait on, and one at a lower OS priority for
background work (a verifier's checks and catch-ups), so that checking another node never
delays this node's own pipeline hops.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from node_agent.context import AgentContext
from node_agent.runtime import (
    CacheBudgetError,
    KVCacheManager,
    ModelConfig,
    StageKVCache,
    StageModel,
    load_model_config,
    load_stage_tensors,
    resolve_dtype,
    tensor_names_for_stage,
)
from node_agent.runtime.cuda_graphs import forget_graphs_over
from node_agent.shard_fetcher import ShardFetcher
from node_agent.shard_handler import ReportFn
from protos.tessera.v1 import common_pb2, coordinator_pb2, node_pb2

log = logging.getLogger(__name__)

DEFAULT_IDLE_TTL_S = 300.0
# A shard assigned without a budget still serves one modest session.
DEFAULT_KV_TOKENS_BUDGET = 4096


class ProgressFn(Protocol):
    """(bytes in hand so far, bytes in total[, bytes that came over the network])."""

    def __call__(self, done: int, total: int, downloaded: int | None = None) -> None: ...


class ShardSource(Protocol):
    """Where a shard's files come from; returns an HF-style directory holding its tensors."""

    async def fetch(self, cmd: coordinator_pb2.AssignShard, progress: ProgressFn) -> Path: ...


@dataclass(frozen=True, order=True)
class ShardKey:
    model: str
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.model}[{self.start}, {self.end})"


class _View:
    """The shard's weights seen as one sub-span, with that sub-span's KV caches."""

    def __init__(self, stage: StageModel, budget: int, idle_ttl_s: float) -> None:
        self.stage = stage
        self.caches = KVCacheManager(budget, idle_ttl_s, cache_factory=stage.new_cache)


@dataclass
class LoadedShard:
    key: ShardKey
    num_layers: int
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_tokens_budget: int
    weight_bytes: int
    idle_ttl_s: float
    full_stage: StageModel
    _views: dict[tuple[int, int], _View] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    dropped: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._views[(self.key.start, self.key.end)] = _View(
            self.full_stage, self.kv_tokens_budget, self.idle_ttl_s
        )
        self._idle.set()

    def covers(self, start: int, end: int) -> bool:
        return self.key.start <= start < end <= self.key.end

    def stage_for(self, start: int, end: int) -> StageModel:
        return self._view(start, end).stage

    # -- KV caches (callable from any thread) --------------------------------------------

    def open_cache(
        self, session_key: str, start: int, end: int, max_len: int, batch: int
    ) -> StageKVCache:
        """Open a cache, keeping every view of the shard within one shared token budget."""
        view = self._view(start, end)
        with self._lock:
            used = sum(v.caches.used_tokens for v in self._views.values())
            free = self.kv_tokens_budget - used
            if max_len * batch > free:
                raise CacheBudgetError(
                    f"the session needs {max_len * batch} KV cache tokens on {self.key} "
                    f"but only {free} of {self.kv_tokens_budget} are free; retry later, use "
                    "another replica, or open the session with a smaller max_length"
                )
            return view.caches.open(session_key, max_len, batch)

    def cache(self, session_key: str, start: int, end: int) -> StageKVCache | None:
        view = self._views.get((start, end))
        if view is None or session_key not in view.caches:
            return None
        return view.caches.get(session_key)

    def release(self, session_key: str) -> bool:
        return any([view.caches.release(session_key) for view in list(self._views.values())])

    def open_caches(self) -> list[tuple[int, int, str]]:
        """(start, end, session key) of every open cache, in every view."""
        return [
            (start, end, key)
            for (start, end), view in list(self._views.items())
            for key in view.caches.session_ids()
        ]

    def take_cache(self, session_key: str, start: int, end: int) -> StageKVCache | None:
        view = self._views.get((start, end))
        return None if view is None else view.caches.take(session_key)

    def adopt_cache(self, session_key: str, start: int, end: int, cache: StageKVCache) -> bool:
        """Serve a live cache of layers [start, end) that a dropped shard hands over; False
        when this shard cannot: another dtype or device, a cache of its own for the
        session, or no room left in its KV budget."""
        if not self.covers(start, end) or (cache.dtype, cache.device) != (
            self.dtype,
            self.device,
        ):
            return False
        view = self._view(start, end)
        if cache.num_layers != view.stage.num_layers:
            return False
        with self._lock:
            used = sum(v.caches.used_tokens for v in self._views.values())
            if cache.max_len * cache.batch > self.kv_tokens_budget - used:
                return False
            if session_key in view.caches:
                return False
            view.caches.adopt(session_key, cache)
        return True

    def stages(self) -> list[StageModel]:
        """The shard's views' stages (what its sessions' CUDA graphs were captured over)."""
        return [view.stage for view in list(self._views.values())]

    def release_all(self) -> None:
        for view in list(self._views.values()):
            for session_key in view.caches.session_ids():
                view.caches.release(session_key)

    def expire_idle(self) -> list[str]:
        return [sid for view in list(self._views.values()) for sid in view.caches.expire_idle()]

    def session_keys(self) -> list[str]:
        return [sid for view in list(self._views.values()) for sid in view.caches.session_ids()]

    def kv_bytes(self) -> int:
        # From reservations, not the caches: reading a cache would count as using it and
        # keep idle sessions from expiring.
        per_token_layer = self.config.kv_bytes_per_token_per_layer(self.dtype.itemsize)
        return sum(
            view.caches.used_tokens * view.stage.num_layers * per_token_layer
            for view in list(self._views.values())
        )

    def kv_tokens_used(self) -> int:
        return sum(view.caches.used_tokens for view in list(self._views.values()))

    # -- in-flight tracking (event loop only) ---------------------------------------------

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _view(self, start: int, end: int) -> _View:
        if not self.covers(start, end):
            raise ValueError(f"layers [{start}, {end}) are not within {self.key}")
        with self._lock:
            view = self._views.get((start, end))
            if view is None:
                view = self._views[(start, end)] = _View(
                    _sub_stage(self.full_stage, start, end, self.num_layers),
                    self.kv_tokens_budget,
                    self.idle_ttl_s,
                )
            return view


def _sub_stage(full: StageModel, start: int, end: int, num_layers: int) -> StageModel:
    """A StageModel for [start, end) that shares the full shard's weight storage."""
    first, last = start == 0, end == num_layers
    weights = full.state_dict()
    names = tensor_names_for_stage(full.config, start, end, first, last)
    return StageModel(
        full.config,
        start,
        end,
        first,
        last,
        {n: weights[n] for n in names},
        device=full.device,
        dtype=full.dtype,
    )


class ShardManager:
    """The node's ShardHandler: owns the loaded shards and the compute thread."""

    def __init__(
        self,
        source: ShardSource,
        *,
        device: str = "cpu",
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
    ) -> None:
        self._source = source
        self.device = device
        self.idle_ttl_s = idle_ttl_s
        self._shards: dict[ShardKey, LoadedShard] = {}
        self._loading: dict[ShardKey, _Loading] = {}
        # One thread for the forward passes pipelines wait on: the device runs one kernel
        # stream anyway, and the event loop stays free to accept, validate and answer.
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-compute")
        # Checks and catch-ups for verifiers: nobody waits on them hop by hop. Its own thread
        # at a lower priority lets a pipeline's call start at once and take the CPU first
        # (on a GPU the kernels of both share the device queue; the check still never
        # holds the pipeline's call back in this process).
        self.background = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tessera-check", initializer=_lower_priority
        )
        self.queue_length = 0  # forward calls waiting for or running on a compute thread
        self._foreground = 0  # of those, the ones on the pipeline thread

    # ---- ShardHandler ---------------------------------------------------------------

    async def assign(self, cmd: coordinator_pb2.AssignShard, report: ReportFn) -> None:
        key = ShardKey(cmd.model, cmd.layers.start, cmd.layers.end)
        status = _Reporter(cmd, report)
        problem = _check_assign(cmd)
        if problem:
            status.failed(problem)
            return
        if key in self._shards:
            status.send(node_pb2.SHARD_STATE_READY, progress=1.0)
            return
        if key in self._loading:
            log.info("%s is already being loaded; ignoring the repeated assignment", key)
            return
        loading = self._loading[key] = _Loading()
        try:
            status.send(node_pb2.SHARD_STATE_ASSIGNED)
            shard = await self._fetch_and_load(cmd, key, status, loading)
        except _Dropped:
            # The agent reports DROPPED for the drop itself; a FAILED now would contradict it.
            log.info("%s was dropped while fetching; not loading it", key)
            return
        except Exception as err:  # any failure is the shard's, never the agent's
            log.warning("shard %s failed: %s", key, err, exc_info=not isinstance(err, ValueError))
            status.failed(str(err) or type(err).__name__)
            return
        finally:
            self._loading.pop(key, None)
        if loading.cancelled:
            log.info("%s was dropped while loading; discarding it", key)
            return
        self._shards[key] = shard
        log.info(
            "shard %s READY on %s (%s, %.1f MiB of weights, %d KV tokens)",
            key,
            shard.device,
            shard.dtype,
            shard.weight_bytes / 2**20,
            shard.kv_tokens_budget,
        )
        status.send(
            node_pb2.SHARD_STATE_READY,
            progress=1.0,
            bytes_fetched=status.bytes_fetched,
            bytes_downloaded=status.bytes_downloaded,
        )

    async def drop(self, cmd: coordinator_pb2.DropShard) -> None:
        key = ShardKey(cmd.model, cmd.layers.start, cmd.layers.end)
        loading = self._loading.get(key)
        if loading is not None:
            loading.cancelled = True
        shard = self._shards.pop(key, None)
        if shard is None:
            return
        shard.dropped = True
        # Right away, so that the sessions' next calls find their caches: a call still
        # running here writes into the same cache object, and the stage server's lock per
        # cache keeps the session's next call behind it.
        handed = self._hand_over_caches(shard)
        await shard.wait_idle()  # calls already running finish; new ones no longer find it
        stale = shard.stages()
        for cache in handed:
            forget_graphs_over(cache, stale)
        shard.release_all()
        del shard
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        log.info("shard %s dropped", key)

    def _hand_over_caches(self, old: LoadedShard) -> list[StageKVCache]:
        """Pass ``old``'s open caches to the shards that serve their layers now."""
        handed: list[StageKVCache] = []
        kept = 0
        for start, end, session_key in old.open_caches():
            heir = self.find(old.key.model, start, end)
            cache = old.cache(session_key, start, end)
            if cache is None:
                continue
            if heir is None or not heir.adopt_cache(session_key, start, end, cache):
                kept += 1
                continue
            old.take_cache(session_key, start, end)
            handed.append(cache)
        if handed:
            log.info(
                "%s: passed %d live session cache(s) to the shard(s) now holding their layers",
                old.key,
                len(handed),
            )
        if kept:
            log.info(
                "%s: frees %d live session cache(s) that no other shard here can take; those "
                "sessions replay their history on their next call",
                old.key,
                kept,
            )
        return handed

    # ---- for the stage server -------------------------------------------------------

    def find(self, model: str, start: int, end: int) -> LoadedShard | None:
        """The READY shard that holds layers [start, end) of ``model``, if any."""
        candidates = [s for s in self._shards.values() if s.key.model == model]
        holding = [s for s in candidates if s.covers(start, end)]
        # The narrowest fitting shard: a wider one is more likely to be dropped soon.
        return min(holding, key=lambda s: s.key.end - s.key.start, default=None)

    def shards(self) -> list[LoadedShard]:
        return list(self._shards.values())

    def describe(self, model: str) -> str:
        held = sorted(str(s.key) for s in self._shards.values() if s.key.model == model)
        return ", ".join(held) if held else "nothing of this model"

    def active_sessions(self) -> int:
        return len({session_of(k) for s in self.shards() for k in s.session_keys()})

    def expire_idle(self) -> list[str]:
        return [key for shard in self.shards() for key in shard.expire_idle()]

    async def run(
        self, fn: Callable[[], object], *, inline_if_idle: bool = False, background: bool = False
    ) -> object:
        """Run ``fn`` on the compute thread (``background``: the low-priority one), counting
        it in the queue while it waits/runs.

        With ``inline_if_idle`` a short ``fn`` runs on the calling (event loop) thread when
        nothing waits for or runs on the compute thread: pipeline work stays serialised (the
        loop cannot queue more while it computes) and two thread hand-offs are saved.
        """
        self.queue_length += 1
        try:
            if background:
                return await _to_the_end(self.background.submit(fn))
            self._foreground += 1
            try:
                if inline_if_idle and self._foreground == 1:
                    return fn()
                return await _to_the_end(self.compute.submit(fn))
            finally:
                self._foreground -= 1
        finally:
            self.queue_length -= 1

    def memory_bytes(self) -> int:
        """Weights plus every open KV cache, in bytes."""
        return sum(s.weight_bytes + s.kv_bytes() for s in self.shards())

    # ---- TelemetrySource ------------------------------------------------------------

    def sample(self) -> node_pb2.Telemetry:
        shards = self.shards()
        return node_pb2.Telemetry(
            queue_length=self.queue_length,
            active_sessions=self.active_sessions(),
            kv_tokens_used=sum(s.kv_tokens_used() for s in shards),
            kv_tokens_budget=sum(s.kv_tokens_budget for s in shards),
        )

    def close(self) -> None:
        self.compute.shutdown(wait=False, cancel_futures=True)
        self.background.shutdown(wait=False, cancel_futures=True)

    # ---- loading --------------------------------------------------------------------

    async def _fetch_and_load(
        self,
        cmd: coordinator_pb2.AssignShard,
        key: ShardKey,
        status: _Reporter,
        loading: _Loading,
    ) -> LoadedShard:
        status.send(node_pb2.SHARD_STATE_FETCHING, progress=0.0)
        directory = await self._source.fetch(cmd, status.progress)
        if loading.cancelled:
            raise _Dropped()
        status.send(
            node_pb2.SHARD_STATE_LOADING,
            progress=1.0,
            bytes_fetched=status.bytes_fetched,
            bytes_downloaded=status.bytes_downloaded,
        )
        started = time.monotonic()
        shard = await asyncio.to_thread(
            load_shard,
            directory,
            key,
            cmd.num_layers,
            self.device,
            cmd.dtype,
            cmd.kv_tokens_budget or DEFAULT_KV_TOKENS_BUDGET,
            self.idle_ttl_s,
        )
        log.info(
            "loaded %s on %s in %s (%.0f MB of weights) in %.2f s",
            key,
            shard.device,
            str(shard.dtype).removeprefix("torch."),
            shard.weight_bytes / 1e6,
            time.monotonic() - started,
        )
        # Everything alive now (torch, gRPC, protobuf, the weights' modules) lives as long
        # as the process: moved out of the collector's reach, a full collection that
        # lands in a decode step no longer walks hundreds of thousands of objects.
        gc.freeze()
        return shard


def load_shard(
    directory: Path,
    key: ShardKey,
    num_layers: int,
    device: str,
    dtype: str,
    kv_tokens_budget: int,
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
) -> LoadedShard:
    """Read exactly the shard's tensors from an HF-style directory and build its stage."""
    config = load_model_config(directory)
    if num_layers and num_layers != config.num_hidden_layers:
        raise ValueError(
            f"the assignment says {key.model} has {num_layers} layers but its config.json "
            f"says {config.num_hidden_layers}; the model store and the planner disagree"
        )
    if key.end > config.num_hidden_layers:
        raise ValueError(
            f"layers [{key.start}, {key.end}) do not exist: {key.model} has "
            f"{config.num_hidden_layers} layers"
        )
    first, last = key.start == 0, key.end == config.num_hidden_layers
    compute_dtype = resolve_dtype(device, dtype or None)
    names = tensor_names_for_stage(config, key.start, key.end, first, last)
    tensors = load_stage_tensors(directory, names)
    stage = StageModel(
        config, key.start, key.end, first, last, tensors, device=device, dtype=compute_dtype
    ).eval()
    stage.requires_grad_(False)
    weight_bytes = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
    return LoadedShard(
        key=key,
        num_layers=config.num_hidden_layers,
        config=config,
        device=torch.device(device),
        dtype=compute_dtype,
        kv_tokens_budget=kv_tokens_budget,
        weight_bytes=weight_bytes,
        idle_ttl_s=idle_ttl_s,
        full_stage=stage,
    )


class _Dropped(Exception):
    def __str__(self) -> str:
        return "dropped while loading"


@dataclass
class _Loading:
    cancelled: bool = False


class _Reporter:
    """Builds ShardStatus messages; progress reports are throttled to whole percents."""

    def __init__(self, cmd: coordinator_pb2.AssignShard, report: ReportFn) -> None:
        self._cmd = cmd
        self._report = report
        self.bytes_fetched = 0
        self.bytes_downloaded = 0
        self._last_percent = -1

    def send(
        self,
        state: node_pb2.ShardState,
        *,
        progress: float = 0.0,
        bytes_fetched: int = 0,
        bytes_downloaded: int = 0,
        error: str = "",
    ) -> None:
        self._report(
            node_pb2.ShardStatus(
                model=self._cmd.model,
                layers=common_pb2.LayerRange(
                    start=self._cmd.layers.start, end=self._cmd.layers.end
                ),
                state=state,
                progress=progress,
                bytes_fetched=bytes_fetched,
                bytes_downloaded=bytes_downloaded,
                error=error,
            )
        )

    def progress(self, done: int, total: int, downloaded: int | None = None) -> None:
        self.bytes_fetched = done
        if downloaded is not None:
            self.bytes_downloaded = downloaded
        fraction = done / total if total > 0 else 1.0
        percent = int(fraction * 100)
        if percent != self._last_percent:
            self._last_percent = percent
            self.send(
                node_pb2.SHARD_STATE_FETCHING, progress=min(1.0, fraction), bytes_fetched=done
            )

    def failed(self, error: str) -> None:
        self.send(node_pb2.SHARD_STATE_FAILED, error=error, bytes_fetched=self.bytes_fetched)


def _check_assign(cmd: coordinator_pb2.AssignShard) -> str:
    if not cmd.model:
        return "the assignment names no model"
    if cmd.layers.start >= cmd.layers.end:
        return f"layer range [{cmd.layers.start}, {cmd.layers.end}) is empty"
    if cmd.num_layers and cmd.layers.end > cmd.num_layers:
        return (
            f"layer range [{cmd.layers.start}, {cmd.layers.end}) exceeds the model's "
            f"{cmd.num_layers} layers"
        )
    return ""


# ---- wiring into the agent ----------------------------------------------------------------


class DirectorySource:
    """A source that already has every shard on disk (tests, and `--model-dir` setups)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    async def fetch(self, cmd: coordinator_pb2.AssignShard, progress: ProgressFn) -> Path:
        progress(1, 1)
        return self._directory


def shard_manager_for(ctx: AgentContext) -> ShardManager:
    """The agent's one ShardManager, created on first use and kept in ``ctx.shard_handler``."""
    if isinstance(ctx.shard_handler, ShardManager):
        return ctx.shard_handler
    manager = ShardManager(_source_for(ctx), device=ctx.hardware.torch_device)
    ctx.shard_handler = manager
    ctx.telemetry_sources.append(manager)
    return manager


def build_shard_handler(ctx: AgentContext) -> ShardManager:
    """Plug-in entry point the agent calls at start-up (see node_agent/plugins.py)."""
    return shard_manager_for(ctx)


def _source_for(ctx: AgentContext) -> ShardSource:
    return CoordinatorSource(ctx)


class CoordinatorSource:
    """Fetches a shard's tensors from the coordinator's model store (content-addressed,
    cached under the data dir) and assembles DATA_DIR/shards/<model>/<start>-<end>/."""

    def __init__(self, ctx: AgentContext) -> None:
        self._ctx = ctx

    async def fetch(self, cmd: coordinator_pb2.AssignShard, progress: ProgressFn) -> Path:
        # A fresh fetcher per shard: the ticket changes whenever the agent registers again.
        fetcher = ShardFetcher.for_data_dir(
            self._ctx.coordinator_address,
            self._ctx.node_id,
            self._ctx.attach_ticket,
            self._ctx.data_dir,
        )
        last = [0, 0]

        def on_progress(done: int, total: int) -> None:
            last[:] = [done, total]
            progress(done, total)

        try:
            directory = await fetcher.materialize(
                cmd.model,
                cmd.layers.start,
                cmd.layers.end,
                progress=False,
                on_progress=on_progress,
            )
            # The fetcher knows what came over the network rather than from the cache.
            progress(last[0], last[1], downloaded=fetcher.bytes_fetched)
            return directory
        finally:
            await fetcher.close()


BACKGROUND_NICE = 10


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority. Linux keeps a nice value per thread
    (and torch's intra-op threads, started from it, inherit it); elsewhere the check thread
    keeps the process's priority, which only costs the preference."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


T = TypeVar("T")


async def _to_the_end(job: Future[T]) -> T:
    """The result of ``job``, submitted to a compute thread. Cancelled meanwhile (its
    client went away), a job that has not started is dropped; one that has runs on in its
    thread whatever happens here, so the cancellation waits for its end. The caller holds
    the session cache's lock all that time: the next call on that cache (a replay after a
    fail-over, on the other compute thread perhaps) must not run on it at the same time."""
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        if not job.cancel():
            while not job.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({asyncio.wrap_future(job)})
        raise


def cache_key(session_id: str, start: int, end: int) -> str:
    """The key of one session's KV cache on one span: "session@start-end"."""
    return f"{session_id}@{start}-{end}"


def session_of(key: str) -> str:
    """The session id of a cache key."""
    return key.rsplit("@", 1)[0]
