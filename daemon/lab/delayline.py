"""A userspace delay line: added latency for one lab host, without netem.

    python -m peerd.daemon.lab.delayline --conf FILE --stats FILE [--dev dl0] [--limit 50000]

Run inside a host's network namespace (netns.Network starts it there, then routes the lab subnet
through it; see docs/lab.md). It opens a TUN device (IFF_TUN | IFF_NO_PI: every read is one IPv4
packet the kernel routed to it), holds each packet for the configured one-way delay, and then sends
it, unchanged, out of the namespace through a raw IPv4 socket (IPPROTO_RAW: the packet carries its own
header) marked with MARK, which an `ip rule` sends by the main table, i.e. out of eth0, so it does
not come back into the TUN.

* Order is kept: a packet leaves at max(arrival + delay, the previous packet's release time), so
  lowering the delay mid-run never reorders what is queued. Times are time.monotonic().
* The queue is bounded (--limit packets); a packet that does not fit is dropped and counted.
* The delay is read from --conf (one number: one-way milliseconds) at start and on SIGHUP.
* --stats is rewritten (atomically) every STATS_INTERVAL and on SIGHUP: packets and bytes carried,
  overflow and send drops, the largest queue, the process's CPU seconds. Its first write means the
  TUN device exists (the lab waits for it before routing through the device).

It runs at nice -10, ahead of the lab's daemons and benchmark processes on a shared machine: the
emulated network should not wait for the CPU that its endpoints are using. One loop, no threads:
select() on the TUN (microsecond timeouts, unlike epoll's milliseconds),
read every packet that is ready (up to BATCH), send every packet that is due. A released packet
leaves within about 0.1 ms of its time on an idle machine; never before it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA  # _IOW('T', 202, int)
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
SO_MARK = 36  # socket.SO_MARK from Python 3.12 only
SO_SNDBUFFORCE = 32
MARK = 0x6C7  # "delayed and released": routed by the main table, never into the TUN again
SNDBUF = 16 << 20  # the raw socket's packets wait in eth0's tbf queue charged to it: room for all of them
STATS_INTERVAL = 1.0
BATCH = 512  # packets read at most before the due ones are sent
MAX_PACKET = 65536
NICE = -10  # scheduling priority (root only): ahead of the daemons and benchmarks sharing the cores


def read_delay(path: str) -> float:
    """One-way delay in seconds from the control file (milliseconds in it)."""
    with open(path) as f:
        ms = float(f.read().strip() or 0)
    if not 0 <= ms <= 10_000:
        raise ValueError(f"one-way delay {ms} ms out of range")
    return ms / 1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    def __init__(self, tun: int, conf: str, stats: str, limit: int):
        self.tun, self.conf, self.stats_path, self.limit = tun, conf, stats, limit
        self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.raw.setsockopt(socket.SOL_SOCKET, SO_MARK, MARK)
        self.raw.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SNDBUF)
        self.raw.setblocking(False)
        self.delay = read_delay(conf)
        self.queue: deque[tuple[float, str, bytes]] = deque()
        self.last = 0.0  # release time of the newest queued packet
        self.counts = {
            "packets": 0,
            "bytes": 0,
            "dropped_overflow": 0,
            "dropped_send": 0,
            "not_ipv4": 0,
            "max_queue": 0,
        }
        self.addresses: dict[bytes, str] = {}

    def reload(self, *_) -> None:
        try:
            self.delay = read_delay(self.conf)
        except (OSError, ValueError) as e:
            print(f"delayline: keeping {self.delay * 1000:g} ms: {e}", file=sys.stderr, flush=True)
        self.write_stats()

    def write_stats(self) -> None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        data = {
            **self.counts,
            "queue": len(self.queue),
            "one_way_ms": self.delay * 1000,
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "pid": os.getpid(),
        }
        tmp = f"{self.stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.stats_path)

    def run(self) -> None:
        q, c, tun, raw = self.queue, self.counts, self.tun, self.raw
        read, now_ = os.read, time.monotonic
        send = raw.sendto
        addresses = self.addresses
        next_stats = now_() + STATS_INTERVAL
        self.write_stats()
        while True:
            now = now_()
            while q and q[0][0] <= now:
                _, dst, pkt = q.popleft()
                try:
                    send(pkt, (dst, 0))
                except OSError:  # ENOBUFS: eth0's tbf queue is full (a drop at the bottleneck); EAGAIN
                    c["dropped_send"] += 1
            if now >= next_stats:
                self.write_stats()
                next_stats = now + STATS_INTERVAL
            timeout = min(q[0][0], next_stats) - now if q else next_stats - now
            if not select.select((tun,), (), (), max(timeout, 0.0))[0]:
                continue
            now = now_()
            release = now + self.delay
            if release < self.last:
                release = self.last
            for _ in range(BATCH):
                try:
                    pkt = read(tun, MAX_PACKET)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    c["not_ipv4"] += 1
                    continue
                if len(q) >= self.limit:
                    c["dropped_overflow"] += 1
                    continue
                key = pkt[16:20]
                dst = addresses.get(key)
                if dst is None:
                    dst = addresses[key] = socket.inet_ntoa(key)
                c["packets"] += 1
                c["bytes"] += len(pkt)
                q.append((release, dst, pkt))
            self.last = release
            if len(q) > c["max_queue"]:
                c["max_queue"] = len(q)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="userspace delay line of a peerd lab host")
    p.add_argument("--dev", default="dl0")
    p.add_argument("--conf", required=True, help="file holding the one-way delay in ms; re-read on SIGHUP")
    p.add_argument("--stats", required=True, help="JSON counters, rewritten every second")
    p.add_argument("--limit", type=int, default=50_000, help="packets queued at most")
    args = p.parse_args(argv)
    try:  # the network before the workloads: on a busy machine the delay should stay the delay
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    except OSError:
        pass
    line = DelayLine(open_tun(args.dev), args.conf, args.stats, args.limit)
    signal.signal(signal.SIGHUP, line.reload)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        line.run()
    finally:
        line.write_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
