"""StageKVCache bookkeeping and the node-wide KVCacheManager budget."""

from __future__ import annotations

import threading

import pytest
import torch

from node_agent.runtime import (
    CacheBudgetError,
    CacheFullError,
    KVCacheManager,
    StageKVCache,
    UnknownSessionError,
    load_stage_model,
)


def small_cache(max_len: int, batch: int = 1) -> StageKVCache:
    return StageKVCache(num_layers=2, batch=batch, num_kv_heads=2, head_dim=4, max_len=max_len)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_manager(budget: int = 100, ttl: float = 5.0, clock: FakeClock | None = None):
    return KVCacheManager(budget, ttl, cache_factory=small_cache, clock=clock or FakeClock())


def test_update_returns_prefix_and_commit_tracks_length():
    cache = small_cache(max_len=8)
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    keys, values = cache.update(0, 0, k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert cache.length == 0  # only commit makes positions valid
    cache.commit(3)
    k2 = torch.randn(1, 2, 2, 4)
    keys, _ = cache.update(0, 3, k2, k2)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2))
    cache.commit(5)
    assert (cache.length, cache.remaining) == (5, 3)


def test_truncate_rolls_back():
    cache = small_cache(max_len=8)
    cache.commit(6)
    cache.truncate(2)
    assert cache.length == 2
    cache.check_append(2, 6)  # room again up to max_len
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(3)


def test_cache_full_and_gaps():
    cache = small_cache(max_len=4)
    with pytest.raises(CacheFullError, match="max_len"):
        cache.check_append(0, 5)
    cache.commit(3)
    with pytest.raises(CacheFullError):
        cache.check_append(3, 2)
    with pytest.raises(ValueError, match="skipped"):
        cache.check_append(4, 0)


def test_stage_forward_past_max_len_keeps_cache_intact(tiny_checkpoint):
    stage = load_stage_model(tiny_checkpoint("llama_gqa").path, 0, 2)
    cache = stage.new_cache(max_len=6)
    stage(torch.arange(4)[None], cache, 0)
    with pytest.raises(CacheFullError):
        stage(torch.arange(3)[None], cache, 4)
    assert cache.length == 4
    with pytest.raises(ValueError, match="batch"):
        stage(torch.zeros(2, 1, dtype=torch.int64), cache, 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        stage.new_cache(max_len=10_000)


def test_budget_enforced_and_released():
    manager = make_manager(budget=100)
    manager.open("a", max_len=60)
    with pytest.raises(CacheBudgetError, match="only 40 of 100"):
        manager.open("b", max_len=50)
    manager.open("b", max_len=40)
    assert manager.used_tokens == 100 and manager.free_tokens == 0
    assert manager.release("a") is True
    assert manager.release("a") is False
    assert manager.used_tokens == 40
    manager.open("c", max_len=20, batch=3)  # reserves max_len * batch
    assert manager.used_tokens == 100
    assert manager.get("c").batch == 3
    assert sorted(manager.session_ids()) == ["b", "c"]


def test_duplicate_and_unknown_sessions():
    manager = make_manager()
    manager.open("a", max_len=10)
    with pytest.raises(ValueError, match="already"):
        manager.open("a", max_len=10)
    with pytest.raises(UnknownSessionError, match="'zzz'"):
        manager.get("zzz")
    assert "a" in manager and "zzz" not in manager and len(manager) == 1


def test_a_cache_taken_from_one_manager_is_adopted_by_another_with_its_contents():
    """A dropped shard hands a live cache to the shard that holds its layers now: the
    same object, with what it holds, counted against the new budget and freed from the old."""
    old, new = make_manager(budget=100), make_manager(budget=50)
    cache = old.open("a", max_len=30)
    cache.update(0, 0, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    cache.commit(3)
    assert old.take("a") is cache
    assert old.used_tokens == 0 and "a" not in old
    assert old.take("a") is None
    new.adopt("a", cache)
    assert new.get("a") is cache and cache.length == 3
    assert new.used_tokens == 30
    with pytest.raises(ValueError, match="already"):
        new.adopt("a", cache)
    with pytest.raises(CacheBudgetError, match="only 20 of 50"):
        new.adopt("b", small_cache(30))
    assert new.used_tokens == 30 and "b" not in new


def test_idle_sessions_expire():
    clock = FakeClock()
    manager = make_manager(budget=100, ttl=5.0, clock=clock)
    manager.open("a", max_len=30)
    clock.now = 5.0
    manager.open("b", max_len=10)
    clock.now = 8.0
    manager.get("a")  # use refreshes the idle timer
    assert manager.expire_idle(now=10.0) == []  # b idle exactly the ttl: kept
    assert manager.expire_idle(now=12.0) == ["b"]
    assert manager.used_tokens == 30
    with pytest.raises(UnknownSessionError):
        manager.get("b")
    clock.now = 20.0
    assert manager.expire_idle() == ["a"]
    assert manager.used_tokens == 0


def test_concurrent_open_release_never_exceeds_budget():
    manager = KVCacheManager(50, 60.0, cache_factory=small_cache)
    peak: list[int] = []
    errors: list[BaseException] = []

    def worker(worker_id: int) -> None:
        try:
            for i in range(50):
                sid = f"{worker_id}-{i}"
                try:
                    manager.open(sid, max_len=10)
                except CacheBudgetError:
                    continue
                peak.append(manager.used_tokens)
                manager.release(sid)
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert max(peak) <= 50
    assert manager.used_tokens == 0 and len(manager) == 0
