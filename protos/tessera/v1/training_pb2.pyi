from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import client_api_pb2 as _client_api_pb2
from protos.tessera.v1 import ledger_pb2 as _ledger_pb2
from protos.tessera.v1 import stage_pb2 as _stage_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainingHyper(_message.Message):
    __slots__ = ("mode", "lora_rank", "lora_alpha", "lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm", "seed", "micro_batches")
    MODE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    lora_rank: int
    lora_alpha: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    seed: int
    micro_batches: int
    def __init__(self, mode: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., seed: _Optional[int] = ..., micro_batches: _Optional[int] = ...) -> None: ...

class OpenTrainingRequest(_message.Message):
    __slots__ = ("capability", "job_id", "model", "layers", "hyper", "restore_step", "restore_sha256")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SHA256_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    model: str
    layers: _common_pb2.LayerRange
    hyper: TrainingHyper
    restore_step: int
    restore_sha256: str
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., model: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., hyper: _Optional[_Union[TrainingHyper, _Mapping]] = ..., restore_step: _Optional[int] = ..., restore_sha256: _Optional[str] = ...) -> None: ...

class OpenTrainingResponse(_message.Message):
    __slots__ = ("step", "trainable_params", "state_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    trainable_params: int
    state_bytes: int
    def __init__(self, step: _Optional[int] = ..., trainable_params: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class TrainForwardRequest(_message.Message):
    __slots__ = ("capability", "job_id", "step", "micro_batch", "input", "labels")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    step: int
    micro_batch: int
    input: _common_pb2.Tensor
    labels: _common_pb2.Tensor
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., input: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainForwardResponse(_message.Message):
    __slots__ = ("step", "micro_batch", "output", "loss", "label_tokens", "compute_ms", "signature", "input_digest", "usage")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    micro_batch: int
    output: _common_pb2.Tensor
    loss: float
    label_tokens: int
    compute_ms: float
    signature: bytes
    input_digest: bytes
    usage: _ledger_pb2.SignedUsage
    def __init__(self, step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., output: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., label_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., signature: _Optional[bytes] = ..., input_digest: _Optional[bytes] = ..., usage: _Optional[_Union[_ledger_pb2.SignedUsage, _Mapping]] = ...) -> None: ...

class TrainBackwardRequest(_message.Message):
    __slots__ = ("capability", "job_id", "step", "micro_batch", "grad_output")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    step: int
    micro_batch: int
    grad_output: _common_pb2.Tensor
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., grad_output: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainBackwardResponse(_message.Message):
    __slots__ = ("step", "micro_batch", "grad_input", "compute_ms", "signature", "input_digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    micro_batch: int
    grad_input: _common_pb2.Tensor
    compute_ms: float
    signature: bytes
    input_digest: bytes
    def __init__(self, step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., grad_input: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ..., signature: _Optional[bytes] = ..., input_digest: _Optional[bytes] = ...) -> None: ...

class GradNormRequest(_message.Message):
    __slots__ = ("capability", "job_id", "step")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    step: int
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class GradNormResponse(_message.Message):
    __slots__ = ("step", "sq_norm", "finite", "signature")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    FINITE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    step: int
    sq_norm: float
    finite: bool
    signature: bytes
    def __init__(self, step: _Optional[int] = ..., sq_norm: _Optional[float] = ..., finite: _Optional[bool] = ..., signature: _Optional[bytes] = ...) -> None: ...

class OptimizerStepRequest(_message.Message):
    __slots__ = ("capability", "job_id", "step", "clip_coef")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLIP_COEF_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    step: int
    clip_coef: float
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ..., clip_coef: _Optional[float] = ...) -> None: ...

class OptimizerStepResponse(_message.Message):
    __slots__ = ("step", "signature")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    step: int
    signature: bytes
    def __init__(self, step: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("capability", "job_id", "step")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    step: int
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("step", "sha256", "total_bytes", "consistent")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    step: int
    sha256: str
    total_bytes: int
    consistent: bool
    def __init__(self, step: _Optional[int] = ..., sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., consistent: _Optional[bool] = ...) -> None: ...

class CloseTrainingRequest(_message.Message):
    __slots__ = ("capability", "job_id")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    job_id: str
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., job_id: _Optional[str] = ...) -> None: ...

class CheckpointHeader(_message.Message):
    __slots__ = ("job_id", "step", "layers", "total_bytes", "sha256")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    layers: _common_pb2.LayerRange
    total_bytes: int
    sha256: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: CheckpointHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[CheckpointHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CheckpointReceipt(_message.Message):
    __slots__ = ("sha256", "total_bytes", "consistent")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    total_bytes: int
    consistent: bool
    def __init__(self, sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., consistent: _Optional[bool] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "step", "layers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    layers: _common_pb2.LayerRange
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ...) -> None: ...
