"""A node agent for tests that turns bad: the real `tessera-node` with the real
TESSERA_FAILPOINTS from its environment (e.g. corrupt=1.0), held back until the file named
by $TESSERA_TEST_CHEAT_TRIGGER exists. Until then it works honestly, earns and can stake;
after, every output it signs is wrong (or, in training, every loss, input gradient or
optimizer step its failpoints name). It also claims an absurd matmul speed, so the router
sends it client traffic first (a cheater wants work). Run as a script with the arguments
of `python -m node_agent.cli`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node_agent import cli, failpoints  # noqa: E402

TRIGGER = Path(os.environ["TESSERA_TEST_CHEAT_TRIGGER"])
_tamper = failpoints.Failpoints.apply
_tamper_loss = failpoints.Failpoints.tamper_loss
_tamper_backward = failpoints.Failpoints.tamper_backward
_skips_step = failpoints.Failpoints.skips_step


async def _apply_when_triggered(self, output, request_input):  # noqa: ANN001, ANN202
    if not TRIGGER.exists():
        return output
    return await _tamper(self, output, request_input)


# Training's failpoints turn with the same trigger.
def _loss_when_triggered(self, loss):  # noqa: ANN001, ANN202
    return _tamper_loss(self, loss) if TRIGGER.exists() else loss


def _backward_when_triggered(self, grad):  # noqa: ANN001, ANN202
    return _tamper_backward(self, grad) if TRIGGER.exists() else grad


def _skips_when_triggered(self):  # noqa: ANN001, ANN202
    return TRIGGER.exists() and _skips_step(self)


failpoints.Failpoints.apply = _apply_when_triggered  # type: ignore[method-assign]
failpoints.Failpoints.tamper_loss = _loss_when_triggered  # type: ignore[method-assign]
failpoints.Failpoints.tamper_backward = _backward_when_triggered  # type: ignore[method-assign]
failpoints.Failpoints.skips_step = _skips_when_triggered  # type: ignore[method-assign]
cli.measure_tflops = lambda *args, **kwargs: 1000.0  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(cli.main())
