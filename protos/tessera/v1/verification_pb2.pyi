from protos.tessera.v1 import common_pb2 as _common_pb2
from protos.tessera.v1 import client_api_pb2 as _client_api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignedTrainingReply(_message.Message):
    __slots__ = ("node_id", "input_digest", "output_sha256", "signature")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    input_digest: bytes
    output_sha256: bytes
    signature: bytes
    def __init__(self, node_id: _Optional[str] = ..., input_digest: _Optional[bytes] = ..., output_sha256: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class TrainingCall(_message.Message):
    __slots__ = ("kind", "step", "micro_batch", "input", "labels", "clip_coef", "primary", "checker")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TrainingCall.Kind]
        FORWARD: _ClassVar[TrainingCall.Kind]
        BACKWARD: _ClassVar[TrainingCall.Kind]
        NORM: _ClassVar[TrainingCall.Kind]
        OPTIMIZER_STEP: _ClassVar[TrainingCall.Kind]
    KIND_UNSPECIFIED: TrainingCall.Kind
    FORWARD: TrainingCall.Kind
    BACKWARD: TrainingCall.Kind
    NORM: TrainingCall.Kind
    OPTIMIZER_STEP: TrainingCall.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CLIP_COEF_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    kind: TrainingCall.Kind
    step: int
    micro_batch: int
    input: _common_pb2.Tensor
    labels: _common_pb2.Tensor
    clip_coef: float
    primary: SignedTrainingReply
    checker: SignedTrainingReply
    def __init__(self, kind: _Optional[_Union[TrainingCall.Kind, str]] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., input: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., clip_coef: _Optional[float] = ..., primary: _Optional[_Union[SignedTrainingReply, _Mapping]] = ..., checker: _Optional[_Union[SignedTrainingReply, _Mapping]] = ...) -> None: ...

class TrainingAnswer(_message.Message):
    __slots__ = ("output", "loss", "label_tokens", "sq_norm", "finite")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    FINITE_FIELD_NUMBER: _ClassVar[int]
    output: _common_pb2.Tensor
    loss: float
    label_tokens: int
    sq_norm: float
    finite: bool
    def __init__(self, output: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., label_tokens: _Optional[int] = ..., sq_norm: _Optional[float] = ..., finite: _Optional[bool] = ...) -> None: ...

class TrainingDispute(_message.Message):
    __slots__ = ("job_id", "capability", "layers", "primary_node_id", "checker_node_id", "restore_step", "restore_sha256", "calls", "primary_answer", "checker_answer")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SHA256_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_ANSWER_FIELD_NUMBER: _ClassVar[int]
    CHECKER_ANSWER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capability: _client_api_pb2.SignedCapability
    layers: _common_pb2.LayerRange
    primary_node_id: str
    checker_node_id: str
    restore_step: int
    restore_sha256: str
    calls: _containers.RepeatedCompositeFieldContainer[TrainingCall]
    primary_answer: TrainingAnswer
    checker_answer: TrainingAnswer
    def __init__(self, job_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., primary_node_id: _Optional[str] = ..., checker_node_id: _Optional[str] = ..., restore_step: _Optional[int] = ..., restore_sha256: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[TrainingCall, _Mapping]]] = ..., primary_answer: _Optional[_Union[TrainingAnswer, _Mapping]] = ..., checker_answer: _Optional[_Union[TrainingAnswer, _Mapping]] = ...) -> None: ...

class TrainingAgreement(_message.Message):
    __slots__ = ("kind", "step", "micro_batch", "layers", "primary", "checker")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    kind: TrainingCall.Kind
    step: int
    micro_batch: int
    layers: _common_pb2.LayerRange
    primary: SignedTrainingReply
    checker: SignedTrainingReply
    def __init__(self, kind: _Optional[_Union[TrainingCall.Kind, str]] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., primary: _Optional[_Union[SignedTrainingReply, _Mapping]] = ..., checker: _Optional[_Union[SignedTrainingReply, _Mapping]] = ...) -> None: ...

class TrainingChecks(_message.Message):
    __slots__ = ("job_id", "capability", "agreements")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    AGREEMENTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capability: _client_api_pb2.SignedCapability
    agreements: _containers.RepeatedCompositeFieldContainer[TrainingAgreement]
    def __init__(self, job_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., agreements: _Optional[_Iterable[_Union[TrainingAgreement, _Mapping]]] = ...) -> None: ...

class TrainingChecksAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class SignedOutput(_message.Message):
    __slots__ = ("node_id", "step", "layers", "input_digest", "output_sha256", "signature", "output")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    step: int
    layers: _common_pb2.LayerRange
    input_digest: bytes
    output_sha256: bytes
    signature: bytes
    output: _common_pb2.Tensor
    def __init__(self, node_id: _Optional[str] = ..., step: _Optional[int] = ..., layers: _Optional[_Union[_common_pb2.LayerRange, _Mapping]] = ..., input_digest: _Optional[bytes] = ..., output_sha256: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., output: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Comparison(_message.Message):
    __slots__ = ("primary", "checker", "agreed", "prefix", "input", "last_position_only")
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LAST_POSITION_ONLY_FIELD_NUMBER: _ClassVar[int]
    primary: SignedOutput
    checker: SignedOutput
    agreed: bool
    prefix: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    input: _common_pb2.Tensor
    last_position_only: bool
    def __init__(self, primary: _Optional[_Union[SignedOutput, _Mapping]] = ..., checker: _Optional[_Union[SignedOutput, _Mapping]] = ..., agreed: _Optional[bool] = ..., prefix: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., input: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., last_position_only: _Optional[bool] = ...) -> None: ...

class NodeCalls(_message.Message):
    __slots__ = ("node_id", "calls", "checked")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    calls: int
    checked: int
    def __init__(self, node_id: _Optional[str] = ..., calls: _Optional[int] = ..., checked: _Optional[int] = ...) -> None: ...

class AuditAgreement(_message.Message):
    __slots__ = ("primary", "checker")
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    primary: SignedOutput
    checker: SignedOutput
    def __init__(self, primary: _Optional[_Union[SignedOutput, _Mapping]] = ..., checker: _Optional[_Union[SignedOutput, _Mapping]] = ...) -> None: ...

class VerificationReport(_message.Message):
    __slots__ = ("session_id", "capability", "comparisons", "calls", "audits")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    COMPARISONS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: _client_api_pb2.SignedCapability
    comparisons: _containers.RepeatedCompositeFieldContainer[Comparison]
    calls: _containers.RepeatedCompositeFieldContainer[NodeCalls]
    audits: _containers.RepeatedCompositeFieldContainer[AuditAgreement]
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ..., comparisons: _Optional[_Iterable[_Union[Comparison, _Mapping]]] = ..., calls: _Optional[_Iterable[_Union[NodeCalls, _Mapping]]] = ..., audits: _Optional[_Iterable[_Union[AuditAgreement, _Mapping]]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("outcome", "arbiter_node_id", "evidence_id", "detail")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[Verdict.Outcome]
        PRIMARY_WRONG: _ClassVar[Verdict.Outcome]
        CHECKER_WRONG: _ClassVar[Verdict.Outcome]
        UNRESOLVED: _ClassVar[Verdict.Outcome]
    OUTCOME_UNSPECIFIED: Verdict.Outcome
    PRIMARY_WRONG: Verdict.Outcome
    CHECKER_WRONG: Verdict.Outcome
    UNRESOLVED: Verdict.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ARBITER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    outcome: Verdict.Outcome
    arbiter_node_id: str
    evidence_id: str
    detail: str
    def __init__(self, outcome: _Optional[_Union[Verdict.Outcome, str]] = ..., arbiter_node_id: _Optional[str] = ..., evidence_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportVerdict(_message.Message):
    __slots__ = ("verdicts", "risk")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    risk: SessionRisk
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., risk: _Optional[_Union[SessionRisk, _Mapping]] = ...) -> None: ...

class SessionRiskRequest(_message.Message):
    __slots__ = ("session_id", "capability")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capability: _client_api_pb2.SignedCapability
    def __init__(self, session_id: _Optional[str] = ..., capability: _Optional[_Union[_client_api_pb2.SignedCapability, _Mapping]] = ...) -> None: ...

class SessionRisk(_message.Message):
    __slots__ = ("session_id", "calls", "checked", "mismatches", "check_fraction", "assumed_corruption", "detection_probability", "undetected_probability")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    CHECK_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_CORRUPTION_FIELD_NUMBER: _ClassVar[int]
    DETECTION_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    UNDETECTED_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    calls: int
    checked: int
    mismatches: int
    check_fraction: float
    assumed_corruption: float
    detection_probability: float
    undetected_probability: float
    def __init__(self, session_id: _Optional[str] = ..., calls: _Optional[int] = ..., checked: _Optional[int] = ..., mismatches: _Optional[int] = ..., check_fraction: _Optional[float] = ..., assumed_corruption: _Optional[float] = ..., detection_probability: _Optional[float] = ..., undetected_probability: _Optional[float] = ...) -> None: ...
