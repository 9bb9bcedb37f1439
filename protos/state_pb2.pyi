from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_STATUS_UNSPECIFIED: _ClassVar[StateStatus]
    STATE_STATUS_OK: _ClassVar[StateStatus]
    STATE_STATUS_NO_SNAPSHOT: _ClassVar[StateStatus]
    STATE_STATUS_GONE: _ClassVar[StateStatus]
    STATE_STATUS_REFUSED: _ClassVar[StateStatus]
STATE_STATUS_UNSPECIFIED: StateStatus
STATE_STATUS_OK: StateStatus
STATE_STATUS_NO_SNAPSHOT: StateStatus
STATE_STATUS_GONE: StateStatus
STATE_STATUS_REFUSED: StateStatus

class StateInfoRequest(_message.Message):
    __slots__ = ("run_key", "tag")
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    run_key: str
    tag: bytes
    def __init__(self, run_key: _Optional[str] = ..., tag: _Optional[bytes] = ...) -> None: ...

class StateInfoResponse(_message.Message):
    __slots__ = ("status", "snapshot_id", "step", "numel", "chunk_bytes", "chunk_hashes", "tcp_address")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    status: StateStatus
    snapshot_id: bytes
    step: int
    numel: int
    chunk_bytes: int
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tcp_address: str
    def __init__(self, status: _Optional[_Union[StateStatus, str]] = ..., snapshot_id: _Optional[bytes] = ..., step: _Optional[int] = ..., numel: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., tcp_address: _Optional[str] = ...) -> None: ...

class StateChunkRequest(_message.Message):
    __slots__ = ("run_key", "snapshot_id", "index", "tag", "caller")
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    run_key: str
    snapshot_id: bytes
    index: int
    tag: bytes
    caller: str
    def __init__(self, run_key: _Optional[str] = ..., snapshot_id: _Optional[bytes] = ..., index: _Optional[int] = ..., tag: _Optional[bytes] = ..., caller: _Optional[str] = ...) -> None: ...

class StateChunkResponse(_message.Message):
    __slots__ = ("status", "data")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    status: StateStatus
    data: bytes
    def __init__(self, status: _Optional[_Union[StateStatus, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
