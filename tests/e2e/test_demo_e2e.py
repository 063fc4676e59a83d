"""`tessera demo`, the README's main command, as a newcomer runs it: real processes.

The whole demo (inference with a kill -9 and training with a kill -9) must finish with the
same output as the run without a failure, and leave no process behind; Ctrl-C half-way must
stop everything it started, too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from support.procs import ManagedProcess

pytestmark = pytest.mark.slow


def demo_command(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "client.cli", "demo", "--workdir", str(workdir), *args]


def processes_using(workdir: Path) -> list[int]:
    """Live processes whose command line names the demo's folder (its coordinator and
    nodes keep their data there); zombies only wait for their parent and do not count."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ")[-1][:1]
            if str(workdir) in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def stop_all(demo: ManagedProcess, workdir: Path) -> None:
    """After a failure half-way: kill what the demo left, so later tests do not share it."""
    demo.kill()
    for pid in processes_using(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def assert_nothing_left(workdir: Path, log: str) -> None:
    deadline = time.monotonic() + 10
    while (left := processes_using(workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}\n{log[-3000:]}"


def serving(route: str, layer: int) -> list[str]:
    """The nodes of a printed route ("alpha [layers 0-1]  ->  bravo [layer 2]") whose hop
    runs ``layer``."""
    hops = re.findall(r"(\w+) \[layers? (\d+)(?:-(\d+))?\]", route)
    return [name for name, first, last in hops if int(first) <= layer <= int(last or first)]


def test_the_demo_runs_end_to_end_and_stops_everything(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    demo = ManagedProcess(demo_command(workdir), tmp_path / "demo.log", name="demo").start()
    try:
        code = demo.wait(timeout=420)
        log = demo.log_text()
        assert code == 0, log[-3000:]
        # The node killed is the one this run routed the middle stage through, and it is
        # the one every fail-over moved layers away from.
        killed = re.search(r"kill -9 (\w+) \(pid", log)
        assert killed, log[-3000:]
        route = re.search(r"route so far: (.*)", log)
        assert route and killed[1] in serving(route[1], layer=2), log[-3000:]
        moved_from = re.findall(r"fail-over at position \d+: layers [\d-]+ moved from (\w+)", log)
        assert moved_from and set(moved_from) == {killed[1]}, log[-3000:]
        assert "identical to the run without a failure: yes" in log
        assert "every stage rolled back to the last consistent checkpoint" in log
        assert "trained weights registered as model" in log
        learned = re.search(r"accuracy (\d+)% -> (\d+)%", log)
        assert learned and int(learned[2]) > int(learned[1]), log[-3000:]
        assert_nothing_left(workdir, log)
    finally:
        stop_all(demo, workdir)


def test_ctrl_c_half_way_stops_everything_and_a_rerun_there_starts_afresh(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    demo = ManagedProcess(demo_command(workdir), tmp_path / "demo.log", name="demo").start()
    try:
        demo.wait_for_line(r"3\. generating", timeout=300)
        assert processes_using(workdir), "the swarm should be running by now"
        # To the demo alone, not its process group: it must stop its children itself.
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 130
        log = demo.log_text()
        assert "interrupted: stopping every process the demo started" in log
        assert_nothing_left(workdir, log)
    finally:
        stop_all(demo, workdir)
    # The same --workdir again: its coordinator's database already holds the model, which
    # the demo imports anew (it failed with ALREADY_EXISTS before it cleared that state).
    short = ("--no-training", "--tokens", "6", "--kill-after", "2")
    again = ManagedProcess(demo_command(workdir, *short), tmp_path / "again.log", name="again")
    again.start()
    try:
        code = again.wait(timeout=300)
        log = again.log_text()
        assert code == 0, log[-3000:]
        assert "cleared an earlier demo's coordinator, nodes and logs" in log
        assert "identical to the run without a failure: yes" in log
        assert_nothing_left(workdir, log)
    finally:
        stop_all(again, workdir)
