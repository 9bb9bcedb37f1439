"""Moshpit groups: who averages with whom in each round (Ryabinin et al., "Moshpit SGD", NeurIPS 2021).

Peers sit on a virtual d-dimensional grid. In round t a peer averages with the peers that share all
its coordinates except coordinate t mod d. When the grid is full (one peer per slot) and nobody
fails, d rounds give the exact global average. Whoever ends up in a group, averaging inside it keeps
the sum of all values and never widens their spread, so a hole, a failure or a stale coordinate
slows convergence down but cannot bias the result.

Everything here is pure (no DHT, no network, no clock): the daemon computes its coordinates and its
`group_key`, publishes itself under the key, and averages with whoever it finds there. The rule, the
two coordinate schemes and measured figures are in docs/algorithms.md, "Moshpit groups".
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DEFAULT_MAX_GROUP_SIZE = 32  # the paper's 32x32; each member of a group all-reduce exchanges with all G-1 others

Coords = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GridShape:
    """A grid with `sides[k]` slots along dimension k. Shapes compare by their sides only.

    The paper's d x M grid is sides = (M,) * d; peerd also uses unequal sides, because they make a
    full grid out of far more peer counts (see `grid_shape`).
    """

    sides: tuple[int, ...]  # non-increasing; the group of round t has at most sides[t % d] members
    reason: str = field(default="", compare=False)  # why this shape, for logs and `peerd status`

    def __post_init__(self) -> None:
        if not self.sides or self.sides[-1] < 1 or list(self.sides) != sorted(self.sides, reverse=True):
            raise ValueError(f"a grid needs at least one dimension and sides >= 1, largest first; got {self.sides}")

    @property
    def d(self) -> int:
        """Dimensions: rounds in one sweep of the grid."""
        return len(self.sides)

    @property
    def M(self) -> int:
        """The largest side: no group has more members."""
        return max(self.sides)

    @property
    def slots(self) -> int:
        return math.prod(self.sides)

    def __str__(self) -> str:
        return "x".join(map(str, self.sides))


def _fullest_sides(n: int, d: int, g: int) -> tuple[int, ...]:
    """The d sides in [2, g], non-increasing, with the smallest product >= n; among equal products
    the lexicographically smallest, which is the most even. Tries each prefix of d - 1 sides once
    (the last side is then ceil(n / prefix product)): about g^(d-1) / (d-1)! steps."""
    best: tuple[int, tuple[int, ...]] | None = None

    def search(prefix: tuple[int, ...], product: int, hi: int) -> None:
        nonlocal best
        if len(prefix) == d - 1:
            last = max(2, -(-n // product))
            if last <= hi and (best is None or (product * last, (*prefix, last)) < best):
                best = (product * last, (*prefix, last))
            return
        for m in range(hi, 1, -1):
            if product * m ** (d - len(prefix)) < n:
                break  # the remaining sides are at most m: no smaller m reaches n either
            if best is not None and product * m * 2 ** (d - len(prefix) - 1) > best[0]:
                continue  # even sides of 2 from here on would leave more slots than the best
            search((*prefix, m), product * m, m)

    search((), 1, g)
    assert best is not None, "(g,) * d always holds n"
    return best[1]


@functools.lru_cache(maxsize=256)
def grid_shape(n_peers: int, max_group_size: int = DEFAULT_MAX_GROUP_SIZE) -> GridShape:
    """The grid for n_peers live peers, with no group larger than max_group_size (G):

    1. d = the fewest dimensions with G^d >= n: as few rounds per sweep, as large groups, as allowed;
    2. sides = d sides in [2, G] whose product (the slots) is the smallest product >= n: a full grid,
       exact in d rounds, whenever n is such a product; otherwise the fewest empty slots;
    3. among those, the most even sides (the smallest largest side): the largest group is smallest.

    Raises ValueError when n_peers < 1 (a daemon counts itself) or max_group_size < 2.
    """
    if n_peers < 1:
        raise ValueError(f"need at least one peer, got {n_peers}")
    if max_group_size < 2:
        raise ValueError(f"max_group_size must be at least 2, got {max_group_size}")
    if n_peers <= max_group_size:
        why = "alone, nothing to average" if n_peers == 1 else "one group of all, 1 round gives the exact average"
        return GridShape((n_peers,), f"{n_peers} peer(s), groups of at most {max_group_size}: {why}")
    d = 2
    while max_group_size**d < n_peers:
        d += 1
    sides = _fullest_sides(n_peers, d, max_group_size)
    slots = math.prod(sides)
    why = (
        f"{n_peers} peers, groups of at most {max_group_size}: {d} dimensions "
        f"({max_group_size}^{d - 1} = {max_group_size ** (d - 1)} < {n_peers}), sides {'x'.join(map(str, sides))}"
    )
    if slots == n_peers:
        why += f", full: {d} rounds give the exact average"
    else:
        why += f" = {slots} slots, {slots - n_peers} empty: not exact, converges over more rounds"
    return GridShape(sides, why)


def slot_coords(index: int, shape: GridShape) -> Coords:
    """The coordinates of slot `index` (0 <= index < slots) in the filling order.

    Write index in mixed radix, with digit a_k < sides[k] and the digit of the smallest (last) side
    f changing fastest; the slot is x_f = a_f and x_k = (a_k + a_f) mod sides[k]. When n peers take
    the first n slots, the empty ones are the last; the skew puts each of them in a different
    group of every round as long as there are at most sides[f] of them, instead of leaving one
    group with all the holes. Raises ValueError for an index outside the grid.
    """
    if not 0 <= index < shape.slots:
        raise ValueError(f"slot {index} is outside a {shape} grid")
    f = shape.d - 1
    index, fast = divmod(index, shape.sides[f])
    coords = [0] * shape.d
    coords[f] = fast
    for k in range(f):
        index, digit = divmod(index, shape.sides[k])
        coords[k] = (digit + fast) % shape.sides[k]
    return tuple(coords)


def _digest(run_id: str, epoch: int, peer_id: str) -> int:
    data = f"peerd moshpit v1\x00{run_id}\x00{epoch}\x00{peer_id}".encode()
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def view_coords(peer_ids: Iterable[str], shape: GridShape, *, run_id: str, epoch: int) -> dict[str, Coords]:
    """Coordinates of every peer in a membership view: the peers are ordered by a hash of
    (run_id, epoch, peer_id) and the i-th takes `slot_coords(i)`. Peers with the same view agree on
    everything, and a full grid averages exactly in d rounds. Peers whose views differ disagree
    about the peers ordered after the first difference. The dict is in slot order.

    The hash order (rather than the IDs' own) reshuffles neighbours every epoch and puts a joiner
    at a random place. Raises ValueError when the view has more peers than the grid has slots.
    """
    ordered = sorted(set(peer_ids), key=lambda p: (_digest(run_id, epoch, p), p))
    if len(ordered) > shape.slots:
        raise ValueError(f"{len(ordered)} peers do not fit a {shape} grid")
    return {p: slot_coords(i, shape) for i, p in enumerate(ordered)}


def hash_coords(peer_id: str, shape: GridShape, *, run_id: str, epoch: int) -> Coords:
    """Coordinates from a hash of (run_id, epoch, peer_id) alone: any two peers that agree on the
    shape agree on each other's coordinates, whatever else their views hold. Groups are uneven
    (about Poisson: some exceed the largest side) and even a full grid is not averaged exactly.
    """
    value = _digest(run_id, epoch, peer_id)  # 256 bits: the bias of reducing it mod the slots is negligible
    coords = []
    for side in shape.sides:
        value, coord = divmod(value, side)
        coords.append(coord)
    return tuple(coords)


def group_key(run_id: str, round_t: int, coords: Coords, shape: GridShape) -> str:
    """The DHT key under which the members of one group of round `round_t` find each other: the
    coordinates with dimension round_t mod d masked out. The shape is part of the key, so peers that
    disagree about it never meet (their coordinates would not be one grid's); so is the round, so a
    late peer cannot join a later round's group. A one-dimensional grid, one group of every live
    peer, is named "all" whatever its size: peers whose views differ by a peer that joined or left
    within a heartbeat or two (one sees 3 peers, another 2) meet there, and matchmaking settles who
    is in (the view's direct path, else the DHT read: peers/matchmaking.py). With its size in the key
    a peer attached just before a phase's end split that round in two.

    `run_id` names the run's namespace; for a run with a secret, pass the same opaque identifier
    the run's membership key uses, so that group keys do not reveal the run either.
    """
    if round_t < 0:
        raise ValueError(f"round must be >= 0, got {round_t}")
    if len(coords) != shape.d or not all(0 <= c < m for c, m in zip(coords, shape.sides)):
        raise ValueError(f"coordinates {coords} are not in a {shape} grid")
    masked = round_t % shape.d
    cells = ".".join("*" if k == masked else str(c) for k, c in enumerate(coords))
    return f"peerd/v1/run/{run_id}/moshpit/{shape if shape.d > 1 else 'all'}/{round_t}/{cells}"


def group_members(
    run_id: str, round_t: int, coords_by_peer: Mapping[str, Coords], shape: GridShape
) -> dict[str, tuple[str, ...]]:
    """Every group of round `round_t`, as the DHT would assemble it: group key -> sorted peer IDs.
    For simulators and tests; each peer of a real run knows only its own key."""
    groups: dict[str, list[str]] = {}
    for peer, coords in coords_by_peer.items():
        groups.setdefault(group_key(run_id, round_t, coords, shape), []).append(peer)
    return {key: tuple(sorted(members)) for key, members in groups.items()}
