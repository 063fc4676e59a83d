"""How many bytes a training stage holds on its node, for the planner's accounting.

The node keeps its inference shard (already counted by the planner) and, while it trains,
a training state on top: an fp32 copy of the stage's weights, fp32 gradients and two AdamW
moments of the trainable parameters, and the activations of every micro-batch awaiting
backward (the driver's GPipe schedule keeps a whole batch in flight). The node runs the
exact check again before it opens training (node_agent.runtime.training.training_memory);
this estimate only keeps the coordinator from choosing nodes that would refuse.
"""

from __future__ import annotations

from coordinator.model_store.layout import EMBEDDING, FINAL_NORM, LM_HEAD, ModelLayout

FP32 = 4
LORA_TARGETS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def stage_tensor_names(layout: ModelLayout, start: int, end: int) -> list[str]:
    """The checkpoint tensors a stage over layers [start, end) holds."""
    names = [n for n in layout.expected_shapes() if _in_stage(n, layout, start, end)]
    if end == layout.num_layers and layout.tie_word_embeddings and start != 0:
        names.append(EMBEDDING)  # the tied head is the embedding matrix
    return names


def _in_stage(name: str, layout: ModelLayout, start: int, end: int) -> bool:
    if name == EMBEDDING:
        return start == 0
    if name in (FINAL_NORM, LM_HEAD):
        return end == layout.num_layers
    layer = int(name.split(".")[2])
    return start <= layer < end


def training_state_bytes(
    layout: ModelLayout,
    start: int,
    end: int,
    mode: str,
    lora_rank: int,
    tokens_in_flight: int,
) -> int:
    shapes = layout.expected_shapes()
    weights = sum(_numel(shapes[n]) for n in stage_tensor_names(layout, start, end))
    if mode == "lora":
        trainable = 0
        for layer in range(start, end):
            for target in LORA_TARGETS:
                out_dim, in_dim = shapes[f"model.layers.{layer}.{target}.weight"]
                trainable += lora_rank * (in_dim + out_dim)
    else:
        trainable = weights
    hidden, inter = layout.hidden_size, layout.intermediate_size
    q_dim = layout.num_heads * layout.head_dim
    kv_dim = layout.num_kv_heads * layout.head_dim
    per_token = (end - start) * (4 * hidden + 2 * q_dim + 2 * kv_dim + 4 * inter) + hidden
    if end == layout.num_layers:
        per_token += 2 * layout.vocab_size  # fp32 logits and their softmax
    return FP32 * (weights + 3 * trainable + tokens_in_flight * per_token)
