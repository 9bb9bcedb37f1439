"""The lab's network: hosts as Linux network namespaces on one bridge, and how their links are shaped.

Everything a lab creates is named after its id (`pdlab-<id>`), so that tearing a lab down, after a
clean exit, a crash half-way through a build, or a SIGKILL of the lab process, is one function that
finds its pieces by name: `destroy(lab_id)`. That name is the cleanup registry; nothing else needs
to be remembered. Per lab:

    bridge pdlab-<id>             10.77.K.1/24, so the root namespace can reach every host's /metrics;
                                  its alias holds the lab process's pid and start time, and the work dir
    $TMPDIR/pdlab-<id>/           work dir: the hosts' data dirs and logs
    netns  pdlab-<id>-<host>      one per host: lo, and eth0 at 10.77.K.(i+2)/24
    veth   pdlab-<id>-<i>         the bridge end of host i's link (the other end is eth0 in its netns)
    bridge pdlab-<id>s<j>         site j's fast link (a host of a site only): unshaped, no rules, no
                                  delay line; eth1 of each of its hosts at 10.(78+j).K.(i+2)/24
    veth   pdlab-<id>-<i>s        the bridge end of host i's site link
    nft    table bridge pdlab-<id>  one `forward` chain: partitions and packet loss, per named counter

Shaping (see docs/lab.md): a host's `rate_mbit` is a tbf qdisc on both ends of its veth, so uplink
and downlink are limited apart; its `loss_pct` drops that share of the packets *delivered to* it,
in the bridge's forward hook, i.e. after they left the sender: the sender's TCP sees a loss on the
wire, not a local error. GSO is capped at one MTU on every eth0, so a drop is one packet, never a
64 KiB super-packet. Added latency: this kernel has no netem, so a host whose `rtt_ms` is > 0 gets a
userspace delay line (daemon/lab/delayline.py) in its namespace: a TUN device `dl0` that the lab
subnet is routed through, whose reader holds every packet for rtt_ms / 2, then sends it out of eth0
(a raw socket whose mark an `ip rule` routes by the main table). It is a process in the namespace,
so the per-namespace kill of `destroy()` removes it, and the TUN device, routes and rules go with it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from peerd.daemon import SOURCE_ROOT

PREFIX = "pdlab-"
LAB_ID = re.compile(r"pdlab-([0-9a-f]{4})(?![0-9a-f])")
CMD_TIMEOUT = 20.0  # seconds for one ip/tc/nft/sysctl command
KILL_TIMEOUT = 10.0  # seconds for SIGKILLed processes of a namespace to be gone
TBF_LATENCY_MS = 20  # queue of each tbf: a packet waits at most this long, then is dropped
LOSS_SCALE = 10000  # numgen range: loss_pct has a resolution of 0.01 %
PROTOCOLS = ("all", "tcp", "udp")
OWNER_TAG = "peerd-lab-owner"
DELAY_DEV = "dl0"  # the delay line's TUN device in a host's namespace
DELAY_TABLE = 77  # routing table of a delayed host: the lab subnet through DELAY_DEV
DELAY_READY_TIMEOUT = 10.0  # seconds for a delay line to open its TUN device
RTT_PORT = 9  # closed on every host: a connect() to it is answered by an RST, one round trip


class LabError(RuntimeError):
    """A network command failed; the message names the command and what it printed."""


def sh(*args: str, input: str | None = None, check: bool = True) -> str:
    """Run one command; its stdout. With check=False a failure returns "" (e.g. deleting what is gone)."""
    r = subprocess.run(args, input=input, capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if r.returncode != 0:
        if check:
            raise LabError(f"`{' '.join(args)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
        return ""
    return r.stdout


def environment_problem() -> str | None:
    """None when this process can build a lab, else one line saying why not."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "peerd lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "peerd lab needs root (it creates network namespaces, links and nftables tables)"
    missing = [tool for tool in ("ip", "tc", "nft", "sysctl") if shutil.which(tool) is None]
    if missing:
        return f"peerd lab needs {', '.join(missing)} (Debian: iproute2, nftables, procps)"
    probe = f"{PREFIX}{secrets.token_hex(2)}-probe"
    try:
        sh("ip", "netns", "add", probe)
    except (LabError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace here: {e}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True, slots=True)
class LinkShape:
    """One host's link. rate_mbit 0 = unlimited; loss applies to packets delivered to the host."""

    rate_mbit: float = 0.0
    loss_pct: float = 0.0
    loss_protocol: str = "all"  # all, tcp or udp
    loss_ports: tuple[int, ...] = ()  # only packets from or to these ports (tcp and udp); () = every packet
    rtt_ms: float = 0.0  # > 0: a delay line holds every packet the host sends to another host for rtt_ms / 2


@dataclass(slots=True)
class Host:
    name: str
    index: int
    netns: str
    ip: str
    port: str  # the bridge end of its veth
    shape: LinkShape = field(default_factory=LinkShape)

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it in the host's namespace (`ip netns exec` execs, no fork)."""
        return ["ip", "netns", "exec", self.netns]


def render_rules(table: str, hosts: list[Host], side: dict[str, int]) -> str:
    """The nft script that replaces the forward chain in one transaction: cuts between hosts on
    different sides, then each host's random loss. Pure; `side` maps host name to a side number
    (hosts absent from it are on side 0)."""
    lines = [f"flush chain bridge {table} forward"]
    sides: dict[int, list[str]] = {}
    for h in hosts:
        sides.setdefault(side.get(h.name, 0), []).append(h.port)
    if len(sides) > 1:
        for h in hosts:
            same = ", ".join(f'"{p}"' for p in sides[side.get(h.name, 0)])
            lines.append(
                f'add rule bridge {table} forward oifname "{h.port}" iifname != {{ {same} }} counter name "cut-{h.name}" drop'
            )
    for h in hosts:
        s = h.shape
        if s.loss_pct <= 0:
            continue
        drop = (
            f'numgen random mod {LOSS_SCALE} < {round(s.loss_pct * LOSS_SCALE / 100)} counter name "loss-{h.name}" drop'
        )
        match = f'add rule bridge {table} forward oifname "{h.port}"'
        proto = {"all": "{ tcp, udp }"}.get(s.loss_protocol, s.loss_protocol)
        if s.loss_ports:
            ports = ", ".join(str(p) for p in s.loss_ports)
            lines.append(f"{match} meta l4proto {proto} th dport {{ {ports} }} {drop}")
            # The other direction of the same flows; a packet between two listed ports is drawn once.
            lines.append(f"{match} meta l4proto {proto} th sport {{ {ports} }} th dport != {{ {ports} }} {drop}")
        elif s.loss_protocol != "all":
            lines.append(f"{match} meta l4proto {proto} {drop}")
        else:
            lines.append(f"{match} {drop}")
    return "\n".join(lines) + "\n"


def _tbf(rate_mbit: float) -> list[str]:
    rate = rate_mbit * 1e6
    burst = max(int(rate / 8 * 0.004), 16 * 1024)  # 4 ms of traffic, at least 16 KiB: several MTUs
    return ["tbf", "rate", f"{rate:.0f}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


class Network:
    """One lab's bridge, hosts and rules. Build with `create()` then `add_host()`; `destroy()` always."""

    def __init__(self, lab_id: str | None = None):
        self.id = lab_id or secrets.token_hex(2)
        self.name = f"{PREFIX}{self.id}"
        self.dir = Path(tempfile.gettempdir()) / self.name
        self.hosts: dict[str, Host] = {}
        self.side: dict[str, int] = {}
        self.subnet_k: int | None = None
        self.delay_lines: dict[str, subprocess.Popen] = {}  # host name: its delay line (rtt_ms > 0 once)

    @property
    def bridge_ip(self) -> str:
        return f"10.77.{self.subnet_k}.1"

    def create(self) -> "Network":
        """The bridge first: its alias names the lab's owner and work dir (`peerd lab clean` reads it)."""
        # Two labs never pick the same free subnet: of one process (bench.churn's), or of two (a
        # benchmark beside the tests).
        with _SUBNETS, open(Path(tempfile.gettempdir()) / "peerd-lab-subnets.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet_k = _free_subnet()
            sh("ip", "link", "add", self.name, "type", "bridge")
            sh("ip", "link", "set", self.name, "alias", f"{OWNER_TAG} {_owner(os.getpid())} {self.dir}")
            self.dir.mkdir(mode=0o700)
            sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.name)
        sh("ip", "link", "set", self.name, "up")
        script = f"add table bridge {self.name}\nadd chain bridge {self.name} forward {{ type filter hook forward priority 0; policy accept; }}\n"
        sh("nft", "-f", "-", input=script)
        return self

    def add_site_link(self, name: str, site: int) -> str:
        """A second link for host `name` (added already) on site `site`'s bridge: unshaped, apart
        from the lab's link (a rack's fast network beside the WAN). Returns the host's address there."""
        h, bridge = self.hosts[name], f"{self.name}s{site}"
        if not Path(f"/sys/class/net/{bridge}").exists():
            sh("ip", "link", "add", bridge, "type", "bridge")
            sh("ip", "link", "set", bridge, "up")
        port, inner = f"{h.port}s", f"{h.port}t"
        sh("ip", "link", "add", port, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", h.netns)
        sh("ip", "link", "set", port, "master", bridge, "up")
        ns, ip = ["ip", "-n", h.netns], f"10.{78 + site}.{self.subnet_k}.{h.index + 2}"
        sh(*ns, "link", "set", inner, "name", "eth1")
        sh(*ns, "addr", "add", f"{ip}/24", "dev", "eth1")
        sh(*ns, "link", "set", "eth1", "up")
        return ip

    def add_host(self, name: str, shape: LinkShape = LinkShape(), congestion_control: str | None = None) -> Host:
        i = len(self.hosts)
        h = Host(name, i, f"{self.name}-{name}", f"10.77.{self.subnet_k}.{i + 2}", f"{self.name}-{i}", shape)
        inner = f"{self.name}-{i}h"  # renamed eth0 once inside
        sh("ip", "netns", "add", h.netns)
        sh("ip", "link", "add", h.port, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", h.netns)
        sh("ip", "link", "set", h.port, "master", self.name, "up")
        ns = ["ip", "-n", h.netns]
        sh(*ns, "link", "set", "lo", "up")
        sh(*ns, "link", "set", inner, "name", "eth0", "gso_max_size", "1500")
        sh(*ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        sh(*ns, "link", "set", "eth0", "up")
        sh("nft", "add", "counter", "bridge", self.name, f"loss-{name}")
        sh("nft", "add", "counter", "bridge", self.name, f"cut-{name}")
        self.hosts[name] = h
        if congestion_control:
            self.set_congestion_control(h, congestion_control)
        self.shape(name, shape)
        return h

    def set_congestion_control(self, h: Host, algorithm: str) -> str:
        """Set the namespace's TCP congestion control; returns what the kernel then reports."""
        try:
            sh(*h.exec_prefix(), "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={algorithm}")
        except LabError as e:
            available = sh(*h.exec_prefix(), "sysctl", "-n", "net.ipv4.tcp_available_congestion_control").strip()
            raise LabError(
                f"cannot use TCP congestion control {algorithm!r} inside a network namespace "
                f"(available: {available}; a namespace may only pick what the host allows): {e}"
            ) from None
        return self.congestion_control(h)

    def congestion_control(self, h: Host) -> str:
        return sh(*h.exec_prefix(), "sysctl", "-n", "net.ipv4.tcp_congestion_control").strip()

    def shape(self, name: str, shape: LinkShape) -> None:
        h = self.hosts[name]
        h.shape = shape
        for where in (["-n", h.netns, "qdisc"], ["qdisc"]):  # uplink: eth0 in the host; downlink: the bridge end
            dev = "eth0" if len(where) > 1 else h.port
            if shape.rate_mbit > 0:
                sh("tc", *where, "replace", "dev", dev, "root", *_tbf(shape.rate_mbit))
            else:
                sh("tc", *where, "del", "dev", dev, "root", check=False)  # fails when there was none
        self._set_delay(h, shape.rtt_ms)
        self.apply_rules()

    # ---- added latency: the delay line ----------------------------------------------------------------

    def _set_delay(self, h: Host, rtt_ms: float) -> None:
        """One-way delay rtt_ms / 2 on everything h sends to the other hosts. The first rtt_ms > 0 starts
        the host's delay line; later changes (0 included) go to it through its control file and SIGHUP,
        so a host keeps its delay line, at 0 ms, once it had one."""
        line = self.delay_lines.get(h.name)
        if line is None and rtt_ms <= 0:
            return
        conf = self.dir / "delay" / f"{h.name}.conf"
        conf.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = conf.with_suffix(".tmp")
        tmp.write_text(f"{rtt_ms / 2}\n")
        os.replace(tmp, conf)
        if line is None:
            self._start_delay_line(h, conf)
        elif line.poll() is None:
            line.send_signal(signal.SIGHUP)
            _wait_for_file(
                self.delay_stats_path(h.name),
                lambda d: d.get("one_way_ms") == rtt_ms / 2,
                DELAY_READY_TIMEOUT,
                f"the delay line of {h.name} to take {rtt_ms / 2} ms",
            )
        else:
            raise LabError(
                f"the delay line of host {h.name} exited ({line.returncode}); see {self.dir / 'delay' / (h.name + '.log')}"
            )

    def delay_stats_path(self, name: str) -> Path:
        return self.dir / "delay" / f"{name}.json"

    def _start_delay_line(self, h: Host, conf: Path) -> None:
        if not Path("/dev/net/tun").exists():
            raise LabError(f"host {h.name}: rtt_ms needs a TUN device, and /dev/net/tun is missing (modprobe tun)")
        stats = self.delay_stats_path(h.name)
        stats.unlink(missing_ok=True)
        with open(self.dir / "delay" / f"{h.name}.log", "ab") as log:
            cmd = [
                *h.exec_prefix(),
                sys.executable,
                "-m",
                "peerd.daemon.lab.delayline",
                "--dev",
                DELAY_DEV,
                "--conf",
                str(conf),
                "--stats",
                str(stats),
            ]
            # Own session: a Ctrl-C of the lab does not reach it; destroy() kills it with the namespace.
            self.delay_lines[h.name] = proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=SOURCE_ROOT,
            )
        try:
            _wait_for_file(
                stats, lambda d: True, DELAY_READY_TIMEOUT, f"the delay line of {h.name} to open {DELAY_DEV}", proc
            )
        except LabError as e:
            raise LabError(f"{e}; log: {(self.dir / 'delay' / (h.name + '.log')).read_text()[-2000:]}") from None
        ns = ["ip", "-n", h.netns]
        subnet = f"10.77.{self.subnet_k}.0/24"
        mtu = json.loads(sh(*ns, "-j", "link", "show", "eth0"))[0]["mtu"]
        for key in (
            "all",
            "default",
            "eth0",
        ):  # replies arrive on eth0 from hosts routed via dl0: no reverse-path check
            sh(*h.exec_prefix(), "sysctl", "-q", "-w", f"net.ipv4.conf.{key}.rp_filter=0")
        sh(*h.exec_prefix(), "sysctl", "-q", "-w", f"net.ipv6.conf.{DELAY_DEV}.disable_ipv6=1")
        sh(*ns, "link", "set", DELAY_DEV, "mtu", str(mtu), "txqueuelen", "10000", "up")  # 500 overflowed under load
        sh(*ns, "route", "add", subnet, "dev", DELAY_DEV, "src", h.ip, "table", str(DELAY_TABLE))
        sh(
            *ns, "route", "add", "throw", f"{self.bridge_ip}/32", "table", str(DELAY_TABLE)
        )  # the lab's own polling: direct
        sh(*ns, "rule", "add", "pref", "100", "fwmark", hex(_delay_mark()), "lookup", "main")
        sh(*ns, "rule", "add", "pref", "110", "to", subnet, "lookup", str(DELAY_TABLE))

    def delay_stats(self) -> dict[str, dict]:
        """Each delay line's counters (daemon/lab/delayline.py), by host; hosts without one are absent."""
        out = {}
        for name in self.delay_lines:
            try:
                out[name] = json.loads(self.delay_stats_path(name).read_text())
                link = json.loads(sh("ip", "-n", self.hosts[name].netns, "-j", "-s", "link", "show", DELAY_DEV))[0][
                    "stats64"
                ]
                out[name]["tun_dropped"] = link["tx"]["dropped"]  # the TUN's queue was full: the delay line fell behind
            except (OSError, ValueError, LabError, KeyError, IndexError):
                pass
        return out

    def measure_rtt(
        self, pairs: list[tuple[str, str]], probes: int = 10, timeout: float = 2.0
    ) -> dict[tuple[str, str], dict]:
        """Round-trip times from host a to host b, for each (a, b), measured in parallel: `probes` TCP
        connects from a to a closed port of b (SYN out, RST back: one round trip, no server needed),
        after one unmeasured connect, at nice -10 as the delay lines run (a probe woken late by a busy
        CPU read a 50 ms path as 63 ms). {(a, b): {"median_ms", "min_ms", "max_ms", "probes"}}; a
        probe lost on a lossy link is left out, and "median_ms" is None when every one was."""
        # A lost SYN or RST is retransmitted after TCP's 1 s initial RTO: below 0.5 s of expected RTT,
        # a probe gives up before that, so a loss is left out rather than measured as 1 s more.
        expected = {(a, b): (self.hosts[a].shape.rtt_ms + self.hosts[b].shape.rtt_ms) / 2000 for a, b in pairs}
        waits = {pair: 0.95 if rtt < 0.5 else max(timeout, 3 * rtt + 1) for pair, rtt in expected.items()}
        procs = {
            (a, b): subprocess.Popen(
                [
                    *self.hosts[a].exec_prefix(),
                    sys.executable,
                    "-c",
                    _RTT_PROBE,
                    self.hosts[b].ip,
                    str(probes),
                    str(waits[a, b]),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for a, b in pairs
        }
        out = {}
        for pair, p in procs.items():
            try:
                stdout, stderr = p.communicate(timeout=(probes + 1) * waits[pair] + 20)
                times = json.loads(stdout)
            except (subprocess.TimeoutExpired, ValueError):
                p.kill()
                p.wait()
                times = []
            out[pair] = {
                "median_ms": round(statistics.median(times), 2) if times else None,
                "min_ms": round(min(times), 2) if times else None,
                "max_ms": round(max(times), 2) if times else None,
                "probes": len(times),
            }
        return out

    def partition(self, sides: list[set[str]]) -> None:
        """Cut every host of one set from every host outside it; hosts in no set form one more side."""
        self.side = {name: k + 1 for k, names in enumerate(sides) for name in names}
        self.apply_rules()

    def heal(self) -> None:
        self.side = {}
        self.apply_rules()

    def apply_rules(self) -> None:
        sh("nft", "-f", "-", input=render_rules(self.name, list(self.hosts.values()), self.side))

    def dropped(self) -> dict[str, dict[str, int]]:
        """Packets dropped so far on the way to each host: {host: {"loss": n, "cut": n}}."""
        out = json.loads(sh("nft", "-j", "list", "counters", "table", "bridge", self.name))
        drops: dict[str, dict[str, int]] = {name: {"loss": 0, "cut": 0} for name in self.hosts}
        for item in out.get("nftables", []):
            c = item.get("counter")
            if c:
                kind, _, host = c["name"].partition("-")
                if host in drops:
                    drops[host][kind] = c["packets"]
        return drops

    def link_stats(self, name: str) -> dict[str, int]:
        """eth0's byte and packet counters, and TCP's retransmitted segments, in the host's namespace."""
        h = self.hosts[name]
        link = json.loads(sh("ip", "-n", h.netns, "-j", "-s", "link", "show", "eth0"))[0]["stats64"]
        snmp = sh(*h.exec_prefix(), "cat", "/proc/net/snmp").splitlines()
        tcp = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
        retrans = int(dict(zip(tcp[0], tcp[1])).get("RetransSegs", 0)) if len(tcp) == 2 else 0
        return {
            "rx_bytes": link["rx"]["bytes"],
            "tx_bytes": link["tx"]["bytes"],
            "rx_packets": link["rx"]["packets"],
            "tx_packets": link["tx"]["packets"],
            "tcp_retransmitted_segments": retrans,
        }

    def destroy(self) -> list[str]:
        removed = destroy(self.id)
        for line in self.delay_lines.values():  # killed with their namespaces: reap them
            try:
                line.wait(KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        return removed


_RTT_PROBE = (
    """
import json, os, socket, sys, time
ip, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:  # as the delay line: what it times is the path, not its wait for a busy CPU after the RST
    os.setpriority(os.PRIO_PROCESS, 0, -10)
except OSError:
    pass
times = []
for i in range(n + 1):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    t0 = time.perf_counter()
    try:
        s.connect((ip, %d))
        ok = True
    except ConnectionRefusedError:
        ok = True
    except OSError:
        ok = False
    dt = (time.perf_counter() - t0) * 1000
    s.close()
    if ok and i:
        times.append(dt)
print(json.dumps(times))
"""
    % RTT_PORT
)


def _delay_mark() -> int:
    from peerd.daemon.lab.delayline import MARK

    return MARK


def _wait_for_file(path: Path, ok, timeout: float, what: str, proc: subprocess.Popen | None = None) -> dict:
    """Wait until `path` holds JSON for which ok() is true; LabError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            data = json.loads(path.read_text())
            if ok(data):
                return data
        except (OSError, ValueError):
            pass
        if proc is not None and proc.poll() is not None:
            raise LabError(f"waiting for {what}: it exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise LabError(f"waiting for {what}: nothing after {timeout:.0f} s")
        time.sleep(0.01)


_SUBNETS = threading.Lock()  # with the file lock, held from choosing a free subnet until the bridge holds it


def _free_subnet() -> int:
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", sh("ip", "-4", "-o", "addr", "show")))
    for k in range(256):
        if str(k) not in used:
            return k
    raise LabError("no free 10.77.K.0/24 subnet left in the root namespace (run `peerd lab clean`)")


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _owner(pid: int) -> str:
    """pid:start time (seconds since the epoch, psutil's): with the pid, names one process for good."""
    try:
        return f"{pid}:{psutil.Process(pid).create_time():.2f}"
    except psutil.NoSuchProcess:
        return f"{pid}:gone"


def _alias(lab_id: str) -> list[str]:
    """[owner, work dir] from the lab's bridge alias, or [] when the bridge is gone or has none."""
    out = sh("ip", "-o", "link", "show", f"{PREFIX}{lab_id}", check=False)
    m = re.search(rf"alias {OWNER_TAG} (\S+) (\S+)", out)
    return [m.group(1), m.group(2)] if m else []


def owner_alive(lab_id: str) -> bool:
    """Whether the process that built this lab still runs (a pid alone could have been reused)."""
    alias = _alias(lab_id)
    return bool(alias) and _owner(int(alias[0].split(":")[0])) == alias[0]


def labs() -> set[str]:
    """Ids of every lab that left something on this machine: namespaces, links, tables, or work dirs
    in this process's temp dir (a lab's work dir elsewhere is found through its bridge's alias)."""
    found = set(LAB_ID.findall(sh("ip", "netns", "list")))
    found |= set(LAB_ID.findall(sh("ip", "-o", "link", "show")))
    found |= set(LAB_ID.findall(sh("nft", "list", "tables")))
    found |= {m.group(1) for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}*") if (m := LAB_ID.fullmatch(p.name))}
    return found


def destroy(lab_id: str) -> list[str]:
    """Remove everything of one lab, whatever state it is in; returns what was removed. Order:
    the processes in its namespaces (SIGKILL, waited for), the bridge ends of its veths (which takes
    the other ends with them at once; a namespace's own cleanup is asynchronous), the bridge, the
    namespaces, the nftables table, the work dir."""
    name = f"{PREFIX}{lab_id}"
    removed: list[str] = []
    alias = _alias(lab_id)
    work = Path(alias[1]) if alias else Path(tempfile.gettempdir()) / name
    namespaces = [n.split()[0] for n in sh("ip", "netns", "list").splitlines() if n.startswith(f"{name}-")]
    pids = [int(p) for ns in namespaces for p in sh("ip", "netns", "pids", ns, check=False).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # stopped (frozen) processes die too
            removed.append(f"process {pid}")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + KILL_TIMEOUT
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:  # until each is gone or a zombie
        time.sleep(0.05)
    links = re.findall(rf"^\d+: ({re.escape(name)}(?:-\d+s?|s\d+)?)[@:]", sh("ip", "-o", "link", "show"), re.M)
    for link in sorted(links, key=len, reverse=True):  # veths before the bridge
        sh("ip", "link", "del", link, check=False)  # a veth may already be gone with its namespace
        removed.append(f"link {link}")
    for ns in namespaces:
        sh("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")

    def has_table() -> bool:
        return bool(re.search(rf"^table bridge {re.escape(name)}$", sh("nft", "list", "tables"), re.M))

    if has_table():
        # A lab that is tearing itself down (`peerd lab clean` saw its bridge gone) may delete its
        # table between the listing and this delete: only a table still there is an error.
        sh("nft", "delete", "table", "bridge", name, check=False)
        if has_table():
            raise LabError(f"nft table bridge {name} could not be deleted")
        removed.append(f"nft table bridge {name}")
    if work.name == name and work.exists():  # never anything but a lab's own dir
        shutil.rmtree(work, ignore_errors=True)
        removed.append(f"dir {work}")
    return removed


def clean(force: bool = False) -> tuple[list[str], list[str]]:
    """Destroy the leftovers of labs whose process is gone (every lab with force).
    Returns (what was removed, ids of labs skipped because their process still runs)."""
    removed, skipped = [], []
    for lab_id in sorted(labs()):
        if not force and owner_alive(lab_id):
            skipped.append(lab_id)
            continue
        removed += destroy(lab_id)
    return removed, skipped
