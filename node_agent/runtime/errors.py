"""Exceptions raised by the model runtime.

They subclass builtin exceptions so callers that only care about the broad category
(bad input vs. exhausted resource) can catch ValueError / RuntimeError / LookupError.
"""


class UnsupportedModelError(ValueError):
    """The checkpoint's config describes a model this runtime cannot run."""


class UnsupportedDtypeError(ValueError):
    """The requested dtype cannot be used on the requested device."""


class CheckpointError(ValueError):
    """The checkpoint directory is unusable (missing files, bad index, ...)."""


class PickleCheckpointError(CheckpointError):
    """The checkpoint only ships pickle weights, which can execute code when loaded."""


class MissingTensorError(CheckpointError):
    """Tensors a stage needs are absent from the checkpoint."""


class WeightLoadError(ValueError):
    """Tensors handed to a StageModel do not fit its parameters."""


class CacheFullError(RuntimeError):
    """Appending to a StageKVCache would exceed its preallocated length."""


class CacheBudgetError(RuntimeError):
    """Opening a session would exceed the node's KV cache token budget."""


class UnknownSessionError(LookupError):
    """No KV cache is open for the given session id."""
