"""Plain-text tables and the summary line of the placement benchmark."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .evaluate import ScenarioResult


def _fmt(value: float, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def scenario_table(result: ScenarioResult) -> str:
    s = result.scenario
    regions = ", ".join(s.regions)
    lines = [
        f"== {s.name}: {s.model.name} on {s.nodes} nodes ({s.mix} mix; {regions}), "
        f"{s.churn_events} churn events ==",
        f"{'system':<15} {'used':>5} {'tok/s':>9} {'sess':>5} {'hops':>5} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'GB/event':>9} {'tok/s@end':>10} {'plan ms':>9}",
    ]
    for r in result.systems:
        lines.append(
            f"{r.name:<15} {r.nodes_used:>5} {_fmt(r.served.tokens_per_s):>9} "
            f"{r.served.sessions:>5} {_fmt(r.served.mean_hops):>5} "
            f"{_fmt(r.served.percentile_ms(50), 0):>8} {_fmt(r.served.percentile_ms(95), 0):>8} "
            f"{_fmt(r.moved_per_event_bytes / 1e9, 2):>9} "
            f"{_fmt(r.after_churn.tokens_per_s):>10} {_fmt(r.plan_s * 1000, 1):>9}"
        )
    found = result.found
    if found is not None:
        lines.append(
            f"{'best found':<15} {'':>5} {_fmt(found.tokens_per_s):>9} {found.sessions:>5} "
            f"{_fmt(found.mean_hops):>5} {_fmt(found.percentile_ms(50), 0):>8} "
            f"{_fmt(found.percentile_ms(95), 0):>8}"
        )
    lines.append(f"{'upper bound':<15} {'':>5} {_fmt(result.bound_tokens_per_s):>9}")
    return "\n".join(lines)


def found_line(results: Sequence[ScenarioResult], planner: str) -> str | None:
    """Where the best plan lies: between the best found by search and the bound; and how
    close the planner comes to the first (None when the search did not run)."""
    pairs = [
        (
            r.by_name(planner).served.tokens_per_s / r.found.tokens_per_s,
            r.found.tokens_per_s / r.bound_tokens_per_s,
        )
        for r in results
        if r.found is not None and r.found.tokens_per_s > 0 and r.bound_tokens_per_s > 0
    ]
    if not pairs:
        return None
    mine = min(p for p, _ in pairs)
    found = [f for _, f in pairs]
    return (
        f"{planner} vs best found by search: {mine:.2f} at the least; best found vs bound: "
        f"{min(found):.2f}-{max(found):.2f} (the best plan lies between the two)"
    )


def plan_time_table(times: Mapping[str, Mapping[int, float | None]], sizes: Sequence[int]) -> str:
    header = f"{'system':<15}" + "".join(f"{f'{n:,} nodes':>15}" for n in sizes)
    lines = [header]
    for name, by_size in times.items():
        cells = []
        for n in sizes:
            t = by_size.get(n)
            cells.append(f"{'(skipped)':>15}" if t is None else f"{t * 1000:>12,.1f} ms")
        lines.append(f"{name:<15}" + "".join(cells))
    return "\n".join(lines)


def ratios(results: Sequence[ScenarioResult], planner: str) -> dict[str, float]:
    """Minimum over scenarios of planner tokens/s divided by each reference's tokens/s."""
    worst = {"parallax": math.inf, "petals": math.inf, "bound": math.inf}
    for result in results:
        mine = result.by_name(planner).served.tokens_per_s
        refs = {
            "parallax": result.by_name("parallax").served.tokens_per_s,
            "petals": result.by_name("petals").served.tokens_per_s,
            "bound": result.bound_tokens_per_s,
        }
        for key, ref in refs.items():
            worst[key] = min(worst[key], mine / ref if ref > 0 else math.inf)
    return worst


def ratio_table(results: Sequence[ScenarioResult], planners: Sequence[str]) -> str:
    titles = "".join(f"{p + ' vs parallax/petals/bound':>44}" for p in planners)
    lines = [f"{'scenario':<22}" + titles]
    for result in results:
        cells = []
        for planner in planners:
            mine = result.by_name(planner).served.tokens_per_s
            parts = [
                mine / result.by_name("parallax").served.tokens_per_s,
                mine / result.by_name("petals").served.tokens_per_s,
                mine / result.bound_tokens_per_s,
            ]
            cells.append(f"{' / '.join(f'{x:.2f}' for x in parts):>44}")
        lines.append(f"{result.scenario.name:<22}" + "".join(cells))
    return "\n".join(lines)


def summary_line(worst: Mapping[str, float], prefix: str = "planner") -> str:
    return (
        f"{prefix} vs parallax: {worst['parallax']:.2f}, vs petals: {worst['petals']:.2f}, "
        f"vs bound: {worst['bound']:.2f}"
    )
