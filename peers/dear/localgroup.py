"""Which peers form a fast local group (where DeAR's exact, synchronous all-reduce pays off).

    decision = local_groups(peers, links, LocalGroupRules(), now=clock())
    decision.groups, decision.solo, decision.reason

A pure function: the caller passes what it knows (each peer's last heartbeat and operator label,
measured links) and `now`; the result is the same for the same inputs on every peer.

**Labels first.** Peers an operator labels alike (`--local-group NAME`) form one group whatever the
measurements say (the operator knows the racks), cut into near-equal groups when more than
`max_size` are live. A labelled peer never joins an unlabelled group.

**Otherwise links.** Two unlabelled peers are *close* when every fresh measurement of the link
between them (either direction, at most `max_age` old) passes all thresholds: RTT at most `max_rtt`,
bandwidth at least `min_bandwidth`, loss at most `max_loss`. An unmeasured or stale link is not
close; with `both_directions`, neither is a link measured fresh from one side only. A group needs every pair of its members close (an all-to-all uses every pair): groups are
built greedily in peer-ID order, each peer joining the first group all of whose members it is close
to, up to `max_size` members. A "group" of one is no group: that peer averages over the WAN.

**Dead members.** A peer unheard for more than `peer_timeout` is left out. So a member that dies
drops out of every decision made `peer_timeout` after its last heartbeat: its group re-forms
without it, or, with one member left, that member falls back to WAN averaging. Until then a DeAR
step that needs the dead member fails within the collective's own timeout (at once when its
connection closes), and the caller stops using the group: training is never held up longer than
that collective timeout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, slots=True)
class PeerSample:
    peer: str  # peer ID
    last_seen: float  # when its latest heartbeat arrived, on the clock `now` is read from
    label: str = ""  # the operator's --local-group; "" when unset


@dataclass(frozen=True, slots=True)
class LinkSample:
    a: str  # the measuring peer
    b: str  # the peer measured
    rtt: float  # seconds
    bandwidth: float  # bytes per second
    loss: float  # fraction of packets lost, in [0, 1]
    measured_at: float  # on the clock `now` is read from


@dataclass(kw_only=True, slots=True, frozen=True)
class LocalGroupRules:
    max_rtt: float = 0.002  # seconds: one rack or one data centre, not a city away
    min_bandwidth: float = 125e6  # bytes per second (1 Gb/s): a bucket's transfer must hide behind compute
    max_loss: float = 0.001  # TCP inside a synchronous group stalls on loss; lossy links go to the UDP path
    max_age: float = 60.0  # seconds after which a link measurement no longer counts
    peer_timeout: float = 10.0  # seconds without a heartbeat after which a peer counts as dead
    max_size: int = 16  # members per group: an all-to-all's messages grow with the square of it
    both_directions: bool = False  # a pair needs a fresh measurement from each side (the daemon: each measures one way)

    def __post_init__(self) -> None:
        if min(self.max_rtt, self.min_bandwidth, self.max_age, self.peer_timeout) <= 0 or not 0 <= self.max_loss <= 1:
            raise ValueError("thresholds must be positive and max_loss in [0, 1]")
        if self.max_size < 2:
            raise ValueError("max_size must be at least 2")

    def close(self, link: LinkSample) -> bool:
        return link.rtt <= self.max_rtt and link.bandwidth >= self.min_bandwidth and link.loss <= self.max_loss


@dataclass(frozen=True, slots=True)
class LocalGroups:
    groups: tuple[tuple[str, ...], ...]  # each of >= 2 live peers, sorted; ordered by first member
    solo: tuple[str, ...]  # live peers in no local group: they average over the WAN
    reason: str  # one human-readable paragraph: how each group formed, why each other peer is solo or out

    def group_of(self, peer: str) -> tuple[str, ...] | None:
        return next((g for g in self.groups if peer in g), None)


def local_groups(
    peers: Iterable[PeerSample], links: Iterable[LinkSample], rules: LocalGroupRules, now: float
) -> LocalGroups:
    """The local groups among `peers` at time `now` (module docstring)."""
    peers = sorted(peers, key=lambda p: p.peer)
    alive = [p for p in peers if now - p.last_seen <= rules.peer_timeout]
    notes = [
        f"{p.peer} left out: unheard for {now - p.last_seen:.1f} s > {rules.peer_timeout:g} s"
        for p in peers
        if p not in alive
    ]
    groups: list[tuple[str, ...]] = []
    solo: list[str] = []

    by_label: dict[str, list[str]] = defaultdict(list)
    for p in alive:
        if p.label:
            by_label[p.label].append(p.peer)
    for label, members in sorted(by_label.items()):
        parts = -(-len(members) // rules.max_size)  # as few groups as max_size allows, of near-equal sizes
        cuts = [round(i * len(members) / parts) for i in range(parts + 1)]
        for chunk in (tuple(members[a:b]) for a, b in zip(cuts, cuts[1:])):
            if len(chunk) > 1:
                groups.append(chunk)
                notes.append(f"[{', '.join(chunk)}] by label {label!r}")
            elif parts == 1:
                solo.append(chunk[0])
                notes.append(f"{chunk[0]} solo: the only live member of label {label!r}")
            else:
                solo.append(chunk[0])
                notes.append(
                    f"{chunk[0]} solo: left over when label {label!r} was cut into groups of at most {rules.max_size}"
                )

    unlabelled = [p.peer for p in alive if not p.label]
    links = list(links)
    close = _close_pairs(set(unlabelled), links, rules, now)
    built: list[list[str]] = []
    for peer in unlabelled:
        home = next((g for g in built if len(g) < rules.max_size and all((peer, m) in close for m in g)), None)
        if home is None:
            built.append([peer])
        else:
            home.append(peer)
    thresholds = (
        f"rtt <= {rules.max_rtt * 1e3:g} ms, >= {rules.min_bandwidth * 8e-9:g} Gb/s, loss <= {rules.max_loss:.2%}"
    )
    for g in built:
        if len(g) > 1:
            groups.append(tuple(g))
            notes.append(f"[{', '.join(g)}] by links ({thresholds})")
        else:
            solo.append(g[0])
            failing = [
                f"{s.a}->{s.b} {s.rtt * 1e3:.2f} ms, {s.bandwidth * 8e-9:.2f} Gb/s, loss {s.loss:.1%}"
                for s in links
                if g[0] in (s.a, s.b) and now - s.measured_at <= rules.max_age and not rules.close(s)
            ]
            seen = f"; failing: {', '.join(failing[:4])}" if failing else ""
            notes.append(f"{g[0]} solo: no fresh link close to every member of a group ({thresholds}{seen})")

    groups.sort()
    solo.sort()
    return LocalGroups(tuple(groups), tuple(solo), "; ".join(notes) or "no peers")


def _close_pairs(
    peers: set[str], links: Iterable[LinkSample], rules: LocalGroupRules, now: float
) -> set[tuple[str, str]]:
    """Ordered pairs (both directions) whose fresh measurements all pass the thresholds."""
    verdicts: dict[frozenset, bool] = {}
    sides: dict[frozenset, set[str]] = defaultdict(set)
    for link in links:
        if link.a == link.b or link.a not in peers or link.b not in peers or now - link.measured_at > rules.max_age:
            continue
        key = frozenset((link.a, link.b))
        verdicts[key] = verdicts.get(key, True) and rules.close(link)
        sides[key].add(link.a)
    return {
        (a, b)
        for key, ok in verdicts.items()
        if ok and (len(sides[key]) == 2 or not rules.both_directions)
        for a in key
        for b in key
        if a != b
    }
