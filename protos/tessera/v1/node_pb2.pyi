from protos.tessera.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ONLINE: _ClassVar[NodeState]
    NODE_STATE_SUSPECT: _ClassVar[NodeState]
    NODE_STATE_OFFLINE: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_BANNED: _ClassVar[NodeState]

class ShardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STATE_UNSPECIFIED: _ClassVar[ShardState]
    SHARD_STATE_ASSIGNED: _ClassVar[ShardState]
    SHARD_STATE_FETCHING: _ClassVar[ShardState]
    SHARD_STATE_LOADING: _ClassVar[ShardState]
    SHARD_STATE_READY: _ClassVar[ShardState]
    SHARD_STATE_FAILED: _ClassVar[ShardState]
    SHARD_STATE_DROPPED: _ClassVar[ShardState]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ONLINE: NodeState
NODE_STATE_SUSPECT: NodeState
NODE_STATE_OFFLINE: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_BANNED: NodeState
SHARD_STATE_UNSPECIFIED: ShardState
SHARD_STATE_ASSIGNED: ShardState
SHARD_STATE_FETCHING: ShardState
SHARD_STATE_LOADING: ShardState
SHARD_STATE_READY: ShardState
SHARD_STATE_FAILED: ShardState
SHARD_STATE_DROPPED: ShardState

class Capabilities(_message.Message):
    __slots__ = ("device_kind", "device_name", "device_count", "memory_total_bytes", "memory_usable_bytes", "compute_capability", "cpu_cores", "ram_bytes", "matmul_tflops", "region", "price_per_1k_token_layers", "limits", "agent_version", "dtypes", "price_per_1k_token_layers_units", "price_per_sample_layer_units", "memory_bandwidth_gbps")
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MATMUL_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_1K_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_1K_TOKEN_LAYERS_UNITS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_SAMPLE_LAYER_UNITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    device_name: str
    device_count: int
    memory_total_bytes: int
    memory_usable_bytes: int
    compute_capability: str
    cpu_cores: int
    ram_bytes: int
    matmul_tflops: float
    region: str
    price_per_1k_token_layers: float
    limits: OwnerLimits
    agent_version: str
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    price_per_1k_token_layers_units: int
    price_per_sample_layer_units: int
    memory_bandwidth_gbps: float
    def __init__(self, device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., device_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., memory_usable_bytes: _Optional[int] = ..., compute_capability: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., matmul_tflops: _Optional[float] = ..., region: _Optional[str] = ..., price_per_1k_token_layers: _Optional[float] = ..., limits: _Optional[_Union[OwnerLimits, _Mapping]] = ..., agent_version: _Optional[str] = ..., dtypes: _Optional[_Iterable[str]] = ..., price_per_1k_token_layers_units: _Optional[int] = ..., price_per_sample_layer_units: _Optional[int] = ..., memory_bandwidth_gbps: _Optional[float] = ...) -> None: ...

class OwnerLimits(_message.Message):
    __slots__ = ("max_memory_bytes", "max_sessions", "active_hours")
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_HOURS_FIELD_NUMBER: _ClassVar[int]
    max_memory_bytes: int
    max_sessions: int
    active_hours: str
    def __init__(self, max_memory_bytes: _Optional[int] = ..., max_sessions: _Optional[int] = ..., active_hours: _Optional[str] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("memory_used_bytes", "utilization", "queue_length", "active_sessions", "kv_tokens_used", "kv_tokens_budget", "rtt_ms")
    class RttMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    memory_used_bytes: int
    utilization: float
    queue_length: int
    active_sessions: int
    kv_tokens_used: int
    kv_tokens_budget: int
    rtt_ms: _containers.ScalarMap[str, float]
    def __init__(self, memory_used_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., queue_length: _Optional[int] = ..., active_sessions: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_budget: _Optional[int] = ..., rtt_ms: _Optional[_Mapping[str, float]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "name", "account", "state", "capabilities", "telemetry", "registered_unix_ms", "last_seen_unix_ms", "state_changed_unix_ms", "data_address", "shards", "trust", "speed", "reliability", "reachable", "state_reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    account: str
    state: NodeState
    capabilities: Capabilities
    telemetry: Telemetry
    registered_unix_ms: int
    last_seen_unix_ms: int
    state_changed_unix_ms: int
    data_address: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    trust: NodeTrust
    speed: NodeSpeed
    reliability: NodeReliability
    reachable: bool
    state_reason: str
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., account: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., registered_unix_ms: _Optional[int] = ..., last_seen_unix_ms: _Optional[int] = ..., state_changed_unix_ms: _Optional[int] = ..., data_address: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., trust: _Optional[_Union[NodeTrust, _Mapping]] = ..., speed: _Optional[_Union[NodeSpeed, _Mapping]] = ..., reliability: _Optional[_Union[NodeReliability, _Mapping]] = ..., reachable: _Optional[bool] = ..., state_reason: _Optional[str] = ...) -> None: ...

class NodeReliability(_message.Message):
    __slots__ = ("leave_rate_per_h", "departures", "hours_online")
    LEAVE_RATE_PER_H_FIELD_NUMBER: _ClassVar[int]
    DEPARTURES_FIELD_NUMBER: _ClassVar[int]
    HOURS_ONLINE_FIELD_NUMBER: _ClassVar[int]
    leave_rate_per_h: float
    departures: int
    hours_online: float
    def __init__(self, leave_rate_per_h: _Optional[float] = ..., departures: _Optional[int] = ..., hours_online: _Optional[float] = ...) -> None: ...

class NodeSpeed(_message.Message):
    __slots__ = ("claimed_ms_per_gparam", "ms_per_gparam", "samples", "measured", "rtt_ms", "call_ms")
    CLAIMED_MS_PER_GPARAM_FIELD_NUMBER: _ClassVar[int]
    MS_PER_GPARAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    CALL_MS_FIELD_NUMBER: _ClassVar[int]
    claimed_ms_per_gparam: float
    ms_per_gparam: float
    samples: int
    measured: bool
    rtt_ms: float
    call_ms: float
    def __init__(self, claimed_ms_per_gparam: _Optional[float] = ..., ms_per_gparam: _Optional[float] = ..., samples: _Optional[int] = ..., measured: _Optional[bool] = ..., rtt_ms: _Optional[float] = ..., call_ms: _Optional[float] = ...) -> None: ...

class NodeTrust(_message.Message):
    __slots__ = ("trust", "check_probability", "consecutive_verified", "verified", "failures", "canary_passed", "canary_failed")
    TRUST_FIELD_NUMBER: _ClassVar[int]
    CHECK_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    CANARY_PASSED_FIELD_NUMBER: _ClassVar[int]
    CANARY_FAILED_FIELD_NUMBER: _ClassVar[int]
    trust: float
    check_probability: float
    consecutive_verified: int
    verified: int
    failures: int
    canary_passed: int
    canary_failed: int
    def __init__(self, trust: _Optional[float] = ..., check_probability: _Optional[float] = ..., consecutive_verified: _Optional[int] = ..., verified: _Optional[int] = ..., failures: _Optional[int] = ..., canary_passed: _Optional[int] = ..., canary_failed: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("model", "layers", "state", "progress", "error", "bytes_fetched", "bytes_downloaded")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWNLOADED_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _common_pb2.LayerRange
    state: ShardState
    progress: float
    error: str
    bytes_fetched: int
    bytes_downloaded: int
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., state: _Optional[_Union[ShardState, str]] = ..., progress: _Optional[float] = ..., error: _Optional[str] = ..., bytes_fetched: _Optional[int] = ..., bytes_downloaded: _Optional[int] = ...) -> None: ...
