"""The shared file between a daemon and its attached process (daemon/attached.py, peerd/attachment.py),
driven directly: the daemon's AttachedTrainer with a stand-in round, and the process's side mapped
from the same file. The paths that only a race reaches end to end: a round that lands while the
process writes its parameters (the EndPhase settles it), and a copy of θ while the daemon writes it."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import types

import pytest
import torch

from peerd import PeerdError
from peerd.attachment import THETA_TRIES, Attachment
from peerd.daemon.attached import AttachedTrainer, AttachRefused, SharedVector
from peerd.daemon.groupspan import Placement
from peerd.daemon.checkpoint import CheckpointStore
from peerd.daemon.algorithms import DiLoCo
from peerd.daemon.diloco import OuterSettings
from peerd.peers.averaging import RoundResult
from peerd.peers.manifest import TensorSpec
from peerd.peers.membership import FOLLOWER, IDLE, TRAINER
from peerd.peers.pace import Pace
from peerd.peers.phases import Phases
from peerd.peers.statesync import FetchResult
from peerd.shared_file import APPLIED_OFFSET, LANDED_OFFSET, THETA_SEQ_OFFSET
from tests.helpers import on_loop as run
from tests.helpers import wait_for

H = 2  # inner steps per phase
NUMEL = 4

pytestmark = pytest.mark.usefixtures("loop_thread")  # the daemon's loop: end_phase and the rounds run there


class HalfMean:
    """A stand-in round: the group's mean is half this member's payload (a second member that did not
    move); records what each round was handed."""

    def __init__(self):
        self.handed: dict[int, torch.Tensor] = {}

    async def __call__(self, vector, weight, round_t, live, restore=True, payload="fp32"):
        self.handed[round_t] = vector.clone()
        vector.mul_(0.5)
        return [RoundResult(round_t, 2, None, "emulated")]


def trainer(tmp_path, round_fn, **overrides) -> AttachedTrainer:
    settings = dict(
        run_id="settle",
        layout=(TensorSpec("w", (NUMEL,), "torch.float32"),),
        creator=True,
        store=CheckpointStore(tmp_path / "checkpoints"),
        algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=True)),
        phases=Phases(H),
        round_timeout=10.0,
        checkpoint_every=10_000,
        shared_dir=tmp_path,
        average=round_fn,
    )
    return AttachedTrainer(**{**settings, **overrides})


def second_phase(tmp_path, take: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Upload, a phase, then a round that lands while the process trains on; the process takes the
    move itself (`take`) or writes its parameters without it. Returns what round 2 was handed and
    the vector the process was answered with."""
    rounds = HalfMean()
    tmp_path.mkdir()
    t = trainer(tmp_path, rounds)
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        assert info.upload
        vector, theta = t._shared.tensor, t._shared.theta  # the process maps the same bytes
        vector.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # these parameters become θ
        params = vector - 1.0  # phase 1: the process moved by -1
        vector.copy_(params)
        run(t.end_phase(info.session, H, 8.0, 1.0, 0.1))  # round 1 starts in the background
        params -= 0.25  # the process trains on meanwhile
        wait_for(lambda: t._shared.count(LANDED_OFFSET) == 1, timeout=10, what="round 1 landed")
        if take:  # what peerd.torch.Optimizer does at its next step: add θ − s, record it (APPLIED)
            params += theta - vector
            t._shared.set_count(APPLIED_OFFSET, 1)
        vector.copy_(params)  # the phase ends: the process writes its parameters
        run(t.end_phase(info.session, H, 8.0, 1.0, 0.1))
        wait_for(lambda: 2 in rounds.handed, timeout=10, what="round 2")
        assert t._shared.count(APPLIED_OFFSET) == 1  # the answered vector holds the one landed move
        return rounds.handed[2], vector.clone()
    finally:
        t.stop()


def test_a_round_that_landed_while_the_process_wrote_is_settled_at_its_end_phase(tmp_path):
    taken = second_phase(tmp_path / "taken", take=True)
    settled = second_phase(tmp_path / "settled", take=False)
    # Phase 1 ends at s = θ0 - 1; the round's mean pseudo-gradient is 0.5, so θ1 = θ0 - 0.25 and
    # the move θ1 - s is +0.75. The process went on to s - 0.25. Taken or settled, phase 2 ends at
    # s - 0.25 + 0.75 = θ0 - 0.5, and round 2 is handed θ1 minus that: 0.25.
    for a, b in zip(taken, settled):
        assert torch.equal(a, b), (a, b)
    assert torch.equal(taken[0], torch.full((NUMEL,), 0.25)), taken[0]
    assert torch.equal(taken[1], torch.tensor([0.5, 1.5, 2.5, 3.5])), taken[1]


def test_a_stop_ends_an_attach_that_waits_for_the_runs_state(tmp_path):
    """A daemon that stops while an attach waits for a download (no donor answers: ATTACH_PATIENCE,
    60 s, of tries): the attach gives up at the stop and the stop goes on, well inside a drain."""
    tries = []

    def sync(min_step, out):
        tries.append(min_step)
        return FetchResult(ok=False, reason="no donor answered")

    t = trainer(
        tmp_path,
        HalfMean(),
        run_id="stop",
        creator=False,
        peer_steps=lambda: [10],  # a live peer ahead: the download is tried again once a second
        sync=sync,
    )
    refused = []

    def attach():
        try:
            t.attach(pid=0, device="cpu", step=0)
        except AttachRefused as e:
            refused.append(str(e))

    attaching = threading.Thread(target=attach, name="attach")
    attaching.start()
    wait_for(lambda: tries, timeout=10, what="a first download")
    stopping = threading.Thread(target=t.stop, name="stop")
    stopping.start()
    stopping.join(30)
    attaching.join(30)
    assert not stopping.is_alive() and not attaching.is_alive()
    assert refused and "no peer served" in refused[0]
    assert len(tries) < 10, tries  # it stopped trying at the stop, not after 60 tries


def test_a_renewal_with_samples_that_are_not_a_count_is_refused_and_changes_nothing(tmp_path):
    t = trainer(tmp_path, HalfMean())
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        t.renew(info.session, 48.0, 0.5)
        assert (t.samples, t.loss) == (48, 0.5)  # the phase so far, as the process renewed it
        renewed = t.session.renewed
        for bad in (math.nan, math.inf, -1.0):
            with pytest.raises(ValueError, match="finite count"):
                t.renew(info.session, bad, 0.1)
        assert (t.samples, t.loss, t.session.renewed) == (48, 0.5, renewed)
    finally:
        t.stop()


def test_a_renewal_of_a_phase_that_has_ended_is_not_taken_for_the_next_ones_progress(tmp_path):
    """A Renew sent before an EndPhase and handled after it carries the ended phase's samples: with
    its boundary, the daemon leaves the new phase's progress alone (samples would count twice)."""
    t = trainer(
        tmp_path, HalfMean(), algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=False))
    )
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the upload
        t.renew(info.session, 32.0, 0.5, H)  # the first phase so far
        assert t.samples == 32
        run(t.end_phase(info.session, H, 32.0, 0.5, 0.1, H))
        assert t.samples == 32 and t.step == H
        t.renew(info.session, 32.0, 0.5, H)  # late: the phase that ended
        assert t.samples == 32
        t.renew(info.session, 16.0, 0.5, 2 * H)  # the phase under way
        assert t.samples == 48
    finally:
        t.stop()


def process_side(shared: SharedVector, numel: int) -> Attachment:
    """The process's mapping of `shared`, as Attachment.attach makes it (without a daemon to call)."""
    a = Attachment(
        run="seq",
        daemon=None,
        control="127.0.0.1:1",
        layout=[],
        settings={},
        device="cpu",
        attach_timeout=1.0,
        reconnect_timeout=1.0,
    )
    vector, theta = a._map_vector(str(shared.path), numel)
    a.current = type("Current", (), {"theta": theta, "vector": vector})()
    return a


def test_a_copy_of_theta_is_taken_again_when_the_daemon_wrote_it_meanwhile(tmp_path):
    shared = SharedVector(tmp_path, NUMEL, theta=True)
    a = process_side(shared, NUMEL)
    try:
        shared.write_theta(torch.full((NUMEL,), 1.0))
        copies = []

        def copy_while_the_daemon_writes(theta):
            copies.append(theta.clone())
            if len(copies) == 1:  # a round lands during the first copy
                shared.write_theta(torch.full((NUMEL,), 2.0))

        a.copy_theta(copy_while_the_daemon_writes)
        assert [c[0].item() for c in copies] == [1.0, 2.0]  # the torn first copy was taken again

        # While THETA_SEQ is odd (a write under way) nothing is copied; once it is even, one copy.
        seq = shared.count(THETA_SEQ_OFFSET)
        shared.set_count(THETA_SEQ_OFFSET, seq + 1)
        threading.Timer(0.02, shared.set_count, (THETA_SEQ_OFFSET, seq + 2)).start()
        copies.clear()
        a.copy_theta(copies.append)
        assert len(copies) == 1

        # A θ that never holds still: a clear error after THETA_TRIES copies, not a torn copy.
        copies.clear()
        with pytest.raises(PeerdError, match="kept changing"):
            a.copy_theta(lambda theta: (copies.append(1), shared.write_theta(theta + 1)))
        assert len(copies) == THETA_TRIES
    finally:
        a._unmap()
        shared.close()


def test_processes_attached_to_one_run_are_one_local_group_led_by_the_first(tmp_path):
    """The daemon's half of a local group: a second attach joins (a new epoch, rank 1, one rendezvous
    file per epoch), the follower's EndPhase answers the leader's of the same boundary, a follower
    whose leader leaves before ending the phase is told to regroup (the step unmoved) and, leader
    then, ends it; a Regroup after a break moves the epoch once for all who ask."""
    rounds = HalfMean()
    t = trainer(tmp_path, rounds, algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=False)))
    try:
        first = t.attach(pid=0, device="cpu", step=0)
        assert first.upload and (first.group.epoch, first.group.rank, first.group.size) == (1, 0, 1)
        t._shared.tensor.copy_(torch.ones(NUMEL))
        run(t.end_phase(first.session, 0, 0.0, math.nan, 0.0))
        second = t.attach(pid=0, device="cpu", step=0)
        assert not second.upload and (second.group.epoch, second.group.rank, second.group.size) == (2, 1, 2)
        assert second.group.store.endswith(".group-2") and second.group.store != first.group.store
        assert [m.token for m in t.members] == [first.session, second.session] and t.session.token == first.session

        # The follower's EndPhase of boundary H waits for the leader's and answers the same.
        answers = []
        follower = threading.Thread(
            target=lambda: answers.append(run(t.end_phase(second.session, H, 8.0, 1.0, 0.1, H)))
        )
        follower.start()
        follower.join(0.3)
        assert follower.is_alive() and 1 not in rounds.handed  # nothing yet: the leader has not ended it
        led = run(t.end_phase(first.session, H, 16.0, 1.0, 0.1, H))
        follower.join(10)
        assert answers == [led] and led.step == H and led.round_t == 1 and led.group_epoch == 2
        assert list(rounds.handed) == [1] and t.step == H  # one round for the group, one step count

        # A break: both ask to regroup from epoch 2; one new epoch, the same places.
        slots = [t.regroup(first.session, 2), t.regroup(second.session, 2)]
        assert [(s.epoch, s.rank, s.size) for s in slots] == [(3, 0, 2), (3, 1, 2)]

        # The leader detaches before ending the next phase: the waiting follower is told to regroup,
        # its step unmoved; it leads the group of one then, and its EndPhase ends the phase.
        answers.clear()
        follower = threading.Thread(
            target=lambda: answers.append(run(t.end_phase(second.session, H, 8.0, 1.0, 0.1, 2 * H)))
        )
        follower.start()
        follower.join(0.3)
        t.detach(first.session)
        follower.join(10)
        assert answers[0].step == H and answers[0].group_epoch == 4 and "leader left" in answers[0].outcome
        assert t.regroup(second.session, 3) == t._slot(t.members[0])  # epoch 4 formed already: its place
        again = run(t.end_phase(second.session, H, 8.0, 1.0, 0.1, 2 * H))
        assert again.step == 2 * H and list(rounds.handed) == [1, 2]
        # The same boundary again (a leader that ended it and left): answered, no second round.
        assert run(t.end_phase(second.session, H, 8.0, 1.0, 0.1, 2 * H)).step == 2 * H and list(rounds.handed) == [1, 2]
    finally:
        t.stop()
    assert not list(tmp_path.glob("*.group-*"))  # the rendezvous files go with the vector


def test_the_first_of_a_group_that_expects_others_waits_for_them_and_all_get_one_epoch(tmp_path):
    t = trainer(tmp_path, HalfMean())
    try:
        infos = []
        leader = threading.Thread(target=lambda: infos.append(t.attach(pid=0, device="cpu", step=0, group_size=3)))
        leader.start()
        wait_for(lambda: t.members, timeout=10, what="the first attach")
        others = [threading.Thread(target=lambda: infos.append(t.attach(pid=0, device="cpu", step=0))) for _ in (1, 2)]
        for o in others:
            o.start()
        for th in (leader, *others):
            th.join(20)
        assert sorted((i.group.epoch, i.group.rank, i.group.size) for i in infos) == [(1, 0, 3), (1, 1, 3), (1, 2, 3)]
        assert [i.upload for i in sorted(infos, key=lambda i: i.group.rank)] == [True, False, False]
    finally:
        t.stop()


def test_an_attach_that_waited_for_a_long_download_is_not_taken_for_a_lapsed_lease(tmp_path):
    """Seen in bench.churn: a restarted daemon's download waited 10 s on a frozen donor, then the
    lease watch ended the process's session 0.2 s after it attached: its lease had run from the
    attach request."""
    import asyncio

    from peerd.daemon.attached import SessionLost

    def sync(min_step, out):
        time.sleep(4.5)  # more than two leases of 2 s
        out.fill_(1.0)
        return FetchResult(ok=True, reason="downloaded slowly", step=4)

    t = trainer(tmp_path, HalfMean(), run_id="slow", creator=False, peer_steps=lambda: [4], sync=sync)
    t.lease_seconds = 2.0
    loop = asyncio.new_event_loop()
    watching = threading.Thread(target=loop.run_forever, name="loop", daemon=True)
    watching.start()
    try:

        async def watch():
            t.start()

        asyncio.run_coroutine_threadsafe(watch(), loop).result(10)
        info = t.attach(pid=0, device="cpu", step=0)
        assert info.step == 4 and not info.upload
        # The process's first Renew comes a while after its answer (lease / 3 in peerd.attachment); the
        # watch, every 0.5 s, has looked twice by then.
        time.sleep(1.0)
        for _ in range(5):
            t.renew(info.session)  # SessionLost here: the watch ended the session
            time.sleep(0.4)
        assert t.session is not None and t.session.token == info.session
    except SessionLost as e:
        pytest.fail(f"the session ended after a slow download: {e}")
    finally:
        t.stop()
        loop.call_soon_threadsafe(loop.stop)
        watching.join(10)


@pytest.mark.parametrize("progress", [True, False])
def test_an_attach_waits_on_while_its_download_makes_progress(tmp_path, monkeypatch, progress):
    """A slow link (a joiner at 1 Mbit/s in bench.vs_peers): tries that each bring verified chunks
    outlast ATTACH_PATIENCE in all and the attach still gets the run's state; tries that bring
    nothing end it at the patience."""
    from peerd.daemon import attached

    monkeypatch.setattr(attached, "ATTACH_PATIENCE", 1.0)
    tries = []

    def sync(min_step, out):
        tries.append(time.monotonic())
        time.sleep(0.4)
        if len(tries) < 6:  # 6 tries and 5 retry pauses of 1 s: about 7 s, seven patiences
            return FetchResult(ok=False, reason="the donor timed out", bytes=1000 if progress else 0)
        out.fill_(1.0)
        return FetchResult(ok=True, reason="downloaded at last", step=4)

    t = trainer(tmp_path, HalfMean(), run_id="slowlink", creator=False, peer_steps=lambda: [4], sync=sync)
    try:
        if progress:
            info = t.attach(pid=0, device="cpu", step=0)
            assert info.step == 4 and len(tries) == 6
        else:
            with pytest.raises(AttachRefused, match="no peer served"):
                t.attach(pid=0, device="cpu", step=0)
            assert len(tries) <= 2  # the patience, 1 s, ended it
    finally:
        t.stop()


class Paced(HalfMean):
    """HalfMean whose group agreed a pace (peers/pace.py): 0.1 s steps and, for round t, rounds of
    `round_s[t]` seconds; no group (no pace) where that is None."""

    def __init__(self, round_s: dict[int, float | None]):
        super().__init__()
        self.round_s = round_s
        self.trainer: AttachedTrainer | None = None
        self.own_steps: list[float] = []  # the trainer's step time as each round began: its pace there

    async def __call__(self, vector, weight, round_t, live, restore=True, payload="fp32"):
        self.own_steps.append(self.trainer.step_seconds)
        (result,) = await super().__call__(vector, weight, round_t, live, restore, payload)
        seconds = self.round_s[round_t]
        return [dataclasses.replace(result, pace=None if seconds is None else Pace(0.1, seconds, 2))]


def test_average_every_auto_answers_each_phase_end_with_the_h_of_the_group_pace_a_round_before(tmp_path):
    """average_every=auto on the daemon's side (overlap: round r lands by the EndPhase of phase
    r + 1). This daemon's step time is its latest phase's. Before any group pace, this daemon's own
    figures: no step time, the schedule's 16. The
    phase after round r's boundary takes round r - 1's group pace: 1.2 x 0.5 s / 0.1 s = 6, so 8 on
    the ladder 2, 4, 8, 16; a slower round moves H one phase later; a round without a group leaves
    it as it was."""
    paced = Paced({1: 0.5, 2: 0.5, 3: 2.0, 4: None})  # round 3: 1.2 x 2.0 / 0.1 = 24, past the top
    t = trainer(tmp_path, paced, phases=Phases(16), auto_every=(2, 16), round_seconds=lambda: math.nan)
    paced.trainer = t
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        assert info.phase_steps == 16, t.fitted
        assert t.fitted.reason == "this daemon's figures: no step time yet: the schedule's phases"
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the upload
        assert math.isnan(t.step_seconds)
        # round 1 starts: no group pace yet. The first phase also held the script's start (32 s)
        run(t.end_phase(info.session, 16, 16.0, 1.0, 32.0))
        assert t.fitted_steps == 16 and t.step_seconds == 2.0
        run(t.end_phase(info.session, 16, 16.0, 1.0, 1.6))  # round 1 landed: its pace decides
        assert t.step_seconds == 0.1  # this daemon's pace: the latest phase's, not the mean (1.05 s)
        assert paced.own_steps == [2.0, 0.1]  # each round went with the step time of the phase it ends
        assert (t.fitted_steps, t.fitted_round) == (8, 1), t.fitted
        assert t.fitted.reason.startswith("round 1's group of 2: 1.2 x a 0.5 s round over 0.1 s steps needs H >= 6")
        run(t.end_phase(info.session, 8, 8.0, 1.0, 0.8))  # round 2 (0.5 s) landed
        assert t.fitted_steps == 8
        run(t.end_phase(info.session, 8, 8.0, 1.0, 0.8))  # round 3 landed
        assert (t.fitted_steps, t.fitted_round) == (16, 3) and "the largest H, average_every_max=16" in t.fitted.reason
        run(t.end_phase(info.session, 16, 16.0, 1.0, 1.6))  # round 4 landed, without a group
        assert (t.fitted_steps, t.fitted_round) == (16, 3)
        assert t.global_step == 5 * 16  # each phase moved the run's step by the schedule's 16
    finally:
        t.stop()
    (tmp_path / "plain").mkdir()
    plain = trainer(tmp_path / "plain", HalfMean())  # a fixed H: no answer of auto's
    try:
        assert plain.attach(pid=0, device="cpu", step=0).phase_steps == 0 and plain.fitted is None
    finally:
        plain.stop()


class Scripted:
    """A stand-in round that returns the given results in turn (a round with no outcome changes nothing)."""

    def __init__(self, results: list[RoundResult]):
        self.results = results

    async def __call__(self, vector, weight, round_t, live, restore=True, payload="fp32"):
        return [dataclasses.replace(self.results.pop(0), round_t=round_t)]


def test_each_round_not_applied_is_logged_with_why_and_a_streak_alone_in_the_run_once(tmp_path, caplog):
    """docs/operations.md, "Debugging a stuck daemon": a round whose result was not applied at INFO
    with its group, planned mates and reason; a tiny task alone in the run logs its streak once."""
    alone = RoundResult(0, 1, None, "alone in the run")
    missed = RoundResult(0, 1, None, "alone: nobody joined", planned=2)
    t = trainer(
        tmp_path,
        Scripted([alone, alone, alone, missed, alone]),
        algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=False)),
    )
    caplog.set_level("DEBUG", logger="peerd.daemon.attached")
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the upload
        for _ in range(5):
            run(t.end_phase(info.session, H, float(H), 1.0, 0.1))
    finally:
        t.stop()
    rounds = [(r.levelname, r.getMessage()) for r in caplog.records if ": round " in r.getMessage()]
    assert [level for level, _ in rounds] == ["INFO", "DEBUG", "DEBUG", "INFO", "INFO"], rounds
    assert rounds[3][1].startswith("run settle: round 4 at step 8: no_group, group of 1 (2 planned)"), rounds
    assert rounds[3][1].endswith(", owed to the next: alone: nobody joined"), rounds


def test_a_local_group_larger_than_the_loops_default_executor_ends_its_phase(tmp_path):
    """Eight processes on one daemon (`torchrun --nproc-per-node 8`): seven followers wait for the
    leader's EndPhase at once, each in a thread of the loop's default executor. With asyncio's own
    default, min(32, cores + 4) threads (6 on 2 cores), they held every thread and the leader's
    EndPhase waited for one until the phase timeout; the daemon's loop has WORKER_THREADS
    (daemon/app.py; tests/helpers.LoopThread sets it as daemon/cli.py does)."""
    n = 8
    t = trainer(
        tmp_path, HalfMean(), algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=False))
    )
    try:
        infos = [t.attach(pid=0, device="cpu", step=0)]
        run(t.end_phase(infos[0].session, 0, 0.0, math.nan, 0.0))  # the upload
        infos += [t.attach(pid=0, device="cpu", step=0) for _ in range(n - 1)]
        assert [m.token for m in t.members] == [i.session for i in infos]
        answers: list = []
        followers = [
            threading.Thread(target=lambda s=i.session: answers.append(run(t.end_phase(s, H, 8.0, 1.0, 0.1, H))))
            for i in infos[1:]
        ]
        for f in followers:
            f.start()
        time.sleep(1.0)  # the followers are in their waits (one not yet there would be answered at once)
        led = run(t.end_phase(infos[0].session, H, 8.0, 1.0, 0.1, H), timeout=20)
        for f in followers:
            f.join(20)
        assert answers == [led] * (n - 1) and led.step == H, (led, answers)
    finally:
        t.stop()


def test_a_daemon_placed_as_a_follower_announces_it_though_its_coordinator_changed_since_its_attach(tmp_path):
    """A spanning group whose first epoch holds two daemons at once: this daemon's process attached
    while it still coordinated itself (announced: trainer), the coordinator moved to b a moment
    later, then the epoch placed this daemon second. Its peers must see it follow: a "trainer" that
    never rounds was planned as a mate at every round and waited for (FLAKY.md, run 91)."""
    roles = []
    t = trainer(tmp_path, HalfMean(), on_role=roles.append)
    try:
        t.attach(pid=0, device="cpu", step=0)
        assert roles == [TRAINER]
        t.span = types.SimpleNamespace(coordinator="b", peer_id="a", label="rack", host="127.0.0.1", close=lambda: None)
        t.placed(Placement(2, 1, 1, 2, "tcp://127.0.0.1:1", ("b", "a")))
        assert roles == [TRAINER, FOLLOWER]
        t.placed(Placement(3, 1, 1, 2, "tcp://127.0.0.1:1", ("b", "a")))  # the same role: not again
        assert roles == [TRAINER, FOLLOWER]
        t.placed(Placement(4, 0, 1, 1, "tcp://127.0.0.1:1", ("a",)))  # b left: this daemon leads
        assert roles == [TRAINER, FOLLOWER, TRAINER]
    finally:
        t.stop()
    assert roles[-1] == IDLE


def test_a_placement_during_the_attachs_announcement_is_announced_after_it_not_before(tmp_path):
    """The attach (its thread) read its role, trainer, and was handing it to the peers when the
    span's beat placed the daemon as a follower: the placement's announcement waits for the attach's
    and then says follower, where before it went first and the attach's stale trainer stayed until
    the next epoch (the peers planned this daemon as a round mate meanwhile)."""
    roles, handing, release = [], threading.Event(), threading.Event()

    def on_role(role):
        if not roles and not handing.is_set():  # the attach's: held until the placement is under way
            handing.set()
            release.wait(10)
        roles.append(role)

    t = trainer(tmp_path, HalfMean(), on_role=on_role)
    try:
        attaching = threading.Thread(target=t.attach, kwargs=dict(pid=0, device="cpu", step=0))
        attaching.start()
        assert handing.wait(10)
        t.span = types.SimpleNamespace(coordinator="b", peer_id="a", label="rack", host="127.0.0.1", close=lambda: None)
        placing = threading.Thread(target=t.placed, args=(Placement(2, 1, 1, 2, "tcp://127.0.0.1:1", ("b", "a")),))
        placing.start()
        placing.join(0.3)  # it reached the announcement, or is about to
        release.set()
        attaching.join(10)
        placing.join(10)
        assert roles == [TRAINER, FOLLOWER]
    finally:
        release.set()
        t.stop()


def test_an_arctopk_run_without_overlap_puts_theta_beside_the_parameters_it_leaves_apart(tmp_path):
    """ARC-Top-K leaves the rows a member did not send in its process's parameters (θ minus them), so
    the shared file carries θ too, as with overlap: what `run_parameters` evaluates and a spanning
    group hands over. Two rows; the round averages row 0."""
    import numpy as np

    from peerd.peers.collective import arctopk
    from peerd.peers.collective.outcome import Outcome, Status

    row = arctopk.ROW

    async def top_k(vector, weight, round_t, live, restore=True, payload="fp32"):
        sent = arctopk.gather(vector.numpy(), np.array([0]))
        arctopk.scatter(sent * np.float32(0.5), np.array([0]), vector.numpy())
        done = Outcome(Status.COMPLETED, "emulated", 1, ("a", "b"), (1.0,), 0, 0, 0.1, b"d")
        return [RoundResult(round_t, 2, done, "emulated", selected=arctopk.Selected(np.array([0]), "fp32"))]

    settings = OuterSettings(lr=1.0, momentum=0.0, payload="arctopk", overlap=False)
    t = trainer(tmp_path, top_k, algorithm=DiLoCo(settings), layout=(TensorSpec("w", (2 * row,), "torch.float32"),))
    assert DiLoCo(dataclasses.replace(settings, payload="int8")).theta_apart is False  # θ is the vector there
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        process = process_side(t._shared, 2 * row)
        vector = t._shared.tensor
        vector.zero_()
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the upload: θ = 0
        vector.sub_(0.25)  # a phase: P = 0.25 everywhere
        run(t.end_phase(info.session, H, 32.0, 0.5, 0.1))
        theta = torch.empty(2 * row)
        process.copy_theta(theta.copy_)
        assert torch.equal(theta, t.algorithm.outer.theta)  # θ as the daemon holds it
        assert torch.equal(theta[:row], torch.full((row,), -0.125)) and not theta[row:].any()
        assert torch.equal(vector[row:], torch.full((row,), -0.25))  # row 1's progress, kept to send
    finally:
        t.stop()
