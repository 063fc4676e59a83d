"""`tessera-coordinator` run in the test's own process, for its many quick refusals."""

from __future__ import annotations

import logging

from coordinator.cli import main


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in-process (argparse exits via SystemExit): fast enough for many cases."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:  # main() configures logging for a whole process; give pytest its own back
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err
