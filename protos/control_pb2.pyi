from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "peers", "secured", "joined_seconds", "task", "train_state", "step", "loss", "samples_per_second", "eval_metric", "eval_score", "error", "local_step", "last_round", "last_round_outcome", "group_size", "param_divergence", "last_round_digest", "last_round_links", "local_group", "local_group_size", "local_group_rank", "wan_share", "last_round_group", "param_divergence_step", "param_distance_to_group_mean", "compute_fraction", "train_wait_seconds", "algorithm", "attached_pid", "attached_device", "attached_processes", "attached_group_epoch", "samples", "samples_averaged", "resumed_from", "synced_from", "train_process_state", "train_process_restarts", "local_group_reason", "parameters", "step_seconds", "round_seconds", "average_every", "payload", "overlap", "average_every_auto", "average_every_reason", "average_every_round", "dear_overlap_ratio", "density")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SECURED_FIELD_NUMBER: _ClassVar[int]
    JOINED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRIC_FIELD_NUMBER: _ClassVar[int]
    EVAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_LINKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    WAN_SHARE_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_GROUP_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIVERGENCE_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAM_DISTANCE_TO_GROUP_MEAN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TRAIN_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_PID_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_AVERAGED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FROM_FIELD_NUMBER: _ClassVar[int]
    TRAIN_PROCESS_STATE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_PROCESS_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_REASON_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_AUTO_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_REASON_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_ROUND_FIELD_NUMBER: _ClassVar[int]
    DEAR_OVERLAP_RATIO_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peers: int
    secured: bool
    joined_seconds: float
    task: str
    train_state: str
    step: int
    loss: float
    samples_per_second: float
    eval_metric: str
    eval_score: float
    error: str
    local_step: int
    last_round: int
    last_round_outcome: str
    group_size: int
    param_divergence: float
    last_round_digest: str
    last_round_links: str
    local_group: str
    local_group_size: int
    local_group_rank: int
    wan_share: float
    last_round_group: _containers.RepeatedScalarFieldContainer[str]
    param_divergence_step: int
    param_distance_to_group_mean: float
    compute_fraction: float
    train_wait_seconds: float
    algorithm: str
    attached_pid: int
    attached_device: str
    attached_processes: int
    attached_group_epoch: int
    samples: int
    samples_averaged: int
    resumed_from: int
    synced_from: int
    train_process_state: str
    train_process_restarts: int
    local_group_reason: str
    parameters: int
    step_seconds: float
    round_seconds: float
    average_every: int
    payload: str
    overlap: bool
    average_every_auto: bool
    average_every_reason: str
    average_every_round: int
    dear_overlap_ratio: float
    density: float
    def __init__(self, run_id: _Optional[str] = ..., peers: _Optional[int] = ..., secured: _Optional[bool] = ..., joined_seconds: _Optional[float] = ..., task: _Optional[str] = ..., train_state: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., eval_metric: _Optional[str] = ..., eval_score: _Optional[float] = ..., error: _Optional[str] = ..., local_step: _Optional[int] = ..., last_round: _Optional[int] = ..., last_round_outcome: _Optional[str] = ..., group_size: _Optional[int] = ..., param_divergence: _Optional[float] = ..., last_round_digest: _Optional[str] = ..., last_round_links: _Optional[str] = ..., local_group: _Optional[str] = ..., local_group_size: _Optional[int] = ..., local_group_rank: _Optional[int] = ..., wan_share: _Optional[float] = ..., last_round_group: _Optional[_Iterable[str]] = ..., param_divergence_step: _Optional[int] = ..., param_distance_to_group_mean: _Optional[float] = ..., compute_fraction: _Optional[float] = ..., train_wait_seconds: _Optional[float] = ..., algorithm: _Optional[str] = ..., attached_pid: _Optional[int] = ..., attached_device: _Optional[str] = ..., attached_processes: _Optional[int] = ..., attached_group_epoch: _Optional[int] = ..., samples: _Optional[int] = ..., samples_averaged: _Optional[int] = ..., resumed_from: _Optional[int] = ..., synced_from: _Optional[int] = ..., train_process_state: _Optional[str] = ..., train_process_restarts: _Optional[int] = ..., local_group_reason: _Optional[str] = ..., parameters: _Optional[int] = ..., step_seconds: _Optional[float] = ..., round_seconds: _Optional[float] = ..., average_every: _Optional[int] = ..., payload: _Optional[str] = ..., overlap: _Optional[bool] = ..., average_every_auto: _Optional[bool] = ..., average_every_reason: _Optional[str] = ..., average_every_round: _Optional[int] = ..., dear_overlap_ratio: _Optional[float] = ..., density: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "peer_id", "maddrs", "runs", "uptime_seconds", "version", "metrics_url", "pid")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    state: str
    peer_id: str
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    uptime_seconds: float
    version: str
    metrics_url: str
    pid: int
    def __init__(self, state: _Optional[str] = ..., peer_id: _Optional[str] = ..., maddrs: _Optional[_Iterable[str]] = ..., runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ..., metrics_url: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PeerEntry(_message.Message):
    __slots__ = ("peer_id", "maddrs", "last_seen_seconds", "version", "role", "delegated_lanes")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DELEGATED_LANES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    last_seen_seconds: float
    version: str
    role: str
    delegated_lanes: int
    def __init__(self, peer_id: _Optional[str] = ..., maddrs: _Optional[_Iterable[str]] = ..., last_seen_seconds: _Optional[float] = ..., version: _Optional[str] = ..., role: _Optional[str] = ..., delegated_lanes: _Optional[int] = ...) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("run_id", "peers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerEntry]
    def __init__(self, run_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerEntry, _Mapping]]] = ...) -> None: ...

class JoinRunRequest(_message.Message):
    __slots__ = ("run_id", "secret_file", "task", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FILE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    secret_file: str
    task: str
    settings: _containers.ScalarMap[str, str]
    def __init__(self, run_id: _Optional[str] = ..., secret_file: _Optional[str] = ..., task: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JoinRunResponse(_message.Message):
    __slots__ = ("joined",)
    JOINED_FIELD_NUMBER: _ClassVar[int]
    joined: bool
    def __init__(self, joined: _Optional[bool] = ...) -> None: ...

class LeaveRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class LeaveRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("run_id", "pid", "device", "layout", "settings", "step", "group_size")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    pid: int
    device: str
    layout: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    settings: _containers.ScalarMap[str, str]
    step: int
    group_size: int
    def __init__(self, run_id: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ..., layout: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., settings: _Optional[_Mapping[str, str]] = ..., step: _Optional[int] = ..., group_size: _Optional[int] = ...) -> None: ...

class LocalGroup(_message.Message):
    __slots__ = ("epoch", "rank", "size", "store", "host", "spans", "hands_over")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    HANDS_OVER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    rank: int
    size: int
    store: str
    host: str
    spans: bool
    hands_over: bool
    def __init__(self, epoch: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., store: _Optional[str] = ..., host: _Optional[str] = ..., spans: _Optional[bool] = ..., hands_over: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session", "shared_path", "numel", "step", "average_every", "lease_seconds", "phase_timeout", "upload", "first_phase", "group", "phase_steps")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_PATH_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    FIRST_PHASE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PHASE_STEPS_FIELD_NUMBER: _ClassVar[int]
    session: str
    shared_path: str
    numel: int
    step: int
    average_every: int
    lease_seconds: float
    phase_timeout: float
    upload: bool
    first_phase: int
    group: LocalGroup
    phase_steps: int
    def __init__(self, session: _Optional[str] = ..., shared_path: _Optional[str] = ..., numel: _Optional[int] = ..., step: _Optional[int] = ..., average_every: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., phase_timeout: _Optional[float] = ..., upload: _Optional[bool] = ..., first_phase: _Optional[int] = ..., group: _Optional[_Union[LocalGroup, _Mapping]] = ..., phase_steps: _Optional[int] = ...) -> None: ...

class EndPhaseRequest(_message.Message):
    __slots__ = ("session", "steps", "samples", "loss", "compute_seconds", "boundary", "group_step", "dear_overlap_ratio")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    GROUP_STEP_FIELD_NUMBER: _ClassVar[int]
    DEAR_OVERLAP_RATIO_FIELD_NUMBER: _ClassVar[int]
    session: str
    steps: int
    samples: float
    loss: float
    compute_seconds: float
    boundary: int
    group_step: int
    dear_overlap_ratio: float
    def __init__(self, session: _Optional[str] = ..., steps: _Optional[int] = ..., samples: _Optional[float] = ..., loss: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., boundary: _Optional[int] = ..., group_step: _Optional[int] = ..., dear_overlap_ratio: _Optional[float] = ...) -> None: ...

class EndPhaseResponse(_message.Message):
    __slots__ = ("step", "round", "outcome", "waited_seconds", "downloaded", "group_epoch", "phase_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    outcome: str
    waited_seconds: float
    downloaded: bool
    group_epoch: int
    phase_steps: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., outcome: _Optional[str] = ..., waited_seconds: _Optional[float] = ..., downloaded: _Optional[bool] = ..., group_epoch: _Optional[int] = ..., phase_steps: _Optional[int] = ...) -> None: ...

class ReportEvalRequest(_message.Message):
    __slots__ = ("session", "metric", "score", "higher_is_better", "loss")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    HIGHER_IS_BETTER_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    session: str
    metric: str
    score: float
    higher_is_better: bool
    loss: float
    def __init__(self, session: _Optional[str] = ..., metric: _Optional[str] = ..., score: _Optional[float] = ..., higher_is_better: _Optional[bool] = ..., loss: _Optional[float] = ...) -> None: ...

class ReportEvalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("session", "samples", "loss", "boundary")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    session: str
    samples: float
    loss: float
    boundary: int
    def __init__(self, session: _Optional[str] = ..., samples: _Optional[float] = ..., loss: _Optional[float] = ..., boundary: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegroupRequest(_message.Message):
    __slots__ = ("session", "epoch")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session: str
    epoch: int
    def __init__(self, session: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RegroupResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: LocalGroup
    def __init__(self, group: _Optional[_Union[LocalGroup, _Mapping]] = ...) -> None: ...
