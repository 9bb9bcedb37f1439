"""Run manifests: what a run trains and how it averages, published once by its creator.

A manifest is signed by its creator (the signer must be the `creator` it names) and sealed with
the run secret where there is one. Members republish the creator's signed bytes unchanged, so the
manifest outlives its creator. If two daemons create the same run at once, everyone picks the
same one: the earliest (created_at, creator).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from peerd.peers.envelope import RecordKind, RecordRejected, open_payload, parse, seal
from peerd.peers.clock import now
from peerd.peers.collective import arctopk
from peerd.peers.collective.group import PAYLOADS
from peerd.peers.identity import Identity
from peerd.peers.phases import Phases
from peerd.peers.run_ids import RunSecret, run_dht_key
from peerd.protos import records_pb2

MANIFEST_FORMAT_VERSION = 1
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_HPARAMS = 64
MAX_HPARAM_CHARS = 256
MAX_LANES = 64  # lanes are announced as a 64-bit mask (PeerRecord.delegated_lanes)
MAX_MODEL_TENSORS = 1024  # parameters of a script's model: the layout rides in the manifest record
MAX_TENSOR_NAME = 128  # (and in a control request, at most --max-request-bytes: 64 KiB by default)
MAX_MODEL_NUMEL = 1 << 34  # float32 values: 64 GiB
FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16", "torch.float64")


@dataclass(frozen=True, slots=True, kw_only=True)
class AveragingSettings:
    average_every: int = 50  # local (inner) optimizer steps between two averaging rounds: DiLoCo's H
    # `average_every=auto` (the text of --set; this field in the manifest): the daemon picks each
    # phase's length from the run's measured round and step times, the smallest H on a ladder from
    # average_every_min to average_every_max whose phase hides a round with a margin (daemon/plan.py
    # fit_every). The phases' schedule, which rendezvous and round numbers follow, is then that of
    # average_every_max, and a phase ends after the fitted H steps, as one the straggler budget ends
    # early: members that fit different H still meet at the same rounds, and the run's step moves by
    # the schedule's phase (local_step counts the steps computed). DiLoCo runs only.
    average_every_auto: bool = False
    average_every_min: int = 10  # auto's smallest H: a round's fixed cost is not worth fewer steps
    average_every_max: int = 200  # auto's largest H, the schedule's: a longer phase averages too rarely
    # The first phase's length: the first average_every steps are cut into phases of first_phase,
    # 2x, 4x, ... steps and the rest, then every phase is average_every (peers/phases.py), so that
    # the run's model is averaged early (docs/algorithms.md, "Training: DiLoCo"); the cost is the
    # extra rounds. 0: every phase is average_every.
    first_phase: int = 5
    max_group_size: int = 16  # largest Moshpit group; sizes the virtual grid
    round_timeout: float = 30.0  # seconds a round may take before members abort it
    # Which collective engine the run's rounds use: "reliable" (GroupAllReduce over TCP, else libp2p
    # streams: exact, all or nothing) or "loss-tolerant" (LossyAllReduce: UDP datagrams where a link
    # passes its probe, nothing retransmitted, docs/loss-tolerance.md). A run-wide choice: the two
    # engines speak different protocols, so every member must use the same. (How each link carries a
    # loss-tolerant run's data is a daemon's own setting, --data-path.)
    engine: str = "reliable"
    datagram_bytes: int = 1472  # UDP datagram size: a 1500-byte path MTU minus IP and UDP headers
    # Slices of the state vector ("lanes"), each averaged in Moshpit rounds of its own, so that the
    # members of a local group can share the WAN averaging of their common state: member r of a
    # group of k averages lanes r, r+k, ... for the whole group (peers/dear/hierarchy.py).
    lanes: int = 1
    # What a round averages: "diloco" (the default of new runs: the pseudo-gradient of the last
    # `average_every` inner steps, applied by an outer Nesterov optimizer; daemon/diloco.py) or
    # "state" (the whole training state: parameters and optimizer moments; manifests made before
    # diloco existed decode as "state").
    algorithm: str = "diloco"
    outer_lr: float = 0.7  # the outer optimizer's learning rate (DiLoCo's 0.7)
    # Its Nesterov momentum: 0.5, not DiLoCo's 0.9, which was worse at every horizon measured here
    # (docs/benchmarks.md, "Outer momentum").
    outer_momentum: float = 0.5
    # How a pseudo-gradient travels: "int8" (8-bit values with a float32 scale per block of 64),
    # "int4" and "int2" (4 and 2 bits a value, the same blocks), "fp16" or "fp32"; with error
    # feedback, so quantization loses nothing over time (peers/collective/codec.py). The engines'
    # AllReduceSettings.payload. Or "arctopk": `density` of the rows of 1,024 values, the same rows
    # on every member of a group, in int8, after a sketch of the vector (peers/collective/arctopk.py;
    # a member keeps what it did not send in its own parameters).
    payload: str = "int8"
    density: float = arctopk.DENSITY  # arctopk: the share of rows a round sends (docs/benchmarks.md, "ARC-Top-K")
    # A round runs on the network while the next inner steps compute, and its result lands as soon
    # as it ends (Streaming DiLoCo; daemon/diloco.py): compute waits only for a round longer than a
    # phase. On by default: in the lab its model was better than without and than a host alone, in
    # the same wall time (docs/benchmarks.md, "Training over a WAN", run 6), though per step it is
    # about 1 % worse (simulation) and a script's loop lands each round a whole phase late (3.5 %
    # worse per step at outer momentum 0.5). False: compute waits for each round (DiLoCo as published).
    overlap: bool = True
    # An inner phase ends after `average_every` steps or, when half of the other live peers have
    # reached the round boundary, after `inner_budget` times the time they took, whichever comes
    # first: a slow peer contributes fewer samples instead of stalling its group (DropCompute). 0: off.
    inner_budget: float = 1.5
    # With the UDP engine or several Moshpit groups, members' outer parameters can drift apart (a
    # result packet lost, different groups): every `repair_every` outer steps the round averages the
    # outer parameters themselves in float32 instead of a pseudo-gradient. 0: never.
    repair_every: int = 25

    def __post_init__(self) -> None:
        if self.algorithm not in ("diloco", "state"):
            raise ValueError(f"algorithm must be diloco or state, got {self.algorithm!r}")
        if self.payload not in (*PAYLOADS, arctopk.PAYLOAD):
            raise ValueError(f"payload must be one of {', '.join(PAYLOADS)} or arctopk, got {self.payload!r}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if not 0 < self.outer_lr <= 10:
            raise ValueError(f"outer_lr must be in (0, 10], got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not (self.inner_budget == 0 or 1 <= self.inner_budget <= 100):
            raise ValueError(f"inner_budget must be 0 (off) or in 1..100, got {self.inner_budget}")
        if not 0 <= self.repair_every <= 100_000:
            raise ValueError(f"repair_every must be in 0..100000, got {self.repair_every}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be {' or '.join(ENGINES)}, got {self.engine!r}")
        if not 512 <= self.datagram_bytes <= 65507:
            raise ValueError(f"datagram_bytes must be in 512..65507, got {self.datagram_bytes}")
        if not 1 <= self.average_every <= 100_000:
            raise ValueError(f"average_every must be in 1..100000, got {self.average_every}")
        if not 1 <= self.average_every_min <= self.average_every_max <= 100_000:
            raise ValueError(
                "average_every_min and average_every_max must be 1 <= min <= max <= 100000, got "
                f"{self.average_every_min} and {self.average_every_max}"
            )
        if self.average_every_auto and self.algorithm != "diloco":
            raise ValueError("average_every=auto needs algorithm=diloco (a state run's phases all take H steps)")
        if not 0 <= self.first_phase <= 100_000:
            raise ValueError(f"first_phase must be 0 (every phase H) or in 1..100000, got {self.first_phase}")
        if not 2 <= self.max_group_size <= 1024:
            raise ValueError(f"max_group_size must be in 2..1024, got {self.max_group_size}")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ValueError(f"lanes must be in 1..{MAX_LANES}, got {self.lanes}")
        if not 0.1 <= self.round_timeout <= 3600:
            raise ValueError(f"round_timeout must be in 0.1..3600 s, got {self.round_timeout}")

    @property
    def loss_tolerant(self) -> bool:
        return self.engine == "loss-tolerant"

    @property
    def phases(self) -> Phases:
        """Where the run's phases end (peers/phases.py); with auto, the schedule of its largest H."""
        return Phases(self.average_every_max if self.average_every_auto else self.average_every, self.first_phase)


ENGINES = ("reliable", "loss-tolerant")

# peerd 0.1.0 named the engine `averaging.transport`, with values "reliable" and "udp": manifests it
# signed (in the DHT, and kept in data dirs) carry "udp" in the same protobuf field, and its users
# typed `--set averaging.transport=udp`. Both are read as the new name here, and only here.
_LEGACY_ENGINE = {"udp": "loss-tolerant"}


def settings_fields(settings: dict[str, str]) -> dict[str, str]:
    """`settings` (the KEY=VALUE text of --set, "averaging." keys included) with the manifest's field
    names: `averaging.average_every=auto` as `averaging.average_every_auto=true`, and peerd 0.1.0's
    `averaging.transport` as `averaging.engine`."""
    out = dict(settings)
    if out.get("averaging.average_every", "").strip().lower() == "auto":
        del out["averaging.average_every"]
        out["averaging.average_every_auto"] = "true"
    if "averaging.transport" in out:
        legacy = out.pop("averaging.transport")
        out.setdefault("averaging.engine", _LEGACY_ENGINE.get(legacy, legacy))
    return out


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One parameter of a script-trained run's model: name, shape, dtype ("torch.float32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


def check_layout(layout: tuple[TensorSpec, ...]) -> None:
    """Raises ValueError unless `layout` is a model a run can hold (bounded, floating point)."""
    if not 0 < len(layout) <= MAX_MODEL_TENSORS:
        raise ValueError(f"a model has 1..{MAX_MODEL_TENSORS} parameters, got {len(layout)}")
    total = 0
    for spec in layout:
        if not 0 < len(spec.name) <= MAX_TENSOR_NAME or len(spec.shape) > 8 or any(d < 0 for d in spec.shape):
            raise ValueError(
                f"parameter {spec.name[:64]!r}: a name of 1..{MAX_TENSOR_NAME} characters and at most 8 dimensions"
            )
        if spec.dtype not in FLOAT_DTYPES:
            raise ValueError(f"parameter {spec.name[:64]!r} is {spec.dtype}; a run trains {', '.join(FLOAT_DTYPES)}")
        total += spec.numel
    if total > MAX_MODEL_NUMEL:
        raise ValueError(f"{total} parameters; at most {MAX_MODEL_NUMEL}")


def layout_mismatch(run: tuple[TensorSpec, ...], given: tuple[TensorSpec, ...]) -> str:
    """The first difference between a run's model and another, in words; "" when they match."""
    for i, (a, b) in enumerate(zip(run, given)):
        if a != b:
            return f"parameter {i}: the run has {a}, this model has {b}"
    if len(run) != len(given):
        return f"the run's model has {len(run)} parameters, this one {len(given)}"
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunManifest:
    run_id: str
    task: str  # an installed task's name; "" for a run trained by users' scripts (`model` set)
    hparams: dict[str, str] = field(default_factory=dict)
    averaging: AveragingSettings = field(default_factory=AveragingSettings)
    creator: str
    created_at: float
    model: tuple[TensorSpec, ...] = ()  # a script-trained run's parameters, in order

    def __post_init__(self) -> None:
        if self.model:
            check_layout(self.model)
            if self.task:
                raise ValueError("a run trains either a task or a script's model, not both")
        elif not TASK_NAME.fullmatch(self.task):
            raise ValueError(f"task name {self.task[:64]!r} is not a valid name")
        if len(self.hparams) > MAX_HPARAMS:
            raise ValueError(f"{len(self.hparams)} hyper-parameters; at most {MAX_HPARAMS}")
        for key, value in self.hparams.items():
            if not TASK_NAME.fullmatch(key) or len(value) > MAX_HPARAM_CHARS:
                raise ValueError(
                    f"hyper-parameter {key[:64]!r} has a bad name or a value over {MAX_HPARAM_CHARS} characters"
                )

    @property
    def order(self) -> tuple[float, str]:
        """Among competing manifests of one run, the smallest wins."""
        return (self.created_at, self.creator)


def encode_manifest(manifest: RunManifest, identity: Identity, secret: RunSecret | None) -> bytes:
    if manifest.creator != identity.peer_id:
        raise ValueError("only the creator signs a manifest")
    a = manifest.averaging
    body = records_pb2.RunManifest(
        format_version=MANIFEST_FORMAT_VERSION,
        run_id=manifest.run_id,
        task=manifest.task,
        hparams=manifest.hparams,
        averaging=records_pb2.AveragingSettings(
            average_every=a.average_every,
            first_phase=a.first_phase,
            max_group_size=a.max_group_size,
            round_timeout=a.round_timeout,
            engine=a.engine,
            datagram_bytes=a.datagram_bytes,
            lanes=a.lanes,
            algorithm=a.algorithm,
            outer_lr=a.outer_lr,
            outer_momentum=a.outer_momentum,
            payload=a.payload,
            overlap=a.overlap,
            inner_budget=a.inner_budget,
            repair_every=a.repair_every,
            average_every_auto=a.average_every_auto,
            average_every_min=a.average_every_min,
            average_every_max=a.average_every_max,
            density=a.density,
        ),
        creator=manifest.creator,
        created_at=manifest.created_at,
        model=[records_pb2.ModelTensor(name=t.name, shape=t.shape, dtype=t.dtype) for t in manifest.model],
    ).SerializeToString()
    return seal(RecordKind.MANIFEST, body, identity, secret, manifest.run_id)


def decode_manifest(data: object, *, run_id: str, secret: RunSecret | None, subkey: str | None) -> RunManifest:
    """Check and decode a manifest of `run_id`; raises RecordRejected saying what is wrong."""
    body_bytes, signer = open_payload(data, RecordKind.MANIFEST, run_id=run_id, secret=secret, subkey=subkey)
    body = parse(records_pb2.RunManifest, body_bytes)
    if body.format_version != MANIFEST_FORMAT_VERSION:
        raise RecordRejected("record_version", f"manifest format version {body.format_version}")
    if body.creator != signer:
        raise RecordRejected("record_forged", "manifest not signed by the creator it names")
    if body.run_id != run_id:
        raise RecordRejected("record_wrong_run", "manifest of another run")
    try:
        return RunManifest(
            run_id=body.run_id,
            task=body.task,
            hparams=dict(body.hparams),
            averaging=AveragingSettings(
                average_every=body.averaging.average_every,
                first_phase=body.averaging.first_phase,  # 0 in manifests made before it: every phase H
                max_group_size=body.averaging.max_group_size,
                round_timeout=body.averaging.round_timeout,
                engine=_LEGACY_ENGINE.get(body.averaging.engine, body.averaging.engine or "reliable"),
                datagram_bytes=body.averaging.datagram_bytes or 1472,
                lanes=body.averaging.lanes or 1,
                # A manifest without an algorithm was made before diloco: its run averages the state.
                **(_diloco_fields(body.averaging) if body.averaging.algorithm == "diloco" else {"algorithm": "state"}),
            ),
            creator=body.creator,
            created_at=body.created_at,
            model=tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in body.model),
        )
    except ValueError as e:
        raise RecordRejected("manifest_invalid", str(e)) from None


def _diloco_fields(a: records_pb2.AveragingSettings) -> dict:
    # auto's bounds are 0 in manifests made before auto (off in them): the defaults
    bounds = {k: v for k in ("average_every_min", "average_every_max") if (v := getattr(a, k))}
    return dict(
        **bounds,
        algorithm="diloco",
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
        payload=a.payload,
        overlap=a.overlap,
        inner_budget=a.inner_budget,
        repair_every=a.repair_every,
        average_every_auto=a.average_every_auto,
        **({"density": a.density} if a.density else {}),  # 0 in manifests made before arctopk: the default
    )


class InvalidManifests(LookupError):
    """The DHT holds manifests of the run, and not one of them is valid: nobody can join it as it is."""


def choose(manifests: list[RunManifest]) -> RunManifest | None:
    """The run's manifest among those found: the earliest, ties broken by creator ID."""
    return min(manifests, key=lambda m: m.order, default=None)


async def fetch(node, run_id: str, secret: RunSecret | None, on_rejected) -> tuple[RunManifest, bytes] | None:
    """Read the run's manifests from the DHT; returns the chosen one with its signed bytes, or None
    when there is none. Invalid ones are counted through on_rejected(reason) and ignored while a valid
    one exists; if every one found is invalid, raises InvalidManifests saying why."""
    found: list[tuple[RunManifest, bytes]] = []
    rejected: list[RecordRejected] = []
    for subkey, (value, _expiration) in (await node.get(run_dht_key(run_id, secret, "manifest"))).items():
        try:
            found.append((decode_manifest(value, run_id=run_id, secret=secret, subkey=subkey), value))
        except RecordRejected as e:
            on_rejected(e.reason)
            rejected.append(e)
    if rejected and not found:
        why = "; ".join(sorted({str(e)[:200] for e in rejected}))
        raise InvalidManifests(f"run {run_id!r} has {len(rejected)} manifest(s) in the DHT and none is valid ({why})")
    best = choose([m for m, _ in found])
    return next(((m, b) for m, b in found if m is best), None)


async def publish(node, manifest: RunManifest, data: bytes, secret: RunSecret | None, ttl: float) -> bool:
    """Store the creator-signed bytes under the creator's slot; any member may republish them."""
    return await node.store(run_dht_key(manifest.run_id, secret, "manifest"), manifest.creator, data, now() + ttl)
