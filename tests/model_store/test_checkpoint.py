"""Reading checkpoints without torch: good ones pass, every kind of broken one is named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import make_checkpoint, tensor_shapes, write_safetensors

from coordinator.model_store import CheckpointError, open_checkpoint
from coordinator.model_store.layout import ModelLayout
from coordinator.model_store.safetensors_format import read_header


@pytest.mark.parametrize(
    ("architecture", "options"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "dtype": "F16"}),
        ("mistral", {"dtype": "BF16"}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_accepts_single_file_checkpoints(tmp_path: Path, architecture: str, options: dict) -> None:
    path = make_checkpoint(tmp_path / "m", architecture, num_layers=2, **options)
    checkpoint = open_checkpoint(path)
    expected = tensor_shapes(json.loads((path / "config.json").read_text()))
    assert [t.name for t in checkpoint.tensors] == list(expected)
    assert all(t.shape == expected[t.name] for t in checkpoint.tensors)
    assert checkpoint.ignored == []
    assert checkpoint.layout.num_layers == 2
    assert [t.layer for t in checkpoint.tensors if "layers.1." in t.name] == [1] * len(
        [n for n in expected if "layers.1." in n]
    )


def test_accepts_sharded_checkpoint_and_reads_the_right_bytes(tmp_path: Path) -> None:
    single = open_checkpoint(make_checkpoint(tmp_path / "one", "qwen2", seed=3))
    sharded = open_checkpoint(make_checkpoint(tmp_path / "three", "qwen2", seed=3, shards=3))
    assert len({t.path for t in sharded.tensors}) == 3
    assert [t.name for t in sharded.tensors] == [t.name for t in single.tensors]
    assert [t.sha256() for t in sharded.tensors] == [t.sha256() for t in single.tensors]


def test_reads_files_the_safetensors_package_writes(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.float16)}
    save_file(arrays, str(tmp_path / "x.safetensors"), metadata={"format": "np"})
    header = read_header(tmp_path / "x.safetensors")
    assert header.metadata == {"format": "np"}
    span = header.tensors["a"]
    assert (span.dtype, span.shape, span.nbytes) == ("F32", (2, 3), 24)
    with (tmp_path / "x.safetensors").open("rb") as handle:
        handle.seek(span.offset)
        assert handle.read(span.nbytes) == arrays["a"].tobytes()


def test_layout_matches_transformers_state_dict(tmp_path: Path) -> None:
    """The tensor table is the single source of truth, so check it against the reference."""
    import transformers

    for architecture, options in [
        ("llama", {"attention_bias": True}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
    ]:
        path = make_checkpoint(tmp_path / architecture, architecture, **options)
        config = transformers.AutoConfig.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_config(config)
        reference = {
            name: tuple(t.shape)
            for name, t in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        layout = ModelLayout.from_config(json.loads((path / "config.json").read_text()))
        assert layout.expected_shapes() == reference, architecture


def test_extra_tensors_are_skipped_and_listed(tmp_path: Path) -> None:
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", np.ones(4, np.float32))}
    checkpoint = open_checkpoint(make_checkpoint(tmp_path / "m", extra_tensors=extra))
    assert checkpoint.ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert all("rotary" not in t.name for t in checkpoint.tensors)


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    return str(info.value)


def test_refuses_pickle_only_checkpoint_and_says_how_to_convert(tmp_path: Path) -> None:
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    message = _error(path)
    assert "pytorch_model.bin" in message and "safetensors" in message
    assert "save_pretrained" in message


def test_names_the_missing_tensor(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", omit=("model.layers.1.mlp.down_proj.weight",))
    message = _error(path)
    assert "model.layers.1.mlp.down_proj.weight" in message and "lacks 1 tensor" in message


def test_qwen2_without_biases_is_missing_them(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", "qwen2", num_layers=1)
    names = list(tensor_shapes(json.loads((path / "config.json").read_text())))
    biases = tuple(n for n in names if n.endswith(".bias"))
    make_checkpoint(path, "qwen2", num_layers=1, omit=biases)
    assert "model.layers.0.self_attn.q_proj.bias" in _error(path)


def test_names_a_tensor_whose_shape_does_not_fit_the_config(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", intermediate_size=64)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(config))
    message = _error(path)
    assert "model.layers.0.mlp.gate_proj.weight" in message and "[64, 32]" in message


def test_refuses_unsupported_architecture(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", architectures=["GPT2LMHeadModel"])
    message = _error(path)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


def test_refuses_config_without_required_field(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))
    assert "num_hidden_layers" in _error(path)


def test_refuses_missing_or_broken_config(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    (path / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _error(path)
    (path / "config.json").unlink()
    assert "config.json not found" in _error(path)


def test_refuses_unsupported_dtype(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", dtype="F32")
    # Same names and shapes, integer dtype: the bytes have the right size, the dtype is wrong.
    config = json.loads((path / "config.json").read_text())
    weights = {n: ("I32", np.zeros(s, np.int32)) for n, s in tensor_shapes(config).items()}
    write_safetensors(path / "model.safetensors", weights)
    message = _error(path)
    assert "model.embed_tokens.weight" in message and "I32" in message


def test_names_a_truncated_file(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = _error(path)
    assert str(weights) in message and "truncated" in message


def test_names_a_file_whose_header_is_not_json(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8] = ord("#")  # the header's opening brace
    weights.write_bytes(bytes(data))
    message = _error(path)
    assert str(weights) in message and "not valid UTF-8 JSON" in message


def test_names_a_header_longer_than_the_file(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    assert "truncated" in _error(path)
    weights.write_bytes(b"\x01\x02")
    assert "too short" in _error(path)


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def test_names_offsets_beyond_the_file(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")

    def push_out(header: dict) -> None:
        begin, end = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [begin + 10**9, end + 10**9]

    _rewrite_header(path / "model.safetensors", push_out)
    message = _error(path)
    assert "model.norm.weight" in message and "ends at byte" in message


def test_names_offsets_that_disagree_with_the_shape(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")

    def lie(header: dict) -> None:
        header["model.norm.weight"]["shape"] = [1000]

    _rewrite_header(path / "model.safetensors", lie)
    message = _error(path)
    assert "model.norm.weight" in message and "data_offsets span" in message


def test_refuses_overlapping_tensors(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")

    def alias(header: dict) -> None:
        norm = header["model.layers.0.input_layernorm.weight"]
        header["model.norm.weight"]["data_offsets"] = norm["data_offsets"]

    _rewrite_header(path / "model.safetensors", alias)
    assert "overlap" in _error(path)


def test_refuses_index_pointing_outside_the_checkpoint(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "points outside the checkpoint" in _error(path)


def test_refuses_index_naming_a_missing_shard(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in _error(path)


def test_refuses_directory_without_weights(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    assert "neither model.safetensors nor" in _error(path)
    assert "does not exist" in _error(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").write_bytes(b"")
    message = _error(tmp_path / "model.safetensors")  # the file, not its directory
    assert "is a file" in message and "holds config.json" in message
