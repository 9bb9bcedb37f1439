"""Record signing, sealing and every way a record can be refused."""

import dataclasses
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from peerd.peers import envelope as envelope_module
from peerd.peers.envelope import RecordKind, seal
from peerd.peers.events import PeerEvents
from peerd.peers.identity import Identity
from peerd.peers.records import (
    MAX_LINKS,
    LinkReport,
    MemberRecord,
    MemberState,
    RecordRejected,
    open_envelope,
    seal_record,
)
from peerd.peers.sketch import MAX_SKETCH_VALUES, ParamSketch
from peerd.peers.run_ids import InvalidRunId, InvalidSecret, RunSecret, run_dht_key, validate_run_id
from peerd.peers.validator import PeerdRecordValidator
from peerd.protos import records_pb2

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def alice(tmp_path_factory) -> Identity:
    return Identity.load_or_create(tmp_path_factory.mktemp("id") / "alice.key")


@pytest.fixture(scope="module")
def mallory(tmp_path_factory) -> Identity:
    return Identity.load_or_create(tmp_path_factory.mktemp("id") / "mallory.key")


def record(identity: Identity, run_id="r1", ts=NOW, state=MemberState.ACTIVE) -> MemberRecord:
    return MemberRecord(
        run_id=run_id,
        peer_id=identity.peer_id,
        maddrs=("/ip4/127.0.0.1/tcp/5",),
        version="0.1.0",
        role="trainer",
        state=state,
        timestamp=ts,
    )


def rejected(reason, data, **kw):
    kw = {"run_id": "r1", "secret": None, "subkey": None, "now": NOW, **kw}
    with pytest.raises(RecordRejected) as e:
        open_envelope(data, **kw)
    assert e.value.reason == reason, e.value


def test_identity_survives_reload(tmp_path):
    a = Identity.load_or_create(tmp_path / "k")
    assert Identity.load_or_create(tmp_path / "k").peer_id == a.peer_id


def test_open_run_round_trip(alice):
    data = seal_record(record(alice), alice, None)
    got = open_envelope(data, run_id="r1", secret=None, subkey=alice.peer_id, now=NOW)
    assert got == record(alice)


def test_secret_run_round_trip_and_wrong_secret(alice):
    secret = RunSecret.from_bytes(b"s" * 32, "r1")
    data = seal_record(record(alice), alice, secret)
    assert open_envelope(data, run_id="r1", secret=secret, subkey=alice.peer_id, now=NOW).peer_id == alice.peer_id
    rejected("record_auth", data, secret=RunSecret.from_bytes(b"t" * 32, "r1"))
    rejected("record_auth", data)  # sealed record read as an open run
    rejected("record_auth", seal_record(record(alice), alice, None), secret=secret)


def test_forged_record_naming_another_peer(alice, mallory):
    # Mallory signs a record that claims to be Alice.
    body = records_pb2.PeerRecord(
        format_version=1, run_id="r1", peer_id=alice.peer_id, state=1, timestamp=NOW
    ).SerializeToString()
    envelope = records_pb2.Envelope(format_version=1, payload=body, public_key=mallory.public_key_der, kind=1)
    envelope.signature = mallory.sign(b"peerd-envelope-v1" + bytes([1]) + body)
    rejected("record_forged", envelope.SerializeToString())
    # Mallory's own valid record published under Alice's subkey.
    rejected("record_forged", seal_record(record(mallory), mallory, None), subkey=alice.peer_id)


def test_tampered_signature(alice):
    env = records_pb2.Envelope.FromString(seal_record(record(alice), alice, None))
    env.payload = env.payload.replace(b"0.1.0", b"9.9.9")
    rejected("record_signature", env.SerializeToString())


def test_a_verified_envelope_is_checked_once_and_a_tampered_copy_still_refused(alice, monkeypatch):
    data = seal_record(record(alice), alice, None)
    calls = []
    real = envelope_module.verify
    monkeypatch.setattr(envelope_module, "verify", lambda *a: calls.append(1) or real(*a))
    assert open_envelope(data, run_id="r1", secret=None, subkey=alice.peer_id, now=NOW) == record(alice)
    assert open_envelope(data, run_id="r1", secret=None, subkey=alice.peer_id, now=NOW) == record(alice)
    assert len(calls) == 1  # the second read of the same bytes: no RSA check
    env = records_pb2.Envelope.FromString(data)
    env.payload = env.payload.replace(b"0.1.0", b"9.9.9")
    rejected("record_signature", env.SerializeToString())  # other bytes: checked, and refused
    assert len(calls) == 2
    rejected("record_forged", data, subkey="someone-else")  # the cached signer is still held to its slot
    monkeypatch.setattr(envelope_module, "VERIFIED_CACHE", 2)
    for ts in (NOW + 1, NOW + 2, NOW + 3):
        open_envelope(seal_record(record(alice, ts=ts), alice, None), run_id="r1", secret=None, subkey=None, now=NOW)
    assert len(envelope_module._VERIFIED) == 2  # bounded: the oldest dropped


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"\xff\x00garbage", "record_malformed"),
        (42, "record_malformed"),
        (b"x" * 20000, "record_oversized"),
        (records_pb2.Envelope(format_version=7).SerializeToString(), "record_version"),
    ],
)
def test_garbage(data, reason):
    rejected(reason, data)


def test_wrong_run_and_future_timestamp(alice):
    rejected("record_wrong_run", seal_record(record(alice, run_id="r2"), alice, None))
    rejected("record_future", seal_record(record(alice, ts=NOW + 3600), alice, None))


def test_validator_refuses_what_a_storing_node_can_check(alice, mallory):
    reasons = []
    v = PeerdRecordValidator(PeerEvents(rejected=reasons.append))
    good = seal_record(record(alice, ts=NOW), alice, None)
    sealed = seal_record(record(alice, ts=NOW), alice, RunSecret.from_bytes(b"k" * 16, "r1"))

    def dht_record(value, subkey, ttl=10.0):
        from peerd.peers.clock import now

        return DHTRecord(b"key", MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), now() + ttl)

    assert v.validate(dht_record(good, alice.peer_id))
    assert not v.validate(dht_record(good, mallory.peer_id))  # Alice's record can't take Mallory's slot
    assert v.validate(dht_record(sealed, alice.peer_id))  # checkable without the run secret
    assert not v.validate(dht_record(sealed, mallory.peer_id))
    assert not v.validate(dht_record(b"junk", alice.peer_id))
    assert not v.validate(dht_record(good, alice.peer_id, ttl=10_000))
    assert reasons == ["record_forged", "record_forged", "record_malformed", "record_expiration"]


@pytest.mark.parametrize("bad", ["", "a" * 65, "has space", "-leading", "ünïcode", "a/b"])
def test_invalid_run_ids(bad):
    with pytest.raises(InvalidRunId):
        validate_run_id(bad)


def test_run_keys_depend_on_the_secret():
    s1, s2 = RunSecret.from_bytes(b"a" * 16, "r"), RunSecret.from_bytes(b"b" * 16, "r")
    assert run_dht_key("r", s1) != run_dht_key("r", s2) != run_dht_key("r", None)
    assert "r" not in run_dht_key("r", s1).split("/")  # the run ID is not readable in a secret run's key
    with pytest.raises(InvalidSecret):
        RunSecret.from_bytes(b"short", "r")
    with pytest.raises(InvalidSecret):
        RunSecret.from_file(Path("/nonexistent/secret"), "r")


def link(peer_id: str, **kw) -> LinkReport:
    return LinkReport(**{"peer_id": peer_id, "rtt": 0.0002, "bandwidth": 2.5e8, "loss": 0.0, "age": 3.5, **kw})


def test_link_reports_and_a_sketch_round_trip_and_a_full_record_fits(alice):
    """MAX_LINKS reports with real peer IDs and a sketch of MAX_SKETCH_VALUES values still fit an
    envelope (peers/envelope.py's bound)."""
    secret = RunSecret.from_bytes(b"s" * 32, "r1")
    ids = [f"Qm{i:044d}" for i in range(MAX_LINKS)]  # as long as an RSA identity's peer ID
    links = tuple(link(p, rtt=1e-4 * i, loss=i / 1000, bandwidth=1e6 * i) for i, p in enumerate(ids))
    sketch = ParamSketch(step=40, size=10**8, values=tuple(0.25 * i - 7.5 for i in range(MAX_SKETCH_VALUES)))
    rec = dataclasses.replace(record(alice), links=links, step=41, sketch=sketch)
    data = seal_record(rec, alice, secret)
    assert open_envelope(data, run_id="r1", secret=secret, subkey=alice.peer_id, now=NOW) == rec


@pytest.mark.parametrize(
    "links",
    [
        pytest.param(lambda me: [link(f"p{i}") for i in range(MAX_LINKS + 1)], id="too-many"),
        pytest.param(lambda me: [link("")], id="empty-peer"),
        pytest.param(lambda me: [link("x" * 300)], id="long-peer"),
        pytest.param(lambda me: [link(me)], id="own-link"),
        pytest.param(lambda me: [link("b"), link("b")], id="repeated"),
        pytest.param(lambda me: [link("b", rtt=float("nan"))], id="nan-rtt"),
        pytest.param(lambda me: [link("b", rtt=-1.0)], id="negative-rtt"),
        pytest.param(lambda me: [link("b", bandwidth=float("inf"))], id="inf-bandwidth"),
        pytest.param(lambda me: [link("b", bandwidth=-5.0)], id="negative-bandwidth"),
        pytest.param(lambda me: [link("b", loss=1.5)], id="loss-above-one"),
        pytest.param(lambda me: [link("b", age=-1.0)], id="negative-age"),
        pytest.param(lambda me: [link("b", age=1e9)], id="ancient"),
    ],
)
def test_malformed_link_reports_refuse_the_record(alice, links):
    """Written straight into the protobuf (seal_record would send them as they are, too): one bad
    report refuses the whole record, under the reason every malformed record is counted by."""
    body = records_pb2.PeerRecord(format_version=1, run_id="r1", peer_id=alice.peer_id, state=1, timestamp=NOW)
    for r in links(alice.peer_id):
        body.links.add(peer_id=r.peer_id, rtt=r.rtt, bandwidth=r.bandwidth, loss=r.loss, age=r.age)
    data = seal(RecordKind.MEMBER, body.SerializeToString(), alice, None, "r1")
    rejected("record_malformed", data)


def sketch_body(peer_id: str, *, step=50, size=1000, values=b"\0\0\x80\x3f" * 8, record_step=50, present=True):
    body = records_pb2.PeerRecord(
        format_version=1, run_id="r1", peer_id=peer_id, state=1, timestamp=NOW, step=record_step
    )
    if present:
        body.sketch.step, body.sketch.size, body.sketch.values = step, size, values
    return body


def test_a_sketch_round_trips_and_an_absent_one_is_none(alice):
    body = sketch_body(alice.peer_id)
    rec = open_envelope(
        seal(RecordKind.MEMBER, body.SerializeToString(), alice, None, "r1"),
        run_id="r1",
        secret=None,
        subkey=None,
        now=NOW,
    )
    assert rec.sketch == ParamSketch(50, 1000, (1.0,) * 8)
    body = sketch_body(alice.peer_id, present=False)
    rec = open_envelope(
        seal(RecordKind.MEMBER, body.SerializeToString(), alice, None, "r1"),
        run_id="r1",
        secret=None,
        subkey=None,
        now=NOW,
    )
    assert rec.sketch is None


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"values": b""}, id="empty"),
        pytest.param({"values": b"\0" * 7}, id="not-float32"),
        pytest.param({"values": b"\0" * 4 * (MAX_SKETCH_VALUES + 1), "size": 10**6}, id="too-many"),
        pytest.param({"values": b"\0" * 4 * 9, "size": 8}, id="more-values-than-parameters"),
        pytest.param({"values": b"\0\0\xc0\x7f" + b"\0" * 4}, id="nan"),
        pytest.param({"values": b"\0\0\x80\x7f" + b"\0" * 4}, id="inf"),
        pytest.param({"step": 0}, id="step-zero"),
        pytest.param({"step": 60, "record_step": 50}, id="step-ahead-of-the-record"),
    ],
)
def test_malformed_sketches_refuse_the_record(alice, fields):
    """Like a bad link report, a bad sketch refuses the whole record as record_malformed."""
    data = seal(RecordKind.MEMBER, sketch_body(alice.peer_id, **fields).SerializeToString(), alice, None, "r1")
    rejected("record_malformed", data)
