from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import client_api_pb2 as _client_api_pb2
from protos.tessera.v1 import training_pb2 as _training_pb2
from protos.tessera.v1 import ledger_pb2 as _ledger_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_DONE: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_DONE: JobState

class DatasetShard(_message.Message):
    __slots__ = ("sha256", "num_tokens")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    num_tokens: int
    def __init__(self, sha256: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DatasetHeader(_message.Message):
    __slots__ = ("name", "shards", "example_len")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_LEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    shards: _containers.RepeatedCompositeFieldContainer[DatasetShard]
    example_len: int
    def __init__(self, name: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[DatasetShard, _Mapping]]] = ..., example_len: _Optional[int] = ...) -> None: ...

class DatasetData(_message.Message):
    __slots__ = ("shard", "offset", "data")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shard: int
    offset: int
    data: bytes
    def __init__(self, shard: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DatasetChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: DatasetHeader
    data: DatasetData
    def __init__(self, header: _Optional[_Union[DatasetHeader, _Mapping]] = ..., data: _Optional[_Union[DatasetData, _Mapping]] = ...) -> None: ...

class DatasetRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("id", "name", "num_tokens", "max_token_id", "example_len", "shards", "created_unix_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_LEN_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    num_tokens: int
    max_token_id: int
    example_len: int
    shards: _containers.RepeatedCompositeFieldContainer[DatasetShard]
    created_unix_ms: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., num_tokens: _Optional[int] = ..., max_token_id: _Optional[int] = ..., example_len: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[DatasetShard, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("model", "dataset_id", "hyper", "steps", "batch_size", "seq_len", "checkpoint_every", "output_model", "account", "owner_public_key")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    OWNER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    model: str
    dataset_id: str
    hyper: _training_pb2.TrainingHyper
    steps: int
    batch_size: int
    seq_len: int
    checkpoint_every: int
    output_model: str
    account: str
    owner_public_key: bytes
    def __init__(self, model: _Optional[str] = ..., dataset_id: _Optional[str] = ..., hyper: _Optional[_Union[_training_pb2.TrainingHyper, _Mapping]] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., output_model: _Optional[str] = ..., account: _Optional[str] = ..., owner_public_key: _Optional[bytes] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class StagePlan(_message.Message):
    __slots__ = ("layers", "node_id", "address")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    layers: _common_pb2.LayerRange
    node_id: str
    address: str
    def __init__(self, layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "model", "dataset_id", "hyper", "steps", "batch_size", "seq_len", "checkpoint_every", "output_model", "account", "state", "step", "last_loss", "tokens_per_s", "checkpoint_step", "stages", "error", "created_unix_ms", "updated_unix_ms", "losses", "replans")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    dataset_id: str
    hyper: _training_pb2.TrainingHyper
    steps: int
    batch_size: int
    seq_len: int
    checkpoint_every: int
    output_model: str
    account: str
    state: JobState
    step: int
    last_loss: float
    tokens_per_s: float
    checkpoint_step: int
    stages: _containers.RepeatedCompositeFieldContainer[StagePlan]
    error: str
    created_unix_ms: int
    updated_unix_ms: int
    losses: _containers.RepeatedCompositeFieldContainer[LossPoint]
    replans: int
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., dataset_id: _Optional[str] = ..., hyper: _Optional[_Union[_training_pb2.TrainingHyper, _Mapping]] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., output_model: _Optional[str] = ..., account: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., last_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., checkpoint_step: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StagePlan, _Mapping]]] = ..., error: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., losses: _Optional[_Iterable[_Union[LossPoint, _Mapping]]] = ..., replans: _Optional[int] = ...) -> None: ...

class LossPoint(_message.Message):
    __slots__ = ("step", "loss")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("kind", "job", "step", "loss", "tokens_per_s", "json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    job: JobInfo
    step: int
    loss: float
    tokens_per_s: float
    json: str
    def __init__(self, kind: _Optional[str] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., json: _Optional[str] = ...) -> None: ...

class OpenTrainingSessionRequest(_message.Message):
    __slots__ = ("job_id", "client_public_key", "client_signature", "request_unix_ms", "max_price", "nonce")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    client_public_key: bytes
    client_signature: bytes
    request_unix_ms: int
    max_price: int
    nonce: bytes
    def __init__(self, job_id: _Optional[str] = ..., client_public_key: _Optional[bytes] = ..., client_signature: _Optional[bytes] = ..., request_unix_ms: _Optional[int] = ..., max_price: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class TrainingSession(_message.Message):
    __slots__ = ("job_id", "model", "hops", "capability", "restore_step", "restore", "job", "replaced_stage", "quote", "settled", "checkers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    REPLACED_STAGE_FIELD_NUMBER: _ClassVar[int]
    QUOTE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    CHECKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    hops: _containers.RepeatedCompositeFieldContainer[_client_api_pb2.Hop]
    capability: _client_api_pb2.SignedCapability
    restore_step: int
    restore: _containers.RepeatedCompositeFieldContainer[CheckpointPart]
    job: JobInfo
    replaced_stage: int
    quote: _ledger_pb2.Quote
    settled: _containers.RepeatedCompositeFieldContainer[_ledger_pb2.UsageReceipt]
    checkers: _containers.RepeatedCompositeFieldContainer[_client_api_pb2.Hop]
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., hops: _Optional[_Iterable[_Union[_client_api_pb2.Hop, _Mapping]]] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., restore_step: _Optional[int] = ..., restore: _Optional[_Iterable[_Union[CheckpointPart, _Mapping]]] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., replaced_stage: _Optional[int] = ..., quote: _Optional[_Union[_ledger_pb2.Quote, _Mapping]] = ..., settled: _Optional[_Iterable[_Union[_ledger_pb2.UsageReceipt, _Mapping]]] = ..., checkers: _Optional[_Iterable[_Union[_client_api_pb2.Hop, _Mapping]]] = ...) -> None: ...

class CheckpointPart(_message.Message):
    __slots__ = ("layers", "sha256", "total_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: _common_pb2.LayerRange
    sha256: str
    total_bytes: int
    def __init__(self, layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("job_id", "capability", "step", "loss", "grad_norm", "tokens", "tokens_per_s", "stage_ms", "wall_s", "usage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capability: _client_api_pb2.SignedCapability
    step: int
    loss: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    stage_ms: _containers.RepeatedScalarFieldContainer[float]
    wall_s: float
    usage: _containers.RepeatedCompositeFieldContainer[_ledger_pb2.SignedUsage]
    def __init__(self, job_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., stage_ms: _Optional[_Iterable[float]] = ..., wall_s: _Optional[float] = ..., usage: _Optional[_Iterable[_Union[_ledger_pb2.SignedUsage, _Mapping]]] = ...) -> None: ...

class StageFailureRequest(_message.Message):
    __slots__ = ("job_id", "capability", "stage", "node_id", "cause", "restore_at_most")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_AT_MOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capability: _client_api_pb2.SignedCapability
    stage: int
    node_id: str
    cause: str
    restore_at_most: int
    def __init__(self, job_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., stage: _Optional[int] = ..., node_id: _Optional[str] = ..., cause: _Optional[str] = ..., restore_at_most: _Optional[int] = ...) -> None: ...

class FinishJobRequest(_message.Message):
    __slots__ = ("job_id", "capability", "state", "error", "usage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capability: _client_api_pb2.SignedCapability
    state: JobState
    error: str
    usage: _containers.RepeatedCompositeFieldContainer[_ledger_pb2.SignedUsage]
    def __init__(self, job_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., error: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[_ledger_pb2.SignedUsage, _Mapping]]] = ...) -> None: ...
