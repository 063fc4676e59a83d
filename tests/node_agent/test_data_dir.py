"""Default data dir per platform, and one agent per data dir."""

import os
from pathlib import Path

import pytest

from node_agent.data_dir import DataDirBusyError, DataDirLock, default_data_dir


def test_default_data_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "tessera" / "node"


def test_default_data_dir_without_xdg_is_under_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_data_dir() == Path.home() / ".local" / "share" / "tessera" / "node"


def test_a_second_agent_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    with DataDirLock(tmp_path):
        with pytest.raises(DataDirBusyError, match=f"pid {os.getpid()}.*--data-dir"):
            DataDirLock(tmp_path).acquire()
    # Released on exit: the next agent gets it.
    with DataDirLock(tmp_path):
        pass
