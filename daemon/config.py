"""The daemon's one typed config tree, and the only place that reads PEERD_* variables.

Precedence, highest first: command-line flag > PEERD_* environment variable > TOML file (--config)
> default. Every setting is one row of OPTIONS: its place in the tree and its help text. Its flag is
the leaf's name with dashes (network.data_path: --data-path) and its variable PEERD_ + the flag's
name in capitals (PEERD_DATA_PATH), so leaves are unique across the tree and the four sources
cannot drift apart.

Values are typed by pydantic (daemon/typed.py, the coercion every settings reader in peerd uses);
the precedence is the 20 lines of load_config. Not pydantic-settings, whose sources name a nested
setting by its path (PEERD_NETWORK__PORT, --network.port, lists as JSON) where peerd names it by
its leaf (PEERD_PORT, --port, PEERD_RUN=a,b), and which merges the sources before validating, so
that an error can no longer say whether the bad value came from the flag, the variable or the
file; the `peerd start` parser (subcommands, --no-X, --initial-peers A B, one-line errors) stays
argparse either way.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from peerd.daemon.typed import Mismatch, coerce
from peerd.peers.run_ids import MAX_RECORD_TTL, InvalidRunId, validate_run_id

MAX_PEER_TTL = MAX_RECORD_TTL / 2


UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path is 108, with the final NUL)
MAX_TRAIN_PROCESSES = 64  # training processes per --task run: a bound, not a target (each is a process)
MAX_RUNS_LIMIT = 1024  # the largest max_runs accepted: a bound, not a target (each run costs DHT traffic)


class ConfigError(ValueError):
    """A setting is unusable; the message names it and is meant to be printed as one line."""


# How a loss-tolerant run's data reaches each member (docs/loss-tolerance.md, "Per-link choice").
DATA_PATHS = ("auto", "reliable", "udp")
# How reliable links are made (peerd.peers.collective.fallback's modes): auto = direct TCP, else libp2p streams.
RELIABLE_LINK_MODES = ("auto", "tcp", "libp2p")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "peerd"


@dataclass(kw_only=True, slots=True)
class NetworkConfig:
    host: str = "0.0.0.0"  # libp2p listen address (IPv4 or IPv6 literal)
    port: int = 31337  # libp2p listen TCP port; 0 lets the OS choose
    announce: list[str] = field(default_factory=list)  # public multiaddrs to announce instead of the listen ones
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs of peers to bootstrap from
    nat_port_map: bool = False  # UPnP/NAT-PMP port mapping: multicasts on the LAN, so opt-in
    auto_nat: bool = False  # libp2p AutoNAT: asks peers to dial back, so opt-in
    startup_timeout: float = 15.0  # starting p2pd and bootstrapping to initial_peers
    dht_timeout: float = 4.0  # one DHT get or store, all hops included
    data_path: str = "auto"  # loss-tolerant runs' data per link: auto (UDP where the probe passes), reliable, udp
    reliable_links: str = "auto"  # reliable links: auto (direct TCP, else libp2p streams), tcp, libp2p
    udp_rate_mbit: float = 0.0  # pace the UDP engine's sends to this rate (Mbit/s); 0 = unpaced

    def __post_init__(self) -> None:
        _check_ip("host", self.host)
        if self.data_path not in DATA_PATHS:
            raise ConfigError(f"data_path: {self.data_path!r} is not one of {', '.join(DATA_PATHS)}")
        if self.reliable_links not in RELIABLE_LINK_MODES:
            raise ConfigError(f"reliable_links: {self.reliable_links!r} is not one of {', '.join(RELIABLE_LINK_MODES)}")
        _check_port("port", self.port)
        for maddr in self.announce:
            _check_maddr("announce", maddr, "/ip4/203.0.113.7/tcp/31337")
        for maddr in self.initial_peers:
            protocols = _check_maddr("initial_peers", maddr, "/ip4/198.51.100.2/tcp/31337/p2p/Qm...")
            if protocols[-1:] != ["p2p"]:
                raise ConfigError(
                    f"initial_peers: {maddr!r} does not end in /p2p/<peer ID> "
                    "(e.g. /ip4/198.51.100.2/tcp/31337/p2p/Qm...; `peerd status` on that peer shows its full addresses)"
                )
        if not 0 <= self.udp_rate_mbit <= 1e6:
            raise ConfigError(f"udp_rate_mbit must be in 0..1000000 (Mbit/s; 0 = unpaced), got {self.udp_rate_mbit}")
        _check_positive("startup_timeout", self.startup_timeout)
        _check_positive("dht_timeout", self.dht_timeout)


@dataclass(kw_only=True, slots=True)
class DiscoveryConfig:
    heartbeat_interval: float = 2.0  # how often this daemon re-announces itself in each run
    refresh_interval: float = 1.0  # how often it re-reads each run's peer records
    peer_ttl: float = 10.0  # a peer whose heartbeat stops is dropped after this long
    goodbye_timeout: float = 2.0  # telling peers we left, all at once, when leaving a run

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "refresh_interval", "peer_ttl", "goodbye_timeout"):
            _check_positive(name, getattr(self, name))
        if self.peer_ttl > MAX_PEER_TTL:
            raise ConfigError(
                f"peer_ttl ({self.peer_ttl}) must be at most {MAX_PEER_TTL} s: DHT nodes refuse longer-lived records"
            )
        if self.peer_ttl < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"peer_ttl ({self.peer_ttl}) must be at least twice heartbeat_interval ({self.heartbeat_interval}), "
                "or one late heartbeat would drop a live peer"
            )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    task: str = ""  # task of the runs created at start (a new run needs one; an existing run names its own)
    set: list[str] = field(default_factory=list)  # "key=value" for a new run; "averaging.KEY=value" sets averaging
    torch_threads: int = 1  # torch intra-op threads of the trainer; several daemons on one machine want 1 each
    checkpoint_every: int = 100  # optimizer steps between two checkpoints in the data dir
    eval_every: int = 50  # optimizer steps between two evaluations (peerd_eval_score)
    max_steps: int = 0  # stop training a run after this many local steps; 0 = never (demos, tests)
    min_peers: int = 1  # wait until this many peers train the run (this daemon included) before the first step
    min_peers_timeout: float = 60.0  # ... but at most this many seconds; then train with whoever is there
    # Operator label: daemons with the same one average gradients every step with DeAR (docs/dear.md); "" = none.
    # "auto" is reserved: a group with the peers labelled auto whose measured links pass the thresholds.
    local_group: str = ""
    # This machine's address on its local group's fast links (the group's store and Gloo connections bind
    # there; daemon/groupspan.py); "" = the daemon's advertised host.
    local_group_host: str = ""
    # Training processes per --task run, children of the daemon (python -m peerd.daemon.taskproc, supervised,
    # attached like a script; docs/your-loop.md): together the daemon's local group, one WAN peer.
    train_processes: int = 1
    # A local group of --task children averages its gradients under DeAR (docs/dear.md), overlapped with
    # backward and the next forward, instead of one Gloo all-reduce after backward. Off by default:
    # measured on charlm's two processes sharing a machine's cores, DeAR hid 96-97 % of the communication
    # but took 7-14 % more CPU per sample (docs/benchmarks.md, "DeAR in a task's group of processes").
    dear: bool = False

    def __post_init__(self) -> None:
        for item in self.set:
            if "=" not in item or not item.split("=", 1)[0]:
                raise ConfigError(f"set: {item!r} is not KEY=VALUE")
        if not 1 <= self.torch_threads <= 256:
            raise ConfigError(f"torch_threads must be in 1..256, got {self.torch_threads}")
        if not 1 <= self.train_processes <= MAX_TRAIN_PROCESSES:
            raise ConfigError(f"train_processes must be in 1..{MAX_TRAIN_PROCESSES}, got {self.train_processes}")
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_steps < 0:
            raise ConfigError("max_steps must be >= 0")
        if self.min_peers < 1:
            raise ConfigError("min_peers must be at least 1")
        if not self.min_peers_timeout > 0:
            raise ConfigError("min_peers_timeout must be greater than 0")
        if self.local_group:
            try:
                validate_run_id(self.local_group)
            except InvalidRunId as e:
                raise ConfigError(f"local_group: {e}") from None
        if self.local_group_host:
            try:
                ipaddress.ip_address(self.local_group_host)
            except ValueError:
                raise ConfigError(f"local_group_host must be an IP address, not {self.local_group_host!r}") from None

    def set_dict(self) -> dict[str, str]:
        """`set` as a mapping: hyper-parameters and averaging.* settings of the runs created at start."""
        return dict(item.split("=", 1) for item in self.set)


@dataclass(kw_only=True, slots=True)
class DaemonConfig:
    data_dir: Path = field(default_factory=default_data_dir)  # identity key, control socket, ready.json, lock
    run: list[str] = field(default_factory=list)  # runs to join at start
    # Most runs held at once: each costs heartbeats, DHT reads and memory; a join beyond it is refused.
    max_runs: int = 16
    run_secret_file: str = ""  # secret for the runs joined at start; empty = open runs
    log_level: str = "INFO"
    drain_timeout: float = 10.0  # SIGTERM to exit: leave runs, stop servers, stop p2pd
    progress_interval: float = 30.0  # seconds between two progress lines per training run in the log; 0 = none
    control: str = ""  # control API's gRPC address: "unix:/path" or "HOST:PORT"; empty = unix socket in the data dir
    control_max_request_bytes: int = 64 * 1024  # larger control requests are refused (RESOURCE_EXHAUSTED)
    metrics_host: str = "0.0.0.0"  # where /metrics listens; Prometheus usually scrapes from another machine
    metrics_port: int = 9400  # 0 lets the OS choose; the chosen URL is in ready.json
    network: NetworkConfig = field(default_factory=NetworkConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().absolute()
        for run_id in self.run:
            try:
                validate_run_id(run_id)
            except InvalidRunId as e:
                raise ConfigError(f"run: {e}") from None
        if not 1 <= self.max_runs <= MAX_RUNS_LIMIT:
            raise ConfigError(f"max_runs must be in 1..{MAX_RUNS_LIMIT}, got {self.max_runs}")
        if len(set(self.run)) > self.max_runs:
            raise ConfigError(f"run: {len(set(self.run))} runs to join at start, more than max_runs ({self.max_runs})")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: {self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")
        self.log_level = self.log_level.upper()
        _check_positive("drain_timeout", self.drain_timeout)
        if not 0 <= self.progress_interval < math.inf:
            raise ConfigError(f"progress_interval: must be 0 (none) or more seconds, got {self.progress_interval}")
        _check_control_address(self.control)
        if not 1024 <= self.control_max_request_bytes <= 1024 * 1024:
            raise ConfigError(
                "control_max_request_bytes must be in 1024..1048576 (gRPC's hard limit), "
                f"got {self.control_max_request_bytes}"
            )
        _check_ip("metrics_host", self.metrics_host)
        _check_port("metrics_port", self.metrics_port)
        socket_path = self.control_address.removeprefix("unix:")
        if socket_path != self.control_address and len(os.fsencode(socket_path)) > UNIX_PATH_MAX:
            raise ConfigError(
                f"control: the socket path {socket_path!r} is longer than the {UNIX_PATH_MAX} bytes a "
                "unix socket allows; pass a shorter --control unix:PATH (or a shorter --data-dir)"
            )
        if self.network.dht_timeout > self.discovery.peer_ttl / 2:
            # Seen in the lab: one frozen DHT node held every refresh past the TTL, and live peers
            # dropped each other, not only the frozen one (docs/lab.md).
            raise ConfigError(
                f"dht_timeout ({self.network.dht_timeout} s) must be at most half of peer_ttl "
                f"({self.discovery.peer_ttl} s), or one unresponsive DHT node makes live peers drop each other"
            )

    @property
    def peer_leave_bound(self) -> float:
        """Seconds within which a peer that stops heartbeating (killed, frozen) leaves this daemon's
        tables: its last record ages out after peer_ttl, the next refresh starts within
        refresh_interval and its DHT read ends within one request timeout. 15 s by default."""
        return self.discovery.peer_ttl + self.discovery.refresh_interval + self.network.dht_timeout

    @property
    def control_address(self) -> str:
        return self.control or f"unix:{self.data_dir / 'control.sock'}"


@dataclass(frozen=True, slots=True)
class Option:
    path: str  # place in the tree, e.g. "network.host"; its leaf names the flag and the variable
    help: str
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.path.rpartition(".")[2].replace("_", "-")

    @property
    def env(self) -> str:
        return env_of(self.flag)


def env_of(flag: str) -> str:
    """A flag's variable: "--data-path" -> "PEERD_DATA_PATH"."""
    return "PEERD_" + flag.lstrip("-").replace("-", "_").upper()


OPTIONS: tuple[Option, ...] = (
    Option("data_dir", "directory for the identity key, control socket, ready.json and lock", "DIR"),
    Option("run", "join this run at start (repeatable)", "RUN_ID"),
    Option("max_runs", "most runs the daemon holds at once; a join beyond it is refused", "N"),
    Option("run_secret_file", "file holding the secret of the runs joined at start; none: open runs", "FILE"),
    Option("log_level", "DEBUG, INFO, WARNING or ERROR", "LEVEL"),
    Option("drain_timeout", "seconds allowed for a clean exit after SIGTERM", "SECONDS"),
    Option("progress_interval", "seconds between progress lines per run (0: none)", "SECONDS"),
    Option("control", "control API address: unix:/path or HOST:PORT; none: the unix socket in the data dir", "ADDR"),
    Option("control_max_request_bytes", "larger control requests are refused", "BYTES"),
    Option("metrics_host", "address /metrics listens on", "ADDR"),
    Option("metrics_port", "port of /metrics (0: any free port)", "PORT"),
    Option("network.host", "libp2p listen address", "ADDR"),
    Option("network.port", "libp2p listen port (0: any free port)", "PORT"),
    Option("network.announce", "public multiaddr to announce (repeatable)", "MADDR"),
    Option("network.initial_peers", "multiaddrs of peers to bootstrap from", "MADDR"),
    Option("network.nat_port_map", "UPnP/NAT-PMP port mapping (multicasts on the LAN, so opt-in)"),
    Option("network.auto_nat", "libp2p AutoNAT (asks peers to dial back, so opt-in)"),
    Option("network.startup_timeout", "seconds to start p2pd and reach the initial peers", "SECONDS"),
    Option("network.dht_timeout", "seconds for one DHT request", "SECONDS"),
    Option(
        "network.data_path",
        "data of runs with the loss-tolerant engine (averaging.engine=loss-tolerant), per link: auto (UDP "
        "where the link probe passes, else the reliable link), reliable, or udp",
        "MODE",
    ),
    Option(
        "network.reliable_links",
        "reliable averaging links: auto (direct TCP, else libp2p streams), tcp or libp2p",
        "MODE",
    ),
    Option(
        "network.udp_rate_mbit",
        "pace UDP averaging sends to this many Mbit/s (runs with averaging.engine=loss-tolerant; 0: unpaced)",
        "MBIT",
    ),
    Option("discovery.heartbeat_interval", "seconds between announcements in each run", "SECONDS"),
    Option("discovery.refresh_interval", "seconds between reads of each run's peers", "SECONDS"),
    Option(
        "discovery.peer_ttl",
        "seconds of silence after which a peer is dropped; a killed peer leaves the tables within --peer-ttl + --refresh-interval + --dht-timeout",
        "SECONDS",
    ),
    Option("discovery.goodbye_timeout", "seconds allowed for telling a run's peers we leave", "SECONDS"),
    Option("train.task", "task of a run created at start (e.g. digits-mlp, charlm)", "NAME"),
    Option(
        "train.set",
        "hyper-parameter of a run created at start, KEY=VALUE, or averaging.SETTING=VALUE (repeatable; "
        "averaging.average_every=auto fits H to the link: docs/algorithms.md)",
        "KEY=VALUE",
    ),
    Option("train.torch_threads", "torch threads of the trainer", "N"),
    Option("train.checkpoint_every", "steps between checkpoints", "STEPS"),
    Option("train.eval_every", "steps between evaluations", "STEPS"),
    Option("train.max_steps", "stop training after this many local steps (0: never)", "STEPS"),
    Option("train.min_peers", "peers training the run (this daemon included) to wait for before the first step", "N"),
    Option("train.min_peers_timeout", "longest wait for --min-peers", "SECONDS"),
    Option(
        "train.local_group",
        "label shared by daemons on fast links: their training processes are one local group, one WAN peer, "
        "averaging gradients every step (the first daemon leads the group's rounds, the others follow; with "
        "averaging.lanes >= 2 each averages its share; its store and Gloo links are not authenticated: "
        "trusted links only, docs/your-loop.md); "
        "'auto': group with the peers labelled auto "
        "whose measured links pass the thresholds (RTT <= 2 ms, >= 1 Gb/s, loss <= 0.1 %)",
        "NAME",
    ),
    Option(
        "train.local_group_host",
        "this machine's address on its --local-group's fast links (default: the address peers dial)",
        "IP",
    ),
    Option(
        "train.train_processes",
        "training processes per --task run, children the daemon supervises (each restarted at most 3 times in "
        "a row), each with its own data: this daemon's local group, one peer of the run, averaging their "
        "gradients every step (docs/your-loop.md); costs a Python process each, a gradient all-reduce over "
        "loopback per step (with more than one) and a shared-memory hand-over of the parameters per round",
        "N",
    ),
    Option(
        "train.dear",
        "a local group of --task training processes averages its gradients under DeAR, overlapped with "
        "backward and the next forward (docs/dear.md), instead of one all-reduce after backward "
        "(measured on charlm's two processes on one machine's shared cores: more CPU per sample, so off)",
    ),
)

# Settings renamed after peerd 0.1.0 (one name per concept; a flag is its leaf in the tree). The old
# flag, variable or TOML key stops `peerd start` with one line naming the new one, rather than being
# ignored or quietly meaning something else.
RENAMED: dict[str, str] = {  # old path in the tree: new path
    "runs": "run",
    "control.address": "control",
    "control.max_request_bytes": "control_max_request_bytes",
    "metrics.host": "metrics_host",
    "metrics.port": "metrics_port",
    "network.transport": "network.data_path",
    "train.hparams": "train.set",
    "train.threads": "train.torch_threads",
}
RENAMED_FLAGS: dict[str, str] = {"--transport": "--data-path", "--udp-rate": "--udp-rate-mbit"}
RENAMED_ENV: dict[str, str] = {env_of(old): env_of(new) for old, new in RENAMED_FLAGS.items()}
# Settings removed: the flag (and its --no- form), variable or TOML key stops `peerd start` with why.
REMOVED: dict[str, str] = {
    "train.train_process": "removed: every --task run trains in child processes (--train-processes)",
}
REMOVED_FLAGS: dict[str, str] = {
    flag: why for path, why in REMOVED.items() for flag in (Option(path, "").flag, "--no-" + Option(path, "").flag[2:])
}


def toml_key(path: str) -> str:
    """A setting as it is written in the TOML file: "network.port" -> "[network] port"."""
    section, _, leaf = path.rpartition(".")
    return f"[{section}] {leaf}" if section else leaf


_SECTIONS = {"network": NetworkConfig, "discovery": DiscoveryConfig, "train": TrainConfig}
# Every settable leaf of the tree ("network.host", "data_dir", ...) and its declared type.
_LEAF_TYPES: dict[str, Any] = {
    **{k: v for k, v in typing.get_type_hints(DaemonConfig).items() if k not in _SECTIONS},
    **{f"{s}.{k}": v for s, cls in _SECTIONS.items() for k, v in typing.get_type_hints(cls).items()},
}
_OPTION = {o.path: o for o in OPTIONS}


def default_of(path: str) -> Any:
    """The tree's default for one setting, e.g. "network.port" -> 31337 (for --help)."""
    section, _, leaf = path.rpartition(".")
    f = next(f for f in dataclasses.fields(_SECTIONS[section] if section else DaemonConfig) if f.name == leaf)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _coerce(path: str, value: Any, where: str) -> Any:
    """`value` as the type the tree declares for `path` (daemon/typed.py); `where` names the setting
    as the user typed it (a flag, a variable, a key of the file)."""
    try:
        return coerce(value, _LEAF_TYPES[path], text=True)
    except Mismatch as e:
        raise ConfigError(f"{where}: {e}") from None


def _flatten_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS and not isinstance(value, dict):
            raise ConfigError(f"config file {path}: [{key}] must be a table")
        if isinstance(value, dict):  # a section (or a table that used to be one: [control], [metrics])
            for sub, subvalue in value.items():
                flat[f"{key}.{sub}"] = subvalue
        else:
            flat[key] = value
    for old in sorted(set(flat) & set(RENAMED)):
        raise ConfigError(f"config file {path}: {toml_key(old)} is now {toml_key(RENAMED[old])} (renamed)")
    for old in sorted(set(flat) & set(REMOVED)):
        raise ConfigError(f"config file {path}: {toml_key(old)} is {REMOVED[old]}")
    unknown = sorted(set(flat) - set(_LEAF_TYPES))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return {k: _coerce(k, v, f"config file {path}: {toml_key(k)}") for k, v in flat.items()}


def load_config(
    cli: Mapping[str, Any], *, config_file: str | None = None, environ: Mapping[str, str] | None = None
) -> DaemonConfig:
    """Build the tree from the four sources. `cli` maps option paths to values the user typed."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = config_file or environ.get("PEERD_CONFIG")
    if config_file:
        values.update(_flatten_file(Path(config_file)))
    for old, new in RENAMED_ENV.items():
        if old in environ:
            raise ConfigError(f"{old} is now {new} (renamed)")
    for old, why in REMOVED.items():
        if (env := Option(old, "").env) in environ:
            raise ConfigError(f"{env} is {why}")
    for option in OPTIONS:
        if option.env in environ:
            values[option.path] = _coerce(option.path, environ[option.env], option.env)
    for path, value in cli.items():
        values[path] = _coerce(path, value, _OPTION[path].flag if path in _OPTION else path)
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    top: dict[str, Any] = {}
    for path, value in values.items():
        if "." in path:
            section, leaf = path.split(".", 1)
            sections[section][leaf] = value
        else:
            top[path] = value
    try:
        built = {name: _SECTIONS[name](**kwargs) for name, kwargs in sections.items()}
        return DaemonConfig(**top, **built)
    except TypeError as e:  # a key the tree does not have; the file check catches most of these first
        raise ConfigError(str(e)) from None


def client_defaults(environ: Mapping[str, str] | None = None) -> tuple[Path, str | None]:
    """The data dir and control address the client commands (status, join, ...) use when not given:
    the variables of `peerd start`'s --data-dir and --control, so both find the same daemon."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("PEERD_DATA_DIR") or default_data_dir()), environ.get("PEERD_CONTROL") or None


def _check_control_address(address: str) -> None:
    """Empty (the data dir's socket), unix:PATH or HOST:PORT. Only the form: whether the address
    can be bound is known when the control server binds it."""
    if address.startswith("unix:"):
        ok = len(address) > len("unix:")
    else:
        host, _, port = address.rpartition(":")
        ok = bool(host) and port.isdigit() and int(port) <= 65535
    if address and not ok:
        raise ConfigError(f"control: {address!r} is neither unix:PATH nor HOST:PORT")


def _check_maddr(name: str, value: str, example: str) -> list[str]:
    """The protocol names of multiaddr `value`, e.g. ["ip4", "tcp", "p2p"]; ConfigError if it does not
    parse. hivemind parses it the same way once p2pd starts, and failed there with errors of its own."""
    from hivemind.utils.multiaddr import Multiaddr  # light: peers/ keeps hivemind's package imports lazy

    try:
        return [p.name for p in Multiaddr(value).protocols()]
    except ValueError as e:  # hivemind's ParseError; the reason after the address says what is wrong
        reason = str(e).rsplit(": ", 1)[-1]
        raise ConfigError(f"{name}: {value!r} is not a multiaddr ({reason}; e.g. {example})") from None


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: must be greater than 0, got {value}")


def _check_port(name: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{name}: {value} is not a TCP port (0-65535)")


def _check_ip(name: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{name}: {value!r} is not an IP address") from None
