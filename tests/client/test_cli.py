"""The `tessera` command line: help that teaches, friendly errors, no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from support.ports import free_port

from client import cli

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_top_level_help_lists_commands_and_examples(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("nodes", "models", "generate", "demo", "examples:", "TESSERA_COORDINATOR"):
        assert word in out
    # An example too long for one line is continued with a shell backslash, so that it can
    # be pasted as it is; never run together with the next line's indentation.
    examples = out.split("examples:", 1)[1]
    assert "--max-price 5000 \\\n      --prefer cheap" in examples
    assert not re.search(r"\S {4,}--", examples), examples


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("nodes", ["--all", "--json", "--coordinator"]),
        ("models", ["--json", "--coordinator"]),
        (
            "generate",
            [
                "--model",
                "--prompt",
                "--token-ids",
                "--max-new-tokens",
                "--temperature",
                "--top-p",
                "--seed",
                "--json",
                "--hop-by-hop",
                "replica",
            ],
        ),
    ],
)
def test_subcommand_help(capsys, command, expected) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in expected:
        assert word in out


def test_no_command_prints_help_and_fails(capsys) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_prompt_and_token_ids_are_mutually_exclusive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "generate",
                "--model",
                "m",
                "--prompt",
                "x",
                "--token-ids",
                "1",
                "--max-new-tokens",
                "1",
            ]
        )
    assert exit_info.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_bad_token_ids_are_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", "m", "--token-ids", "1,x", "--max-new-tokens", "1"])
    assert exit_info.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag", "fragment"),
    [
        (["--token-ids", ""], "--token-ids", "is empty"),
        (["--token-ids=-5,2"], "--token-ids", "0 or more, got -5"),
        (["--token-ids", "1;2"], "--token-ids", "comma-separated integers"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens", "1 or more, got 0"),
        (["--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens", "1 or more, got -3"),
        (["--prompt", "x", "--top-p", "0"], "--top-p", "more than 0 and at most 1"),
        (["--prompt", "x", "--top-p", "1.5"], "--top-p", "more than 0 and at most 1"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature", "0 or more, got -1"),
        (["--prompt", "x", "--temperature", "nan"], "--temperature", "not a finite number"),
        (["--prompt", "x", "--max-price", "-1"], "--max-price", "0 (no cap)"),
        (["--prompt", "x", "--seed", "-1"], "--seed", "from 0 to 2^63-1"),
        (["--prompt", "x", "--coordinator", "localhost"], "--coordinator", "is not HOST:PORT"),
        (["--prompt", "x", "--coordinator", "http://h:7000"], "--coordinator", "serving on"),
        (["--prompt", "x", "--coordinator", "h:99999"], "--coordinator", "is not HOST:PORT"),
    ],
)
def test_bad_generate_values_name_the_flag(capsys, argv, flag, fragment) -> None:
    # Refused while parsing: nothing is dialled (no coordinator runs here), and the usage
    # shown is generate's own, not the top-level one.
    base = ["generate", "--model", "m", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*base, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"tessera generate: error: argument {flag}" in err and fragment in err, err
    assert "Traceback" not in err


def test_bad_values_of_the_listing_commands_are_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["jobs", "--limit", "0", "--coordinator", "127.0.0.1:1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tessera jobs: error: argument --limit: must be 1 or more" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["nodes", "--coordinator", "coord.example.org"])
    assert exit_info.value.code == 2
    assert "'coord.example.org' is not HOST:PORT" in capsys.readouterr().err


def test_a_malformed_coordinator_variable_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_COORDINATOR", "localhost")
    assert cli.main(["models"]) == 2
    err = capsys.readouterr().err
    assert "$TESSERA_COORDINATOR is 'localhost', which is not HOST:PORT" in err
    assert "--coordinator HOST:PORT" in err


def test_an_address_that_is_no_coordinator_says_so(capsys) -> None:
    # What a node's data-plane port (or any other gRPC server) answers: UNIMPLEMENTED.
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert cli.main(["nodes", "--coordinator", f"127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert f"the server at 127.0.0.1:{port} does not answer as a Tessera coordinator" in err
    assert "check --coordinator" in err and "serving on HOST:PORT" in err


def test_demo_refuses_a_kill_that_would_never_come(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--tokens", "5", "--kill-after", "10"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tessera demo: error: --kill-after (10) must be less than --tokens (5)" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--tokens", "-1"])
    assert exit_info.value.code == 2
    assert "argument --tokens: must be 1 or more" in capsys.readouterr().err


def test_demo_refuses_a_workdir_it_cannot_create(tmp_path, capsys) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    # Checked before any process starts, so this returns at once.
    assert cli.main(["demo", "--workdir", str(a_file / "work")]) == 2
    err = capsys.readouterr().err
    assert f"cannot use --workdir {a_file / 'work'}" in err
    assert "give a directory this user can write" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_client_key_that_cannot_be_created_is_a_usage_error(capsys) -> None:
    # Not there, so balance creates it; but no one, root included, can create a folder in
    # /proc (a chmod-ed folder would not stop root, who runs some test machines).
    key = Path("/proc/self/tessera-test/client.key")
    assert cli.main(["balance", "--key", str(key), "--coordinator", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot create the client key at {key}" in err and "pass --key a path" in err


def test_unreachable_coordinator_says_how_to_fix_it() -> None:
    address = f"127.0.0.1:{free_port()}"
    result = run_cli("nodes", env={"TESSERA_COORDINATOR": address})
    assert result.returncode == 1
    assert f"cannot reach the coordinator at {address}" in result.stderr
    assert "--coordinator HOST:PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_client_never_imports_torch() -> None:
    code = (
        "import sys, json; import client, client.cli, client.driver, client.api; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'node_agent', 'coordinator', 'safetensors'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
