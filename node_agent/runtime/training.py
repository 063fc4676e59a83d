"""Stage-side training engine: forward/backward per micro-batch, AdamW, checkpoints.

A ``StageTrainer`` owns one ``StageModel`` while a job trains it. The driver walks every
micro-batch forward through the stages, then backward in reverse, passing activation
gradients between them; each stage accumulates its own parameter gradients, reports their
squared norm (the driver sums them for global clipping) and applies AdamW on command. Only
data arrives from the driver (token ids, labels, gradients, numbers), never code.

Full mode trains every parameter; LoRA mode freezes the base weights and trains adapters on
the attention and MLP projections (see ``lora.py``).

Keep vs recompute (``recompute=False`` is the default):

* keep: each pending micro-batch holds its autograd graph, i.e. every activation the
  backward pass needs. Per decoder layer that is about
  ``(4*hidden + 2*q_dim + 2*kv_dim + 4*intermediate) * dtype_bytes`` per token (norm inputs,
  the q/k/v and attention outputs, the four SwiGLU tensors), plus ``~2 * vocab * 4`` bytes
  per token on the last stage (fp32 logits and their softmax). A stage holding ``k``
  micro-batches of ``b*t`` tokens pays ``k * b * t * layers * per_layer``. Backward then
  costs one pass.
* recompute (activation checkpointing): a pending micro-batch holds only its input,
  ``hidden * dtype_bytes`` per token (8 bytes per token id on the first stage), and backward
  re-runs the forward first (~1.33x the compute of keep). Only the micro-batch being
  backpropagated has its activations alive. Choose it when the pipeline keeps many
  micro-batches in flight (GPipe keeps all of them) on a memory-tight node.

The math path of attention on CPU also materialises ``heads * T * T`` scores per sequence;
the estimate assumes fused attention (flash / memory-efficient), which is linear in T.

Exactness: the loss on the last stage is the mean cross-entropy of one micro-batch, scaled by
``1 / num_micro_batches`` before backward, so accumulated gradients equal those of one big
batch when micro-batches hold equally many labelled tokens (the driver's fixed-shape
batches do). There is no dropout, so recompute reproduces the kept graph bit for bit.

Refusals never leave the stage half-updated: a bad gradient is rejected before autograd
runs (the micro-batch stays pending, so a corrected retry works), and parameter gradients
are computed into fresh tensors and checked for NaN/inf before any is added to ``.grad``.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from node_agent.runtime.config import ModelConfig
from node_agent.runtime.lora import LORA_TARGETS, LoRAAdapters, lora_parameter_count
from node_agent.runtime.stage_model import StageModel

TrainingMode = Literal["full", "lora"]
MicroBatchId = Hashable
IGNORE_INDEX = -100
STATE_FORMAT = "tessera-stage-training/1"
_METADATA_KEY = "tessera_training"
_PARAM_PREFIX = "param/"
_ADAM_PREFIX = "adam/"
_ADAM_FIELDS = ("exp_avg", "exp_avg_sq", "step")
# A checkpoint restores only onto a stage that agrees on all of these.
_IDENTITY_KEYS = (
    "format",
    "mode",
    "start",
    "end",
    "lora_rank",
    "lora_alpha",
    "architecture",
    "dtype",
)


class TrainingInputError(ValueError):
    """A request to the trainer is malformed; nothing was changed."""


class UnknownMicroBatchError(KeyError):
    """Backward (or discard) named a micro-batch with no forward pending on this stage."""

    def __str__(self) -> str:
        # KeyError would otherwise print the message wrapped in quotes.
        return str(self.args[0]) if self.args else ""


class NonFiniteGradientError(ValueError):
    """NaN or inf gradients were refused; no parameter gradient was touched."""


class StaleVersionError(ValueError):
    """An optimizer step named a version other than the stage's current one."""


class TooManyMicroBatchesError(RuntimeError):
    """More micro-batches are pending backward than this stage accepts."""


@dataclass
class _Pending:
    # keep: the leaf the graph starts from; recompute: the raw input to run again.
    inputs: torch.Tensor
    labels: torch.Tensor | None
    root: torch.Tensor | None  # loss or stage output with its graph; None when recomputing
    output_shape: torch.Size
    output_dtype: torch.dtype


class StageTrainer:
    """Trains one pipeline stage; every public method is serialised by a lock."""

    def __init__(
        self,
        stage: StageModel,
        mode: TrainingMode = "full",
        *,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        seed: int = 0,
        num_micro_batches: int = 1,
        recompute: bool = False,
        max_pending: int = 64,
    ) -> None:
        if mode not in ("full", "lora"):
            raise TrainingInputError(f"training mode must be 'full' or 'lora', got {mode!r}")
        _check_positive_int("num_micro_batches", num_micro_batches)
        _check_positive_int("max_pending", max_pending)
        config = stage.config
        if mode == "full" and config.tie_word_embeddings and (stage.is_first != stage.is_last):
            # The first and last stage would each update their own copy of the shared
            # matrix, and the model would silently stop being tied.
            raise TrainingInputError(
                "full-parameter training of a model with tied embeddings needs the embedding "
                "and the LM head on the same stage; train with mode='lora', or place the "
                "whole model on one stage"
            )
        self.stage = stage
        self.mode: TrainingMode = mode
        self.seed = seed
        self.num_micro_batches = num_micro_batches
        self.recompute = recompute
        self.max_pending = max_pending
        self.hyper_params = {
            "lr": lr,
            "betas": list(betas),
            "weight_decay": weight_decay,
            "eps": eps,
        }
        self.lora: LoRAAdapters | None = None
        if mode == "lora":
            stage.requires_grad_(False)
            self.lora = LoRAAdapters(stage, lora_rank, lora_alpha, seed)
        else:
            stage.requires_grad_(True)
        self._params: dict[str, nn.Parameter] = dict(self._named_trainable())
        self._optimizer = _adamw(self._params, lr, betas, weight_decay, eps)
        self._pending: dict[MicroBatchId, _Pending] = {}
        self._version = 0
        self._lock = threading.RLock()

    # ---- introspection -------------------------------------------------------------

    @property
    def version(self) -> int:
        """Number of optimizer steps applied (restored from checkpoints)."""
        return self._version

    @property
    def pending(self) -> list[MicroBatchId]:
        with self._lock:
            return list(self._pending)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self._params)

    # ---- forward / backward --------------------------------------------------------

    def forward(
        self, micro_batch_id: MicroBatchId, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the stage on one micro-batch and remember what backward needs.

        Returns the stage output (hidden states, or logits on the last stage) detached, or,
        on the last stage with ``labels`` int64 ``[B, T]`` (-100 = ignore), the unscaled
        mean cross-entropy as a 0-dim fp32 tensor.
        """
        with self._lock:
            self._check_new_micro_batch(micro_batch_id)
            inputs = self._stage_input(x)
            labels = self._checked_labels(labels, x)
            if self.recompute:
                with torch.no_grad():
                    result = self._run(inputs, labels)
                root = None
            else:
                inputs = self._as_leaf(inputs)
                with torch.enable_grad():
                    result = self._run(inputs, labels)
                root = result
            self._pending[micro_batch_id] = _Pending(
                inputs=inputs,
                labels=labels,
                root=root,
                output_shape=result.shape,
                output_dtype=result.dtype,
            )
            return result.detach()

    def backward(
        self, micro_batch_id: MicroBatchId, grad_output: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Backpropagate one micro-batch; return the gradient w.r.t. the stage input.

        The last stage with labels takes no ``grad_output`` (its loss is the root); other
        stages take the gradient w.r.t. their output, same shape and dtype as that output.
        Returns None on the first stage, whose input is token ids.
        """
        with self._lock:
            pending = self._pending.get(micro_batch_id)
            if pending is None:
                raise UnknownMicroBatchError(
                    f"unknown micro-batch {micro_batch_id!r}: no forward is pending for it on "
                    f"this stage (pending: {list(self._pending)}); run forward first, and "
                    "backward each micro-batch once"
                )
            seed_grad = self._checked_grad_output(pending, grad_output)
            del self._pending[micro_batch_id]
            if pending.root is None:
                leaf = self._as_leaf(pending.inputs)
                with torch.enable_grad():
                    root = self._run(leaf, pending.labels)
            else:
                root = pending.root
                leaf = pending.inputs
            if pending.labels is not None:
                root = root / self.num_micro_batches
            return self._accumulate(root, leaf, seed_grad, micro_batch_id)

    def evaluate(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Forward without keeping anything (validation loss, accuracy probes)."""
        with self._lock, torch.no_grad():
            labels = self._checked_labels(labels, x)
            return self._run(self._stage_input(x), labels)

    def discard(self, micro_batch_id: MicroBatchId | None = None) -> int:
        """Drop one pending micro-batch (or all, with None), e.g. after a peer failed."""
        with self._lock:
            if micro_batch_id is None:
                count = len(self._pending)
                self._pending.clear()
                return count
            if self._pending.pop(micro_batch_id, None) is None:
                raise UnknownMicroBatchError(f"unknown micro-batch {micro_batch_id!r}")
            return 1

    # ---- optimizer -----------------------------------------------------------------

    def grad_sq_norm(self) -> float:
        """Squared L2 norm of this stage's accumulated gradients (0.0 before any backward)."""
        with self._lock:
            grads = [p.grad for p in self._params.values() if p.grad is not None]
            if not grads:
                return 0.0
            # fp64 so that summing per-stage norms matches one stage summing everything.
            return float(torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum())

    def zero_grad(self) -> None:
        """Forget accumulated gradients (a step abandoned by the driver)."""
        with self._lock:
            for param in self._params.values():
                param.grad = None

    def step(self, clip_scale: float, version: int) -> int:
        """Apply AdamW to ``clip_scale * grads``, clear grads; return the new version.

        ``version`` must equal the stage's current version, so a retried or reordered
        command can never apply a step twice.
        """
        with self._lock:
            if isinstance(version, bool) or not isinstance(version, int):
                raise TrainingInputError(f"version must be an integer, got {version!r}")
            if version != self._version:
                raise StaleVersionError(
                    f"stale version {version}: this stage is at version {self._version}; "
                    "the driver is out of sync (a duplicated step, or a stage restored from "
                    "another checkpoint), so roll every stage back to one checkpoint"
                )
            if isinstance(clip_scale, bool) or not isinstance(clip_scale, (int, float)):
                raise TrainingInputError(f"clip_scale must be a number, got {clip_scale!r}")
            if not (math.isfinite(clip_scale) and clip_scale > 0):
                raise TrainingInputError(
                    f"clip_scale must be finite and > 0, got {clip_scale}; compute it with "
                    "clip_scale(total_sq_norm, max_norm)"
                )
            if self._pending:
                raise TrainingInputError(
                    f"{len(self._pending)} micro-batches still await backward "
                    f"({list(self._pending)}); backward or discard them before stepping"
                )
            if self._optimizer is not None:
                with torch.no_grad():
                    if clip_scale != 1.0:
                        for param in self._params.values():
                            if param.grad is not None:
                                param.grad.mul_(clip_scale)
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
            self._version += 1
            return self._version

    # ---- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, metadata) to resume exactly: trainable params, AdamW moments, version.

        Both are safetensors-compatible (``save_file(tensors, path, metadata)``); tensors are
        CPU copies. LoRA checkpoints hold only adapters: the base weights are in the store.
        Accumulated, unstepped gradients are not saved: checkpoint between steps.
        """
        with self._lock:
            if self._pending:
                raise TrainingInputError(
                    "cannot checkpoint while micro-batches are pending; finish the step first"
                )
            tensors: dict[str, torch.Tensor] = {}
            for name, param in self._params.items():
                tensors[_PARAM_PREFIX + name] = _cpu_copy(param)
                state = self._optimizer.state.get(param, {}) if self._optimizer else {}
                for field in _ADAM_FIELDS:
                    if field in state:
                        value = state[field]
                        value = value if torch.is_tensor(value) else torch.tensor(float(value))
                        tensors[f"{_ADAM_PREFIX}{name}/{field}"] = _cpu_copy(value)
            return tensors, {
                _METADATA_KEY: json.dumps(self._identity() | {"version": self._version})
            }

    def load_state_dict(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> None:
        """Restore a ``state_dict()`` of the same stage, mode and model; refuse anything else."""
        with self._lock:
            if self._pending:
                raise TrainingInputError(
                    "cannot restore while micro-batches are pending; discard them first"
                )
            info = _parse_metadata(metadata)
            mine = self._identity()
            differing = sorted(key for key in _IDENTITY_KEYS if info.get(key) != mine[key])
            if differing:
                theirs = {k: info.get(k) for k in differing}
                ours = {k: mine[k] for k in differing}
                raise TrainingInputError(
                    f"checkpoint is for another stage or job: it has {theirs}, this stage "
                    f"has {ours}"
                )
            version = info.get("version")
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise TrainingInputError(f"checkpoint version must be an integer >= 0: {version!r}")
            self._check_checkpoint_tensors(tensors)
            with torch.no_grad():
                for name, param in self._params.items():
                    param.copy_(tensors[_PARAM_PREFIX + name])
                    param.grad = None
            if self._optimizer is not None:
                self._optimizer.load_state_dict(self._optimizer_state(tensors))
            self._version = version

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """This stage's weights under their Hugging Face names, LoRA merged in (for export)."""
        with self._lock:
            if self.lora is not None:
                return self.lora.merged_weights(self.stage)
            return {name: t.detach().clone() for name, t in self.stage.state_dict().items()}

    def close(self) -> None:
        """Detach adapters and drop pending state; the stage is an inference model again."""
        with self._lock:
            self._pending.clear()
            if self.lora is not None:
                self.lora.remove()
            self.stage.requires_grad_(False)
            for param in self.stage.parameters():
                param.grad = None

    # ---- internals -----------------------------------------------------------------

    def _named_trainable(self) -> Iterator[tuple[str, nn.Parameter]]:
        if self.lora is not None:
            yield from self.lora.named_adapter_parameters()
        else:
            yield from self.stage.named_parameters()

    def _identity(self) -> dict[str, Any]:
        stage = self.stage
        return {
            "format": STATE_FORMAT,
            "mode": self.mode,
            "start": stage.start,
            "end": stage.end,
            "lora_rank": self.lora.rank if self.lora else None,
            "lora_alpha": self.lora.alpha if self.lora else None,
            "architecture": stage.config.architecture,
            "dtype": str(stage.dtype).removeprefix("torch."),
            "hyper_params": self.hyper_params,
            "seed": self.seed,
        }

    def _check_new_micro_batch(self, micro_batch_id: MicroBatchId) -> None:
        try:
            hash(micro_batch_id)
        except TypeError as err:
            raise TrainingInputError(
                f"micro-batch id must be hashable (an int or str), got {micro_batch_id!r}"
            ) from err
        if micro_batch_id in self._pending:
            raise TrainingInputError(
                f"micro-batch {micro_batch_id!r} already has a forward pending; backward or "
                "discard it before reusing the id"
            )
        if len(self._pending) >= self.max_pending:
            raise TooManyMicroBatchesError(
                f"{len(self._pending)} micro-batches already await backward on this stage "
                f"(limit {self.max_pending}); backward some before sending more"
            )

    def _stage_input(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(x):
            raise TrainingInputError(f"stage input must be a tensor, got {type(x).__name__}")
        if self.stage.is_first:
            return x  # token ids; StageModel validates dtype, shape and range
        if not x.is_floating_point():
            raise TrainingInputError(f"stage expects float hidden states, got {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise TrainingInputError("stage input holds NaN or inf values; refusing it")
        return x.detach().to(device=self.stage.device, dtype=self.stage.dtype)

    def _as_leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.stage.is_first:
            return inputs
        # detach() gives a fresh tensor object, so a recompute starts a new graph.
        return inputs.detach().requires_grad_(True)

    def _checked_labels(self, labels: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        if labels is None:
            return None
        if not self.stage.is_last:
            raise TrainingInputError("only the last stage takes labels")
        if not torch.is_tensor(labels) or labels.dtype != torch.int64 or labels.dim() != 2:
            raise TrainingInputError(
                f"labels must be int64 [batch, seq], got {getattr(labels, 'dtype', labels)} "
                f"{list(getattr(labels, 'shape', []))}"
            )
        if tuple(labels.shape) != tuple(x.shape[:2]):
            raise TrainingInputError(
                f"labels have shape {list(labels.shape)} but the input is "
                f"[batch, seq] = {list(x.shape[:2])}"
            )
        vocab = self.stage.config.vocab_size
        valid = (labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab))
        if not bool(valid.all()):
            raise TrainingInputError(
                f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored)"
            )
        if not bool((labels != IGNORE_INDEX).any()):
            raise TrainingInputError(
                f"every label is {IGNORE_INDEX}, so the loss is undefined; send at least one "
                "target token per micro-batch"
            )
        return labels.to(self.stage.device)

    def _checked_grad_output(
        self, pending: _Pending, grad_output: torch.Tensor | None
    ) -> torch.Tensor | None:
        if pending.labels is not None:
            if grad_output is not None:
                raise TrainingInputError(
                    "the last stage computes its own loss from the labels; send no grad_output"
                )
            return None
        if grad_output is None:
            raise TrainingInputError(
                f"backward needs grad_output {pending.output_dtype} "
                f"{list(pending.output_shape)} (the gradient w.r.t. this stage's output)"
            )
        if not torch.is_tensor(grad_output):
            raise TrainingInputError(
                f"grad_output must be a tensor, got {type(grad_output).__name__}"
            )
        if grad_output.shape != pending.output_shape or grad_output.dtype != pending.output_dtype:
            raise TrainingInputError(
                f"grad_output is {grad_output.dtype} {list(grad_output.shape)}, but this "
                f"micro-batch's output was {pending.output_dtype} {list(pending.output_shape)}"
            )
        if not bool(torch.isfinite(grad_output).all()):
            raise NonFiniteGradientError(
                "grad_output holds NaN or inf values; refused and not applied (the "
                "micro-batch is still pending: retry with a finite gradient or discard it)"
            )
        return grad_output.to(self.stage.device)

    def _run(self, inputs: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        out = self.stage(inputs)
        if labels is None:
            return out
        return F.cross_entropy(
            out.reshape(-1, out.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def _accumulate(
        self,
        root: torch.Tensor,
        leaf: torch.Tensor,
        seed_grad: torch.Tensor | None,
        micro_batch_id: MicroBatchId,
    ) -> torch.Tensor | None:
        wants_input_grad = not self.stage.is_first
        targets = list(self._params.values()) + ([leaf] if wants_input_grad else [])
        if not root.requires_grad or not targets:
            return torch.zeros_like(leaf) if wants_input_grad else None
        # Fresh gradient tensors first, .grad only once all are known finite.
        grads = torch.autograd.grad(root, targets, grad_outputs=seed_grad, allow_unused=True)
        present = [g for g in grads if g is not None]
        if present and not bool(torch.stack([torch.isfinite(g).all() for g in present]).all()):
            raise NonFiniteGradientError(
                f"backward of micro-batch {micro_batch_id!r} produced NaN or inf gradients; "
                "refused and not applied (the micro-batch was dropped; lower the learning "
                "rate or check the input)"
            )
        with torch.no_grad():
            for param, grad in zip(self._params.values(), grads, strict=False):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        if not wants_input_grad:
            return None
        input_grad = grads[-1]
        return torch.zeros_like(leaf) if input_grad is None else input_grad.detach()

    def _check_checkpoint_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        problems: list[str] = []
        expected = {_PARAM_PREFIX + name for name in self._params}
        params_in = {k for k in tensors if k.startswith(_PARAM_PREFIX)}
        if missing := sorted(expected - params_in):
            problems.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected := sorted(params_in - expected):
            problems.append(f"unexpected {unexpected[:5]}")
        for name, param in self._params.items():
            tensor = tensors.get(_PARAM_PREFIX + name)
            if tensor is None:
                continue
            if tensor.shape != param.shape or tensor.dtype != param.dtype:
                problems.append(
                    f"{name} is {tensor.dtype} {list(tensor.shape)}, expected {param.dtype} "
                    f"{list(param.shape)}"
                )
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name} holds NaN or inf")
            fields = [f"{_ADAM_PREFIX}{name}/{field}" for field in _ADAM_FIELDS]
            present = [f in tensors for f in fields]
            if any(present) and not all(present):
                problems.append(f"optimizer state of {name} is incomplete")
            if all(present):
                for field in fields[:2]:
                    if tensors[field].shape != param.shape:
                        problems.append(f"{field} has shape {list(tensors[field].shape)}")
        if problems:
            raise TrainingInputError("checkpoint does not fit this stage: " + "; ".join(problems))

    def _optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        assert self._optimizer is not None
        current = self._optimizer.state_dict()
        index_of_param = _param_indices(self._optimizer)
        index_of_name = {name: index_of_param[id(p)] for name, p in self._params.items()}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, index in index_of_name.items():
            if f"{_ADAM_PREFIX}{name}/step" not in tensors:
                continue  # never stepped (no gradient yet): AdamW starts it fresh
            state[index] = {
                field: tensors[f"{_ADAM_PREFIX}{name}/{field}"].clone() for field in _ADAM_FIELDS
            }
        return {"state": state, "param_groups": current["param_groups"]}


# ---- helpers for drivers and the planner -------------------------------------------


def clip_scale(total_sq_norm: float, max_norm: float | None) -> float:
    """Scale for global-norm clipping, as torch.nn.utils.clip_grad_norm_ computes it."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    if not math.isfinite(total_sq_norm) or total_sq_norm < 0:
        raise ValueError(f"total squared norm must be finite and >= 0, got {total_sq_norm}")
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + 1e-6))


def state_to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """Serialise a ``state_dict()`` as safetensors bytes (for streaming to the store)."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=dict(metadata))


def state_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes into (tensors, metadata); refuses malformed data."""
    from safetensors.torch import load

    if len(data) < 8:
        raise TrainingInputError("checkpoint is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise TrainingInputError("checkpoint header is longer than the checkpoint")
    try:
        header = json.loads(data[8 : 8 + header_len])
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for corrupt data
        raise TrainingInputError(f"checkpoint is not valid safetensors: {err}") from err
    metadata = header.get("__metadata__") or {}
    return tensors, metadata


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes a training stage holds: weights, grads, AdamW moments and activations."""

    weight_bytes: int  # every weight of the stage (frozen or not)
    trainable_params: int
    grad_bytes: int
    optimizer_bytes: int  # AdamW's two moments, kept in the parameter dtype
    activation_bytes_per_token: int  # what a kept micro-batch holds per token
    input_bytes_per_token: int  # what a recomputed micro-batch holds per token

    def total(
        self, tokens_in_flight: int, recompute: bool = False, micro_batch_tokens: int = 0
    ) -> int:
        """Peak bytes with ``tokens_in_flight`` tokens of micro-batches awaiting backward."""
        fixed = self.weight_bytes + self.grad_bytes + self.optimizer_bytes
        if not recompute:
            return fixed + tokens_in_flight * self.activation_bytes_per_token
        # One micro-batch at a time is re-run with its activations alive.
        return (
            fixed
            + tokens_in_flight * self.input_bytes_per_token
            + micro_batch_tokens * self.activation_bytes_per_token
        )


def training_memory(
    config: ModelConfig,
    start: int,
    end: int,
    mode: TrainingMode,
    lora_rank: int,
    dtype_bytes: int,
) -> TrainingMemory:
    """Planner-side estimate for layers [start, end) (first/last follow from the range)."""
    if mode not in ("full", "lora"):
        raise ValueError(f"training mode must be 'full' or 'lora', got {mode!r}")
    is_first, is_last = start == 0, end == config.num_hidden_layers
    layers = end - start
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    embedding = config.vocab_size * hidden
    params = layers * config.params_per_layer()
    if is_first:
        params += embedding
    if is_last:
        params += hidden + (0 if config.tie_word_embeddings and is_first else embedding)
    if mode == "full":
        trainable = params
    else:
        shapes = {
            "self_attn.q_proj": (hidden, q_dim),
            "self_attn.k_proj": (hidden, kv_dim),
            "self_attn.v_proj": (hidden, kv_dim),
            "self_attn.o_proj": (q_dim, hidden),
            "mlp.gate_proj": (hidden, inter),
            "mlp.up_proj": (hidden, inter),
            "mlp.down_proj": (inter, hidden),
        }
        trainable = layers * lora_parameter_count([shapes[t] for t in LORA_TARGETS], lora_rank)
    per_layer_token = (4 * hidden + 2 * q_dim + 2 * kv_dim + 4 * inter) * dtype_bytes
    activation = layers * per_layer_token + (hidden * dtype_bytes if not is_first else 0)
    if is_last:
        activation += 2 * config.vocab_size * 4 + hidden * dtype_bytes  # fp32 logits + softmax
    weights = params * dtype_bytes + (trainable * dtype_bytes if mode == "lora" else 0)
    return TrainingMemory(
        weight_bytes=weights,
        trainable_params=trainable,
        grad_bytes=trainable * dtype_bytes,
        optimizer_bytes=2 * trainable * dtype_bytes,
        activation_bytes_per_token=activation,
        input_bytes_per_token=8 if is_first else hidden * dtype_bytes,
    )


def training_bytes(
    config: ModelConfig,
    start: int,
    end: int,
    mode: TrainingMode,
    lora_rank: int,
    dtype_bytes: int,
    tokens_in_flight: int = 0,
    recompute: bool = False,
    micro_batch_tokens: int = 0,
) -> int:
    """Total bytes of a training shard: what the planner checks against node memory."""
    memory = training_memory(config, start, end, mode, lora_rank, dtype_bytes)
    return memory.total(tokens_in_flight, recompute, micro_batch_tokens)


def _adamw(
    params: Mapping[str, nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> torch.optim.AdamW | None:
    for label, value in (("lr", lr), ("eps", eps)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise TrainingInputError(f"{label} must be a positive number, got {value!r}")
    if not (isinstance(weight_decay, (int, float)) and 0 <= weight_decay < math.inf):
        raise TrainingInputError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise TrainingInputError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not params:
        return None  # e.g. LoRA on a stage holding only the head: nothing to train here
    # Norm weights and biases are not decayed (standard practice for transformers).
    decayed = [p for p in params.values() if p.dim() >= 2]
    plain = [p for p in params.values() if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=lr, betas=tuple(betas), eps=eps, foreach=False
    )


def _param_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> its index in optimizer.state_dict() (numbered across groups in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(param): index for index, param in enumerate(params)}


def _parse_metadata(metadata: Mapping[str, str]) -> dict[str, Any]:
    raw = metadata.get(_METADATA_KEY) if isinstance(metadata, Mapping) else None
    if not isinstance(raw, str):
        raise TrainingInputError(
            f"checkpoint metadata lacks {_METADATA_KEY!r}; it was not written by StageTrainer"
        )
    try:
        info = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TrainingInputError(f"checkpoint metadata is not JSON: {err}") from err
    if not isinstance(info, dict):
        raise TrainingInputError("checkpoint metadata must be a JSON object")
    return info


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _check_positive_int(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TrainingInputError(f"{label} must be a positive integer, got {value!r}")
