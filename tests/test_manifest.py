import pytest

from peerd.peers.envelope import RecordRejected
from peerd.peers.identity import Identity
from peerd.peers.envelope import RecordKind, seal
from peerd.peers.manifest import (
    AveragingSettings,
    RunManifest,
    choose,
    decode_manifest,
    encode_manifest,
    settings_fields,
)
from peerd.protos import records_pb2
from peerd.peers.records import MemberRecord, MemberState, seal_record
from peerd.peers.run_ids import RunSecret


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return Identity.load_or_create(d / "a"), Identity.load_or_create(d / "b")


def manifest(creator: Identity, **kw) -> RunManifest:
    return RunManifest(
        run_id="r", task="digits-mlp", hparams={"lr": "0.1"}, creator=creator.peer_id, created_at=100.0, **kw
    )


def test_round_trip_open_and_sealed(ids):
    a, _ = ids
    m = manifest(a, averaging=AveragingSettings(average_every=5, engine="loss-tolerant", datagram_bytes=8972))
    assert decode_manifest(encode_manifest(m, a, None), run_id="r", secret=None, subkey=a.peer_id) == m
    s = RunSecret.from_bytes(b"x" * 16, "r")
    assert decode_manifest(encode_manifest(m, a, s), run_id="r", secret=s, subkey=a.peer_id) == m
    with pytest.raises(RecordRejected) as e:
        decode_manifest(encode_manifest(m, a, s), run_id="r", secret=RunSecret.from_bytes(b"y" * 16, "r"), subkey=None)
    assert e.value.reason == "record_auth"


def test_a_manifest_of_peerd_0_1_0_loads_with_its_engine(ids):
    """peerd 0.1.0 signed `transport = "udp"` into the same protobuf field: it reads as the loss-tolerant
    engine, and its --set spelling averaging.transport=udp as averaging.engine=loss-tolerant."""
    a, _ = ids
    for legacy, engine in (("udp", "loss-tolerant"), ("reliable", "reliable"), ("", "reliable")):
        body = records_pb2.RunManifest(
            format_version=1,
            run_id="r",
            task="digits-mlp",
            averaging=records_pb2.AveragingSettings(
                average_every=5, max_group_size=16, round_timeout=30.0, engine=legacy
            ),
            creator=a.peer_id,
            created_at=100.0,
        ).SerializeToString()
        data = seal(RecordKind.MANIFEST, body, a, None, "r")
        assert decode_manifest(data, run_id="r", secret=None, subkey=None).averaging.engine == engine
    assert settings_fields({"averaging.transport": "udp", "lr": "1"}) == {
        "averaging.engine": "loss-tolerant",
        "lr": "1",
    }


def test_only_the_creator_can_sign(ids):
    a, b = ids
    with pytest.raises(ValueError):
        encode_manifest(manifest(a), b, None)
    with pytest.raises(RecordRejected) as e:
        decode_manifest(encode_manifest(manifest(a), a, None), run_id="r", secret=None, subkey=b.peer_id)
    assert e.value.reason == "record_forged"


def test_a_member_record_is_not_a_manifest(ids):
    a, _ = ids
    rec = MemberRecord(
        run_id="r", peer_id=a.peer_id, maddrs=(), version="0", role="trainer", state=MemberState.ACTIVE, timestamp=1.0
    )
    with pytest.raises(RecordRejected) as e:
        decode_manifest(seal_record(rec, a, None), run_id="r", secret=None, subkey=None)
    assert e.value.reason == "record_malformed"


@pytest.mark.parametrize(
    "kw",
    [
        {"task": "bad task"},
        {"hparams": {"bad key": "1"}},
        {"hparams": {"k": "x" * 300}},
        {"averaging": "zero"},
    ],
)
def test_invalid_manifests(ids, kw):
    a, _ = ids
    with pytest.raises((ValueError, TypeError)):
        if kw.get("averaging") == "zero":
            AveragingSettings(average_every=0)
        else:
            RunManifest(run_id="r", creator=a.peer_id, created_at=1.0, **{"task": "t", **kw})


@pytest.mark.parametrize(
    "kw", [{"engine": "carrier-pigeon"}, {"engine": "udp"}, {"datagram_bytes": 100}, {"datagram_bytes": 70000}]
)
def test_invalid_averaging_engines(kw):
    with pytest.raises(ValueError):
        AveragingSettings(**kw)


def test_every_payload_of_the_codec_is_a_runs_choice_and_travels_in_its_manifest(ids):
    a, _ = ids
    for payload in ("fp32", "fp16", "int8", "int4", "int2"):
        m = manifest(a, averaging=AveragingSettings(payload=payload))
        assert decode_manifest(encode_manifest(m, a, None), run_id=m.run_id, secret=None, subkey=a.peer_id) == m
    with pytest.raises(ValueError, match="int4, int2 or arctopk"):
        AveragingSettings(payload="int3")


def test_arctopk_travels_with_its_density_and_refuses_a_density_out_of_range(ids):
    a, _ = ids
    for density in (0.5, 0.01, 1.0):
        m = manifest(a, averaging=AveragingSettings(payload="arctopk", density=density))
        assert decode_manifest(encode_manifest(m, a, None), run_id=m.run_id, secret=None, subkey=a.peer_id) == m
    assert AveragingSettings().density == 0.5  # also what a manifest made before arctopk decodes to
    for kw, message in (
        ({"density": 0.0}, "density must be in"),
        ({"density": 1.5}, "density must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            AveragingSettings(payload="arctopk", **kw)
    assert AveragingSettings(payload="arctopk", lanes=4, engine="loss-tolerant").lanes == 4


def test_choose_the_earliest(ids):
    a, b = ids
    early = RunManifest(run_id="r", task="x", creator=b.peer_id, created_at=1.0)
    late = RunManifest(run_id="r", task="y", creator=a.peer_id, created_at=2.0)
    assert choose([late, early]) == early
    assert choose([]) is None


def test_a_script_run_carries_its_model_and_names_the_first_mismatch(ids):
    from peerd.peers.manifest import TensorSpec, layout_mismatch

    a, _ = ids
    model = (TensorSpec("w", (3, 4), "torch.float32"), TensorSpec("b", (3,), "torch.bfloat16"))
    m = RunManifest(run_id="r", task="", creator=a.peer_id, created_at=1.0, model=model)
    assert decode_manifest(encode_manifest(m, a, None), run_id="r", secret=None, subkey=a.peer_id) == m
    assert layout_mismatch(model, model) == ""
    assert layout_mismatch(model, (model[0], TensorSpec("b", (4,), "torch.bfloat16"))) == (
        "parameter 1: the run has b [3] torch.bfloat16, this model has b [4] torch.bfloat16"
    )
    assert layout_mismatch(model, model[:1]) == "the run's model has 2 parameters, this one 1"
    for bad in [
        dict(task="", model=()),
        dict(task="digits-mlp", model=model),
        dict(task="", model=(TensorSpec("i", (2,), "torch.int64"),)),
        dict(task="", model=(TensorSpec("", (2,), "torch.float32"),)),
        dict(task="", model=tuple(TensorSpec(f"p{i}", (1,), "torch.float32") for i in range(1025))),
    ]:
        with pytest.raises(ValueError):
            RunManifest(run_id="r", creator=a.peer_id, created_at=1.0, **bad)


def test_average_every_auto_travels_in_the_manifest_and_its_schedule_is_the_largest_h(ids):
    """--set averaging.average_every=auto is the manifest's average_every_auto; its bounds travel
    too, and the phases' schedule is average_every_max's. A manifest made before auto (bounds 0)
    reads with auto off and the default bounds."""
    a, _ = ids
    assert settings_fields({"averaging.average_every": "auto", "lr": "1"}) == {
        "averaging.average_every_auto": "true",
        "lr": "1",
    }
    assert settings_fields({"averaging.average_every": "20"}) == {"averaging.average_every": "20"}
    auto = AveragingSettings(average_every_auto=True, average_every_min=4, average_every_max=64, first_phase=0)
    assert auto.phases.every == 64 and AveragingSettings(average_every=7).phases.every == 7
    m = manifest(a, averaging=auto)
    assert decode_manifest(encode_manifest(m, a, None), run_id="r", secret=None, subkey=a.peer_id) == m
    body = records_pb2.RunManifest(
        format_version=1,
        run_id="r",
        task="digits-mlp",
        averaging=records_pb2.AveragingSettings(
            average_every=5, max_group_size=16, round_timeout=30.0, algorithm="diloco", outer_lr=0.7, payload="int8"
        ),
        creator=a.peer_id,
        created_at=100.0,
    ).SerializeToString()
    old = decode_manifest(seal(RecordKind.MANIFEST, body, a, None, "r"), run_id="r", secret=None, subkey=None)
    assert not old.averaging.average_every_auto
    assert (old.averaging.average_every_min, old.averaging.average_every_max) == (10, 200)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"average_every_min": 0}, "1 <= min <= max"),
        ({"average_every_min": 30, "average_every_max": 20}, "1 <= min <= max"),
        ({"average_every_max": 100_001}, "1 <= min <= max"),
        ({"average_every_auto": True, "algorithm": "state"}, "needs algorithm=diloco"),
    ],
)
def test_auto_bounds_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        AveragingSettings(**kw)
