"""deploy/*.service: systemd accepts every line, and the programs accept every flag.

A unit is only read on an operator's machine, so a misspelt key (systemd ignores it with a
warning) or a flag a later release renamed (the service then exits 2 at every start) would
otherwise be found there. `systemd-analyze verify` reads each unit as systemd would, with
ExecStart pointed at this checkout's programs; the flags of each ExecStart go through the
program's own parser with the settings the unit's comments give as examples.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli import build_parser as coordinator_parser
from node_agent.cli import build_parser as node_parser

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "deploy").glob("*.service"))
INSTALLED_BIN = "/opt/tessera/venv/bin/"
PARSERS = {"tessera-coordinator": coordinator_parser, "tessera-node": node_parser}
EXAMPLE = re.compile(r"^#\s+(TESSERA_\w+)=(.*)$", re.MULTILINE)


def test_both_programs_have_a_unit() -> None:
    assert [u.name for u in UNITS] == ["tessera-coordinator.service", "tessera-node.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_reads_every_line(unit: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    here = tmp_path / unit.name
    here.write_text(unit.read_text().replace(INSTALLED_BIN, f"{Path(sys.executable).parent}/"))
    result = subprocess.run(
        [analyze, "verify", here.name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    said = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and said == "", said


def _exec_start(unit: Path) -> list[str]:
    text = unit.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_the_program_takes_every_flag(unit: Path) -> None:
    examples = dict(EXAMPLE.findall(unit.read_text()))
    assert examples, f"{unit.name} gives no example settings in its comments"
    argv = []
    for word in _exec_start(unit):
        word = word.replace("%d", "/run/credentials/x")
        if word.startswith("$") and not word.startswith("${"):
            argv += shlex.split(examples[word[1:]])  # $VAR: split into words, as systemd does
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: examples[m.group(1)], word))
    program = Path(argv[0]).name
    assert argv[0] == INSTALLED_BIN + program
    args = PARSERS[program]().parse_args(argv[1:])  # SystemExit(2) on any unknown flag
    assert args.command == argv[1]  # and the subcommand the unit means
