"""ModelConfig parsing, memory helpers and dtype selection."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node_agent.runtime import (
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedDtypeError,
    UnsupportedModelError,
    load_model_config,
    resolve_dtype,
    tensor_names_for_stage,
)
from node_agent.runtime.dtypes import TF32_OVERRIDE_ENV, pin_full_fp32
from node_agent.runtime.layers import rope_inv_freq

MINIMAL = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "vocab_size": 1000,
}

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_defaults_follow_transformers():
    config = ModelConfig.from_dict(MINIMAL)
    assert config.num_key_value_heads == 8
    assert config.head_dim == 32
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert config.tie_word_embeddings is False
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (False, False, False)
    assert config.layer_sliding_windows == (None, None)


def test_architecture_from_model_type_and_qwen2_bias():
    raw = {k: v for k, v in MINIMAL.items() if k != "architectures"} | {"model_type": "qwen2"}
    config = ModelConfig.from_dict(raw)
    assert config.architecture == "Qwen2ForCausalLM"
    assert (config.qkv_bias, config.o_proj_bias) == (True, False)


def test_llama_attention_and_mlp_bias():
    config = ModelConfig.from_dict(MINIMAL | {"attention_bias": True, "mlp_bias": True})
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == (True, True, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_attention_heads": 7}, "not divisible"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
)
def test_unsupported_configs_are_explained(change, message):
    raw = {k: v for k, v in (MINIMAL | change).items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(raw)


def test_llama3_scaling_in_v4_and_v5_layouts():
    v4 = ModelConfig.from_dict(
        MINIMAL | {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3"} | LLAMA3_SCALING}
    )
    v5 = ModelConfig.from_dict(
        MINIMAL
        | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0} | LLAMA3_SCALING}
    )
    assert v4 == v5
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_rope_inv_freq_equals_transformers(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama3_rope")
    config = load_model_config(ckpt.path)
    assert config.rope_scaling is not None
    expected = ckpt.reference.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(config), expected)


def test_sliding_windows_per_layer(tiny_checkpoint):
    assert load_model_config(tiny_checkpoint("mistral").path).layer_sliding_windows == (6,) * 4
    qwen = load_model_config(tiny_checkpoint("qwen2_sliding").path)
    assert qwen.layer_sliding_windows == (None, None, 5, 5)
    assert load_model_config(tiny_checkpoint("qwen2").path).layer_sliding_windows == (None,) * 4


def test_memory_helpers_match_real_parameter_counts(tiny_checkpoint, any_variant):
    ckpt = tiny_checkpoint(any_variant)
    config = load_model_config(ckpt.path)
    layer_params = sum(p.numel() for p in ckpt.reference.model.layers[0].parameters())
    assert config.bytes_per_layer(2) == 2 * layer_params
    embed = ckpt.reference.model.embed_tokens.weight
    assert config.embedding_bytes(4) == 4 * embed.numel()
    per_token = 2 * config.num_key_value_heads * config.head_dim * 2
    assert config.kv_bytes_per_token_per_layer(2) == per_token


def test_config_json_round_trip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL))
    assert load_model_config(tmp_path) == ModelConfig.from_dict(MINIMAL)


@pytest.mark.parametrize(("start", "end"), [(-1, 1), (1, 0), (0, 3), (1, 1)])
def test_stage_range_is_validated(start, end):
    config = ModelConfig.from_dict(MINIMAL)
    with pytest.raises(ValueError, match="stage"):
        tensor_names_for_stage(config, start, end, is_first=False, is_last=False)


def test_head_only_stage_is_allowed():
    config = ModelConfig.from_dict(MINIMAL)
    assert tensor_names_for_stage(config, 2, 2, is_first=False, is_last=True) == [
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_resolve_dtype_on_cpu():
    assert resolve_dtype("cpu") == torch.float32
    assert resolve_dtype("cpu", "fp32") == torch.float32
    assert resolve_dtype(torch.device("cpu"), torch.float32) == torch.float32
    with pytest.raises(UnsupportedDtypeError, match="CPU"):
        resolve_dtype("cpu", torch.float16)
    with pytest.raises(UnsupportedDtypeError, match="CPU"):
        resolve_dtype("cpu", "bf16")
    with pytest.raises(UnsupportedDtypeError, match="unknown dtype"):
        resolve_dtype("cpu", "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resolve_dtype_on_cuda():
    chosen = resolve_dtype("cuda")
    assert chosen in (torch.bfloat16, torch.float16)
    assert resolve_dtype("cuda", "fp16") == torch.float16


def test_pin_full_fp32_turns_tf32_off_and_drops_the_override(monkeypatch, caplog):
    monkeypatch.setenv(TF32_OVERRIDE_ENV, "1")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with caplog.at_level(logging.WARNING, logger="node_agent.runtime.dtypes"):
            pin_full_fp32()
        assert TF32_OVERRIDE_ENV not in os.environ
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        assert any(TF32_OVERRIDE_ENV in r.message for r in caplog.records)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


_MATMUL_ERROR = """
import sys, torch
if sys.argv[1] == "stage":
    from node_agent.runtime import load_stage_model
    load_stage_model(sys.argv[2], 0, 1, device="cuda", dtype="fp32")
g = torch.Generator().manual_seed(0)
a, b = (torch.randn(1024, 1024, generator=g, dtype=torch.float64) for _ in range(2))
exact = a @ b
got = (a.float().cuda() @ b.float().cuda()).double().cpu()
print(((got - exact).norm() / exact.norm()).item())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_stage_computes_fp32_in_full_precision_despite_the_override(tiny_checkpoint):
    """The override really turns TF32 on (the control), and a CUDA stage turns it off."""
    env = dict(os.environ, **{TF32_OVERRIDE_ENV: "1"})
    path = str(tiny_checkpoint("llama_gqa").path)

    def error(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _MATMUL_ERROR, mode, path],
            env=env,
            cwd=Path(__file__).resolve().parents[2],  # the repository: node_agent importable
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])

    assert error("bare") > 1e-4  # TF32: ~1e-3
    assert error("stage") < 1e-5  # fp32: ~1e-7
