"""bench/cuda_check.py, the GPU check, runs end to end on a CPU (--device cpu --quick).

CI has no GPU, so this is the only run the script gets there: the probe, the parity table
against transformers and the checks' tolerances, the speed table, and a swarm of real node
processes checking each other. On a GPU the same code runs in fp16/bf16 with CUDA graphs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_on_a_cpu(tmp_path: Path) -> None:
    report = tmp_path / "cuda_check.json"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "bench" / "cuda_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "cuda check: PASS"
    data = json.loads(report.read_text())
    assert data["failures"] == []
    assert data["device"]["tflops"] > 0 and data["device"]["bandwidth_gbps"] > 0
    # The runtime's fp32 logits are transformers' to rounding, and every honest error of
    # the parity table is far under the fp32 tolerance.
    assert data["transformers_vs_runtime_fp32"] < 1e-5
    assert data["parity"] and max(data["parity"].values()) < 1e-4
    assert data["corrupt_error"] > 0.3
    assert data["speed float32 runtime"]["decode_tok_s"] > 0
    runs = data["swarm"]
    assert len(runs) == 4 and all(r["mismatches"] == 0 and len(r["ids"]) == 16 for r in runs)
