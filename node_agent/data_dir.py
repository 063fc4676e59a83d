"""Where the agent keeps its state (key, shard cache), and a lock so only one agent uses it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType

LOCK_FILE_NAME = "node.lock"


def default_data_dir() -> Path:
    """A per-user folder that survives reboots and needs no root."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "tessera" / "node"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tessera" / "node"


class DataDirBusyError(Exception):
    """Another agent already runs on this data dir."""


class DataDirLock:
    """An exclusive advisory lock on DATA_DIR/node.lock.

    Two agents on one data dir would share a key, so each new Attach would kick the other
    off the coordinator forever. The lock turns that into one clear error at start-up.
    The OS drops the lock when the process dies, even on kill -9, so it never goes stale.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock_exclusive(fd)
        except OSError as exc:
            os.lseek(fd, 0, os.SEEK_SET)
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirBusyError(
                f"another tessera-node (pid {holder}) is already using {self.path.parent}; "
                f"stop it first, or give this one its own --data-dir"
            ) from exc
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _lock_exclusive(fd: int) -> None:
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
