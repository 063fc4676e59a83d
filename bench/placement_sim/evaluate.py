"""Run every system on the same scenario and collect what the benchmark reports."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .gpus import GPUS, MIXES
from .models import ModelShape
from .parallax import ParallaxSystem
from .petals_greedy import PetalsSystem
from .pipeline_search import searched_served
from .regions import REGIONS, Site, draw_access
from .scenarios import Scenario
from .serving import Served, saturate
from .swarm import ServingParams, SimNode, Swarm
from .system import PlacementSystem
from .tessera import TesseraSystem
from .upper_bound import upper_bound_tokens_per_s

SystemFactory = Callable[[Swarm, int], PlacementSystem]


def default_systems(replicas: int) -> list[tuple[str, SystemFactory]]:
    """Tessera as the coordinator runs it, Tessera using every node, and the baselines."""
    return [
        (
            f"tessera r={replicas}",
            lambda swarm, seed: TesseraSystem(
                swarm, replicas=replicas, name=f"tessera r={replicas}"
            ),
        ),
        (
            "tessera r=all",
            lambda swarm, seed: TesseraSystem(swarm, replicas=None, name="tessera r=all"),
        ),
        ("petals", lambda swarm, seed: PetalsSystem(swarm, seed=seed)),
        ("parallax", lambda swarm, seed: ParallaxSystem(swarm)),
    ]


@dataclass(frozen=True)
class SystemResult:
    name: str
    plan_s: float
    nodes_used: int
    served: Served
    moved_per_event_bytes: float
    after_churn: Served


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    bound_tokens_per_s: float
    systems: tuple[SystemResult, ...]
    # The best plan of whole pipelines the search found on this model (None: not run).
    found: Served | None = None

    def by_name(self, name: str) -> SystemResult:
        return next(s for s in self.systems if s.name == name)


def client_count(swarm: Swarm) -> int:
    """Enough arrivals to saturate any placement: one per KV slot in the swarm."""
    return len(swarm.nodes) * swarm.params.slots + 1


def run_system(
    scenario: Scenario, params: ServingParams, factory: SystemFactory, clients: Sequence[Site]
) -> SystemResult:
    swarm = Swarm.of(scenario.model, params, scenario.build_nodes())
    system = factory(swarm, scenario.seed)
    started = time.process_time()
    system.start()
    plan_s = time.process_time() - started
    nodes_used = len(system.ranges())
    served = saturate(system, clients)

    moved: list[int] = []
    for event in scenario.churn():
        if event.kind == "join":
            assert event.node is not None
            swarm.add(event.node)
            moved.append(system.join(event.node, event.time_s))
        elif event.node_id in swarm.nodes:
            swarm.remove(event.node_id)
            moved.append(system.leave(event.node_id, event.time_s))
    after = saturate(system, clients)
    return SystemResult(
        system.name,
        plan_s,
        nodes_used,
        served,
        float(np.mean(moved)) if moved else 0.0,
        after,
    )


def run_scenario(
    scenario: Scenario,
    params: ServingParams,
    systems: Sequence[tuple[str, SystemFactory]],
    log: Callable[[str], None] = lambda _: None,
    search: bool = True,
) -> ScenarioResult:
    swarm = Swarm.of(scenario.model, params, scenario.build_nodes())
    clients = scenario.clients(client_count(swarm))
    bound = upper_bound_tokens_per_s(swarm, clients)
    found = None
    if search:
        started = time.perf_counter()
        found = searched_served(swarm, clients)  # reads the swarm, as the bound does
        log(f"  {scenario.name}: search done in {time.perf_counter() - started:.1f} s")
    results = []
    for name, factory in systems:
        started = time.perf_counter()
        results.append(run_system(scenario, params, factory, clients))
        log(f"  {scenario.name}: {name} done in {time.perf_counter() - started:.1f} s")
    return ScenarioResult(scenario, bound, tuple(results), found)


def plan_time_swarm(model: ModelShape, params: ServingParams, size: int, seed: int) -> Swarm:
    """A steam-mix swarm spread over every region, for timing the planners alone."""
    rng = random.Random(seed)
    mix = MIXES["steam"]
    cards = list(mix)
    nodes = []
    for i in range(size):
        gpu = GPUS[rng.choices(cards, weights=[mix[c] for c in cards])[0]]
        nodes.append(SimNode(f"p{i:05d}", gpu, Site(rng.choice(REGIONS), draw_access(rng))))
    return Swarm.of(model, params, nodes)


PLAN_TIME_REPEATS = 3


def plan_time_s(
    model: ModelShape,
    params: ServingParams,
    factory: SystemFactory,
    size: int,
    seed: int,
    repeats: int = PLAN_TIME_REPEATS,
) -> float:
    """CPU seconds of the initial placement, the least of `repeats` runs of the same plan
    on a fresh swarm (this process's CPU time: on a shared machine wall time mostly
    measures the neighbours; and on a virtual machine the same work took 0.55-1.3 s of CPU
    from one run to the next, so the least, as `timeit` advises, is what the code costs).
    Every system is timed the same way."""
    best = float("inf")
    for _ in range(repeats):
        swarm = plan_time_swarm(model, params, size, seed)
        system = factory(swarm, seed)
        started = time.process_time()
        system.start()
        best = min(best, time.process_time() - started)
    return best
