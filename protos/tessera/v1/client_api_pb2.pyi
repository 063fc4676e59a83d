from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import ledger_pb2 as _ledger_pb2
from protos.tessera.v1 import node_pb2 as _node_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListNodesRequest(_message.Message):
    __slots__ = ("include_offline",)
    INCLUDE_OFFLINE_FIELD_NUMBER: _ClassVar[int]
    include_offline: bool
    def __init__(self, include_offline: _Optional[bool] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_node_pb2.NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_node_pb2.NodeInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "num_layers", "hidden_size", "vocab_size", "total_bytes", "has_tokenizer", "available", "unavailable_reason", "ready_replicas", "added_unix_ms", "sha256", "max_positions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    READY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ADDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    total_bytes: int
    has_tokenizer: bool
    available: bool
    unavailable_reason: str
    ready_replicas: _containers.RepeatedScalarFieldContainer[int]
    added_unix_ms: int
    sha256: str
    max_positions: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., total_bytes: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., available: _Optional[bool] = ..., unavailable_reason: _Optional[str] = ..., ready_replicas: _Optional[_Iterable[int]] = ..., added_unix_ms: _Optional[int] = ..., sha256: _Optional[str] = ..., max_positions: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelDetail(_message.Message):
    __slots__ = ("info", "config_json", "tokenizer_json")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    config_json: str
    tokenizer_json: bytes
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., config_json: _Optional[str] = ..., tokenizer_json: _Optional[bytes] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("node_id", "address", "layers", "relayed", "public_key", "account", "device_kind", "compute_dtype", "check_probability")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECK_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    layers: _common_pb2.LayerRange
    relayed: bool
    public_key: bytes
    account: str
    device_kind: str
    compute_dtype: str
    check_probability: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., relayed: _Optional[bool] = ..., public_key: _Optional[bytes] = ..., account: _Optional[str] = ..., device_kind: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., check_probability: _Optional[float] = ...) -> None: ...

class RouteStage(_message.Message):
    __slots__ = ("layers", "primary", "alternates", "checkers")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    CHECKERS_FIELD_NUMBER: _ClassVar[int]
    layers: _common_pb2.LayerRange
    primary: Hop
    alternates: _containers.RepeatedCompositeFieldContainer[Hop]
    checkers: _containers.RepeatedCompositeFieldContainer[Hop]
    def __init__(self, layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., primary: _Optional[_Union[Hop, _Mapping]] = ..., alternates: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., checkers: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("model", "max_length", "account", "max_price", "prefer", "client_public_key", "request_unix_ms", "client_signature", "nonce")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_FIELD_NUMBER: _ClassVar[int]
    PREFER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_length: int
    account: str
    max_price: int
    prefer: str
    client_public_key: bytes
    request_unix_ms: int
    client_signature: bytes
    nonce: bytes
    def __init__(self, model: _Optional[str] = ..., max_length: _Optional[int] = ..., account: _Optional[str] = ..., max_price: _Optional[int] = ..., prefer: _Optional[str] = ..., client_public_key: _Optional[bytes] = ..., request_unix_ms: _Optional[int] = ..., client_signature: _Optional[bytes] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class CapabilityClaims(_message.Message):
    __slots__ = ("session_id", "model", "grants", "issued_unix_ms", "expires_unix_ms", "max_tokens", "account", "client_public_key", "usage_credit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    USAGE_CREDIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    grants: _containers.RepeatedCompositeFieldContainer[Hop]
    issued_unix_ms: int
    expires_unix_ms: int
    max_tokens: int
    account: str
    client_public_key: bytes
    usage_credit: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., grants: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., issued_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., max_tokens: _Optional[int] = ..., account: _Optional[str] = ..., client_public_key: _Optional[bytes] = ..., usage_credit: _Optional[int] = ...) -> None: ...

class SignedCapability(_message.Message):
    __slots__ = ("claims", "signature")
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    claims: bytes
    signature: bytes
    def __init__(self, claims: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SessionGrant(_message.Message):
    __slots__ = ("session_id", "stages", "capability", "num_layers", "hidden_size", "vocab_size", "quote")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUOTE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stages: _containers.RepeatedCompositeFieldContainer[RouteStage]
    capability: SignedCapability
    num_layers: int
    hidden_size: int
    vocab_size: int
    quote: _ledger_pb2.Quote
    def __init__(self, session_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[RouteStage, _Mapping]]] = ..., capability: _Optional[_Union[SignedCapability, _Mapping]] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., quote: _Optional[_Union[_ledger_pb2.Quote, _Mapping]] = ...) -> None: ...

class RerouteRequest(_message.Message):
    __slots__ = ("session_id", "capability", "span", "exclude_node_ids", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: SignedCapability
    span: _common_pb2.LayerRange
    exclude_node_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[SignedCapability, _Mapping]] = ..., span: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., exclude_node_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RerouteResponse(_message.Message):
    __slots__ = ("hops", "capability")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[Hop]
    capability: SignedCapability
    def __init__(self, hops: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., capability: _Optional[_Union[SignedCapability, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "capability", "usage")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: SignedCapability
    usage: _containers.RepeatedCompositeFieldContainer[_ledger_pb2.SignedUsage]
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[SignedCapability, _Mapping]] = ..., usage: _Optional[_Iterable[_Union[_ledger_pb2.SignedUsage, _Mapping]]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("settlement",)
    SETTLEMENT_FIELD_NUMBER: _ClassVar[int]
    settlement: _ledger_pb2.Settlement
    def __init__(self, settlement: _Optional[_Union[_ledger_pb2.Settlement, _Mapping]] = ...) -> None: ...

class StepTime(_message.Message):
    __slots__ = ("node_id", "layers", "tokens", "wall_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layers: _common_pb2.LayerRange
    tokens: int
    wall_ms: float
    def __init__(self, node_id: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., tokens: _Optional[int] = ..., wall_ms: _Optional[float] = ...) -> None: ...

class StepTimesReport(_message.Message):
    __slots__ = ("session_id", "capability", "steps", "unreachable_node_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: SignedCapability
    steps: _containers.RepeatedCompositeFieldContainer[StepTime]
    unreachable_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[SignedCapability, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepTime, _Mapping]]] = ..., unreachable_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepTimesAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...
