"""How long the training driver waits for one stage call, from the node's own past calls.

A node that hangs with its connection open (a PC gone to sleep, a process stopped, a GPU
driver wedged) answers nothing and closes nothing: without a deadline of its own the job
would wait out the RPC timeout, which has to be generous (a node's first call may compile
kernels or page in its weights). So once a node has answered a few calls of one kind, a
call of that kind gets ``max(floor_s, factor x the slowest of its recent answers)`` and the
cold timeout only caps it. The micro-batches of a job all have one shape, so a node's calls
of one kind cost the same from step to step; their times include what they waited behind
the node's other micro-batches, which recurs every step too. Only recent answers count, so
a slow first step (kernel compilation) stops widening the deadline once it has passed.

A lockstep shadow (a checker) has such a deadline of its own, and once the primary has
answered the very same call, at most ``patience`` more: a checker that is slow or gone
stops checking, it never holds the job back (client/training_driver.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The calls of an optimizer step, whose cost repeats step after step. OpenTraining (which
# may download a checkpoint) and SaveCheckpoint (an upload) always get the cold timeout.
STEP_CALLS = frozenset({"ForwardTrain", "BackwardTrain", "GradNorm", "OptimizerStep"})


@dataclass
class StepDeadlines:
    cold_s: float  # no reference yet, and the cap of every deadline
    floor_s: float
    factor: float
    recent: int = 32  # answers kept per (node, call): 16 steps of 2 micro-batches
    min_samples: int = 2
    _walls: dict[tuple[str, str], deque[float]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # A floor above the cold timeout is allowed: the cold timeout caps every deadline.
        if not (self.floor_s > 0 and self.cold_s > 0 and self.factor >= 1):
            raise ValueError(
                f"step deadlines need floor_s > 0, cold_s > 0 and factor >= 1, got floor_s="
                f"{self.floor_s}, cold_s={self.cold_s}, factor={self.factor}"
            )

    def answered(self, node_id: str, method: str, wall_s: float) -> None:
        if method in STEP_CALLS:
            walls = self._walls.setdefault((node_id, method), deque(maxlen=self.recent))
            walls.append(wall_s)

    def timeout(self, node_id: str, method: str) -> float:
        """The deadline of the next ``method`` call to ``node_id``."""
        walls = self._walls.get((node_id, method))
        if walls is None or len(walls) < self.min_samples:
            return self.cold_s
        return self.patience(max(walls))

    def patience(self, reference_s: float) -> float:
        """How long a call may take given a reference time: the deadline of a node's call
        from its slowest recent answer, and how long a shadow may still take to answer a
        call once the primary has, from the primary's time."""
        return min(self.cold_s, max(self.floor_s, self.factor * reference_s))
