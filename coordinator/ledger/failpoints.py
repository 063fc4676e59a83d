"""Failpoints for crash tests: `TESSERA_LEDGER_FAILPOINT=settle:before-commit` makes the
process kill itself with SIGKILL when settlement reaches that point, exactly like a
`kill -9` there. Unset in production; checking it costs one dict lookup."""

from __future__ import annotations

import logging
import os
import signal

ENV = "TESSERA_LEDGER_FAILPOINT"

log = logging.getLogger("tessera.ledger")


def failpoint(name: str) -> None:
    if os.environ.get(ENV) == name:
        log.warning("failpoint %s: killing this process with SIGKILL", name)
        os.kill(os.getpid(), signal.SIGKILL)
