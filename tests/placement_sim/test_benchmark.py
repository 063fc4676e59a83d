"""Every system on the same scenario: sane results, none above the bound; the command runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_sim.evaluate import default_systems, run_scenario
from placement_sim.gpus import GPUS
from placement_sim.models import LLAMA2_7B, LLAMA2_13B, LLAMA2_70B
from placement_sim.scenarios import (
    EUROPE,
    EVERYWHERE,
    FULL,
    NORTH_ATLANTIC,
    US_EAST,
    Scenario,
    quick,
)
from placement_sim.swarm import ServingParams
from placement_sim.tessera import TesseraSystem
from placement_toy import HOME, node, swarm, toy_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_card_table_has_the_required_cards():
    required = {
        "RTX 3060 12GB": 12,
        "RTX 3070 8GB": 8,
        "RTX 3080 10GB": 10,
        "RTX 3090 24GB": 24,
        "RTX 4060 Ti 16GB": 16,
        "RTX 4070 12GB": 12,
        "RTX 4090 24GB": 24,
        "RTX A4000 16GB": 16,
    }
    for name, memory in required.items():
        assert GPUS[name].memory_gib == memory
        assert GPUS[name].fp16_tflops > 0 and GPUS[name].memory_gbps > 0


def test_llama2_shapes_have_their_published_sizes():
    def total(m):
        return m.num_layers * m.params_per_layer + m.embed_params + m.head_params

    assert round(total(LLAMA2_7B) / 1e9, 2) == 6.74
    assert round(total(LLAMA2_13B) / 1e9, 2) == 13.02
    assert round(total(LLAMA2_70B) / 1e9, 2) == 68.98


def test_tessera_adapter_routes_through_the_planners_layout():
    model = toy_model(4)
    s = swarm(node("a"), node("b"), model=model)
    system = TesseraSystem(s, replicas=2)
    system.start()
    hops = system.route(HOME, {}, set())
    assert hops[0].start == 0 and hops[-1].end == 4
    assert all(x.end == y.start for x, y in zip(hops, hops[1:], strict=False))
    assert system.route(HOME, {}, full=set(system.ranges())) is None


@pytest.mark.parametrize("name", [s.name for s in FULL])
def test_no_system_beats_the_upper_bound(name):
    scenario = quick([s for s in FULL if s.name == name])[0]
    result = run_scenario(scenario, ServingParams(), default_systems(2))
    assert result.bound_tokens_per_s > 0
    for system in result.systems:
        assert 0 < system.served.tokens_per_s <= result.bound_tokens_per_s, system.name
        assert system.served.sessions > 0
        assert system.moved_per_event_bytes >= 0
    # The best found is a real plan too: served below the bound.
    assert result.found is not None
    assert 0 < result.found.tokens_per_s <= result.bound_tokens_per_s


@pytest.mark.parametrize(
    ("model", "nodes", "mix", "regions", "seed"),
    [
        # Five 24 GB / 16 GB cards in one region: most sessions stay on one card, whose
        # 4th slot an earlier bound charged a batch-4 hand-off it never pays (it fell
        # below what Tessera and Parallax serve here: 316.7 < 317.9, 326.7 < 328.4).
        (LLAMA2_7B, 5, "high-end", US_EAST, 116),
        (LLAMA2_7B, 5, "high-end", US_EAST, 127),
        (LLAMA2_7B, 6, "steam", US_EAST, 116),
        (LLAMA2_13B, 8, "steam", NORTH_ATLANTIC, 103),
        (LLAMA2_70B, 12, "high-end", EUROPE, 104),
        # A node or two per region: sessions on one card each, and pipelines that must
        # cross regions (way (e) prices the crossings and the clients' legs per region).
        (LLAMA2_7B, 6, "high-end", EVERYWHERE, 131),
        (LLAMA2_13B, 10, "steam", EVERYWHERE, 105),
    ],
)
@pytest.mark.parametrize("kv_tokens", [2048, 4096])
def test_no_system_beats_the_upper_bound_on_small_swarms(
    model, nodes, mix, regions, seed, kv_tokens
):
    # 4096 tokens: 8 slots, whose batch-8 hand-offs make some ways of charging (step 3b)
    # credit more than a session costs; those bound nothing and must be left out.
    scenario = Scenario(f"small-{seed}", model, nodes, mix, regions, 2, seed)
    result = run_scenario(scenario, ServingParams(kv_tokens=kv_tokens), default_systems(2))
    assert 0 < result.bound_tokens_per_s < float("inf")
    for system in result.systems:
        assert system.served.tokens_per_s <= result.bound_tokens_per_s, system.name
    assert result.found is not None
    assert result.found.tokens_per_s <= result.bound_tokens_per_s


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    model=st.sampled_from([LLAMA2_7B, LLAMA2_13B, LLAMA2_70B]),
    nodes=st.integers(5, 14),
    mix=st.sampled_from(["steam", "high-end", "low-memory"]),
    regions=st.sampled_from([US_EAST, EUROPE, NORTH_ATLANTIC, EVERYWHERE]),
    kv_tokens=st.sampled_from([2048, 4096]),
    seed=st.integers(0, 10**6),
)
def test_no_system_beats_the_upper_bound_on_random_small_swarms(
    model, nodes, mix, regions, kv_tokens, seed
):
    # The bound is a proof; a proof that a real system beats is wrong. Random swarms,
    # fixed examples (derandomize) so that CI runs the same ones every time.
    scenario = Scenario(f"random-{seed}", model, nodes, mix, regions, 0, seed)
    result = run_scenario(scenario, ServingParams(kv_tokens=kv_tokens), default_systems(2))
    for system in result.systems:
        assert system.served.tokens_per_s <= result.bound_tokens_per_s, system.name
    assert result.found is not None
    assert result.found.tokens_per_s <= result.bound_tokens_per_s


def test_the_command_prints_tables_and_the_summary_line_last():
    out = subprocess.run(
        [
            sys.executable,
            "bench/placement.py",
            "--quick",
            "--skip-plan-times",
            "--scenario",
            "70b-europe-highend",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(
        r"planner vs parallax: \d+\.\d\d, vs petals: \d+\.\d\d, vs bound: \d+\.\d\d", lines[-1]
    ), lines[-1]
    assert any(line.startswith("parallax") for line in lines)
    assert any(line.startswith("upper bound") for line in lines)
    assert any(line.startswith("best found") for line in lines)
    assert any("vs best found by search" in line for line in lines)


def test_the_command_names_a_wrong_scenario():
    out = subprocess.run(
        [sys.executable, "bench/placement.py", "--scenario", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "unknown scenario" in out.stderr
