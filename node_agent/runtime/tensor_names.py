"""Which checkpoint tensors (Hugging Face names) a pipeline stage needs."""

from __future__ import annotations

from node_agent.runtime.config import ModelConfig

EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    prefix = f"model.layers.{layer}"
    names = [f"{prefix}.input_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        names.append(f"{prefix}.self_attn.{proj}.weight")
        if config.qkv_bias:
            names.append(f"{prefix}.self_attn.{proj}.bias")
    names.append(f"{prefix}.self_attn.o_proj.weight")
    if config.o_proj_bias:
        names.append(f"{prefix}.self_attn.o_proj.bias")
    names.append(f"{prefix}.post_attention_layernorm.weight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names.append(f"{prefix}.mlp.{proj}.weight")
        if config.mlp_bias:
            names.append(f"{prefix}.mlp.{proj}.bias")
    return names


def tensor_names_for_stage(
    config: ModelConfig, start: int, end: int, is_first: bool, is_last: bool
) -> list[str]:
    """Names for layers [start, end) plus embedding (first) and final norm + head (last).

    With tied embeddings the head *is* the embedding matrix, so the last stage asks for
    ``model.embed_tokens.weight`` instead of ``lm_head.weight`` (which tied checkpoints omit).
    """
    validate_stage_range(config, start, end, is_first, is_last)
    names: list[str] = []
    if is_first or (is_last and config.tie_word_embeddings):
        names.append(EMBEDDING)
    for layer in range(start, end):
        names.extend(layer_tensor_names(config, layer))
    if is_last:
        names.append(FINAL_NORM)
        if not config.tie_word_embeddings:
            names.append(LM_HEAD)
    return names


def validate_stage_range(
    config: ModelConfig, start: int, end: int, is_first: bool, is_last: bool
) -> None:
    if not 0 <= start <= end <= config.num_hidden_layers:
        raise ValueError(
            f"stage layer range [{start}, {end}) must satisfy "
            f"0 <= start <= end <= num_hidden_layers ({config.num_hidden_layers})"
        )
    if start == end and not (is_first or is_last):
        raise ValueError(f"stage [{start}, {end}) has no layers, embedding or head to run")
