"""Placement benchmark: Tessera's planner + router against Petals and Parallax, side by side.

Every system places the same model on the same simulated swarm (real cards, regional
RTTs, heavy-tailed churn), then serves the same stream of sessions with its own router.
The performance model, the baselines and the upper bound are described in
bench/placement_sim/ (README.md there). Run from the repository root:

    .venv/bin/python bench/placement.py            # full run, about 5-9 minutes on 2 cores
    .venv/bin/python bench/placement.py --quick    # smaller swarms, about 2 minutes

The last line is `planner vs parallax: X, vs petals: Y, vs bound: Z`: the minimum over
scenarios of Tessera's served tokens/s divided by each reference's.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # coordinator.planner / coordinator.router

from placement_sim.evaluate import (  # noqa: E402  (needs the path above)
    default_systems,
    plan_time_s,
    run_scenario,
)
from placement_sim.models import LLAMA2_70B  # noqa: E402
from placement_sim.parallax import ParallaxSystem  # noqa: E402
from placement_sim.petals_greedy import PetalsSystem  # noqa: E402
from placement_sim.report import (  # noqa: E402
    found_line,
    plan_time_table,
    ratio_table,
    ratios,
    scenario_table,
    summary_line,
)
from placement_sim.scenarios import FULL, quick  # noqa: E402
from placement_sim.swarm import ServingParams  # noqa: E402
from placement_sim.tessera import TesseraSystem  # noqa: E402

from coordinator.settings import Settings  # noqa: E402

log = logging.getLogger("tessera.bench.placement")
PLAN_SIZES = (100, 1_000, 10_000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Compare Tessera's planner and router with re-implementations of Petals' greedy "
            "block selection and Parallax's DP + water-filling, on the same simulated swarms "
            "of consumer GPUs. Prints a table per scenario, plan times at 100/1,000/10,000 "
            "nodes, and a last line 'planner vs parallax: X, vs petals: Y, vs bound: Z' "
            "(minimum ratio of served tokens/s over all scenarios)."
        ),
        epilog=(
            "Columns: used = nodes holding layers; tok/s = served tokens/s at saturation; "
            "sess = sessions admitted; hops = mean hops per session; p50/p95 ms = time per "
            "token of the admitted sessions; GB/event = weights fetched per churn event; "
            "tok/s@end = served tokens/s after the churn trace; plan ms = CPU time of the "
            "initial placement (the plan time table: the least CPU time of 3 runs of the "
            "same plan, since one run's varies by 2x on a virtual machine). The 'upper "
            "bound' row is what no placement and router can serve more than in this "
            "performance model: the least of six ways of pricing "
            "sessions, two of them linear programs over regions, nodes and their batches, "
            "the last with every session in one placement (SciPy's HiGHS; the proof is in "
            "bench/placement_sim/README.md). The 'best found' row is a real plan below "
            "it: the best plan of whole pipelines that a local search finds from Tessera's "
            "when it knows this performance model exactly (and ignores how likely nodes are "
            "to leave), served by Tessera's router; the best plan lies between the two "
            "rows (bench/placement_sim/pipeline_search.py)."
        ),
    )
    parser.add_argument(
        "--quick", action="store_true", help="a third of the nodes and 6 churn events"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="Tessera's `replicas` (default 2, the coordinator's default); the summary line "
        "uses this configuration, and a 'tessera r=all' row always shows every node in use",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this scenario (repeatable); names: " + ", ".join(s.name for s in FULL),
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=Settings.kv_tokens_per_shard,
        help="KV budget per shard (tokens; default %(default)s, what `tessera-coordinator "
        "serve` gives every shard)",
    )
    parser.add_argument(
        "--context-tokens", type=int, default=512, help="context each session keeps in cache"
    )
    parser.add_argument(
        "--client-gbps",
        type=float,
        default=25.0,
        help="memory bandwidth of a Petals client's CPU, which runs the LM head (GB/s; "
        "default 25: about half a dual-channel DDR4-3200 desktop's peak)",
    )
    parser.add_argument(
        "--skip-plan-times", action="store_true", help="do not time the planners at scale"
    )
    parser.add_argument(
        "--slow-plan-times",
        action="store_true",
        help="also time 'tessera r=all' at 10,000 nodes (planner v1 is quadratic there: "
        "30-50 s on 2 cores)",
    )
    parser.add_argument(
        "--skip-search",
        action="store_true",
        help="do not run the search for the 'best found' row (about 1 minute in all)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if not 0 < args.client_gbps < float("inf"):
        parser.error("--client-gbps must be a positive number")
    if args.kv_tokens < args.context_tokens or args.context_tokens < 1:
        parser.error("--kv-tokens must be >= --context-tokens >= 1")
    known = {s.name for s in FULL}
    unknown = [name for name in args.scenario if name not in known]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {sorted(known)}")
    return args


def plan_times(params: ServingParams, replicas: int, slow: bool) -> dict[str, dict]:
    """Initial placement time at each size. Petals' plan is the sequence of greedy joins
    (its rebalancing runs continuously afterwards, on each server)."""
    factories = {
        f"tessera r={replicas}": lambda s, seed: TesseraSystem(s, replicas=replicas),
        "tessera r=all": lambda s, seed: TesseraSystem(s, replicas=None),
        "petals": lambda s, seed: PetalsSystem(s, seed=seed, rebalance_on_start=False),
        "parallax": lambda s, seed: ParallaxSystem(s),
    }
    times: dict[str, dict] = {}
    for name, factory in factories.items():
        times[name] = {}
        for size in PLAN_SIZES:
            # Planner v1 with r=all is quadratic (30-50 s at 10,000 nodes): on request only.
            if not slow and name == "tessera r=all" and size >= 10_000:
                times[name][size] = None
                continue
            times[name][size] = plan_time_s(LLAMA2_70B, params, factory, size, seed=size)
            log.info("plan time %s at %d nodes: %.3f s", name, size, times[name][size])
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    params = ServingParams(
        kv_tokens=args.kv_tokens,
        context_tokens=args.context_tokens,
        client_memory_gbps=args.client_gbps,
    )
    scenarios = [s for s in FULL if not args.scenario or s.name in args.scenario]
    if args.quick:
        scenarios = quick(scenarios)
    started = time.perf_counter()
    print(
        f"placement benchmark: {len(scenarios)} scenario(s); KV {params.kv_tokens} tokens per "
        f"layer, {params.context_tokens}-token sessions -> {params.slots} sessions per node; "
        f"efficiency {params.compute_efficiency:.0%} of peak FLOPS, "
        f"{params.memory_efficiency:.0%} of peak bandwidth; LM head on the last node's GPU "
        f"(Petals: on the client's CPU at {params.client_memory_gbps:g} GB/s)"
    )
    systems = default_systems(args.replicas)
    results = []
    for scenario in scenarios:
        result = run_scenario(scenario, params, systems, log=log.info, search=not args.skip_search)
        results.append(result)
        print()
        print(scenario_table(result))

    if not args.skip_plan_times:
        print()
        print(f"== plan time ({LLAMA2_70B.name}, steam mix, all regions) ==")
        print(plan_time_table(plan_times(params, args.replicas, args.slow_plan_times), PLAN_SIZES))

    planner = f"tessera r={args.replicas}"
    print()
    print("== served tokens/s ratios ==")
    print(ratio_table(results, [planner, "tessera r=all"]))
    print(f"({time.perf_counter() - started:.0f} s)")
    found = found_line(results, planner)
    if found:
        print(found)
    print(summary_line(ratios(results, "tessera r=all"), prefix="planner (r=all)"))
    print(summary_line(ratios(results, planner)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
