"""`tessera train` / `tessera jobs`: help that teaches, usage errors, listing real jobs."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from jobs.jobs_harness import JobsCoordinator

from client import cli


def test_train_help_teaches(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in (
        "--model",
        "--data",
        "--steps",
        "--batch-size",
        "--seq-len",
        "--lr",
        "--micro-batches",
        "--checkpoint-every",
        "--mode",
        "--output-model",
        "--json",
        "--resume",
        "examples:",
    ):
        assert word in out, word


def test_train_without_its_arguments_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model", "m"])
    assert exit_info.value.code == 2
    assert "--data" in capsys.readouterr().err


_TRAIN = ["train", "--coordinator", "127.0.0.1:1", "--model", "m", "--steps", "5",
          "--batch-size", "2", "--seq-len", "8", "--lr", "1e-3"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--steps", "-5"], "argument --steps: must be 1 or more, got -5"),
        (["--batch-size", "0"], "argument --batch-size: must be 1 or more"),
        (["--seq-len", "x"], "argument --seq-len: 'x' is not a whole number"),
        (["--lr", "0"], "argument --lr: must be more than 0"),
        (["--lr", "inf"], "argument --lr: 'inf' is not a finite number"),
        (["--checkpoint-every", "-2"], "argument --checkpoint-every: must be 0 or more"),
        (["--weight-decay", "-1"], "argument --weight-decay: must be 0 or more"),
        (["--max-price", "-1"], "argument --max-price: must be 0 (no cap)"),
        (["--micro-batches", "3"], "--micro-batches 3 does not divide --batch-size 2"),
    ],
)
def test_bad_train_values_are_refused_before_any_upload(tmp_path, capsys, argv, fragment) -> None:
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(100, dtype=np.int32))
    # 127.0.0.1:1 has no coordinator: a mistake noticed only there would exit 1, not 2.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*_TRAIN, "--data", str(data), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tessera train: error:" in err and fragment in err, err


def test_train_names_a_data_file_that_is_not_there(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*_TRAIN, "--data", str(tmp_path / "missing.npy")])
    assert exit_info.value.code == 2
    assert f"--data {tmp_path / 'missing.npy'}: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*_TRAIN, "--data", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--data {tmp_path} is not a file" in capsys.readouterr().err


def test_jobs_on_an_unreachable_coordinator_says_what_to_do(capsys) -> None:
    assert cli.main(["jobs", "--coordinator", "127.0.0.1:1"]) == 1
    assert "cannot reach the coordinator" in capsys.readouterr().err


async def test_jobs_lists_submitted_jobs(jc: JobsCoordinator, capsys) -> None:
    dataset = await jc.upload(np.arange(300, dtype=np.int32) % 60)
    job = await jc.submit(dataset.id, output_model="tiny-out")
    address = jc.coordinator.address
    assert await asyncio.to_thread(cli.main, ["jobs", "--coordinator", address]) == 0
    table = capsys.readouterr().out
    assert job.job_id in table and "queued" in table and "tiny-out" in table
    assert await asyncio.to_thread(cli.main, ["jobs", "--coordinator", address, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(j["job_id"], j["state"], int(j["steps"])) for j in listed] == [
        (job.job_id, "queued", 6)
    ]


async def test_train_with_a_bad_file_fails_cleanly(jc: JobsCoordinator, tmp_path, capsys) -> None:
    bad = tmp_path / "floats.npy"
    np.save(bad, np.zeros(10, dtype=np.float32))
    args = [
        "train",
        "--coordinator",
        jc.coordinator.address,
        "--model",
        "tiny",
        "--data",
        str(bad),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "4",
        "--lr",
        "1e-3",
    ]
    assert await asyncio.to_thread(cli.main, args) == 2
    assert "integer token ids" in capsys.readouterr().err
