"""deploy/local_swarm.sh: brings a loopback swarm up, and takes every child down with it."""

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from support.procs import REPO_ROOT, ManagedProcess

pytestmark = pytest.mark.slow


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too: it only waits for its parent to read its status.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1].startswith("Z")


def test_the_swarm_comes_up_and_sigterm_stops_every_child(tmp_path: Path) -> None:
    script = REPO_ROOT / "deploy" / "local_swarm.sh"
    env = {"TESSERA_BACKOFF_CAP_S": "0.5"}
    swarm = ManagedProcess(
        ["bash", script, "-n", "2", "-d", tmp_path / "swarm"], tmp_path / "swarm.log", env=env
    ).start()
    try:
        swarm.wait_for_line("the swarm is up", timeout=180)
        log = swarm.log_text()
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", log)]
        assert len(pids) == 3, log  # the coordinator and two nodes
        assert "nodes list --data-dir" in log
        for i in (1, 2):
            assert "registered as" in (tmp_path / "swarm" / f"node-{i}" / "node.log").read_text()

        swarm.send_signal(signal.SIGTERM)
        assert swarm.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"children left behind: {pids}"
            time.sleep(0.05)
        node_log = (tmp_path / "swarm" / "node-1" / "node.log").read_text()
        assert "closed the stream" in node_log  # drained before the coordinator went
        assert "all stopped" in swarm.log_text()
    finally:
        # The script and its children share a process group (start_new_session): if the
        # test failed half-way, take the whole group down.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(swarm.pid, signal.SIGKILL)
        swarm.kill()


def test_bad_arguments_are_explained() -> None:
    import subprocess

    script = REPO_ROOT / "deploy" / "local_swarm.sh"
    bad = subprocess.run(["bash", script, "-n", "two"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "whole number" in bad.stderr
    helped = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "local_swarm.sh -n 5" in helped.stdout
