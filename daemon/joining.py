"""Joining a run: find (or create) its manifest, check its task is installed, start its trainer.

A run with no manifest and no --task is joined for discovery only (membership, peers, no
training). Code is never loaded from the network: a manifest only names an installed task.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import concurrent.futures
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peerd.daemon.datadir import write_atomic
from peerd.daemon.typed import Mismatch, coerce
from peerd.peers import manifest as manifests
from peerd.peers.clock import now
from peerd.peers.envelope import RecordRejected
from peerd.peers.manifest import AveragingSettings, RunManifest, TensorSpec, layout_mismatch
from peerd.peers.node import PeerNode
from peerd.peers.phases import Phases
from peerd.peers.run_ids import RunSecret
from peerd.peers.statesync import FetchResult, fetch_state

# Training code (torch, the tasks, the trainer, the averager) is imported by the functions that
# set up training: a daemon whose runs are discovery only never loads torch, about 210 MiB
# (docs/benchmarks.md, "Daemon costs").
if TYPE_CHECKING:
    import torch

    from peerd.daemon.attached import AttachedTrainer
    from peerd.daemon.tasks import Task
    from peerd.peers.averaging import RoundResult
    from peerd.peers.membership import Roll

logger = logging.getLogger(__name__)

MANIFEST_TTL = 300.0  # seconds a published manifest lives without being republished
MANIFEST_REPUBLISH = 60.0  # seconds between republications by each member
CANCEL_GRACE = 5.0  # seconds a cancelled round may take to restore the vector it was writing
SYNC_TIMEOUT = 120.0  # seconds one download of the run's state may take


def rendezvous_for(membership, phases: Phases, round_timeout: float):
    """The averager's `rendezvous(round_t, mates) -> Roll`: announce this daemon's step, then wait for
    the mates that announce a step in either of the two previous rounds (peers/membership.py,
    RunMembership.rendezvous): one round behind, a mate trains on to this boundary; two behind, it
    downloads the latest round's state first (daemon/straggler.catch_up_from), then does the same.
    A mate further behind is not waited for; one that would arrive after the wait ends its phase
    early to be there (daemon/straggler.MateWait)."""
    from peerd.daemon.straggler import rendezvous_patience

    patience = rendezvous_patience(round_timeout)

    async def rendezvous(round_t: int, mates: list[str]) -> Roll:
        roll = await membership.rendezvous(mates, phases.end(round_t), phases.end(round_t - 2), patience)
        if roll.behind:
            logger.info(
                "run %s: round %d goes on without %d group mate(s) still behind it",
                membership.run_id,
                round_t,
                len(roll.behind),
            )
        return roll

    return rendezvous


class RunRefused(ValueError):
    """The run cannot be joined as asked; the message says why, in one line."""


@dataclass
class RunHandle:
    run_id: str
    manifest: RunManifest | None
    trainer: AttachedTrainer | None  # a script's, or a TaskChild: a task's child (daemon/taskchild.py)
    secret: RunSecret | None = None
    republisher: asyncio.Task | None = None
    round_task: asyncio.Task | None = None  # the averaging round in flight, on the daemon's loop
    download: concurrent.futures.Future | None = None  # the state download a trainer's thread waits for
    stopping: bool = False  # leave or drain: no round or download starts, the one in flight is cancelled

    def cancel(self) -> None:
        """The run stops (on the daemon's loop): the round and the download in flight end."""
        self.stopping = True
        for pending in (self.round_task, self.download):
            if pending is not None:
                pending.cancel()


def bounded_round(handle: RunHandle, run_round, timeout: float):
    """The trainer's round, awaited on the daemon's loop: `average(vector, weight, round_t, lanes,
    restore, payload) -> [RoundResult]` runs `run_round` (one round per lane; `lanes` None: every
    lane; the vector travels in `payload`'s format, peers/collective/codec.py) for at most `timeout`
    s (the run's round_timeout). A round that times out, or that the run's stop cancels
    (`RunHandle.cancel`; none starts once the run stops), answers one interrupted result, `cancelled`
    for a stop, and leaves the vector as it was if `restore`, else partly written
    (MoshpitAverager.average); either way `average` returns once the round has stopped writing
    into the vector, or after CANCEL_GRACE. The caller's own cancellation (the daemon stops)
    cancels the round too."""
    from peerd.peers.averaging import RoundResult

    def interrupted(round_t: int, cancelled: bool) -> list[RoundResult]:
        reason = "round cancelled: the run stops" if cancelled else f"round timed out after {timeout:.0f} s"
        return [RoundResult(round_t, 1, None, reason, interrupted=True, cancelled=cancelled)]

    async def average(
        vector, weight: float, round_t: int, lanes=None, restore: bool = True, payload: str = "fp32"
    ) -> list[RoundResult]:
        if handle.stopping:
            return interrupted(round_t, cancelled=True)
        task = asyncio.ensure_future(run_round(vector, weight, round_t, lanes, restore, payload))
        handle.round_task = task
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                # The engine restores the vector (or its own shard) when cancelled: wait for that
                # before the caller reuses it.
                await asyncio.wait({task}, timeout=CANCEL_GRACE)
                return interrupted(round_t, cancelled=False)
            if task.cancelled():  # by the run's stop
                return interrupted(round_t, cancelled=True)
            return task.result()
        except asyncio.CancelledError:  # the caller's: the round goes with it
            task.cancel()
            raise
        finally:
            handle.round_task = None

    return average


def sync_bridge(
    handle: RunHandle, loop: asyncio.AbstractEventLoop, node: PeerNode, run_id: str, secret, membership, events
):
    """A blocking `sync(min_step, out)` for the trainer (in a worker thread): downloads the run's state from the
    live peers that announce at least min_step (peers/statesync.py), at most SYNC_TIMEOUT seconds,
    and copies it into `out` only when complete and verified. Downloads land in one buffer of the
    bridge's own, so a failed download's verified chunks survive until the next call resumes them."""
    import torch

    partial, buffer = None, None

    def sync(min_step: int, out: torch.Tensor) -> FetchResult:
        nonlocal partial, buffer
        if handle.stopping:
            return FetchResult(ok=False, reason="state download cancelled: the run stops")
        donors = [e.peer_id for e in membership.peers() if e.step >= min_step]
        if not donors:
            return FetchResult(ok=False, reason="no live peer is ahead")
        if buffer is None or buffer.numel() != out.numel():
            buffer, partial = torch.empty_like(out), None
        coro = fetch_state(
            node,
            run_id,
            secret,
            donors,
            min_step=min_step,
            out=buffer,
            resume=partial,
            timeout=SYNC_TIMEOUT,
            events=events,
        )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        handle.download = future  # cancelled like a round when the run stops
        if handle.stopping:
            future.cancel()
        try:
            result = future.result(SYNC_TIMEOUT + CANCEL_GRACE)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return FetchResult(ok=False, reason="state download cancelled")
        finally:
            handle.download = None
        if result.ok and result.tensor is not None and result.tensor.numel() == out.numel():
            out.copy_(result.tensor)
            partial = buffer = None  # kept only for a resume: a daemon that caught up holds no copy
        elif result.ok:
            return FetchResult(
                ok=False, reason=f"the run's state has {result.tensor.numel()} values, ours {out.numel()}"
            )
        else:
            partial = result.partial
        return result

    return sync


def hparams_from_text(task: Task, text: dict[str, str]):
    """Typed hyper-parameters from KEY=VALUE text, by the types the task declares (daemon/typed.py)."""
    from peerd.daemon.tasks import HparamsError

    types = typing.get_type_hints(task.hparams_type)
    values: dict[str, object] = {}
    for key, raw in text.items():
        try:  # an unknown key goes as it is: parse_hparams names it with the known ones
            values[key] = coerce(raw, types[key], text=True) if key in types else raw
        except Mismatch as e:
            raise HparamsError(f"{task.name}: hyper-parameter {key!r}: {e}") from None
    return task.parse_hparams(values)


def _split_settings(text: dict[str, str]) -> tuple[dict[str, str], AveragingSettings]:
    hparams = {k: v for k, v in text.items() if not k.startswith("averaging.")}
    averaging = {k.removeprefix("averaging."): v for k, v in text.items() if k.startswith("averaging.")}
    types = typing.get_type_hints(AveragingSettings)
    unknown = sorted(set(averaging) - set(types))
    if unknown:
        raise RunRefused(f"unknown averaging setting(s): {', '.join(unknown)} (known: {', '.join(types)})")
    typed = {}
    for key, raw in averaging.items():
        try:
            typed[key] = coerce(raw, types[key], text=True)
        except Mismatch as e:
            raise RunRefused(f"averaging.{key}: {e}") from None
    try:
        return hparams, AveragingSettings(**typed)
    except ValueError as e:
        raise RunRefused(f"averaging: {e}") from None


def preload(task: str) -> None:
    """Import what training a run needs: torch, the averager, the daemon's half of a training process
    and the task's module.
    Seconds on a busy machine (1.3 s of the loop's time at a load of 2 when a `--task` run started,
    3.4 s seen under load), so the daemon runs this in a worker thread (asyncio.to_thread) before
    it resolves or trains a run, not on its event loop, where heartbeats, probe echoes and control
    calls would wait. A task that cannot be loaded is left for resolve() to refuse, with its reason."""
    importlib.import_module("peerd.daemon.attached")
    importlib.import_module("peerd.peers.averaging")
    if task:
        with contextlib.suppress(RunRefused):
            _installed(task)


def _installed(name: str) -> Task:
    from peerd.daemon.tasks import TaskLoadError, TaskNotFound, get_task

    try:
        return get_task(name)
    except (TaskNotFound, TaskLoadError, ValueError) as e:
        raise RunRefused(str(e)) from None


def manifest_path(data_dir: Path, run_id: str) -> Path:
    """Where a daemon keeps the signed manifest of a run it created or joined, so that a restart
    with no peer left to hold it in the DHT republishes the same run (same digest, same seed)."""
    return data_dir / "runs" / run_id / "manifest"


def _stored(path: Path, run_id: str, secret: RunSecret | None) -> tuple[RunManifest, bytes] | None:
    """The manifest kept at `path`, or None (none kept, or unusable: one log line says why)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("run %s: cannot read the manifest kept in %s: %s", run_id, path, e.strerror)
        return None
    try:
        return manifests.decode_manifest(data, run_id=run_id, secret=secret, subkey=None), data
    except RecordRejected as e:  # e.g. another --run-secret-file than the run was created with
        logger.warning("run %s: ignoring the manifest kept in %s: %s", run_id, path, e)
        return None


def _keep(path: Path, data: bytes) -> None:
    try:
        if path.is_file() and path.read_bytes() == data:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as e:  # training can go on; only a lone restart would mint a new manifest
        logger.warning("cannot keep the run's manifest in %s: %s", path, e.strerror)


def _check_asked(
    manifest: RunManifest, task_name: str, settings: dict[str, str], where: str, model: tuple[TensorSpec, ...] = ()
) -> None:
    """Refuse (RunRefused, naming what differs) a --task, --set or script model that disagrees with
    the run's manifest, or a manifest whose task this daemon cannot train. `where` says where it
    was found."""
    run_id = manifest.run_id
    if not manifest.task:  # trained by scripts (peerd.torch.Optimizer)
        if task_name:
            raise RunRefused(
                f"run {run_id!r} trains a model of users' scripts (peerd.torch), not task {task_name!r}{where}"
            )
        if model and (why := layout_mismatch(manifest.model, model)):
            raise RunRefused(f"this model does not match run {run_id!r}'s: {why}{where}")
        hparam_text, averaging = _split_settings(settings)
        if hparam_text:
            raise RunRefused(
                f"run {run_id!r} trains a script's model: only averaging.* settings apply, not {', '.join(sorted(hparam_text))}"
            )
        _differs(manifest, [], averaging, settings, where)
        return
    if model:
        raise RunRefused(
            f"run {run_id!r} trains task {manifest.task!r} inside its daemons; a script attaches to a run "
            f"created by a script (another run ID){where}"
        )
    if task_name and task_name != manifest.task:
        raise RunRefused(f"run {run_id!r} trains task {manifest.task!r}, not {task_name!r}{where}")
    task = _installed(manifest.task)
    try:
        hparams_from_text(task, manifest.hparams)
    except (ValueError, TypeError) as e:  # HparamsError is a ValueError
        raise RunRefused(f"run {run_id!r} has a manifest this daemon cannot use: {e}") from None
    if not settings:
        return
    hparam_text, averaging = _split_settings(settings)
    try:
        asked = hparams_from_text(task, hparam_text).to_dict()
    except (ValueError, TypeError) as e:
        raise RunRefused(str(e)) from None
    differs = [f"{k}={manifest.hparams.get(k)}" for k in hparam_text if manifest.hparams.get(k) != str(asked[k])]
    _differs(manifest, differs, averaging, settings, where)


def check_attach(manifest: RunManifest, model: tuple[TensorSpec, ...], settings: dict[str, str]) -> None:
    """Refuse (RunRefused) a script whose model or averaging settings differ from the run's."""
    _check_asked(manifest, "", manifests.settings_fields(settings), "", model)


def _differs(
    manifest: RunManifest, differs: list[str], averaging: AveragingSettings, settings: dict[str, str], where: str
) -> None:
    for key in (k.removeprefix("averaging.") for k in settings if k.startswith("averaging.")):
        if getattr(averaging, key) != getattr(manifest.averaging, key):
            differs.append(f"averaging.{key}={getattr(manifest.averaging, key)}")
    if differs:
        raise RunRefused(
            f"run {manifest.run_id!r} exists and its manifest sets {', '.join(differs)}{where}; drop --set"
        )


async def resolve(
    node: PeerNode,
    run_id: str,
    secret: RunSecret | None,
    task_name: str,
    settings: dict[str, str],
    on_rejected,
    data_dir: Path,
    model: tuple[TensorSpec, ...] = (),
) -> tuple[RunManifest, bytes] | None:
    """The run's manifest: the one in the DHT; else the one this daemon kept when it last created or
    joined the run (republished); else a new one if task_name (or, for a script attaching, its
    `model`) is given; else None (discovery only).
    The manifest used is kept in the data dir (manifest_path). Raises RunRefused when the run
    cannot be trained here as asked: another task, settings that differ from the manifest's, or
    --set without --task for a run that has no manifest."""
    path = manifest_path(data_dir, run_id)
    settings = manifests.settings_fields(settings)
    try:
        found = await manifests.fetch(node, run_id, secret, on_rejected)
    except manifests.InvalidManifests as e:
        raise RunRefused(str(e)) from None
    kept = _stored(path, run_id, secret) if found is None else None
    known = found or kept
    if task := task_name or (known[0].task if known else ""):
        await asyncio.to_thread(preload, task)  # torch and the task's module, off the event loop
    if found is not None:
        _check_asked(found[0], task_name, settings, "", model)
        _keep(path, found[1])
        return found
    if kept is not None:
        manifest, data = kept
        _check_asked(manifest, task_name, settings, f" (kept in {path}; delete it to create the run anew)", model)
        logger.info("run %s: no manifest in the DHT; republishing the one kept in %s", run_id, path)
    elif model:
        hparam_text, averaging = _split_settings(settings)
        if hparam_text:
            raise RunRefused(f"a script's run takes only averaging.* settings, not {', '.join(sorted(hparam_text))}")
        if averaging.algorithm != "diloco":  # a script hands over its parameters alone (docs/your-loop.md)
            raise RunRefused("a script's run averages under averaging.algorithm=diloco; state is for --task runs")
        manifest = RunManifest(
            run_id=run_id, task="", averaging=averaging, creator=node.peer_id, created_at=now(), model=model
        )
        data = manifests.encode_manifest(manifest, node.identity, secret)
    elif not task_name:
        if settings:
            raise RunRefused(f"run {run_id!r} has no manifest: --set needs --task to create it")
        return None  # discovery only
    else:
        task = _installed(task_name)
        hparam_text, averaging = _split_settings(settings)
        try:
            hparams = hparams_from_text(task, hparam_text)
        except (ValueError, TypeError) as e:  # HparamsError is a ValueError
            raise RunRefused(str(e)) from None
        manifest = RunManifest(
            run_id=run_id,
            task=task.name,
            hparams={k: str(v) for k, v in hparams.to_dict().items()},  # the complete set: defaults may change
            averaging=averaging,
            creator=node.peer_id,
            created_at=now(),
        )
        data = manifests.encode_manifest(manifest, node.identity, secret)
    await manifests.publish(node, manifest, data, secret, MANIFEST_TTL)
    # Two daemons may create (or republish) the run at once: everyone settles on the earliest manifest.
    try:
        settled = await manifests.fetch(node, run_id, secret, on_rejected)
    except manifests.InvalidManifests:
        settled = None  # ours is valid: it was not found yet
    settled = settled if settled is not None else (manifest, data)
    _keep(path, settled[1])
    return settled


def seed_from(*parts: str) -> int:
    """A 63-bit seed every peer derives the same way from the same strings."""
    return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little") >> 1


def init_seed(manifest: RunManifest) -> int:
    """The seed of a task run's first parameters: the same on every peer."""
    return seed_from(manifest.run_id, manifest.creator, repr(manifest.created_at))


def outer_settings(a: AveragingSettings):
    """The DiLoCo settings of a run (averaging.algorithm=diloco)."""
    from peerd.daemon.diloco import OuterSettings

    return OuterSettings(
        lr=a.outer_lr,
        momentum=a.outer_momentum,
        payload=a.payload,
        overlap=a.overlap,
        repair_every=a.repair_every,
        lanes=a.lanes,
    )


async def republish(node: PeerNode, manifest: RunManifest, data: bytes, secret: RunSecret | None) -> None:
    """Keep the manifest in the DHT while this daemon is in the run (runs as a background task)."""
    while True:
        await asyncio.sleep(MANIFEST_REPUBLISH)
        if not await manifests.publish(node, manifest, data, secret, MANIFEST_TTL):
            logger.info(
                "run %s: republishing the manifest failed; next try in %.0f s", manifest.run_id, MANIFEST_REPUBLISH
            )
