from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChallengeRequest(_message.Message):
    __slots__ = ("public_key",)
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    def __init__(self, public_key: _Optional[bytes] = ...) -> None: ...

class Challenge(_message.Message):
    __slots__ = ("nonce", "expires_unix_ms")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    expires_unix_ms: int
    def __init__(self, nonce: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("public_key", "nonce", "signature", "name", "account", "capabilities", "data_address")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    nonce: bytes
    signature: bytes
    name: str
    account: str
    capabilities: _node_pb2.Capabilities
    data_address: str
    def __init__(self, public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., name: _Optional[str] = ..., account: _Optional[str] = ..., capabilities: _Optional[_Union[_node_pb2.Capabilities, _Mapping]] = ..., data_address: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("node_id", "coordinator_public_key", "attach_ticket", "heartbeat_interval_ms", "offline_after_ms", "mqtt_url", "reachable", "coordinator_unix_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TICKET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    MQTT_URL_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    coordinator_public_key: bytes
    attach_ticket: bytes
    heartbeat_interval_ms: int
    offline_after_ms: int
    mqtt_url: str
    reachable: bool
    coordinator_unix_ms: int
    def __init__(self, node_id: _Optional[str] = ..., coordinator_public_key: _Optional[bytes] = ..., attach_ticket: _Optional[bytes] = ..., heartbeat_interval_ms: _Optional[int] = ..., offline_after_ms: _Optional[int] = ..., mqtt_url: _Optional[str] = ..., reachable: _Optional[bool] = ..., coordinator_unix_ms: _Optional[int] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "drain", "shard_status")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    SHARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    hello: AttachHello
    heartbeat: Heartbeat
    drain: DrainRequest
    shard_status: _node_pb2.ShardStatus
    def __init__(self, hello: _Optional[_Union[AttachHello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., drain: _Optional[_Union[DrainRequest, _Mapping]] = ..., shard_status: _Optional[_Union[_node_pb2.ShardStatus, _Mapping]] = ...) -> None: ...

class AttachHello(_message.Message):
    __slots__ = ("node_id", "attach_ticket", "keepalive_pings")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TICKET_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_PINGS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    attach_ticket: bytes
    keepalive_pings: bool
    def __init__(self, node_id: _Optional[str] = ..., attach_ticket: _Optional[bytes] = ..., keepalive_pings: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "sent_unix_ms", "telemetry")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sent_unix_ms: int
    telemetry: _node_pb2.Telemetry
    def __init__(self, seq: _Optional[int] = ..., sent_unix_ms: _Optional[int] = ..., telemetry: _Optional[_Union[_node_pb2.Telemetry, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "heartbeat_ack", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    heartbeat_ack: HeartbeatAck
    command: Command
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node_id", "state", "heartbeat_interval_ms", "acks_on_state_change_only", "telemetry_interval_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ACKS_ON_STATE_CHANGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: _node_pb2.NodeState
    heartbeat_interval_ms: int
    acks_on_state_change_only: bool
    telemetry_interval_ms: int
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[_node_pb2.NodeState, str]] = ..., heartbeat_interval_ms: _Optional[int] = ..., acks_on_state_change_only: _Optional[bool] = ..., telemetry_interval_ms: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq", "state")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    state: _node_pb2.NodeState
    def __init__(self, seq: _Optional[int] = ..., state: _Optional[_Union[_node_pb2.NodeState, str]] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("drain", "assign", "drop", "probe", "reachability")
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    drain: Drain
    assign: AssignShard
    drop: DropShard
    probe: ProbePeers
    reachability: Reachability
    def __init__(self, drain: _Optional[_Union[Drain, _Mapping]] = ..., assign: _Optional[_Union[AssignShard, _Mapping]] = ..., drop: _Optional[_Union[DropShard, _Mapping]] = ..., probe: _Optional[_Union[ProbePeers, _Mapping]] = ..., reachability: _Optional[_Union[Reachability, _Mapping]] = ...) -> None: ...

class Reachability(_message.Message):
    __slots__ = ("reachable",)
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    def __init__(self, reachable: _Optional[bool] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason", "deadline_ms")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    deadline_ms: int
    def __init__(self, reason: _Optional[str] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class AssignShard(_message.Message):
    __slots__ = ("model", "layers", "dtype", "kv_tokens_budget", "num_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _common_pb2.LayerRange
    dtype: str
    kv_tokens_budget: int
    num_layers: int
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., dtype: _Optional[str] = ..., kv_tokens_budget: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class DropShard(_message.Message):
    __slots__ = ("model", "layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: _common_pb2.LayerRange
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ...) -> None: ...

class ProbePeers(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("name", "config_json", "tensors", "num_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    num_layers: int
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., num_layers: _Optional[int] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "sha256", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model", "sha256")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    model: str
    sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("sha256", "offset", "total_bytes", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    offset: int
    total_bytes: int
    data: bytes
    def __init__(self, sha256: _Optional[str] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
