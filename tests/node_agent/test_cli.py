"""`tessera-node`: help that teaches, and clear exit codes for set-up mistakes."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from node_agent import cli, identity
from node_agent.data_dir import DataDirLock
from protos import identity as wire_identity


def test_help_runs_as_a_module_and_shows_examples() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "node_agent.cli", "join", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for text in ("--coordinator", "--max-memory-gb", "--listen", "--mqtt", "examples:"):
        assert text in result.stdout
    # The test-only knobs stay out of the operator's way.
    assert "--backoff" not in result.stdout


def test_the_cli_loads_torch_only_to_serve() -> None:
    # --help and the stake and earnings commands answer in a blink: torch takes seconds to
    # load, and `join` (the runtime) is the only command that needs it.
    code = "import sys, node_agent.cli; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_top_level_help_lists_the_commands(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "join" in out and "probe" in out and "Exit codes" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["join"], "--coordinator"),
        (["join", "--coordinator", "nohost"], "is not HOST:PORT"),
        (["join", "--coordinator", "127.0.0.1:0"], "'127.0.0.1:0' is not HOST:PORT"),
        (["join", "--coordinator", "http://h:7000"], "serving on HOST:PORT"),
        (["earnings", "--coordinator", "localhost"], "'localhost' is not HOST:PORT"),
        (["stake", "deposit", "5", "--coordinator", "h"], "'h' is not HOST:PORT"),
        (["join", "--coordinator", "h:1", "--max-memory-gb", "-3"], "more than 0"),
        (["join", "--coordinator", "h:1", "--price", "nan"], "'nan' is not a whole number"),
        (["join", "--coordinator", "h:1", "--price", "1.5"], "'1.5' is not a whole number"),
        (["join", "--coordinator", "h:1", "--price", "-1"], "0 or more"),
        (["join", "--coordinator", "h:1", "--price", str(1 << 63)], "below 2^63"),
        (["join", "--coordinator", "h:1", "--max-memory-gb", "lots"], "'lots' is not a number"),
        (["join", "--coordinator", "h:1", "--max-memory-gb", "inf"], "not a finite number"),
        (["join", "--coordinator", "h:1", "--mqtt", "http://x"], "broker URL"),
    ],
)
def test_bad_flags_exit_2_and_say_why(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _join(tmp_path, *extra: str) -> list[str]:
    return ["join", "--coordinator", "127.0.0.1:1", "--data-dir", str(tmp_path), *extra]


def test_a_readable_key_stops_the_agent_with_the_fix(tmp_path, caplog) -> None:
    identity.load_or_create_key(tmp_path)
    os.chmod(identity.key_path(tmp_path), 0o644)
    assert cli.main(_join(tmp_path)) == 2
    assert "chmod 600" in caplog.text


def test_a_data_dir_that_is_a_file_exits_2_and_says_so(tmp_path, caplog) -> None:
    not_a_dir = tmp_path / "node-data"
    not_a_dir.write_text("")
    assert cli.main(_join(not_a_dir)) == 2
    assert f"{not_a_dir} is a file, not a directory" in caplog.text
    assert "give --data-dir a directory" in caplog.text


def test_a_listen_address_it_cannot_use_is_no_data_dir_problem(tmp_path, caplog) -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    argv = _join(tmp_path, "--device", "cpu", "--benchmark-s", "0.05", "--listen", "192.0.2.1:0")
    assert cli.main(argv) == 2
    assert "cannot listen on 192.0.2.1:0" in caplog.text
    assert "pick another --listen" in caplog.text
    assert "data directory" not in caplog.text and "--data-dir" not in caplog.text


def test_earnings_from_an_address_that_is_no_coordinator_says_so(tmp_path, capsys) -> None:
    identity.load_or_create_key(tmp_path)
    # What a node's data-plane port (or any other gRPC server) answers: UNIMPLEMENTED.
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        argv = ["earnings", "--coordinator", f"127.0.0.1:{port}", "--data-dir", str(tmp_path)]
        assert cli.main(argv) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert f"the server at 127.0.0.1:{port} does not answer as a Tessera coordinator" in err
    assert "check --coordinator" in err


def test_a_second_agent_on_one_data_dir_exits_2(tmp_path, caplog) -> None:
    with DataDirLock(tmp_path):
        assert cli.main(_join(tmp_path)) == 2
    assert "already using" in caplog.text


def test_a_missing_gpu_exits_2(tmp_path, caplog) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the probe tests cover cuda:N")
    assert cli.main(_join(tmp_path, "--device", "cuda")) == 2
    assert "--device cpu" in caplog.text


def test_probe_prints_json_and_creates_nothing(tmp_path, capsys) -> None:
    data_dir = tmp_path / "fresh"
    assert cli.main(["probe", "--device", "cpu", "--data-dir", str(data_dir),
                     "--benchmark-s", "0.05"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["device_kind"] == "cpu" and report["matmul_tflops"] > 0
    assert report["memory_bandwidth_gbps"] > 0
    assert report["node_id"] == "" and not data_dir.exists()

    key = identity.load_or_create_key(data_dir)
    assert cli.main(["probe", "--device", "cpu", "--data-dir", str(data_dir),
                     "--benchmark-s", "0.05"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["node_id"] == wire_identity.node_id(wire_identity.public_key_bytes(key))


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["text", "json"])
def test_earnings_without_a_coordinator_says_so_on_stderr(tmp_path, extra: list[str]) -> None:
    identity.load_or_create_key(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "node_agent.cli", "earnings", "--coordinator", "127.0.0.1:1",
         "--data-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    # stdout stays clean for scripts that parse --json.
    assert result.stdout == ""
    assert "cannot reach the coordinator at 127.0.0.1:1" in result.stderr
    assert "--coordinator" in result.stderr
