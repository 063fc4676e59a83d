"""A small Llama-style checkpoint for the demo, written with numpy only (the client has no
torch): `config.json`, `model.safetensors` and a character-level `tokenizer.json`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class DemoShape:
    layers: int = 6
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    max_positions: int = 1024


def character_vocab() -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    return vocab


def write_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path))


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors layout: u64 header length, JSON header, then raw little-endian data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def write_demo_checkpoint(directory: Path, shape: DemoShape = DemoShape(), seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    vocab = character_vocab()
    rng = np.random.default_rng(seed)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def weight(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.05).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": weight(len(vocab), shape.hidden)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = np.ones(shape.hidden, np.float32)
        tensors[f"{p}.self_attn.q_proj.weight"] = weight(shape.hidden, shape.hidden)
        tensors[f"{p}.self_attn.k_proj.weight"] = weight(kv, shape.hidden)
        tensors[f"{p}.self_attn.v_proj.weight"] = weight(kv, shape.hidden)
        tensors[f"{p}.self_attn.o_proj.weight"] = weight(shape.hidden, shape.hidden)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(shape.hidden, np.float32)
        tensors[f"{p}.mlp.gate_proj.weight"] = weight(shape.intermediate, shape.hidden)
        tensors[f"{p}.mlp.up_proj.weight"] = weight(shape.intermediate, shape.hidden)
        tensors[f"{p}.mlp.down_proj.weight"] = weight(shape.hidden, shape.intermediate)
    tensors["model.norm.weight"] = np.ones(shape.hidden, np.float32)
    tensors["lm_head.weight"] = weight(len(vocab), shape.hidden)
    write_safetensors(directory / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": len(vocab),
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory / "tokenizer.json", vocab)
    return directory
