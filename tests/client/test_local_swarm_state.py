"""clear_state: what a rerun of the demo (or a benchmark) in the same folder removes."""

from pathlib import Path

from client.local_swarm import MARKER, STATE_DIRS, clear_state


def fill(workdir: Path) -> None:
    for name in (*STATE_DIRS, "checkpoint", "notes"):
        (workdir / name).mkdir(parents=True)
        (workdir / name / "file").write_text(name)


def test_a_folder_a_swarm_ran_in_loses_its_state_and_nothing_else(tmp_path: Path) -> None:
    fill(tmp_path)
    (tmp_path / MARKER).touch()
    assert clear_state(tmp_path) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MARKER, "checkpoint", "notes"])
    assert clear_state(tmp_path) is False, "nothing left to clear"


def test_a_folder_no_swarm_marked_is_left_alone(tmp_path: Path) -> None:
    # A --workdir the user picked that holds a `logs` folder of their own.
    fill(tmp_path)
    assert clear_state(tmp_path) is False
    assert all((tmp_path / name / "file").read_text() == name for name in STATE_DIRS)
