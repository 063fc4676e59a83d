"""`tessera-coordinator models ...` as a user runs it: real CLI and coordinator processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
from safetensors import safe_open
from support.checkpoints import make_checkpoint
from support.coordinator_harness import FakeNode
from support.procs import REPO_ROOT, start_coordinator

from node_agent.shard_fetcher import ShardFetcher
from protos import codec

OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
]


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "models", *map(str, args)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
    )  # fmt: skip


def _listed(data_dir: Path) -> dict[str, dict]:
    result = _cli("list", "--json", "--data-dir", data_dir)
    assert result.returncode == 0, result.stderr
    return {m["name"]: m for m in json.loads(result.stdout)}


def test_checks_happen_before_any_upload(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    # No coordinator is running: the checkpoint is refused before anyone is contacted.
    result = _cli("add", pickled, "--name", "p", "--coordinator", "127.0.0.1:9")
    assert result.returncode == 2
    assert "pickle" in result.stderr and "safetensors" in result.stderr
    broken = make_checkpoint(tmp_path / "broken", omit=("model.norm.weight",))
    result = _cli("add", broken, "--coordinator", "127.0.0.1:9")
    assert result.returncode == 2 and "model.norm.weight" in result.stderr
    result = _cli("add", make_checkpoint(tmp_path / "ok"), "--check-only")
    assert result.returncode == 0 and "LlamaForCausalLM, 2 layers" in result.stderr


async def test_add_list_fetch_restart_remove(tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path / "tiny", "qwen2", num_layers=3, shards=2, dtype="BF16",
                             tokenizer=True)  # fmt: skip
    with start_coordinator(tmp_path) as coordinator:
        data_dir = coordinator.data_dir
        added = _cli("add", source, "--name", "tiny", "--data-dir", data_dir)
        assert added.returncode == 0, added.stderr
        assert "added model tiny: Qwen2ForCausalLM, 3 layers" in added.stdout
        assert "uploading" in added.stderr  # the progress bar
        info = _listed(data_dir)["tiny"]
        assert info["has_tokenizer"] and info["num_layers"] == 3
        assert info["unavailable_reason"] == "no node is online to load it yet"
        table = _cli("list", "--data-dir", data_dir)
        assert table.returncode == 0, table.stderr
        header, row = table.stdout.splitlines()
        assert header.split() == ["NAME", "ARCHITECTURE", "LAYERS", "SIZE", "TOKENIZER",
                                  "SERVED", "ADDED"]  # fmt: skip
        assert row.split()[:3] == ["tiny", "Qwen2ForCausalLM", "3"]
        served = "no: no node is online to load it yet"
        assert re.search(rf"  3 +\d+\.\d KiB +yes +{served} +\d{{4}}-\d\d-\d\d \d\d:\d\d$", row)

        again = _cli("add", source, "--name", "tiny", "--data-dir", data_dir)
        assert again.returncode == 2 and "already exists" in again.stderr
        assert "--replace" in again.stderr
        wrong = _cli("add", source, "--name", "other", "--coordinator", coordinator.address,
                     "--admin-token", "not-the-token")  # fmt: skip
        assert wrong.returncode == 2 and "admin token" in wrong.stderr
        assert wrong.stderr.count("admin.token") == 1, wrong.stderr  # where to find it, once
        assert "other" not in _listed(data_dir)
        replaced = _cli("add", source, "--name", "tiny", "--replace", "--data-dir", data_dir)
        assert replaced.returncode == 0, replaced.stderr

        shard = await _fetch_last_stage(coordinator.address, tmp_path / "node")
        _assert_same_tensors(shard, source)
        coordinator.kill()  # kill -9: the model must survive

    with start_coordinator(tmp_path, data_dir=data_dir) as restarted:
        assert set(_listed(data_dir)) == {"tiny"}
        channel = grpc.aio.insecure_channel(restarted.address, options=OPTIONS)
        node = FakeNode(channel, "after-restart")
        await node.register()
        fetcher = ShardFetcher.for_data_dir(channel, node.node_id, node.ticket, tmp_path / "node")
        manifest = await fetcher.fetch_manifest("tiny")
        await fetcher.ensure_tensors("tiny", list(manifest.tensors))
        # Only what this node never fetched travels: the cache survived both restarts.
        new = [n for n in manifest.tensors if n.startswith(("model.layers.0.", "model.layers.1."))]
        new.append("model.embed_tokens.weight")
        assert fetcher.bytes_fetched == sum(manifest.tensors[n].nbytes for n in new)
        await channel.close()

        removed = _cli("remove", "tiny", "--data-dir", data_dir)
        assert removed.returncode == 0, removed.stderr
        assert _listed(data_dir) == {}
        empty = _cli("list", "--data-dir", data_dir)
        assert empty.returncode == 0 and "no models yet" in empty.stdout
        assert "models add DIR --name NAME" in empty.stdout
        assert not [p for p in (data_dir / "blobs").rglob("*") if p.is_file()]
        missing = _cli("remove", "tiny", "--data-dir", data_dir)
        assert missing.returncode == 2 and "no model named 'tiny'" in missing.stderr


async def _fetch_last_stage(address: str, node_dir: Path) -> Path:
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        node = FakeNode(channel, "fetcher")
        await node.register()
        fetcher = ShardFetcher.for_data_dir(channel, node.node_id, node.ticket, node_dir)
        return await fetcher.materialize("tiny", 2, 3)


def _assert_same_tensors(shard: Path, source: Path) -> None:
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    import torch  # numpy has no bfloat16

    with safe_open(str(shard / "model.safetensors"), framework="pt") as got:
        names = list(got.keys())
        assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
        for name in names:
            with safe_open(str(source / index[name]), framework="pt") as want:
                assert torch.equal(got.get_tensor(name), want.get_tensor(name)), name
