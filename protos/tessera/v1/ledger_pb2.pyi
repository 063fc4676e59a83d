from protos.tessera.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StakeRequest(_message.Message):
    __slots__ = ("amount", "request_id", "query")
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    amount: int
    request_id: str
    query: SignedQuery
    def __init__(self, amount: _Optional[int] = ..., request_id: _Optional[str] = ..., query: _Optional[_Union[SignedQuery, _Mapping]] = ...) -> None: ...

class SettleUsageRequest(_message.Message):
    __slots__ = ("session_id", "usage")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    usage: _containers.RepeatedCompositeFieldContainer[SignedUsage]
    def __init__(self, session_id: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[SignedUsage, _Mapping]]] = ...) -> None: ...

class GrantCreditsRequest(_message.Message):
    __slots__ = ("account", "amount", "request_id")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    account: str
    amount: int
    request_id: str
    def __init__(self, account: _Optional[str] = ..., amount: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class AccountBalance(_message.Message):
    __slots__ = ("account", "available", "escrowed")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ESCROWED_FIELD_NUMBER: _ClassVar[int]
    account: str
    available: int
    escrowed: int
    def __init__(self, account: _Optional[str] = ..., available: _Optional[int] = ..., escrowed: _Optional[int] = ...) -> None: ...

class SignedQuery(_message.Message):
    __slots__ = ("public_key", "unix_ms", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    unix_ms: int
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., unix_ms: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Earnings(_message.Message):
    __slots__ = ("node_id", "account", "pending", "released", "slashed", "rejected", "next_release_unix_ms", "staked", "available")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SLASHED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_RELEASE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STAKED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    account: str
    pending: int
    released: int
    slashed: int
    rejected: int
    next_release_unix_ms: int
    staked: int
    available: int
    def __init__(self, node_id: _Optional[str] = ..., account: _Optional[str] = ..., pending: _Optional[int] = ..., released: _Optional[int] = ..., slashed: _Optional[int] = ..., rejected: _Optional[int] = ..., next_release_unix_ms: _Optional[int] = ..., staked: _Optional[int] = ..., available: _Optional[int] = ...) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("ok", "violations", "transactions", "minted", "escrowed", "open_holds")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    MINTED_FIELD_NUMBER: _ClassVar[int]
    ESCROWED_FIELD_NUMBER: _ClassVar[int]
    OPEN_HOLDS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violations: _containers.RepeatedScalarFieldContainer[str]
    transactions: int
    minted: int
    escrowed: int
    open_holds: int
    def __init__(self, ok: _Optional[bool] = ..., violations: _Optional[_Iterable[str]] = ..., transactions: _Optional[int] = ..., minted: _Optional[int] = ..., escrowed: _Optional[int] = ..., open_holds: _Optional[int] = ...) -> None: ...

class Quote(_message.Message):
    __slots__ = ("amount", "account", "prices")
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    PRICES_FIELD_NUMBER: _ClassVar[int]
    amount: int
    account: str
    prices: _containers.RepeatedCompositeFieldContainer[NodePrice]
    def __init__(self, amount: _Optional[int] = ..., account: _Optional[str] = ..., prices: _Optional[_Iterable[_Union[NodePrice, _Mapping]]] = ...) -> None: ...

class NodePrice(_message.Message):
    __slots__ = ("node_id", "price_per_1k_token_layers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_1K_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    price_per_1k_token_layers: int
    def __init__(self, node_id: _Optional[str] = ..., price_per_1k_token_layers: _Optional[int] = ...) -> None: ...

class UsageReceipt(_message.Message):
    __slots__ = ("session_id", "node_id", "node_public_key", "layer_start", "layer_end", "tokens", "first_step", "last_step", "longest")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LONGEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    node_id: str
    node_public_key: bytes
    layer_start: int
    layer_end: int
    tokens: int
    first_step: int
    last_step: int
    longest: int
    def __init__(self, session_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_public_key: _Optional[bytes] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., tokens: _Optional[int] = ..., first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., longest: _Optional[int] = ...) -> None: ...

class SignedUsage(_message.Message):
    __slots__ = ("receipt", "node_signature", "client_signature", "billed_tokens")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    NODE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    receipt: bytes
    node_signature: bytes
    client_signature: bytes
    billed_tokens: int
    def __init__(self, receipt: _Optional[bytes] = ..., node_signature: _Optional[bytes] = ..., client_signature: _Optional[bytes] = ..., billed_tokens: _Optional[int] = ...) -> None: ...

class Settlement(_message.Message):
    __slots__ = ("session_id", "escrowed", "charged", "refunded", "fee", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ESCROWED_FIELD_NUMBER: _ClassVar[int]
    CHARGED_FIELD_NUMBER: _ClassVar[int]
    REFUNDED_FIELD_NUMBER: _ClassVar[int]
    FEE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    escrowed: int
    charged: int
    refunded: int
    fee: int
    closed: bool
    def __init__(self, session_id: _Optional[str] = ..., escrowed: _Optional[int] = ..., charged: _Optional[int] = ..., refunded: _Optional[int] = ..., fee: _Optional[int] = ..., closed: _Optional[bool] = ...) -> None: ...
