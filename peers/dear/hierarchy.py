"""The hierarchy: a local group averages its state over the WAN as one big peer, each member a share.

    exchange = LaneExchange(n=len(vector), lanes=L, size=k)     # once per group (buffers reused)
    done = hierarchical_round(collective, exchange, rank, vector, weight, average_lanes, gather_timeout)
    done.results, done.error                                    # the WAN rounds' RoundResults; why the group broke

**Lanes.** A run's manifest cuts its state vector into `lanes` near-equal contiguous slices
(`averaging.lanes`, default 1; `lane_bounds`). Each lane is averaged in Moshpit rounds of its own:
its own view (the peers that average it), grid, group keys and matchmaking (peers/averaging.py). A
peer in no local group averages every lane itself, with the same weight.

**A local group of k members** (a DeAR group: members hold the same state, step by step) averages
each lane once for the group. Member r *owns* lanes r, r + k, r + 2k, ... (`owned_lanes`; with
more members than lanes, members r >= lanes own none) and announces the others as delegated in its
heartbeats (`delegated_mask`, the member record's `delegated_lanes`, with the group's `group_id`),
so that peers leave it out of those lanes' views (`lane_view`: only while a member of the same
group announces that it averages the lane, so that a stale announcement of a broken group cannot
hide a peer that now averages alone). At each averaging round, on every member:

1. **reduce-scatter** within the group (the DeAR engine's primitive): slot r of the exchange buffer
   holds owner r's lanes plus a weight; member r receives the group's mean of its lanes (the
   members' copies agree anyway; the mean makes sure) and of the weight, times k: the group's
   samples since the previous round;
2. **WAN rounds**: member r averages each of its lanes with that lane's Moshpit group, weighted by
   the group's samples, concurrently (one round per lane);
3. **all-gather** within the group: every member receives every owner's lanes, so all hold the
   same vector again, every lane averaged over the WAN (or, where a lane's round failed, the
   group's own values: still the same on every member).

Members whose lanes finish early wait at the all-gather for the others' WAN rounds, so it gets a
limit of its own (`gather_timeout`: the round's timeout plus slack), not the DeAR op timeout. A
failed reduce-scatter leaves the vector as it was; a failed all-gather leaves this member's own
lanes averaged and the others as they were. Either way the group is broken (`error`); the caller
drops it, and trains on alone.

WAN traffic: a group sends its state once, spread over min(k, lanes) members' links, instead of
once per member.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from peerd.peers.collective.group import shard_bounds
from peerd.peers.dear.backend import Collective, CollectiveError


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


class LaneExchange:
    """The buffer of a local group's two halves around the WAN rounds: `size` equal slots, slot r
    holding owner r's lanes one after the other and, last, a weight. Allocated once per group."""

    def __init__(self, n: int, lanes: int, size: int):
        self.n, self.lanes, self.size = n, lanes, size
        bounds = lane_bounds(n, lanes)
        self.owned = [[bounds[lane] for lane in owned_lanes(lanes, size, r)] for r in range(size)]
        self.slot = max(sum(e - s for s, e in spans) for spans in self.owned) + 1  # + the weight
        self.buffer = torch.zeros(size * self.slot, dtype=torch.float32)

    def share(self, rank: int) -> float:
        """The fraction of the vector member `rank` averages over the WAN."""
        return sum(e - s for s, e in self.owned[rank]) / self.n

    def _slot(self, rank: int) -> torch.Tensor:
        return self.buffer[rank * self.slot : (rank + 1) * self.slot]

    def _pairs(self, rank: int, vector: torch.Tensor):
        """(slice of owner `rank`'s slot, the same lane's slice of `vector`) for each lane it owns."""
        slot, at = self._slot(rank), 0
        for s, e in self.owned[rank]:
            yield slot[at : at + e - s], vector[s:e]
            at += e - s

    def pack(self, vector: torch.Tensor, weight: float) -> None:
        """Every slot from this member's vector: what the reduce-scatter averages."""
        for r in range(self.size):
            self.put(r, vector)
            self._slot(r)[-1] = weight

    def put(self, rank: int, vector: torch.Tensor) -> None:
        """Owner `rank`'s lanes of `vector` into its slot (before the all-gather: its WAN results)."""
        for held, lane in self._pairs(rank, vector):
            held.copy_(lane)

    def take(self, rank: int, vector: torch.Tensor) -> float:
        """Owner `rank`'s slot into its lanes of `vector`; returns the slot's weight (after the
        reduce-scatter, for this member: the group's mean of its lanes and of the weight)."""
        for held, lane in self._pairs(rank, vector):
            lane.copy_(held)
        return float(self._slot(rank)[-1])

    def spread(self, rank: int, vector: torch.Tensor) -> None:
        """After the all-gather: every other owner's lanes into `vector`."""
        for r in range(self.size):
            if r != rank:
                self.take(r, vector)


@dataclass(slots=True)
class HierarchyRound:
    results: list = field(default_factory=list)  # RoundResults of this member's WAN lane rounds
    gathered: bool = False  # the all-gather completed: every member holds the same vector
    error: str = ""  # why the local group broke ("" when it holds)


def hierarchical_round(
    collective: Collective,
    exchange: LaneExchange,
    rank: int,
    vector: torch.Tensor,
    weight: float,
    average_lanes: Callable[[torch.Tensor, float, Sequence[int]], list],
    gather_timeout: float,
) -> HierarchyRound:
    """One averaging round of a local group member (module docstring); blocking, on the trainer
    thread. `average_lanes(vector, group_weight, lanes)` runs this member's WAN rounds of `lanes`
    in place and returns their RoundResults."""
    done = HierarchyRound()
    exchange.pack(vector, weight)
    try:
        rs = collective.reduce_scatter(exchange.buffer)
        collective.wait(rs)
    except CollectiveError as e:
        done.error = f"reduce-scatter before the WAN rounds failed: {e}"
        return done
    group_weight = exchange.take(rank, vector) * exchange.size
    mine = owned_lanes(exchange.lanes, exchange.size, rank)
    if mine:
        done.results = average_lanes(vector, group_weight, mine)
    exchange.put(rank, vector)
    try:
        ag = collective.all_gather(rs, timeout=gather_timeout)
        collective.wait(ag)
    except CollectiveError as e:
        done.error = f"all-gather after the WAN rounds failed: {e}"
        return done
    exchange.spread(rank, vector)
    done.gathered = True
    return done
