"""A machine whose clock is wrong, for the code that stamps signed requests
(protos/coordinator_clock.py), in this process only: the coordinator's processes keep the
right time."""

from __future__ import annotations

import time
import types

import pytest

from protos import coordinator_clock


def set_clock_off(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """From now on, this process stamps requests as if its clock ran ``seconds`` ahead
    (negative: behind)."""
    wrong = types.SimpleNamespace(time=lambda: time.time() + seconds)
    monkeypatch.setattr(coordinator_clock, "time", wrong)
