"""Start a coordinator and node agents as local processes on loopback, and clean them up.

Used by `tessera demo` and the benchmarks. The processes are the real programs
(`python -m coordinator.cli serve`, `python -m node_agent.cli join`), talking over real
gRPC; this module only starts, watches and kills them. It needs the `node` and
`coordinator` extras installed in the same environment.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.api import Client

_REGISTERED = re.compile(r"registered as (\w+)")
# What a LocalSwarm keeps under its work directory, and the file that says one ran there.
STATE_DIRS = ("coordinator", "nodes", "logs")
MARKER = ".tessera-local-swarm"


class SwarmError(RuntimeError):
    pass


@dataclass
class LocalProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    node_id: str = ""

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class LocalSwarm:
    """A coordinator plus node agents under one work directory."""

    workdir: Path
    coordinator_args: Sequence[str] = ()
    processes: list[LocalProcess] = field(default_factory=list)
    address: str = ""

    @property
    def coordinator_dir(self) -> Path:
        return self.workdir / "coordinator"

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> LocalProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with log_path.open("wb") as log:
            # A session of its own: Ctrl-C in the terminal reaches only us, and we decide
            # how the children end.
            popen = subprocess.Popen(
                [sys.executable, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        proc = LocalProcess(name, popen, log_path)
        self.processes.append(proc)
        return proc

    def start_coordinator(self, timeout_s: float = 60.0, listen: str = "127.0.0.1:0") -> str:
        """Start (or restart, on the same database) the coordinator; returns its address."""
        self.coordinator_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / MARKER).touch()  # clear_state may clear this folder's state
        addr_file = self.coordinator_dir / "coordinator.addr"
        addr_file.unlink(missing_ok=True)
        proc = self._spawn(
            "coordinator",
            [
                "-m",
                "coordinator.cli",
                "serve",
                "--listen",
                listen,
                "--db",
                str(self.coordinator_dir / "coordinator.db"),
                *self.coordinator_args,
            ],
        )
        self._wait(
            lambda: addr_file.exists() and addr_file.read_text().strip() != "",
            proc,
            "the coordinator to start",
            timeout_s,
        )
        self.address = addr_file.read_text().strip()
        return self.address

    def start_node(self, name: str, extra_args: Sequence[str] = ()) -> LocalProcess:
        proc = self._spawn(
            name,
            [
                "-m",
                "node_agent.cli",
                "join",
                "--coordinator",
                self.address,
                "--name",
                name,
                "--data-dir",
                str(self.workdir / "nodes" / name),
                "--device",
                "cpu",
                "--listen",
                "127.0.0.1:0",
                *extra_args,
            ],
        )
        return proc

    def wait_registered(self, procs: Sequence[LocalProcess], timeout_s: float = 120.0) -> None:
        for proc in procs:

            def found(p: LocalProcess = proc) -> bool:
                match = _REGISTERED.search(p.log_text())
                if match:
                    p.node_id = match.group(1)
                return bool(match)

            self._wait(found, proc, f"node {proc.name} to register", timeout_s)

    def add_model(self, directory: Path, name: str, timeout_s: float = 120.0) -> None:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "models",
                "add",
                str(directory),
                "--name",
                name,
                "--data-dir",
                str(self.coordinator_dir),
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if result.returncode != 0:
            raise SwarmError(f"models add failed:\n{result.stdout}\n{result.stderr}")

    @property
    def coordinator(self) -> LocalProcess:
        return next(p for p in reversed(self.processes) if p.name == "coordinator")

    def node(self, node_id: str) -> LocalProcess:
        """The newest process with this id: a restarted node keeps its id."""
        for proc in reversed(self.processes):
            if proc.node_id == node_id:
                return proc
        raise KeyError(node_id)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill9()

    def _wait(
        self, ready: Callable[[], bool], proc: LocalProcess, what: str, timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            if not proc.alive():
                raise SwarmError(
                    f"{proc.name} exited while waiting for {what}; its log "
                    f"({proc.log_path}) ends with:\n{_tail(proc.log_text())}"
                )
            time.sleep(0.1)
        raise SwarmError(
            f"timed out waiting for {what}; see {proc.log_path}:\n{_tail(proc.log_text())}"
        )


def clear_state(workdir: Path) -> bool:
    """Remove an earlier swarm's state from ``workdir`` (its coordinator's database, which
    already holds the models it imported; the nodes' keys and caches; the logs), so a
    swarm started there begins afresh. Only a folder a LocalSwarm marked as its own is
    touched (a user's own ``logs`` folder in a --workdir they picked stays), and nothing
    else in it. Returns whether there was anything to clear."""
    if not (workdir / MARKER).exists():
        return False
    stale = [workdir / name for name in STATE_DIRS if (workdir / name).exists()]
    for path in stale:
        shutil.rmtree(path)
    return bool(stale)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


def wait_for_replicas(
    client: Client, model: str, replicas: int = 1, timeout_s: float = 180.0
) -> None:
    """Wait until every layer of `model` has `replicas` ready replicas (1: it can serve;
    2: every stage also has an alternate, and checks have a second node)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = {m.name: m for m in client.models()}.get(model)
        if info is not None and info.available and min(info.ready_replicas) >= replicas:
            return
        time.sleep(0.2)
    raise SwarmError(
        f"model {model} did not get {replicas} ready replica(s) of every layer in "
        f"{timeout_s:.0f} s; the node logs say why"
    )
