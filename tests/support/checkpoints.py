"""Small random Llama / Mistral / Qwen2 checkpoints on disk, without transformers.

    path = make_checkpoint(tmp_path / "tiny", "qwen2", num_layers=3, shards=2, tokenizer=True)

writes config.json, model.safetensors (or model.safetensors.index.json plus shards) and,
if asked, tokenizer.json. The files follow the Hugging Face layout exactly, so
transformers, the safetensors package, the node runtime and the model store all read them.
Weights are seeded, so the same arguments give the same bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
_WORDS = (
    "the a an of to and in is it that on for with as was at by be this are from or have "
    "one two three four five six seven eight nine ten swarm node layer model token gpu "
    "hello world tessera quick brown fox jumps over lazy dog"
).split()


def make_config(
    architecture: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 64,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    max_position_embeddings: int = 256,
    dtype: str = "F32",
    **overrides: Any,
) -> dict[str, Any]:
    """A config.json dict; `architecture` is "llama", "mistral" or "qwen2"."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": _TORCH_DTYPE[dtype],
        "initializer_range": 0.02,
    }
    if architecture == "llama":
        config.update(attention_bias=attention_bias, mlp_bias=False)
    elif architecture == "mistral":
        config.update(sliding_window=None)
    elif architecture == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    config.update(overrides)
    return config


def tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a checkpoint of this config holds, in HF order."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    model_type = config.get("model_type", "llama")
    qkv_bias = model_type == "qwen2" or (model_type == "llama" and config.get("attention_bias"))
    o_bias = model_type == "llama" and bool(config.get("attention_bias"))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden)
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}.self_attn.{proj}.weight"] = (out, hidden)
            if qkv_bias:
                shapes[f"{p}.self_attn.{proj}.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, q_out)
        if o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def random_weights(
    config: Mapping[str, Any], *, dtype: str = "F32", seed: int = 0
) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, array); BF16 arrays are uint16 bit patterns."""
    rng = np.random.default_rng(seed)
    weights: dict[str, tuple[str, np.ndarray]] = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            # Near one, as trained norms are, but not exactly: tests must see every tensor.
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = 0.02 * rng.standard_normal(shape)
        weights[name] = (dtype, to_dtype(values.astype(np.float32), dtype))
    return weights


def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return values.astype("<f4")
    if dtype == "F16":
        return values.astype("<f2")
    if dtype == "BF16":
        bits = values.astype("<f4").view("<u4").astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype("<u2")
    raise ValueError(f"unsupported dtype {dtype}")


def write_safetensors(
    path: Path,
    tensors: Mapping[str, tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the safetensors format by hand: header length, JSON header, raw bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: list[bytes] = []
    offset = 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the reference writer pads to 8 bytes
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for data in blobs:
            handle.write(data)


# The small Llama shape the end-to-end tests share (with their own layer count and seed):
# fast on 2 cores, and still GQA (4 query heads over 2 KV heads).
TINY_SHAPE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 96,
}


def make_checkpoint(
    directory: Path,
    architecture: str = "llama",
    *,
    dtype: str = "F32",
    shards: int = 1,
    seed: int = 0,
    tokenizer: bool = False,
    extra_tensors: Mapping[str, tuple[str, np.ndarray]] | None = None,
    omit: tuple[str, ...] = (),
    **config_options: Any,
) -> Path:
    """Write a random checkpoint into `directory` (created) and return it.

    `shards` > 1 splits the weights over model-0000i-of-0000n.safetensors files with an
    index, as save_pretrained does for big models. `config_options` go to make_config
    (num_layers, hidden_size, vocab_size, tie_word_embeddings, attention_bias, ...).
    `omit` drops tensors (to build broken checkpoints), `extra_tensors` adds some.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = make_config(architecture, dtype=dtype, **config_options)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_weights(config, dtype=dtype, seed=seed)
    weights.update(extra_tensors or {})
    for name in omit:
        weights.pop(name)
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", weights)
    else:
        names = list(weights)
        per_shard = -(-len(names) // shards)
        weight_map = {}
        for index in range(shards):
            file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[index * per_shard : (index + 1) * per_shard]}
            write_safetensors(directory / file_name, part)
            weight_map.update({n: file_name for n in part})
        total = sum(array.nbytes for _, array in weights.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    if tokenizer:
        (directory / "tokenizer.json").write_text(make_tokenizer_json(config["vocab_size"]))
    return directory


def make_tokenizer_json(vocab_size: int) -> str:
    """A WordLevel tokenizer.json (whitespace split) with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokens = ["<unk>", "<s>", "</s>", *_WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), vocab_size)]
    tokens = tokens[:vocab_size]
    if len(tokens) < 3:
        raise ValueError("a tokenizer needs a vocabulary of at least 3 tokens")
    tok = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()


def transformers_greedy(
    checkpoint: Path, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy `generate` on the checkpoint in fp32, never stopping at EOS: the
    reference a swarm must equal token for token, one list of new ids per prompt. Skips the
    test when transformers (a test-only dependency) is missing."""
    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    generated = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            generated.append(ids[0, len(prompt) :].tolist())
    return generated
