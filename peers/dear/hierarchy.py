"""Lanes: a run's vector cut into slices, each averaged in Moshpit rounds of its own, and how a local
group that spans daemons shares them out (peers/dear/delegate.py averages them).

**Lanes.** A run's manifest cuts its vector into `lanes` near-equal contiguous slices
(`averaging.lanes`, default 1; `lane_bounds`). Each lane is averaged in Moshpit rounds of its own:
its own view (the peers that average it), grid, group keys and matchmaking (peers/averaging.py). A
peer in no local group averages every lane itself, with the same weight.

**A local group of k daemons** averages each lane once for the group. Daemon r of the group's epoch
*owns* lanes r, r + k, r + 2k, ... (`owned_lanes`; with more daemons than lanes, daemons r >= lanes
own none) and announces the others as delegated in its heartbeats (`delegated_mask`, the member
record's `delegated_lanes`, with the group's `group_id`), so that peers leave it out of those
lanes' views (`lane_view`: only while a member of the same group announces that it averages the
lane, so that a stale announcement of a broken group cannot hide a peer that now averages alone).

WAN traffic: a group sends its vector once, spread over min(k, lanes) daemons' links, instead of
once per daemon.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


from peerd.peers.collective.group import shard_bounds


def lane_bounds(n: int, lanes: int) -> list[tuple[int, int]]:
    """[start, end) of each of `lanes` near-equal contiguous slices of n elements, in order."""
    if lanes < 1 or n < lanes:
        raise ValueError(f"cannot cut {n} elements into {lanes} lanes")
    return list(shard_bounds(n, lanes))


def owned_lanes(lanes: int, size: int, rank: int) -> tuple[int, ...]:
    """The lanes member `rank` of a local group of `size` averages for the group."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    return tuple(range(rank, lanes, size))


def delegated_mask(lanes: int, size: int, rank: int) -> int:
    """The lanes other members of its group average for member `rank`, as a bit mask (bit l: lane l)."""
    owned = set(owned_lanes(lanes, size, rank))
    return sum(1 << lane for lane in range(lanes) if lane not in owned)


def group_id(members: Sequence[str]) -> str:
    """The ID a DeAR group's members announce (the member record's `dear_group`): the same on every
    member, from the member list alone."""
    return hashlib.blake2b("\n".join(sorted(members)).encode(), digest_size=8).hexdigest()


def lane_view(
    me: str, mine: Sequence[int], my_group: str, peers: Mapping[str, tuple[int, str]], lane: int
) -> list[str]:
    """The sorted peer IDs that average `lane`: this daemon if `lane` is among `mine`, and every live
    peer (peer ID -> its announced (delegated mask, DeAR group ID)) except those that delegated the
    lane *to someone who averages it*: a live peer, or this daemon, announcing the same group and
    not delegating the lane. A delegation nobody takes up (its group broke, its owner died, an
    announcement not yet refreshed) does not count: that peer is in the view, as a peer alone."""
    owners = {group for delegated, group in peers.values() if group and not delegated >> lane & 1}
    if my_group and lane in mine:
        owners.add(my_group)
    view = {p for p, (delegated, group) in peers.items() if not (delegated >> lane & 1 and group in owners)}
    if lane in mine:
        view.add(me)
    return sorted(view)
