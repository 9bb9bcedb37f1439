"""The DHT record validator: what every peerd DHT node checks before it stores or accepts a record.

hivemind calls validate() when a peer asks us to store a record and when a peer returns one to
our get. peerd's DHT holds only peerd records, so anything else is refused here, counted, and
never reaches a peer table.
"""

from __future__ import annotations

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from peerd.peers.events import PeerEvents
from peerd.peers.records import RecordRejected, check_storable
from peerd.peers.clock import now
from peerd.peers.run_ids import MAX_RECORD_TTL


class PeerdRecordValidator(RecordValidatorBase):
    def __init__(self, events: PeerEvents, max_ttl: float = MAX_RECORD_TTL):
        self.events = events
        self.max_ttl = max_ttl

    def validate(self, record: DHTRecord) -> bool:
        try:
            if record.expiration_time > now() + self.max_ttl:
                raise RecordRejected("record_expiration", "expires too far in the future")
            try:
                value = MSGPackSerializer.loads(record.value)
                subkey = MSGPackSerializer.loads(record.subkey)
            except Exception:  # msgpack raises several types on garbage
                raise RecordRejected("record_malformed", "not msgpack") from None
            if not isinstance(subkey, str):
                raise RecordRejected("record_malformed", "peerd records have a string subkey (a peer ID)")
            check_storable(value, subkey)
        except RecordRejected as e:
            self.events.rejected(e.reason)
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value  # records are signed by peers/records.py before they are stored

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value
