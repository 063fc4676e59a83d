"""When does straggler hedging help, and when does it cost? A queueing simulation.

One pipeline stage served by `replicas` nodes, each a FIFO queue. Requests (decode steps
of many sessions) arrive as a Poisson stream at a load of rho (fraction of the replicas'
total capacity); each goes to a random replica (its session's primary). Service times are
those of a consumer swarm: usually `base_ms`, but with probability `straggle_p` the node
stalls for `straggle_ms` (a busy GPU, a congested link, a GC pause).

Policies, side by side on the same arrivals and service draws:
  * none:   wait for the primary.
  * h-p50:  the same with the median as the reference instead of the p95.
  * hedge:  the driver's policy (client/hedging.py): a request still unanswered after
            max(floor, factor x p95 of recent times) is also queued on another replica,
            after the replay of `replay_ms` of history; the first answer wins and the
            loser is cancelled when it has not started yet (a started one runs on: the
            node cannot be interrupted mid-step).

Simplification: requests are handled in arrival order, so a hedge takes its place in the
alternate's queue ahead of requests that arrive between the original request and the
hedge (a few ms at most here); this slightly favours hedging at high load.

It prints p50/p95/p99 latency per load and the extra work hedging added. Aktas & Soljanin
("Straggler mitigation at scale", 2019) show that redundancy beats relaunch at low and
moderate load and hurts at high load, where the duplicates queue behind real work; the
simulation shows where that crossover lies for these numbers.

    python -m bench.hedging [--requests 20000] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Swarm:
    replicas: int = 4
    base_ms: float = 20.0
    straggle_p: float = 0.01
    straggle_ms: float = 500.0
    replay_ms: float = 10.0  # the alternate rebuilds the session's cache first


@dataclass(frozen=True)
class Policy:
    hedge: bool
    factor: float = 3.0
    floor_ms: float = 50.0
    quantile: float = 95.0  # the driver's trigger: factor x this percentile of recent times


def simulate(
    swarm: Swarm, rho: float, policy: Policy, n: int, seed: int
) -> tuple[np.ndarray, float]:
    """Latencies (ms) of n requests, and the work done per request relative to none."""
    rng = random.Random(seed)
    mean_service = swarm.base_ms * (1 - swarm.straggle_p) + swarm.straggle_ms * swarm.straggle_p
    rate = rho * swarm.replicas / mean_service  # arrivals per ms
    free_at = [0.0] * swarm.replicas  # when each replica's queue drains (FIFO)
    # What each session's driver sees of a node: the recent latencies of calls to it.
    recent: list[list[float]] = [[] for _ in range(swarm.replicas)]
    latencies = np.empty(n)
    work = 0.0
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        primary = rng.randrange(swarm.replicas)
        service = swarm.straggle_ms if rng.random() < swarm.straggle_p else swarm.base_ms
        alt_service = swarm.straggle_ms if rng.random() < swarm.straggle_p else swarm.base_ms
        start = max(t, free_at[primary])
        done = start + service
        free_at[primary] = done
        work += service
        finish = done
        seen = recent[primary]
        if policy.hedge and len(seen) >= 8:
            typical = float(np.percentile(seen[-32:], policy.quantile))
            hedge_at = t + max(policy.floor_ms, policy.factor * typical)
            if done > hedge_at:
                alternate = (primary + 1 + rng.randrange(swarm.replicas - 1)) % swarm.replicas
                alt_start = max(hedge_at, free_at[alternate])
                alt_done = alt_start + swarm.replay_ms + alt_service
                if alt_done < done:
                    finish = alt_done
                    # The primary is cancelled if it had not started; else it runs on.
                    if start > alt_done:
                        free_at[primary] -= service
                        work -= service
                free_at[alternate] = alt_done
                work += swarm.replay_ms + alt_service
        latencies[i] = finish - t
        seen.append(finish - t)
    return latencies, work / n / mean_service


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    swarm = Swarm()
    print(
        f"{swarm.replicas} replicas, {swarm.base_ms:.0f} ms steps, {swarm.straggle_p:.0%} "
        f"stall {swarm.straggle_ms:.0f} ms, replay {swarm.replay_ms:.0f} ms; "
        f"{args.requests} requests per cell"
    )
    print(f"{'load':>5} {'policy':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'work':>6}")
    ratios = []
    for rho in (0.2, 0.4, 0.6, 0.8, 0.9):
        row = {}
        policies = (
            ("none", Policy(False)),
            ("hedge", Policy(True)),
            ("h-p50", Policy(True, quantile=50.0)),
        )
        for name, policy in policies:
            lat, work = simulate(swarm, rho, policy, args.requests, args.seed)
            p50, p95, p99 = np.percentile(lat, [50, 95, 99])
            row[name] = p95
            print(f"{rho:>5.1f} {name:>6} {p50:>8.1f} {p95:>8.1f} {p99:>8.1f} {work:>6.2f}")
        ratios.append((rho, row["hedge"] / row["none"], row["h-p50"] / row["none"]))
    print(
        "p95 latency vs no hedging, by load (p95 trigger / p50 trigger): "
        + ", ".join(f"{rho:.1f}: {a:.2f}/{b:.2f}" for rho, a, b in ratios)
    )


if __name__ == "__main__":
    main()
