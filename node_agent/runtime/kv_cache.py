"""Per-session KV caches for one pipeline stage, and a node-wide token budget over them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from node_agent.runtime.errors import CacheBudgetError, CacheFullError, UnknownSessionError


class KVTensors:
    """A cache's preallocated K/V tensors alone, written at a position held in a tensor.

    What a captured decode step (runtime/cuda_graphs.py) writes through: with the position
    on the GPU one graph serves every step. It refers only to the tensors, never to the
    cache that keeps the graph, so no reference cycle holds a released cache's memory.
    Keys past the position written are stale or zero; the caller's mask hides them.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def update(
        self, layer: int, start_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a chunk's K/V at ``start_pos`` (a 0-d tensor); returns every position."""
        index = start_pos + torch.arange(keys.shape[2], device=start_pos.device)
        cached_k, cached_v = self.keys[layer], self.values[layer]
        cached_k.index_copy_(2, index, keys)
        cached_v.index_copy_(2, index, values)
        return cached_k, cached_v


class StageKVCache:
    """Preallocated K/V tensors ``[batch, n_kv_heads, max_len, head_dim]`` per stage layer.

    Layers are indexed locally (0 = the stage's first layer). ``length`` counts the positions
    every layer holds; it only moves on ``commit``/``truncate`` so a failed forward pass
    never leaves a half-written position marked valid.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, value in (
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        shape = (batch, num_kv_heads, max_len, head_dim)
        # Zero-filled rather than empty so stale GPU memory can never leak into attention.
        self._keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self._values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.tensors = KVTensors(self._keys, self._values)
        # Captured decode steps over this cache (runtime/cuda_graphs.py): they point at its
        # tensors, so they live and die with it. Keyed by (stage view, last position only).
        self.decode_graphs: dict[tuple[int, bool], Any] = {}
        self.decode_steps = 0  # single-position steps run eagerly so far
        self.num_layers = num_layers
        self.batch = batch
        self.max_len = max_len
        self.device = torch.device(device)
        self.dtype = dtype
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def remaining(self) -> int:
        return self.max_len - self._length

    def check_append(self, start_pos: int, num_tokens: int) -> None:
        """Validate writing ``num_tokens`` positions at ``start_pos`` before any work is done."""
        if start_pos < 0 or start_pos > self._length:
            raise ValueError(
                f"start_pos {start_pos} must be within [0, {self._length}] (the cached length); "
                "positions cannot be skipped"
            )
        if start_pos + num_tokens > self.max_len:
            raise CacheFullError(
                f"writing {num_tokens} token(s) at position {start_pos} needs "
                f"{start_pos + num_tokens} positions but the cache holds {self.max_len}; "
                "open the session with a larger max_len"
            )

    def update(
        self, layer: int, start_pos: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a chunk's K/V at ``start_pos`` and return K/V for positions [0, chunk end)."""
        end = start_pos + keys.shape[2]
        cached_k, cached_v = self._keys[layer], self._values[layer]
        # The cache holds plain values: writing grad-carrying tensors in place would chain
        # every later step's autograd graph onto this one.
        cached_k[:, :, start_pos:end].copy_(keys.detach())
        cached_v[:, :, start_pos:end].copy_(values.detach())
        if keys.requires_grad or values.requires_grad:
            # Keep the current chunk differentiable; the cached prefix is a constant.
            return (
                torch.cat([cached_k[:, :, :start_pos], keys], dim=2),
                torch.cat([cached_v[:, :, :start_pos], values], dim=2),
            )
        return cached_k[:, :, :end], cached_v[:, :, :end]

    def commit(self, end_pos: int) -> None:
        """Mark positions [0, end_pos) valid; anything after a replayed chunk is dropped."""
        if not 0 <= end_pos <= self.max_len:
            raise ValueError(f"end_pos {end_pos} outside [0, {self.max_len}]")
        self._length = end_pos

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` positions (e.g. rejected speculative tokens)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate to {length}; cache holds {self._length} positions")
        self._length = length

    def reset(self) -> None:
        self._length = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)


CacheFactory = Callable[[int, int], StageKVCache]
"""Builds a cache for (max_len, batch); typically ``StageModel.new_cache``."""


@dataclass
class _Session:
    cache: StageKVCache
    reserved_tokens: int
    last_used: float


class KVCacheManager:
    """Open caches keyed by session id, bounded by a node-wide token budget.

    A session reserves ``max_len * batch`` tokens up front because its tensors are
    preallocated at that size; the planner converts tokens to bytes.
    """

    def __init__(
        self,
        budget_tokens: int,
        idle_ttl_s: float,
        *,
        cache_factory: CacheFactory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
        if idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be positive, got {idle_ttl_s}")
        self.budget_tokens = budget_tokens
        self.idle_ttl_s = idle_ttl_s
        self._cache_factory = cache_factory
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._used_tokens = 0
        self._lock = threading.Lock()

    @property
    def used_tokens(self) -> int:
        with self._lock:
            return self._used_tokens

    @property
    def free_tokens(self) -> int:
        with self._lock:
            return self.budget_tokens - self._used_tokens

    def open(self, session_id: str, max_len: int, batch: int = 1) -> StageKVCache:
        if max_len <= 0 or batch <= 0:
            raise ValueError(f"max_len and batch must be positive, got {max_len}, {batch}")
        return self._admit(
            session_id,
            max_len,
            batch,
            lambda: self._cache_factory(max_len, batch),
        )

    def adopt(self, session_id: str, cache: StageKVCache) -> None:
        """Take over a live cache opened elsewhere (a shard being dropped hands its
        sessions to the shard that now holds their layers), within this budget."""
        self._admit(session_id, cache.max_len, cache.batch, lambda: cache)

    def _admit(
        self, session_id: str, max_len: int, batch: int, cache: Callable[[], StageKVCache]
    ) -> StageKVCache:
        tokens = max_len * batch
        # Allocation happens under the lock so two sessions cannot both pass the budget
        # check; it is a single tensor allocation per layer, so the lock is held briefly.
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} already has an open KV cache")
            free = self.budget_tokens - self._used_tokens
            if tokens > free:
                raise CacheBudgetError(
                    f"session {session_id!r} needs {tokens} KV cache tokens "
                    f"(max_len {max_len} x batch {batch}) but only {free} of "
                    f"{self.budget_tokens} are free; retry later or with a shorter max_len"
                )
            admitted = cache()
            self._sessions[session_id] = _Session(admitted, tokens, self._clock())
            self._used_tokens += tokens
            return admitted

    def take(self, session_id: str) -> StageKVCache | None:
        """Remove the session's cache without discarding it (see ``adopt``); None if it
        was not open."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return None
            self._used_tokens -= session.reserved_tokens
            return session.cache

    def get(self, session_id: str) -> StageKVCache:
        """Return the session's cache and mark it as recently used."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise UnknownSessionError(
                    f"no KV cache open for session {session_id!r} (never opened, released or "
                    "expired after idling)"
                )
            session.last_used = self._clock()
            return session.cache

    def release(self, session_id: str) -> bool:
        """Free the session's reservation; returns False if it was not open."""
        return self.take(session_id) is not None

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Release sessions idle for longer than ``idle_ttl_s``; returns their ids."""
        with self._lock:
            current = self._clock() if now is None else now
            expired = [
                sid
                for sid, session in self._sessions.items()
                if current - session.last_used > self.idle_ttl_s
            ]
            for sid in expired:
                self._used_tokens -= self._sessions.pop(sid).reserved_tokens
            return expired

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
