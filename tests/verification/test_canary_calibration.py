"""The canaries' calibration record: every honest error is counted per device/dtype pair,
and the coordinator warns when a pair's largest error grows past a fifth of its tolerance,
not on every canary that stays there (GPU bf16 pairs sit near a quarter of theirs)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import sqlite_utils

from coordinator.verifier.canaries import Canaries
from coordinator.verifier.service import NodeFacts


def test_a_pair_near_its_tolerance_is_reported_when_its_worst_error_grows(tmp_path, caplog):
    db = sqlite_utils.Database(tmp_path / "coordinator.db")
    canaries = Canaries(SimpleNamespace(_ctx=SimpleNamespace(db=db)))  # type: ignore[arg-type]
    gpu = NodeFacts("n1", "127.0.0.1:1", "acct", "cuda", "bfloat16")
    tolerance = 0.08
    with caplog.at_level(logging.WARNING, logger="tessera.verifier.canaries"):
        for error in (0.019, 0.018, 0.0185, 0.021, 0.005, 0.021):
            canaries._calibrate(gpu, [("cpu", "float32")], error, tolerance)
    warned = [r.getMessage() for r in caplog.records if "widen the tolerance" in r.getMessage()]
    assert len(warned) == 2, warned  # 0.019 (the first over 0.016) and 0.021 (a new high)
    assert "0.019" in warned[0] and "0.021" in warned[1]
    rows = list(db["canary_calibration"].rows)
    assert len(rows) == 1
    assert rows[0]["comparisons"] == 6 and rows[0]["max_error"] == 0.021
    assert rows[0]["pair"] == "cpu/float32~cuda/bfloat16"
