"""Real subprocesses for integration tests: coordinators, node agents, anything with a log.

Every process writes stdout+stderr to its own log file; tests wait for a line in that log
with a deadline (never a bare sleep), and every process is killed at the end even when a
test fails half-way (context manager, plus an atexit safety net).

    with start_coordinator(tmp_path) as coord:
        node = start_node(coord.address, tmp_path / "n1", "n1")
        ...
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 30.0

_live: set[ManagedProcess] = set()
_counter = itertools.count(1)


class ProcessFailed(AssertionError):
    """The process exited, or the awaited line never came. The message holds the log tail."""


class ManagedProcess:
    """A subprocess whose output goes to a log file, with deadline-based waiting."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path = REPO_ROOT,
        name: str | None = None,
    ) -> None:
        self.args = [str(a) for a in args]
        self.log_path = Path(log_path)
        self.name = name or Path(self.args[0]).name
        self.cwd = cwd
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,  # a Ctrl-C in the test runner doesn't hit children twice
            )
        _live.add(self)
        return self

    # -- inspection ---------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_offset(self) -> int:
        """The current end of the log: pass it as `since` to wait only for newer lines."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_line(
        self,
        pattern: str | re.Pattern[str],
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        since: int = 0,
    ) -> re.Match[str]:
        """The first match of `pattern` in the log after byte `since`, polling until `timeout`."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
            match = regex.search(text)
            if match:
                return match
            if not self.alive:
                raise ProcessFailed(
                    f"{self.name} exited with {self.returncode} before logging "
                    f"{regex.pattern!r}; last lines of {self.log_path}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{self.name} did not log {regex.pattern!r} within {timeout} s; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            time.sleep(0.02)

    # -- ending -------------------------------------------------------------------------------
    def send_signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> int:
        """kill -9, as a crash would; returns the exit status."""
        if self.proc is None:
            return 0
        if self.alive:
            self.proc.kill()
        code = self.proc.wait(timeout=DEFAULT_TIMEOUT_S)
        _live.discard(self)
        return code

    def terminate(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """SIGTERM, wait up to `timeout`, then kill -9. Returns the exit status."""
        if self.proc is None:
            return 0
        self.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=DEFAULT_TIMEOUT_S)
        _live.discard(self)
        return code

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ProcessFailed(
                f"{self.name} still running after {timeout} s; last lines:\n{self.tail()}"
            ) from exc
        _live.discard(self)
        return code

    def __enter__(self) -> ManagedProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_live):
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def python_module(module: str, *args: object) -> list[str]:
    return [sys.executable, "-m", module, *(str(a) for a in args)]


# -- coordinator --------------------------------------------------------------------------------
SERVING_RE = re.compile(r"serving on (\S+:\d+)")


@dataclass
class CoordinatorProcess:
    process: ManagedProcess
    address: str
    data_dir: Path
    db_path: Path
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin.token").read_text().strip()

    def kill(self) -> int:
        return self.process.kill()

    def terminate(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return self.process.terminate(timeout)

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()


def start_coordinator(
    tmp_path: Path,
    *,
    data_dir: Path | None = None,
    db_path: Path | None = None,
    listen: str = "127.0.0.1:0",
    heartbeat_interval: float | None = None,
    offline_after: float | None = None,
    mqtt: str | None = None,
    log_level: str = "INFO",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> CoordinatorProcess:
    """Run `python -m coordinator.cli serve` and wait until it logs `serving on HOST:PORT`.

    Restarting on the same database: pass the previous `data_dir` (and `db_path`).
    """
    data_dir = data_dir or tmp_path / "coordinator"
    db_path = db_path or data_dir / "coordinator.db"
    data_dir.mkdir(parents=True, exist_ok=True)
    args = python_module(
        "coordinator.cli",
        "serve",
        "--listen",
        listen,
        "--db",
        db_path,
        "--data-dir",
        data_dir,
        "--log-level",
        log_level,
    )
    if heartbeat_interval is not None:
        args += ["--heartbeat-interval", str(heartbeat_interval)]
    if offline_after is not None:
        args += ["--offline-after", str(offline_after)]
    if mqtt:
        args += ["--mqtt", mqtt]
    args += list(extra_args)
    log_path = data_dir / f"coordinator-{next(_counter)}.log"
    process = ManagedProcess(args, log_path, env=env, name="coordinator").start()
    try:
        match = process.wait_for_line(SERVING_RE, timeout=timeout)
    except BaseException:
        process.kill()
        raise
    return CoordinatorProcess(process, match.group(1), data_dir, db_path)


# -- node agent ---------------------------------------------------------------------------------
REGISTERED_RE = re.compile(r"registered as ([A-Za-z0-9_-]+)")


@dataclass
class NodeProcess:
    process: ManagedProcess
    data_dir: Path
    name: str
    node_id: str | None

    def kill(self) -> int:
        return self.process.kill()

    def terminate(self, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        return self.process.terminate(timeout)

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()


def start_node(
    coordinator_addr: str,
    data_dir: Path,
    name: str,
    extra_args: Sequence[str] = (),
    *,
    wait_registered: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> NodeProcess:
    """Run `python -m node_agent.cli join ... --device cpu`; by default wait for its node id."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = python_module(
        "node_agent.cli",
        "join",
        "--coordinator",
        coordinator_addr,
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--device",
        "cpu",
        *extra_args,
    )
    log_path = data_dir / f"node-{name}-{next(_counter)}.log"
    process = ManagedProcess(args, log_path, env=env, name=f"node {name}").start()
    node_id = None
    if wait_registered:
        try:
            node_id = process.wait_for_line(REGISTERED_RE, timeout=timeout).group(1)
        except BaseException:
            process.kill()
            raise
    return NodeProcess(process, data_dir, name, node_id)


def run_until_killed(script: str, *args: object, timeout_s: float = 300.0) -> str:
    """Run ``script`` (python -c) with the repository and tests/ importable, expect it to
    kill itself with SIGKILL (a client or runner dying unannounced); returns its stdout."""
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])},
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    return done.stdout
