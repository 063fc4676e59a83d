"""Checkpoint loading: only a stage's tensors, safetensors only, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import node_agent.runtime.checkpoint as checkpoint_module
from node_agent.runtime import (
    CheckpointError,
    MissingTensorError,
    PickleCheckpointError,
    StageModel,
    UnsupportedModelError,
    WeightLoadError,
    load_model_config,
    load_stage_model,
    load_stage_tensors,
    tensor_locations,
    tensor_names_for_stage,
)

pytest.importorskip("transformers")


@pytest.fixture
def record_reads(monkeypatch):
    """Record every tensor name the loader actually reads from disk."""
    reads: list[str] = []
    real_safe_open = checkpoint_module.safe_open

    class RecordingHandle:
        def __init__(self, *args, **kwargs):
            self._inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            reads.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(checkpoint_module, "safe_open", RecordingHandle)
    return reads


@pytest.mark.parametrize("sharded", [False, True])
def test_stage_reads_exactly_its_tensors(tiny_checkpoint, stage_bounds, record_reads, sharded):
    ckpt = tiny_checkpoint("llama_gqa", sharded=sharded)
    config = load_model_config(ckpt.path)
    for start, end in stage_bounds:
        is_first, is_last = start == 0, end == config.num_hidden_layers
        names = tensor_names_for_stage(config, start, end, is_first, is_last)
        record_reads.clear()
        tensors = load_stage_tensors(ckpt.path, names)
        assert list(tensors) == names
        assert sorted(record_reads) == sorted(names)
        reference = dict(ckpt.reference.named_parameters())
        for name, tensor in tensors.items():
            assert torch.equal(tensor, reference[name].detach()), name


def test_tensor_names_match_checkpoint_and_stage_parameters(
    tiny_checkpoint, stage_bounds, any_variant
):
    ckpt = tiny_checkpoint(any_variant)
    config = load_model_config(ckpt.path)
    available = set(tensor_locations(ckpt.path))
    covered: set[str] = set()
    for start, end in stage_bounds:
        is_last = end == config.num_hidden_layers
        names = tensor_names_for_stage(config, start, end, start == 0, is_last)
        assert set(names) <= available
        stage = load_stage_model(ckpt.path, start, end)
        assert set(stage.state_dict()) == set(names)
        covered |= set(names)
    assert covered == available  # together the stages hold the whole model


def test_tied_last_stage_needs_embedding_not_lm_head(tiny_checkpoint):
    config = load_model_config(tiny_checkpoint("llama_tied").path)
    last = tensor_names_for_stage(config, 3, 4, is_first=False, is_last=True)
    assert "model.embed_tokens.weight" in last
    assert "lm_head.weight" not in last
    middle = tensor_names_for_stage(config, 1, 3, is_first=False, is_last=False)
    assert "model.embed_tokens.weight" not in middle


def test_qkv_bias_names(tiny_checkpoint):
    config = load_model_config(tiny_checkpoint("qwen2").path)
    names = tensor_names_for_stage(config, 1, 2, is_first=False, is_last=False)
    assert "model.layers.1.self_attn.q_proj.bias" in names
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    assert all(name.startswith("model.layers.1.") for name in names)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama_gqa").path
    shutil.copy(source / "config.json", tmp_path / "config.json")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_stage_model(tmp_path, 1, 3)
    load_stage_model(tmp_path, 0, 1)  # other stages are unaffected


def test_unsupported_architecture_is_refused(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(tmp_path)


def test_pickle_only_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint("llama_gqa").path / "config.json", tmp_path / "config.json")
    # Never a valid pickle: the loader must refuse without ever opening it.
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(PickleCheckpointError, match="safetensors"):
        load_stage_model(tmp_path, 0, 1)


def test_directory_without_weights(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint("llama_gqa").path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_stage_model(tmp_path, 0, 1)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model_config(tmp_path)


def test_index_cannot_point_outside_the_directory(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="outside"):
        tensor_locations(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing"):
        tensor_locations(tmp_path)


def test_shape_mismatch_is_reported(tiny_checkpoint):
    path = tiny_checkpoint("llama_gqa").path
    config = load_model_config(path)
    names = tensor_names_for_stage(config, 1, 2, is_first=False, is_last=False)
    tensors = load_stage_tensors(path, names)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight has shape \[64, 64\]"):
        StageModel(config, 1, 2, False, False, tensors)


def test_missing_and_unexpected_weights_are_reported(tiny_checkpoint):
    path = tiny_checkpoint("llama_gqa").path
    config = load_model_config(path)
    names = tensor_names_for_stage(config, 1, 2, is_first=False, is_last=False)
    tensors = load_stage_tensors(path, names)
    del tensors["model.layers.1.input_layernorm.weight"]
    tensors["model.layers.2.input_layernorm.weight"] = torch.ones(64)
    with pytest.raises(WeightLoadError) as excinfo:
        StageModel(config, 1, 2, False, False, tensors)
    message = str(excinfo.value)
    assert "missing ['model.layers.1.input_layernorm.weight']" in message
    assert "unexpected ['model.layers.2.input_layernorm.weight']" in message
