from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import client_api_pb2 as _client_api_pb2
from protos.tessera.v1 import ledger_pb2 as _ledger_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcknowledgeRequest(_message.Message):
    __slots__ = ("session_id", "capability", "usage")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: _client_api_pb2.SignedCapability
    usage: _containers.RepeatedCompositeFieldContainer[_ledger_pb2.SignedUsage]
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., usage: _Optional[_Iterable[_Union[_ledger_pb2.SignedUsage, _Mapping]]] = ...) -> None: ...

class AcknowledgeResponse(_message.Message):
    __slots__ = ("acknowledged_tokens",)
    ACKNOWLEDGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    acknowledged_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, acknowledged_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("capability", "session_id", "step", "model", "layers", "start_pos", "input", "last_position_only", "background", "relay_to", "relayed", "ring", "probes")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_ONLY_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    RELAY_TO_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    capability: _client_api_pb2.SignedCapability
    session_id: str
    step: int
    model: str
    layers: _common_pb2.LayerRange
    start_pos: int
    input: _common_pb2.Tensor
    last_position_only: bool
    background: bool
    relay_to: _containers.RepeatedCompositeFieldContainer[RelayHop]
    relayed: bool
    ring: RingContinuation
    probes: _containers.RepeatedCompositeFieldContainer[LogitProbe]
    def __init__(self, capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., session_id: _Optional[str] = ..., step: _Optional[int] = ..., model: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., start_pos: _Optional[int] = ..., input: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_position_only: _Optional[bool] = ..., background: _Optional[bool] = ..., relay_to: _Optional[_Iterable[_Union[RelayHop, _Mapping]]] = ..., relayed: _Optional[bool] = ..., ring: _Optional[_Union[RingContinuation, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[LogitProbe, _Mapping]]] = ...) -> None: ...

class LogitProbe(_message.Message):
    __slots__ = ("position", "token_ids")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbeAnswer(_message.Message):
    __slots__ = ("position", "top_ids", "top_logits", "probed_logits", "logsumexp")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGITS_FIELD_NUMBER: _ClassVar[int]
    PROBED_LOGITS_FIELD_NUMBER: _ClassVar[int]
    LOGSUMEXP_FIELD_NUMBER: _ClassVar[int]
    position: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logits: _containers.RepeatedScalarFieldContainer[float]
    probed_logits: _containers.RepeatedScalarFieldContainer[float]
    logsumexp: float
    def __init__(self, position: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logits: _Optional[_Iterable[float]] = ..., probed_logits: _Optional[_Iterable[float]] = ..., logsumexp: _Optional[float] = ...) -> None: ...

class RingContinuation(_message.Message):
    __slots__ = ("route", "steps", "temperature", "top_p", "seed", "stop_token_ids", "origin_step")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_STEP_FIELD_NUMBER: _ClassVar[int]
    route: _containers.RepeatedCompositeFieldContainer[RelayHop]
    steps: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    origin_step: int
    def __init__(self, route: _Optional[_Iterable[_Union[RelayHop, _Mapping]]] = ..., steps: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., origin_step: _Optional[int] = ...) -> None: ...

class RelayHop(_message.Message):
    __slots__ = ("node_id", "address", "layers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    layers: _common_pb2.LayerRange
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ...) -> None: ...

class DeliveriesRequest(_message.Message):
    __slots__ = ("session_id", "capability")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: _client_api_pb2.SignedCapability
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("step", "layers", "response", "error_code", "error_message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    layers: _common_pb2.LayerRange
    response: ForwardResponse
    error_code: int
    error_message: str
    def __init__(self, step: _Optional[int] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., response: _Optional[_Union[ForwardResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("step", "output", "compute_ms", "cache_length", "signature", "usage", "input_digest", "probe_answers", "relay_failed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROBE_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FAILED_FIELD_NUMBER: _ClassVar[int]
    step: int
    output: _common_pb2.Tensor
    compute_ms: float
    cache_length: int
    signature: bytes
    usage: _ledger_pb2.SignedUsage
    input_digest: bytes
    probe_answers: _containers.RepeatedCompositeFieldContainer[ProbeAnswer]
    relay_failed: str
    def __init__(self, step: _Optional[int] = ..., output: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ..., cache_length: _Optional[int] = ..., signature: _Optional[bytes] = ..., usage: _Optional[_Union[_ledger_pb2.SignedUsage, _Mapping]] = ..., input_digest: _Optional[bytes] = ..., probe_answers: _Optional[_Iterable[_Union[ProbeAnswer, _Mapping]]] = ..., relay_failed: _Optional[str] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "capability")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: _client_api_pb2.SignedCapability
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("payload", "node_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    node_id: str
    def __init__(self, payload: _Optional[bytes] = ..., node_id: _Optional[str] = ...) -> None: ...
