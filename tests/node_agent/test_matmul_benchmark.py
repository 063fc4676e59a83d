"""The start-up benchmark measures real throughput, quickly."""

import time

from node_agent.matmul_benchmark import measure_tflops


def test_cpu_benchmark_is_positive_and_fast() -> None:
    start = time.perf_counter()
    tflops = measure_tflops("cpu", budget_s=0.3)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0
    # Positive, and below what any CPU of today can do in fp32.
    assert 0.0 < tflops < 100.0


def test_the_budget_bounds_the_run_time() -> None:
    """The run lasts about its budget: at least it, plus set-up and a few warm-up matmuls."""
    took = {}
    for budget in (0.05, 0.6):
        start = time.perf_counter()
        measure_tflops("cpu", budget_s=budget)
        took[budget] = time.perf_counter() - start
    assert took[0.05] >= 0.05 and took[0.6] >= 0.6, took
    # The same set-up and warm-up on both sides: what is left is the budgets' difference
    # (0.55 s), whatever the machine's load; a benchmark ignoring its budget shows ~0.
    assert 0.35 < took[0.6] - took[0.05] < 1.2, took
