"""A lab scenario: its TOML schema as typed dataclasses, and every check made before anything is built.

    name = "churn"                  # optional; default: the file's name
    duration = 60.0                 # seconds of schedule, from the moment every first host trains
    congestion_control = "reno"     # TCP congestion control in every host: reno or bbr (cubic: see docs/lab.md)
    start_timeout = 120.0           # seconds for the first hosts to start training

    [run]                           # the run every daemon trains
    id = "lab"
    task = "digits-mlp"
    settings = { "averaging.average_every" = 10 }   # `--set KEY=VALUE` of the run's creator
    min_peers = 0                   # 0: every host present at the start
    max_steps = 0                   # 0: train until the end of the scenario
    checkpoint_every = 20
    args = []                       # more `peerd start` flags for every daemon

    [link]                          # every host's link, unless its [[host]] says otherwise
    rate_mbit = 100.0               # 0 = unlimited; both directions
    loss_pct = 0.0                  # share of the packets delivered to the host that are dropped
    loss_protocol = "all"           # all, tcp or udp
    loss_ports = []                 # only packets from or to these ports
    rtt_ms = 0                      # 0-2000: added round-trip time (userspace delay line; see docs/lab.md)

    [[host]]
    name = "a"
    join_at = 0.0                   # > 0: the host's daemon starts late, at this time
    site = "s1"                     # hosts of one site share a second, fast link (its own bridge, unshaped)
                                    # and train as one local group (`--local-group s1`, its address there)
    loss_pct = 5.0                  # any [link] key

    [[fault]]
    at = 20.0
    action = "kill"                 # kill, freeze, thaw, restart, partition, heal or link
    hosts = ["b"]                   # kill/freeze/thaw/restart/link: these; partition: one side
    loss_pct = 10.0                 # link only: any [link] key, rtt_ms included

Errors are ScenarioError with one line naming the file, the table and the key.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from peerd.daemon.lab.netns import PROTOCOLS, LinkShape
from peerd.daemon.typed import Mismatch, coerce

ACTIONS = ("kill", "freeze", "thaw", "restart", "partition", "heal", "link")
HOST_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")
CONGESTION_CONTROLS = ("reno", "bbr", "cubic")
MAX_HOSTS = 64  # each host is a daemon with its p2pd: a machine runs out of cores long before addresses
MAX_SITES = 8  # a site's link is a subnet 10.(78 + its index).K.0/24 (daemon/lab/netns.py)
MAX_RTT_MS = 2000.0  # a host's rtt_ms: its delay line holds packets for rtt_ms / 2 (docs/lab.md)


class ScenarioError(ValueError):
    """The scenario cannot run; one line."""


@dataclass(kw_only=True, slots=True)
class RunSpec:
    id: str = "lab"  # the run's ID
    task: str = "digits-mlp"  # task of the run, created by the first host
    settings: dict[str, str] = field(default_factory=dict)  # hyper-parameters and averaging.* of the new run
    min_peers: int = 0  # peers to wait for before the first step; 0 = every host present at the start
    max_steps: int = 0  # local steps after which a daemon stops training; 0 = never
    checkpoint_every: int = 20  # local steps between checkpoints
    args: list[str] = field(default_factory=list)  # more `peerd start` flags for every daemon
    # Every host creates the run itself and is given no peer to bootstrap from: each trains alone
    # (a baseline of the same processes without communication). min_peers is then 1.
    isolated: bool = False


@dataclass(kw_only=True, slots=True)
class HostSpec:
    name: str
    join_at: float = 0.0  # seconds after the start of the schedule at which its daemon starts
    link: LinkShape = field(default_factory=LinkShape)
    site: str = ""  # its site's name: a second link, unshaped, to the site's other hosts; "" when none


@dataclass(kw_only=True, slots=True)
class Fault:
    at: float
    action: str
    hosts: tuple[str, ...] = ()
    link: dict[str, Any] = field(default_factory=dict)  # action "link": the LinkShape fields it changes

    def describe(self) -> str:
        what = f"{self.action} {','.join(self.hosts)}".strip()
        if self.link:
            what += " (" + ", ".join(f"{k}={v}" for k, v in self.link.items()) + ")"
        return what


@dataclass(kw_only=True, slots=True)
class Scenario:
    name: str
    duration: float
    congestion_control: str = "reno"
    start_timeout: float = 120.0
    run: RunSpec = field(default_factory=RunSpec)
    hosts: list[HostSpec] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)  # sorted by time; equal times keep file order

    @property
    def sites(self) -> list[str]:
        """The sites' names, in the order their subnets are numbered."""
        return sorted({h.site for h in self.hosts if h.site})

    def host(self, name: str) -> HostSpec:
        return next(h for h in self.hosts if h.name == name)

    @property
    def first_hosts(self) -> list[HostSpec]:
        return [h for h in self.hosts if h.join_at == 0]


def load(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse(data, default_name=path.stem)
    except ScenarioError as e:
        raise ScenarioError(f"{path.name}: {e}") from None


_LINK_KEYS = ("rate_mbit", "loss_pct", "loss_protocol", "loss_ports", "rtt_ms")


def parse(data: dict[str, Any], default_name: str = "scenario") -> Scenario:
    top = _Table(
        "top level", data, ("name", "duration", "congestion_control", "start_timeout", "run", "link", "host", "fault")
    )
    duration = top.number("duration", required=True)
    if duration <= 0:
        raise ScenarioError(f"duration must be more than 0 s, not {duration}")
    cc = top.text("congestion_control", "reno")
    if cc not in CONGESTION_CONTROLS:
        raise ScenarioError(f"congestion_control must be one of {', '.join(CONGESTION_CONTROLS)}, not {cc!r}")
    run = _run(_Table("[run]", top.table("run"), [f.name for f in fields(RunSpec)]))
    default_link = _link(_Table("[link]", top.table("link"), _LINK_KEYS), LinkShape())
    hosts = []
    for i, raw in enumerate(top.array("host"), 1):
        t = _Table(f"[[host]] {i}", raw, ("name", "join_at", "site", *_LINK_KEYS))
        name = t.text("name", required=True)
        if not HOST_NAME.fullmatch(name):
            raise ScenarioError(
                f"[[host]] {i}: name {name!r} must be 1-16 of a-z, 0-9 and '-', starting with a letter or digit"
            )
        if name in (h.name for h in hosts):
            raise ScenarioError(f"[[host]] {i}: a second host named {name!r}")
        join_at = t.number("join_at", 0.0)
        if not 0 <= join_at < duration:
            raise ScenarioError(f"[[host]] {name!r}: join_at {join_at} is outside the scenario (0 to {duration} s)")
        site = t.text("site")
        if site and not HOST_NAME.fullmatch(site):
            raise ScenarioError(f"[[host]] {name!r}: site {site!r} must be 1-16 of a-z, 0-9 and '-'")
        hosts.append(HostSpec(name=name, join_at=join_at, link=_link(t, default_link), site=site))
    if len({h.site for h in hosts if h.site}) > MAX_SITES:
        raise ScenarioError(f"more than {MAX_SITES} sites: each is a subnet of its own (10.78-10.85)")
    if not 1 <= len(hosts) <= MAX_HOSTS:
        raise ScenarioError(f"{len(hosts)} [[host]] tables: a lab has 1 to {MAX_HOSTS} hosts")
    first = [h for h in hosts if h.join_at == 0]
    if not first:
        raise ScenarioError("every host has join_at > 0: at least one must be there at the start")
    if run.min_peers > len(first):
        raise ScenarioError(f"[run] min_peers = {run.min_peers}, but only {len(first)} hosts are there at the start")
    faults = []
    for i, raw in enumerate(top.array("fault"), 1):
        t = _Table(f"[[fault]] {i}", raw, ("at", "action", "hosts", *_LINK_KEYS))
        action = t.text("action", required=True)
        if action not in ACTIONS:
            raise ScenarioError(f"[[fault]] {i}: action must be one of {', '.join(ACTIONS)}, not {action!r}")
        at = t.number("at", required=True)
        if not 0 <= at <= duration:
            raise ScenarioError(f"[[fault]] {i} ({action}): at = {at} is outside the scenario (0 to {duration} s)")
        names = tuple(t.strings("hosts"))
        unknown = [n for n in names if n not in {h.name for h in hosts}]
        if unknown:
            raise ScenarioError(
                f"[[fault]] {i} ({action}): unknown host {unknown[0]!r} (hosts: {', '.join(h.name for h in hosts)})"
            )
        if action == "heal" and names:
            raise ScenarioError(f"[[fault]] {i}: heal takes no hosts (it removes the partition)")
        if action != "heal" and not names:
            raise ScenarioError(f"[[fault]] {i} ({action}): name the hosts it applies to (hosts = [...])")
        shape = _link(t, LinkShape())  # checks the values
        changes = {k: getattr(shape, k) for k in _LINK_KEYS if k in raw}
        if action == "link" and not changes:
            raise ScenarioError(f"[[fault]] {i}: a link fault changes at least one of {', '.join(_LINK_KEYS)}")
        if action != "link" and any(k in raw for k in _LINK_KEYS):
            raise ScenarioError(f'[[fault]] {i} ({action}): link keys belong to action = "link"')
        faults.append(Fault(at=at, action=action, hosts=names, link=changes))
    faults.sort(key=lambda f: f.at)
    scenario = Scenario(
        name=top.text("name", default_name),
        duration=duration,
        congestion_control=cc,
        start_timeout=top.number("start_timeout", 120.0),
        run=run,
        hosts=hosts,
        faults=faults,
    )
    check_schedule(scenario)
    return scenario


def check_schedule(s: Scenario) -> None:
    """Replay the schedule on host states and refuse what cannot happen: acting on a host before it
    joined, thawing what is not frozen, restarting what was not killed, two partitions at once."""
    state = {h.name: "absent" for h in s.hosts}
    events = [(h.join_at, -1, "join", (h.name,)) for h in s.hosts] + [
        (f.at, i, f.action, f.hosts) for i, f in enumerate(s.faults)
    ]
    partitioned = False
    for at, i, action, names in sorted(events, key=lambda e: (e[0], e[1])):
        where = f"[[fault]] {i + 1} ({action} at {at} s)"
        need = {"kill": ("running", "frozen"), "freeze": ("running",), "thaw": ("frozen",), "restart": ("killed",)}
        for n in names if action in need else ():
            if state[n] not in need[action]:
                raise ScenarioError(f"{where}: host {n!r} is {state[n]} then, so it cannot be {_past(action)}")
        if action == "partition":
            if partitioned:
                raise ScenarioError(f"{where}: the lab is already partitioned; heal first")
            if len(set(names)) == len(s.hosts):
                raise ScenarioError(f"{where}: a partition needs hosts on both sides")
            partitioned = True
        elif action == "heal":
            if not partitioned:
                raise ScenarioError(f"{where}: nothing to heal, no partition then")
            partitioned = False
        new = {"join": "running", "kill": "killed", "freeze": "frozen", "thaw": "running", "restart": "running"}.get(
            action
        )
        for n in names if new else ():
            state[n] = new


def _past(action: str) -> str:
    return {"kill": "killed", "freeze": "frozen", "thaw": "thawed", "restart": "restarted"}[action]


def _run(t: "_Table") -> RunSpec:
    settings = t.table_of_scalars("settings")
    spec = RunSpec(
        id=t.text("id", "lab"),
        task=t.text("task", "digits-mlp"),
        settings=settings,
        min_peers=t.integer("min_peers", 0),
        max_steps=t.integer("max_steps", 0),
        checkpoint_every=t.integer("checkpoint_every", 20),
        args=t.strings("args"),
        isolated=t.boolean("isolated", False),
    )
    for name in ("min_peers", "max_steps"):
        if getattr(spec, name) < 0:
            raise ScenarioError(f"[run] {name} must be >= 0")
    if spec.checkpoint_every < 1:
        raise ScenarioError("[run] checkpoint_every must be >= 1")
    if spec.isolated and spec.min_peers > 1:
        raise ScenarioError("[run] isolated hosts train alone: min_peers must be 0 or 1")
    return spec


def _link(t: "_Table", base: LinkShape) -> LinkShape:
    shape = replace(
        base,
        rate_mbit=t.number("rate_mbit", base.rate_mbit),
        loss_pct=t.number("loss_pct", base.loss_pct),
        loss_protocol=t.text("loss_protocol", base.loss_protocol),
        loss_ports=tuple(t.integers("loss_ports", list(base.loss_ports))),
        rtt_ms=t.number("rtt_ms", base.rtt_ms),
    )
    if not 0 <= shape.rtt_ms <= MAX_RTT_MS:
        raise ScenarioError(
            f"{t.where}: rtt_ms = {shape.rtt_ms:g} must be between 0 and {MAX_RTT_MS:g} ms "
            "(the added round-trip time; each host's delay line holds what it sends for rtt_ms / 2)"
        )
    if shape.rate_mbit < 0:
        raise ScenarioError(f"{t.where}: rate_mbit must be >= 0 (0 = unlimited)")
    if not 0 <= shape.loss_pct <= 100:
        raise ScenarioError(f"{t.where}: loss_pct must be between 0 and 100")
    if shape.loss_protocol not in PROTOCOLS:
        raise ScenarioError(f"{t.where}: loss_protocol must be one of {', '.join(PROTOCOLS)}")
    if any(not 1 <= p <= 65535 for p in shape.loss_ports):
        raise ScenarioError(f"{t.where}: loss_ports must be TCP/UDP ports (1-65535)")
    return shape


class _Table:
    """One TOML table with typed getters; unknown keys are refused when it is made."""

    def __init__(self, where: str, data: Any, known):
        if not isinstance(data, dict):
            raise ScenarioError(f"{where} must be a table")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ScenarioError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        self.where, self.data = where, data

    def _get(self, key: str, default, required: bool, kind, what: str | None = None):
        """The key's value as type `kind` (daemon/typed.py, exact: TOML's own types; an int is a
        float), or `default` when it is absent."""
        if key not in self.data:
            if required:
                raise ScenarioError(f"{self.where}: {key} is required")
            return default
        value = self.data[key]
        try:
            return coerce(value, kind, text=False)
        except Mismatch as e:
            raise ScenarioError(f"{self.where}: {key} must be {what or e.expected}, not {value!r}") from None

    def number(self, key: str, default: float = 0.0, required: bool = False) -> float:
        value = self._get(key, default, required, float)
        if not math.isfinite(value):
            raise ScenarioError(f"{self.where}: {key} must be a finite number")
        return value

    def integer(self, key: str, default: int) -> int:
        return self._get(key, default, False, int)

    def boolean(self, key: str, default: bool) -> bool:
        return self._get(key, default, False, bool)

    def text(self, key: str, default: str = "", required: bool = False) -> str:
        return self._get(key, default, required, str)

    def table(self, key: str) -> dict:
        return self._get(key, {}, False, dict)

    def array(self, key: str) -> list:
        return self._get(key, [], False, list, f"an array of tables ([[{key}]])")

    def strings(self, key: str) -> list[str]:
        return self._get(key, [], False, list[str])

    def integers(self, key: str, default: list[int]) -> list[int]:
        return self._get(key, default, False, list[int])

    def table_of_scalars(self, key: str) -> dict[str, str]:
        values = self.table(key)
        for k, v in values.items():
            if not isinstance(v, (str, int, float, bool)):
                raise ScenarioError(f"{self.where}: {key}.{k} must be a string or a number")
        return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
