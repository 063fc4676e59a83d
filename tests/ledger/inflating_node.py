"""A cheating node agent for tests: the real `tessera-node` whose usage receipts claim ten
times the tokens it computed (and signs them with its real key). Run as a script with the
arguments of `python -m node_agent.cli`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node_agent import cli, receipts  # noqa: E402

_honest = receipts.UsageMeter.record


def _inflated(self, session_id, layer_start, layer_end, step, tokens, *rest, **named):  # noqa: ANN001, ANN002, ANN003, ANN202
    return _honest(self, session_id, layer_start, layer_end, step, tokens * 10, *rest, **named)


receipts.UsageMeter.record = _inflated  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
