"""The `tessera` command line: help that teaches, friendly errors, no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
