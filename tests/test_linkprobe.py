"""Link probes over real UDP sockets on loopback: what passes, what fails, what is refused; the
bandwidth statistic on made-up packet trains through a token-bucket shaper (a fake, no network)."""

from __future__ import annotations

import asyncio
import collections
import socket
import time

import pytest

from peerd.peers.events import PeerEvents
from peerd.peers.linkprobe import (
    ECHO,
    FAIL_AFTER,
    FORMAT,
    MAGIC,
    PAUSE,
    PROBE_COUNT,
    RETRY_AFTER,
    SIZE,
    TRAIN_COUNT,
    TRAIN_SIZE,
    VERSION,
    LinkProber,
    TrainRate,
    median_rate,
    train_rate,
)


def _counting():
    rejected: collections.Counter[str] = collections.Counter()
    probes = collections.Counter()
    events = PeerEvents(
        packet_rejected=lambda r: rejected.update([r]),
        link_probes=lambda answered, lost: probes.update(answered=answered, lost=lost),
        link_probe_late=lambda: probes.update(late=1),
    )
    return events, rejected, probes


def test_a_clean_link_passes_with_no_loss_and_a_closed_port_fails():
    async def main():
        events, rejected, probes = _counting()
        a, b = LinkProber(events=events), LinkProber(events=events)
        await a.start(), await b.start()
        try:
            stats = await a.measure("b", b.address)
            assert stats.passes and stats.last_loss == 0 and 0 < stats.rtt < 0.1, stats
            assert a.passes("b") and not a.passes("nobody")
            # A port where nothing answers (UDP blocked, or no prober): every probe is lost.
            closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
            closed.close()
            stats = await a.measure("c", f"127.0.0.1:{port}", wait=0.2)
            assert not stats.passes and stats.last_loss == 1 and not a.passes("c")
            assert probes == {"answered": PROBE_COUNT, "lost": PROBE_COUNT}
            assert not rejected
            with pytest.raises(ValueError, match="not host:port"):
                await a.measure("d", "no-port-here")
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_a_path_that_passed_survives_one_failed_measurement_and_a_failed_one_is_retried_soon():
    """A peer whose loop was busy through ECHO_WAIT answers nothing once: its path keeps passing
    until FAIL_AFTER measurements in a row fail; a failed link is due again after RETRY_AFTER
    (doubling), a passing one only after the interval."""

    async def main():
        a, b = LinkProber(), LinkProber()
        await a.start(), await b.start()
        original, deaf = b._received, False
        b._received = lambda data, addr, at: None if deaf else original(data, addr, at)
        try:
            first = await a.measure("b", b.address, wait=0.2)
            assert first.passes and first.failures == 0 and not a.due("b", b.address, 15.0, first.measured_at + 14)
            deaf = True
            held = await a.measure("b", b.address, wait=0.2)
            assert held.last_loss == 1 and held.failures == 1 and a.passes("b"), held
            assert not a.due("b", b.address, 15.0, held.measured_at + RETRY_AFTER - 0.1)
            assert a.due("b", b.address, 15.0, held.measured_at + RETRY_AFTER)
            for _ in range(FAIL_AFTER - 1):
                failed = await a.measure("b", b.address, wait=0.2)
            assert not a.passes("b") and failed.failures == FAIL_AFTER, failed
            assert not a.due("b", b.address, 15.0, failed.measured_at + RETRY_AFTER * 2 ** (FAIL_AFTER - 1) - 0.1)
            assert a.due("b", b.address, 15.0, failed.measured_at + 15.0)
            assert a.due("b", "127.0.0.1:1", 15.0, failed.measured_at)  # a new address: at once
            deaf = False
            back = await a.measure("b", b.address, wait=0.2)
            assert back.passes and back.failures == 0, back
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_echoes_this_loop_was_too_busy_to_read_in_time_are_answers_not_loss():
    """The measuring loop stalls through the whole wait (its reader never gets a turn, as when a
    long callback runs just before the wait's last wake-up): the echoes wait in its socket, and
    count. Counted as lost, they kept a pair of a loaded machine's daemons out of a local group
    for minutes (the running loss forgets 5 % per probe slowly; LocalGroupRules.max_loss is 0.1 %).
    A train's echoes are read the same way."""

    async def main():
        events, rejected, probes = _counting()
        a, b = LinkProber(events=events), LinkProber(events=events)
        await a.start(), await b.start()
        loop = asyncio.get_running_loop()
        try:
            loop.remove_reader(a._sock.fileno())  # a's loop reads nothing until the wait is over
            # Waits long enough for b (on this loop, on a loaded machine) to have echoed everything:
            # a 0.2 s wait left a CI run's train unechoed (bandwidth 0). The RTT is the kernel's.
            stats = await a.measure("b", b.address, wait=1.0)
            assert stats.last_loss == 0 and stats.loss == 0 and stats.passes and 0 < stats.rtt < 0.1, stats
            # Up to 4 trains: one the CPU descheduled mid-send is discarded by design (train_window).
            assert await a.measure_bandwidth("b", b.address, trains=1, most=4, wait=2.0) > 0
            assert probes == {"answered": PROBE_COUNT, "lost": 0} and not rejected, (probes, rejected)
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_echoes_of_a_peer_busy_beyond_the_wait_answer_the_measurement_when_they_come():
    """The peer's loop stalls through the whole wait (it reads the probes only afterwards): the
    measurement ends with every probe lost, and the echoes, when they come, answer it after all
    (the same LinkStats, judged again) until the peer's next measurement starts."""

    async def main():
        events, rejected, probes = _counting()
        a, b = LinkProber(events=events), LinkProber(events=events)
        await a.start(), await b.start()
        loop = asyncio.get_running_loop()
        try:
            first = await a.measure("b", b.address, wait=0.2)
            assert first.passes and first.loss == 0
            loop.remove_reader(b._sock.fileno())  # b's loop reads nothing through the wait
            stats = await a.measure("b", b.address, wait=0.2)
            assert stats.last_loss == 1 and stats.failures == 1 and a.stats["b"] is stats, stats
            loop.add_reader(b._sock.fileno(), b._readable)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if stats.last_loss == 0:
                    break
            assert stats.last_loss == 0 and stats.loss == 0 and stats.failures == 0 and stats.passes, stats
            assert 0 < stats.rtt < 0.1 and stats.measurements == 2, stats  # b's hold is not the link's
            # the metric keeps what each measurement counted when it ended, and counts each late echo
            assert probes == {"answered": PROBE_COUNT, "lost": PROBE_COUNT, "late": PROBE_COUNT}, probes
            assert not rejected, rejected
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_a_lossy_link_still_passes_and_its_loss_is_measured():
    """The answering side drops every second probe (as a path losing half of them would): the link
    passes (the loss-tolerant engine is made for it) and the loss reads 50 %."""

    async def main():
        a, b = LinkProber(), LinkProber()
        await a.start(), await b.start()
        seen = 0
        original = b._received

        def lossy(data, addr, at):
            nonlocal seen
            seen += 1
            if seen % 2:
                original(data, addr, at)

        b._received = lossy
        try:
            stats = await a.measure("b", b.address, wait=0.2)
            assert stats.passes and stats.last_loss == pytest.approx(0.5), stats
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_garbage_forged_echoes_and_floods_are_refused_and_counted():
    async def main():
        events, rejected, _ = _counting()
        a = LinkProber(events=events, echo_rate=100.0)
        await a.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.sendto(b"x" * 10, ("127.0.0.1", a.port))  # wrong size
            sock.sendto(b"NOPE".ljust(SIZE, b"\0"), ("127.0.0.1", a.port))  # not a probe
            forged = FORMAT.pack(MAGIC, VERSION, ECHO, b"12345678", 0, 0.0).ljust(SIZE, b"\0")
            sock.sendto(forged, ("127.0.0.1", a.port))  # an echo of nothing a sent
            await asyncio.sleep(0.2)
            assert rejected == {"probe_bad_size": 1, "probe_bad_header": 1, "probe_unexpected_echo": 1}
            # A flood of valid probes is answered up to the echo rate, the rest counted, not answered.
            probe = FORMAT.pack(MAGIC, VERSION, 1, b"abcdefgh", 0, 0.0).ljust(SIZE, b"\0")
            for _ in range(400):
                try:
                    sock.sendto(probe, ("127.0.0.1", a.port))
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            await asyncio.sleep(0.2)
            echoes = 0
            while True:
                try:
                    sock.recv(100)
                    echoes += 1
                except BlockingIOError:
                    break
            # A burst of 100 and 100 a second: at most about 150 echoes in this half second.
            assert rejected["probe_rate_limited"] > 0 and echoes <= 150, (echoes, rejected)
            assert echoes + rejected["probe_rate_limited"] <= 400
        finally:
            sock.close()
            a.close()

    asyncio.run(main())


# The lab's 200 Mbit/s tbf (daemon/lab/netns.py): 25 MB/s, a bucket of 4 ms of traffic (100 KB).
RATE, BUCKET = 25e6, 100_000
GAP = 5_000  # ns between two datagrams of a sender that is not descheduled: 240 MB/s


def send_times(pause_before: int | None = None, pause: int = 8_000_000) -> list[int]:
    """A train sent back to back from t = 0, descheduled for `pause` ns before datagram `pause_before`."""
    return [
        seq * GAP + (pause if pause_before is not None and seq >= pause_before else 0) for seq in range(TRAIN_COUNT)
    ]


def shaped(sent: list[int], rate: float = RATE, bucket: int = BUCKET) -> dict[int, int]:
    """Receive times through a token bucket (full at the start, as after an idle link), FIFO."""
    tokens, clock, out = bucket, 0, {}
    for seq, t in enumerate(sent):
        at = max(t, clock)
        tokens = min(bucket, tokens + (at - clock) * rate / 1e9)
        if tokens < TRAIN_SIZE:  # wait for the tokens of one datagram
            at += round((TRAIN_SIZE - tokens) / rate * 1e9)
            tokens = TRAIN_SIZE
        tokens -= TRAIN_SIZE
        clock = out[seq] = at
    return out


def test_a_train_reads_the_shaper_rate_and_a_pause_before_its_window_does_not_count():
    r = train_rate(send_times(), shaped(send_times()))
    assert r.rate == pytest.approx(RATE, rel=0.01) and r.link_bound, r
    # Descheduled for 8 ms at datagram 150: the bucket refills and lets most of the last quarter
    # through at the sender's pace. Read without the pause, that train says more than 3 times the
    # shaper's rate; with it, the train does not count.
    sent = send_times(pause_before=150)
    assert train_rate(sent, shaped(sent)).rate > 3 * RATE
    assert train_rate(sent, shaped(sent), pauses=[150]) is None
    # A pause early in the train leaves enough of it after the refill; one inside the last quarter
    # cuts the window short. Both still read the shaper's rate.
    for at in (10, 230):
        sent = send_times(pause_before=at)
        r = train_rate(sent, shaped(sent), pauses=[at])
        assert r.rate == pytest.approx(RATE, rel=0.02) and r.link_bound, (at, r)


def test_an_unshaped_link_reads_the_senders_pace_and_its_pauses_do_not_lower_it():
    sent = send_times()
    r = train_rate(sent, {seq: t + 40_000 for seq, t in enumerate(sent)})  # a constant delay, no limit
    assert r.rate == pytest.approx(TRAIN_SIZE / GAP * 1e9, rel=0.01) and not r.link_bound, r
    sent = send_times(pause_before=220)
    through = {seq: t + 40_000 for seq, t in enumerate(sent)}
    assert train_rate(sent, through).rate < r.rate / 10  # the pause read as the link's slowness
    cut = train_rate(sent, through, pauses=[220])  # the window ends at the pause
    assert cut.rate == pytest.approx(r.rate) and not cut.link_bound, cut
    # A sender held back by the link (a shaper on a veth pushes back into sendto): its window left at
    # the link's pace, so the spreads match, but 4 times slower than the train's first quarter: link-bound.
    held = [seq * GAP if seq < 64 else (63 + (seq - 63) * 4) * GAP for seq in range(TRAIN_COUNT)]
    r = train_rate(held, {seq: t + 40_000 for seq, t in enumerate(held)})
    assert r.rate == pytest.approx(TRAIN_SIZE / (4 * GAP) * 1e9, rel=0.01) and r.link_bound, r
    # Too few echoes in the window (a receiver that lost the tail): no figure rather than a wrong one.
    assert train_rate(sent, {seq: t for seq, t in through.items() if seq < 200}) is None


def test_the_median_of_trains_outvotes_one_that_rode_a_burst():
    """The trains of issue 17: a 200 Mbit/s host read 64.6 MB/s in one of three (the highest train
    used to decide), 24.3 and 24.2 MB/s in the others."""
    trains = [TrainRate(64623724.9, False), TrainRate(24331017.7, True), TrainRate(24210368.9, True)]
    assert median_rate(trains) == trains[1]
    # Of two, the lower: a measurement that counted only these two still reads the shaper's rate.
    assert median_rate(trains[::2]) == trains[2]
    assert median_rate(trains[:1]) == trains[0] and median_rate([]) is None


def test_trains_on_loopback_and_a_descheduled_sender_costs_one_more_train():
    """Loopback is no limit: the trains read the sender's pace. A sender stalled for 3 ms inside the
    first train (a seam around its sends, as a scheduler would) spoils that train, and the
    measurement sends another instead of counting it. Trains of 64 datagrams: both probers share
    one event loop, so a train waits whole in the receiver's socket buffer (208 KB on many kernels)."""

    async def main():
        outcomes: list[str] = []
        a, b = LinkProber(events=PeerEvents(link_train=outcomes.append)), LinkProber()
        await a.start(), await b.start()
        sent = 0
        original = a._send

        def stalling(data, addr, *, full=True):
            nonlocal sent
            if len(data) == TRAIN_SIZE:
                sent += 1
                if sent == 30:
                    time.sleep(6 * PAUSE)
            return original(data, addr, full=full)

        a._send = stalling
        try:
            with pytest.raises(ValueError, match="before its bandwidth"):
                await a.measure_bandwidth("b", b.address)
            await a.measure("b", b.address)
            # A busy machine may deschedule the sender in more trains: allow for many.
            figure = await a.measure_bandwidth("b", b.address, count=64, most=30)
            assert outcomes[0] == "paused" and outcomes.count("counted") == 3 and "unanswered" not in outcomes, outcomes
            # Not whether it reads as link-bound: on a busy machine the receiver, descheduled, spreads
            # the echoes wider than the sender spread the train, a true reading of that path
            # (tests/FLAKY.md, run 22); the rule is checked on exact timestamps above (test_an_unshaped_link_…).
            assert figure > 1e7, a.stats["b"]
            assert [r.bandwidth for r in a.reports()] == [figure]
        finally:
            a.close(), b.close()

    asyncio.run(main())
