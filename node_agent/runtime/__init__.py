"""Model runtime of the node agent: load and run one pipeline stage of a Llama-family LLM."""

from node_agent.runtime.checkpoint import (
    load_model_config,
    load_stage_tensors,
    tensor_locations,
)
from node_agent.runtime.config import Llama3RopeScaling, ModelConfig
from node_agent.runtime.dtypes import parse_dtype, resolve_dtype
from node_agent.runtime.errors import (
    CacheBudgetError,
    CacheFullError,
    CheckpointError,
    MissingTensorError,
    PickleCheckpointError,
    UnknownSessionError,
    UnsupportedDtypeError,
    UnsupportedModelError,
    WeightLoadError,
)
from node_agent.runtime.kv_cache import CacheFactory, KVCacheManager, StageKVCache
from node_agent.runtime.stage_loader import load_stage_model
from node_agent.runtime.stage_model import StageModel
from node_agent.runtime.tensor_names import tensor_names_for_stage
from protos.model_family import SUPPORTED_ARCHITECTURES

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CacheBudgetError",
    "CacheFactory",
    "CacheFullError",
    "CheckpointError",
    "KVCacheManager",
    "Llama3RopeScaling",
    "MissingTensorError",
    "ModelConfig",
    "PickleCheckpointError",
    "StageKVCache",
    "StageModel",
    "UnknownSessionError",
    "UnsupportedDtypeError",
    "UnsupportedModelError",
    "WeightLoadError",
    "load_model_config",
    "load_stage_model",
    "load_stage_tensors",
    "parse_dtype",
    "resolve_dtype",
    "tensor_locations",
    "tensor_names_for_stage",
]
