"""bench/verification.py: its simulation agrees with the formula, and the command runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench" / "verification.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("verification_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_measured_detection_follows_the_formula() -> None:
    bench = load_bench()
    rows = bench.run(trials=400, seed=3)
    assert len(rows) == 3 * 3 + len(bench.ADAPTIVE) * 3
    for row in rows:
        # Binomial noise over 400 trials: sd <= 0.025; four of them either side.
        assert abs(row.detected - row.formula) < 0.1, row
        assert 0.0 < row.overhead_steady <= row.overhead_first <= 1.0, row
    adaptive = [r for r in rows if r.patient is not None]
    # Trust earned first makes a cheater harder to catch, never easier.
    assert all(r.patient <= r.detected + 0.1 for r in adaptive)


def test_the_command_ends_with_the_overhead_line() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--trials", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO_ROOT,
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("verification overhead at 99% detection: "), out.stdout[-500:]
