"""Which daemons form this daemon's local group: operator-labelled, or by measured links with the
reserved label `auto` (`plan_group`, pure). The daemon's spanning group (daemon/groupspan.py) takes
its members from it.

    plan = plan_group(me, peers, round_members, rules, now)
    plan.members, plan.rank, plan.form, plan.reason

The input is this daemon's live peer table (the membership's, which already drops peers unheard for
`peer_ttl`), its own label and address, and the peers that count as present (`round_members`). The
local group is `local_groups(...)`'s label-only decision (every table entry counts as live: the
table did the expiry). With the label AUTO it is the decision by links among the peers labelled
AUTO: each one's link reports from its latest record (this daemon's own: those of its latest
heartbeat, what the peers saw), both directions of every pair fresh (at most `max_age` old, on the
records' clock) and within the thresholds; so every member reaches the same decision from the same
records. `form` says whether every member is present and published a dialable address. Ranks are
the members' order by peer ID, the same on every member.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from peerd.peers.dear.localgroup import LinkSample, LocalGroupRules, PeerSample, local_groups
from peerd.peers.linkprobe import LinkReport

AUTO = "auto"  # the reserved label: form a group with the peers whose measured links pass the thresholds


@dataclass(frozen=True, slots=True)
class GroupPeer:
    peer: str  # peer ID
    label: str  # its --local-group ("" when unset)
    address: str  # its spanning group's store, "host:port" ("" when none)
    links: tuple[LinkReport, ...] = ()  # its link reports (label AUTO), as of `timestamp`
    timestamp: float = 0.0  # the DHT time of the record they came in: a report was measured at timestamp - age


@dataclass(frozen=True, slots=True)
class Formation:
    members: tuple[str, ...]  # sorted peer IDs of the local group (this daemon included); () when none
    rank: int  # this daemon's index in members; -1 when not forming
    addresses: tuple[str, ...]  # addresses[i]: members[i]'s engine
    form: bool  # every condition holds: build the DeAR group now
    reason: str  # one human-readable line


def plan_group(
    me: GroupPeer, peers: Sequence[GroupPeer], round_members: Collection[str], rules: LocalGroupRules, now: float
) -> Formation:
    """Whether to form this daemon's local group right after a completed round (module docstring)."""
    known = {p.peer: p for p in peers if p.peer != me.peer}
    known[me.peer] = me
    if me.label == AUTO:  # by links, among the peers that opted in (labelled AUTO): module docstring
        auto = [p for p in known.values() if p.label == AUTO]
        links = [
            LinkSample(p.peer, r.peer_id, r.rtt, r.bandwidth, r.loss, p.timestamp - r.age)
            for p in auto
            for r in p.links
        ]
        decision = local_groups([PeerSample(p.peer, now) for p in auto], links, rules, now)
    else:
        decision = local_groups([PeerSample(p.peer, now, p.label) for p in known.values()], (), rules, now)
    group = decision.group_of(me.peer)
    if not me.label or group is None:
        return Formation((), -1, (), False, f"no local group: {decision.reason}")
    addresses = tuple(known[m].address for m in group)
    rank = group.index(me.peer)
    absent = [m for m in group if m not in round_members]
    if absent:
        return Formation(group, rank, addresses, False, f"{len(absent)} of {len(group)} members were not in the round")
    if not all(_dialable(a) for a in addresses):
        return Formation(group, rank, addresses, False, "not every member has announced a valid engine address yet")
    how = "by links" if me.label == AUTO else f"by label {me.label!r}"
    return Formation(group, rank, addresses, True, f"forming [{', '.join(group)}] {how}")


def _dialable(address: str) -> bool:
    """'host:port' with a port in 1..65535 (addresses come from peers' records: checked before use)."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
