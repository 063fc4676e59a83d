"""Verification benchmark: how often must we check to catch a cheater, and what does it cost?

A node corrupts a fraction f of its outputs (1%, 5%, 20%). Each of its calls is checked
against an independent replica with probability p; the first checked corruption is
detected (arbitration then bans the node). For 1,000 calls of the cheater the benchmark
measures the detection probability over many trials, next to the formula
1 - (1 - p*f)^n, and the extra compute: redundant calls per client call.

A second table repeats flat sampling with audits (a check also compares every earlier
call of its session on that hop, 40 calls a session): the same checks, more detection. It
is an upper estimate of what the driver gets: positions a fail-over replayed on a
replacement are not audited, nor are the last hop's rows the client let go for its
memory budget (docs/verification.md, "The last hop"). A third table adds what the
coordinator does with audits: each call an audit found right is a verified result, so an
honest node's check probability falls faster (its extra compute over its first 1,000
calls), while the audits still catch a corrupter's calls (detection).

Two policies, side by side in one run:
- flat sampling at p = 1%, 5%, 10%;
- adaptive replication (coordinator/verifier/reputation.py, the real Schedule): every call
  of a new node is checked until it has `warmup` consecutive verified results, then the
  probability falls as warmup/results down to p_min; any failure resets it. Its extra
  compute is what honest nodes pay: over their first 1,000 calls, and in steady state
  (calls 100,000-101,000), since trust earned once keeps paying off.

The call stream is simulated in this process (numpy random draws per call, the real
Schedule deciding p for every call) rather than sent over gRPC: a million calls per
configuration would take hours through real stage servers. The end-to-end path (real
failpoints, real arbitration and bans) is exercised by tests/verification/.
A check counts as one extra stage call; a checker that fell behind also catches up on
the positions it missed, as one batched prefill (see docs/verification.md).

    python bench/verification.py            # about a minute
    python bench/verification.py --trials 500

The last line is `verification overhead at 99% detection: X%`.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coordinator.verifier.reputation import Schedule  # noqa: E402

CALLS = 1000
CORRUPTIONS = (0.01, 0.05, 0.20)
FLAT_RATES = (0.01, 0.05, 0.10)
ADAPTIVE = (  # (warmup, p_min)
    (10, 0.01), (10, 0.02), (10, 0.05), (10, 0.10), (20, 0.02), (50, 0.02),
)  # fmt: skip
STEADY_FROM = 100_000  # calls an honest node has served when "steady state" is measured
SESSION_CALLS = 40  # calls of one node in one session, for the audit table
GOAL_DETECTION = 0.99
GOAL_OVERHEAD = 0.05


@dataclass(frozen=True)
class Row:
    policy: str
    corruption: float
    detected: float  # measured over trials: a cheater that corrupts from its first call
    formula: float  # 1 - (1 - p*f)^n, p = mean check probability over the n calls
    overhead_first: float  # honest node: checks per call over its first CALLS calls
    overhead_steady: float  # honest node: checks per call at steady state
    patient: float | None = None  # detected when it first earns trust for STEADY_FROM calls


def flat_detection(p: float, f: float, trials: int, rng: np.random.Generator) -> float:
    corrupted = rng.random((trials, CALLS)) < f
    checked = rng.random((trials, CALLS)) < p
    return float(np.mean(np.any(corrupted & checked, axis=1)))


def audited_detection(p: float, f: float, trials: int, rng: np.random.Generator) -> float:
    """Flat sampling where a check also audits every earlier call of its session on that
    hop: the checker's catch-up replays them and the client compares (docs/verification.md,
    "Catch-ups are audits"). A corrupt call is caught when a check follows it in its
    session, at no extra compute."""
    sessions = CALLS // SESSION_CALLS
    corrupted = rng.random((trials, sessions, SESSION_CALLS)) < f
    checked = rng.random((trials, sessions, SESSION_CALLS)) < p
    corrupt_so_far = np.cumsum(corrupted, axis=2) > 0
    return float(np.mean(np.any(corrupt_so_far & checked, axis=(1, 2))))


def adaptive_detection(
    schedule: Schedule,
    f: float,
    trials: int,
    rng: np.random.Generator,
    trusted: int = 0,
    *,
    audits: bool = False,
) -> float:
    """Each trial: a node corrupting f of its outputs, checked as the Schedule says. It
    starts new, or (``trusted``) with that many consecutive verified results earned
    honestly first: the patient cheater. With ``audits`` a check also compares the
    unchecked calls of its session before it, and each one found right is a verified
    result too (so the cheater's honest calls lower its check probability faster)."""
    caught = 0
    for _ in range(trials):
        consecutive = trusted
        unchecked = 0  # calls of this session since its last check
        corrupt_unchecked = False
        draws = rng.random((CALLS, 2))
        for call, (corrupt_draw, check_draw) in enumerate(draws):
            if call % SESSION_CALLS == 0:
                unchecked, corrupt_unchecked = 0, False
            corrupt = corrupt_draw < f
            if check_draw >= schedule.probability(consecutive):
                unchecked += 1
                corrupt_unchecked |= corrupt
                continue
            if corrupt or (audits and corrupt_unchecked):
                caught += 1  # one signed wrong output, arbitrated: banned
                break
            consecutive += 1 + (unchecked if audits else 0)
            unchecked = 0
    return caught / trials


def honest_trajectory(
    schedule: Schedule, calls: int, rng: np.random.Generator, *, audits: bool = False
) -> tuple[np.ndarray, int]:
    """Check probability at each call of an honest node (checks always pass), and the
    consecutive verified results it holds at the end. With ``audits`` a check's catch-up
    also credits every unchecked call of its session before it (SESSION_CALLS calls a
    session), as the coordinator credits audit agreements."""
    probabilities = np.empty(calls)
    consecutive = 0
    unchecked = 0  # calls of the session so far that no check or audit has covered
    draws = rng.random(calls)
    for i in range(calls):
        if i % SESSION_CALLS == 0:
            unchecked = 0
        p = schedule.probability(consecutive)
        probabilities[i] = p
        if draws[i] < p:
            consecutive += 1 + (unchecked if audits else 0)
            unchecked = 0
        else:
            unchecked += 1
    return probabilities, consecutive


def run(trials: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    work = len(FLAT_RATES) * len(CORRUPTIONS) + len(ADAPTIVE) * (len(CORRUPTIONS) + 1)
    with tqdm(total=work, desc="configurations", unit="cfg", leave=False) as progress:
        for p in FLAT_RATES:
            for f in CORRUPTIONS:
                detected = flat_detection(p, f, trials, rng)
                formula = 1 - (1 - p * f) ** CALLS
                rows.append(Row(f"flat p={p:.0%}", f, detected, formula, p, p))
                progress.update()
        for warmup, p_min in ADAPTIVE:
            schedule = Schedule(warmup=warmup, p_min=p_min)
            honest, trusted = honest_trajectory(schedule, STEADY_FROM, rng)
            first, steady = float(honest[:CALLS].mean()), schedule.probability(trusted)
            progress.update()
            for f in CORRUPTIONS:
                detected = adaptive_detection(schedule, f, trials, rng)
                patient = adaptive_detection(schedule, f, trials, rng, trusted)
                formula = 1 - float(np.prod(1 - honest[:CALLS] * f))
                name = f"adaptive w={warmup} min={p_min:.0%}"
                rows.append(Row(name, f, detected, formula, first, steady, patient))
                progress.update()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Detection probability within 1,000 calls vs extra compute, for flat and "
        "adaptive sampling against nodes corrupting 1%, 5% and 20% of their outputs.",
        epilog="example: python bench/verification.py --trials 2000",
    )
    parser.add_argument("--trials", type=int, default=1000, help="cheaters per configuration")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    began = time.monotonic()
    rows = run(args.trials, args.seed)
    print(f"{CALLS} calls per cheater, {args.trials} trials per configuration")
    print(
        f"{'policy':<26}{'corrupt':>8}{'detected':>10}{'formula':>9}"
        f"{'extra (first 1k)':>18}{'extra (steady)':>16}{'patient':>9}"
    )
    for r in rows:
        patient = "-" if r.patient is None else f"{r.patient:.4f}"
        print(
            f"{r.policy:<26}{r.corruption:>8.0%}{r.detected:>10.4f}{r.formula:>9.4f}"
            f"{r.overhead_first:>18.2%}{r.overhead_steady:>16.2%}{patient:>9}"
        )
    print(
        "detected: a new node corrupting from its first call; patient: one that first earns "
        f"trust honestly for {STEADY_FROM:,} calls, then corrupts (detection within the next "
        f"{CALLS} calls)"
    )
    print(
        f"\nwith audits: a check also compares every earlier call of its session on that hop "
        f"({SESSION_CALLS} calls a session), same extra compute;"
        " an upper estimate (module docstring)"
    )
    print(f"{'policy':<26}{'corrupt':>8}{'checks only':>13}{'with audits':>13}")
    audit_rng = np.random.default_rng(args.seed + 1)
    for r in rows:
        if r.policy.startswith("flat"):
            audited = audited_detection(r.overhead_first, r.corruption, args.trials, audit_rng)
            print(f"{r.policy:<26}{r.corruption:>8.0%}{r.detected:>13.4f}{audited:>13.4f}")
    print(
        "\ntrust from audits (the coordinator credits each audited call as a verified "
        f"result): an honest node's checks per call over its first {CALLS} calls, and a 5% "
        f"corrupter's detection within its first {CALLS} calls, checks alone vs audits that "
        "detect and earn trust"
    )
    print(
        f"{'policy':<26}{'extra, checks':>14}{'with audits':>13}{'detected':>10}{'with audits':>13}"
    )
    for warmup, p_min in ADAPTIVE:
        schedule = Schedule(warmup=warmup, p_min=p_min)
        alone, _ = honest_trajectory(schedule, CALLS, audit_rng)
        with_audits, _ = honest_trajectory(schedule, CALLS, audit_rng, audits=True)
        caught = adaptive_detection(schedule, 0.05, args.trials, audit_rng)
        caught_audited = adaptive_detection(schedule, 0.05, args.trials, audit_rng, audits=True)
        name = f"adaptive w={warmup} min={p_min:.0%}"
        print(
            f"{name:<26}{alone.mean():>14.2%}{with_audits.mean():>13.2%}{caught:>10.4f}"
            f"{caught_audited:>13.4f}"
        )
    # Cheapest policy that reaches the detection goal against a 5% corrupter.
    qualifying = [r for r in rows if r.corruption == 0.05 and r.detected >= GOAL_DETECTION]
    print(f"({time.monotonic() - began:.0f} s)")
    if not qualifying:
        print("no configuration reached 99% detection of a 5%-corrupting node")
        print("verification overhead at 99% detection: n/a")
        return 1
    best = min(qualifying, key=lambda r: (r.overhead_steady, r.overhead_first))
    met = "meets" if best.overhead_steady <= GOAL_OVERHEAD else "misses"
    print(
        f"cheapest at >= 99% detection of a 5% corrupter: {best.policy} (detected "
        f"{best.detected:.4f}, formula {best.formula:.4f}); extra compute "
        f"{best.overhead_steady:.2%} in steady state, {best.overhead_first:.2%} over an honest "
        f"node's first {CALLS} calls; {met} the <= {GOAL_OVERHEAD:.0%} goal"
    )
    robust = [
        r
        for r in rows
        if r.corruption == 0.05
        and (r.patient if r.patient is not None else r.detected) >= GOAL_DETECTION
    ]
    if robust:
        cheapest = min(robust, key=lambda r: r.overhead_steady)
        print(
            f"also against a patient cheater: {cheapest.policy} at "
            f"{cheapest.overhead_steady:.2%} extra compute"
        )
    print(f"verification overhead at 99% detection: {100 * best.overhead_steady:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
