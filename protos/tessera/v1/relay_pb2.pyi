from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TunnelUp(_message.Message):
    __slots__ = ("hello", "data", "close")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    hello: TunnelHello
    data: TunnelData
    close: TunnelClose
    def __init__(self, hello: _Optional[_Union[TunnelHello, _Mapping]] = ..., data: _Optional[_Union[TunnelData, _Mapping]] = ..., close: _Optional[_Union[TunnelClose, _Mapping]] = ...) -> None: ...

class TunnelDown(_message.Message):
    __slots__ = ("welcome", "open", "data", "close")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    welcome: TunnelWelcome
    open: TunnelOpen
    data: TunnelData
    close: TunnelClose
    def __init__(self, welcome: _Optional[_Union[TunnelWelcome, _Mapping]] = ..., open: _Optional[_Union[TunnelOpen, _Mapping]] = ..., data: _Optional[_Union[TunnelData, _Mapping]] = ..., close: _Optional[_Union[TunnelClose, _Mapping]] = ...) -> None: ...

class TunnelHello(_message.Message):
    __slots__ = ("node_id", "attach_ticket", "previous_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TICKET_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    attach_ticket: bytes
    previous_port: int
    def __init__(self, node_id: _Optional[str] = ..., attach_ticket: _Optional[bytes] = ..., previous_port: _Optional[int] = ...) -> None: ...

class TunnelWelcome(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class TunnelOpen(_message.Message):
    __slots__ = ("conn",)
    CONN_FIELD_NUMBER: _ClassVar[int]
    conn: int
    def __init__(self, conn: _Optional[int] = ...) -> None: ...

class TunnelData(_message.Message):
    __slots__ = ("conn", "data")
    CONN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    conn: int
    data: bytes
    def __init__(self, conn: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TunnelClose(_message.Message):
    __slots__ = ("conn",)
    CONN_FIELD_NUMBER: _ClassVar[int]
    conn: int
    def __init__(self, conn: _Optional[int] = ...) -> None: ...
