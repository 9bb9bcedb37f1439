from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]

class RecordKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_KIND_UNSPECIFIED: _ClassVar[RecordKind]
    RECORD_KIND_MEMBER: _ClassVar[RecordKind]
    RECORD_KIND_MANIFEST: _ClassVar[RecordKind]
    RECORD_KIND_GROUP_ENTRY: _ClassVar[RecordKind]

class JoinStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOIN_STATUS_UNSPECIFIED: _ClassVar[JoinStatus]
    JOIN_STATUS_ACCEPTED: _ClassVar[JoinStatus]
    JOIN_STATUS_REFUSED: _ClassVar[JoinStatus]
    JOIN_STATUS_NOT_LEADER: _ClassVar[JoinStatus]
    JOIN_STATUS_LATE: _ClassVar[JoinStatus]
    JOIN_STATUS_GROUP_FULL: _ClassVar[JoinStatus]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_LEFT: MemberState
RECORD_KIND_UNSPECIFIED: RecordKind
RECORD_KIND_MEMBER: RecordKind
RECORD_KIND_MANIFEST: RecordKind
RECORD_KIND_GROUP_ENTRY: RecordKind
JOIN_STATUS_UNSPECIFIED: JoinStatus
JOIN_STATUS_ACCEPTED: JoinStatus
JOIN_STATUS_REFUSED: JoinStatus
JOIN_STATUS_NOT_LEADER: JoinStatus
JOIN_STATUS_LATE: JoinStatus
JOIN_STATUS_GROUP_FULL: JoinStatus

class PeerRecord(_message.Message):
    __slots__ = ("format_version", "run_id", "peer_id", "maddrs", "version", "role", "state", "timestamp", "step", "local_group", "dear_address", "probe_address", "links", "delegated_lanes", "dear_group", "sketch")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_FIELD_NUMBER: _ClassVar[int]
    DEAR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROBE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    DELEGATED_LANES_FIELD_NUMBER: _ClassVar[int]
    DEAR_GROUP_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    run_id: str
    peer_id: str
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    version: str
    role: str
    state: MemberState
    timestamp: float
    step: int
    local_group: str
    dear_address: str
    probe_address: str
    links: _containers.RepeatedCompositeFieldContainer[LinkReport]
    delegated_lanes: int
    dear_group: str
    sketch: ParamSketch
    def __init__(self, format_version: _Optional[int] = ..., run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., maddrs: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[_Union[MemberState, str]] = ..., timestamp: _Optional[float] = ..., step: _Optional[int] = ..., local_group: _Optional[str] = ..., dear_address: _Optional[str] = ..., probe_address: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkReport, _Mapping]]] = ..., delegated_lanes: _Optional[int] = ..., dear_group: _Optional[str] = ..., sketch: _Optional[_Union[ParamSketch, _Mapping]] = ...) -> None: ...

class ParamSketch(_message.Message):
    __slots__ = ("step", "size", "values")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    step: int
    size: int
    values: bytes
    def __init__(self, step: _Optional[int] = ..., size: _Optional[int] = ..., values: _Optional[bytes] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("peer_id", "rtt", "bandwidth", "loss", "age")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    rtt: float
    bandwidth: float
    loss: float
    age: float
    def __init__(self, peer_id: _Optional[str] = ..., rtt: _Optional[float] = ..., bandwidth: _Optional[float] = ..., loss: _Optional[float] = ..., age: _Optional[float] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("format_version", "sealed", "nonce", "payload", "public_key", "signature", "kind")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    sealed: bool
    nonce: bytes
    payload: bytes
    public_key: bytes
    signature: bytes
    kind: RecordKind
    def __init__(self, format_version: _Optional[int] = ..., sealed: _Optional[bool] = ..., nonce: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., kind: _Optional[_Union[RecordKind, str]] = ...) -> None: ...

class AveragingSettings(_message.Message):
    __slots__ = ("average_every", "max_group_size", "round_timeout", "engine", "datagram_bytes", "lanes", "algorithm", "outer_lr", "outer_momentum", "payload", "overlap", "inner_budget", "repair_every", "first_phase", "average_every_auto", "average_every_min", "average_every_max", "density")
    AVERAGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DATAGRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    INNER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REPAIR_EVERY_FIELD_NUMBER: _ClassVar[int]
    FIRST_PHASE_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_AUTO_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_MIN_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_MAX_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    average_every: int
    max_group_size: int
    round_timeout: float
    engine: str
    datagram_bytes: int
    lanes: int
    algorithm: str
    outer_lr: float
    outer_momentum: float
    payload: str
    overlap: bool
    inner_budget: float
    repair_every: int
    first_phase: int
    average_every_auto: bool
    average_every_min: int
    average_every_max: int
    density: float
    def __init__(self, average_every: _Optional[int] = ..., max_group_size: _Optional[int] = ..., round_timeout: _Optional[float] = ..., engine: _Optional[str] = ..., datagram_bytes: _Optional[int] = ..., lanes: _Optional[int] = ..., algorithm: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., payload: _Optional[str] = ..., overlap: _Optional[bool] = ..., inner_budget: _Optional[float] = ..., repair_every: _Optional[int] = ..., first_phase: _Optional[int] = ..., average_every_auto: _Optional[bool] = ..., average_every_min: _Optional[int] = ..., average_every_max: _Optional[int] = ..., density: _Optional[float] = ...) -> None: ...

class RunManifest(_message.Message):
    __slots__ = ("format_version", "run_id", "task", "hparams", "averaging", "creator", "created_at", "model")
    class HparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    CREATOR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    run_id: str
    task: str
    hparams: _containers.ScalarMap[str, str]
    averaging: AveragingSettings
    creator: str
    created_at: float
    model: _containers.RepeatedCompositeFieldContainer[ModelTensor]
    def __init__(self, format_version: _Optional[int] = ..., run_id: _Optional[str] = ..., task: _Optional[str] = ..., hparams: _Optional[_Mapping[str, str]] = ..., averaging: _Optional[_Union[AveragingSettings, _Mapping]] = ..., creator: _Optional[str] = ..., created_at: _Optional[float] = ..., model: _Optional[_Iterable[_Union[ModelTensor, _Mapping]]] = ...) -> None: ...

class ModelTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class GoodbyeRequest(_message.Message):
    __slots__ = ("run_key", "envelope")
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    run_key: str
    envelope: bytes
    def __init__(self, run_key: _Optional[str] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class GoodbyeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupEntry(_message.Message):
    __slots__ = ("format_version", "group_key", "round", "engine_addr", "weight", "timestamp", "gather_timeout", "step_seconds", "round_seconds")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    GATHER_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    group_key: str
    round: int
    engine_addr: str
    weight: float
    timestamp: float
    gather_timeout: float
    step_seconds: float
    round_seconds: float
    def __init__(self, format_version: _Optional[int] = ..., group_key: _Optional[str] = ..., round: _Optional[int] = ..., engine_addr: _Optional[str] = ..., weight: _Optional[float] = ..., timestamp: _Optional[float] = ..., gather_timeout: _Optional[float] = ..., step_seconds: _Optional[float] = ..., round_seconds: _Optional[float] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("group_key", "round", "envelope")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    round: int
    envelope: bytes
    def __init__(self, group_key: _Optional[str] = ..., round: _Optional[int] = ..., envelope: _Optional[bytes] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("peer_id", "engine_addr", "weight", "gather_timeout", "step_seconds", "round_seconds")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GATHER_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    engine_addr: str
    weight: float
    gather_timeout: float
    step_seconds: float
    round_seconds: float
    def __init__(self, peer_id: _Optional[str] = ..., engine_addr: _Optional[str] = ..., weight: _Optional[float] = ..., gather_timeout: _Optional[float] = ..., step_seconds: _Optional[float] = ..., round_seconds: _Optional[float] = ...) -> None: ...

class JoinGroupResponse(_message.Message):
    __slots__ = ("status", "members")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    status: JoinStatus
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    def __init__(self, status: _Optional[_Union[JoinStatus, str]] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ...) -> None: ...
