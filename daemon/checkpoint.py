"""Checkpoints in the data dir: written atomically, verified before they are loaded, and kept apart
by the identity of what they hold (run, task, hyper-parameters, the model's layout).

File layout (`ckpt-<step>.peerd`, or `ckpt-<step>-<tag>.peerd` when a checkpoint of another identity
holds that name): a 52-byte header, the identity (JSON), then the payload (torch.save of a dict).

    offset  size  field
    0       8     magic b"PEERDCK2"
    8       8     step (u64, little endian)
    16      8     payload length in bytes (u64)
    24      24    blake2b-192 digest of the identity and the payload
    48      4     identity length in bytes (u32)
    52      n     identity: JSON {"run_id", "task", "hparams", "layout"}

A file is written to a temp name, fsynced, then renamed (daemon/datadir.write_atomic), so a crash
leaves either the old set of checkpoints or the old set plus a complete new one (and a temp file,
which the next start removes). A file that is short, has a wrong magic or a wrong digest (a torn
write on a filesystem that lied, a bad disk) is never loaded: load_latest() skips it, counts it,
and falls back to the next newest. A checkpoint of another identity is never loaded nor deleted;
pruning removes only older checkpoints of the identity being saved. Files of the first format
(b"PEERDCK1", no identity) are read too; their identity is unknown.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from peerd.daemon.datadir import write_atomic

logger = logging.getLogger(__name__)

MAGIC = b"PEERDCK2"
MAGIC_V1 = b"PEERDCK1"  # 48-byte header, no identity: written by releases before identities
HEADER = struct.Struct("<8sQQ24sI")
HEADER_V1 = struct.Struct("<8sQQ24s")
MAX_IDENTITY_BYTES = 64 * 1024
# ckpt-<step>.peerd; ckpt-<step>-<identity tag>.peerd where the first name holds another identity's
NAME = re.compile(r"ckpt-(\d{12})(?:-[0-9a-f]{16})?\.peerd")


def step_of(path: Path) -> int:
    """The step in a checkpoint file's name (one of CheckpointStore.paths())."""
    return int(NAME.fullmatch(path.name).group(1))


class CorruptCheckpoint(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    state: dict[str, Any]
    path: Path
    identity: dict[str, Any] | None = None  # None: a first-format file, identity unknown


def identity_of(run_id: str, task: str, hparams: dict[str, str], model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint must match to be loaded into this model: the run, its task and complete
    hyper-parameters (as the manifest writes them), and the model's layout (names, shapes, dtypes)."""
    layout = layout_of(model.state_dict())
    return {"run_id": run_id, "task": task, "hparams": dict(sorted(hparams.items())), "layout": layout}


def layout_of(model_state: dict[str, Any]) -> str:
    return layout_digest([(k, list(v.shape), str(v.dtype)) for k, v in model_state.items() if torch.is_tensor(v)])


def layout_digest(entries: list[tuple[str, list[int], str]]) -> str:
    """The digest of a model's layout: (name, shape, dtype) per tensor, in order."""
    return hashlib.blake2b(json.dumps(entries).encode(), digest_size=8).hexdigest()


def mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Why a checkpoint of identity `theirs` cannot be loaded where `ours` is trained; "" if it can."""
    for key in ("run_id", "task"):
        if theirs.get(key) != ours.get(key):
            return f"{key} {theirs.get(key)!r}, not {ours.get(key)!r}"
    a, b = theirs.get("hparams") or {}, ours.get("hparams") or {}
    if diff := sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)):
        return "hyper-parameters " + ", ".join(f"{k}={a.get(k, '-')} (now {b.get(k, '-')})" for k in diff)
    if theirs.get("layout") != ours.get("layout"):
        return "another model layout (the task's code changed)"
    return ""


def passed_over_error(passed: list[tuple[Path, str]], resumed: Checkpoint | None) -> str:
    """A run's `error` in status when load_latest() passed over checkpoints of another identity
    (left on disk); "" when it passed over none."""
    if not passed:
        return ""
    path, why = passed[0]
    more = f" (and {len(passed) - 1} more)" if len(passed) > 1 else ""
    start = f"resumed from step {resumed.step}" if resumed is not None else "training from the start"
    return f"checkpoint {path.name}{more} not loaded: {why}; {start}; kept on disk"


def _digest(ident: bytes, payload) -> bytes:
    h = hashlib.blake2b(ident, digest_size=24)
    h.update(payload)
    return h.digest()


class CheckpointStore:
    def __init__(
        self,
        directory: Path,
        keep: int = 2,
        on_corrupt: Callable[[Path, str], None] | None = None,
        on_foreign: Callable[[Path, str], None] | None = None,
    ):
        """`on_corrupt(path, why)` hears of files that do not verify, `on_foreign(path, why)` of
        checkpoints of another identity that load_latest() passed over."""
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory, self.keep = directory, keep
        self.on_corrupt = on_corrupt or (lambda path, why: None)
        self.on_foreign = on_foreign or (lambda path, why: None)
        self._adopted: set[Path] = set()  # first-format files load_latest() loaded: ours to prune
        self.passed_over: list[tuple[Path, str]] = []  # by the latest load_latest(): other identities, why

    def save(self, step: int, state: dict[str, Any], identity: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint of `step` atomically, then drop all but the newest `keep` of this
        identity (None: the empty one)."""
        if step < 0:
            raise ValueError("step must be >= 0")
        identity = identity or {}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        ident = json.dumps(identity, sort_keys=True).encode()
        header = HEADER.pack(MAGIC, step, len(payload), _digest(ident, payload), len(ident))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:012d}.peerd"
        if path.exists() and path not in self._adopted and self._identity_or_none(path) != identity:
            path = path.with_name(f"ckpt-{step:012d}-{hashlib.blake2b(ident, digest_size=8).hexdigest()}.peerd")
        write_atomic(path, header + ident + payload)
        ours = [p for p in self.paths() if p in self._adopted or self._identity_or_none(p) == identity]
        for old in ours[self.keep :]:
            old.unlink(missing_ok=True)
            self._adopted.discard(old)
        return path

    def load_latest(self, identity: dict[str, Any] | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies and, given `identity`, is of that identity (a
        first-format file: whose model layout matches), or None. Corrupt files and checkpoints of
        another identity are reported (the latter also in `passed_over`), skipped, and left on disk."""
        self.passed_over = []
        for path in self.paths():
            try:
                theirs = self.read_identity(path)
                why = mismatch(identity, theirs) if identity is not None and theirs is not None else ""
                if not why:
                    checkpoint = self.read(path)
                    if identity is not None and theirs is None:
                        model = checkpoint.state.get("model")
                        ok = isinstance(model, dict) and layout_of(model) == identity["layout"]
                        why = "" if ok else "written by an older release for another model layout"
            except CorruptCheckpoint as e:
                logger.warning("skipping checkpoint %s: %s", path.name, e)
                self.on_corrupt(path, str(e))
                continue
            if why:
                self.passed_over.append((path, why))
                self.on_foreign(path, why)
                continue
            if theirs is None:
                self._adopted.add(path)
            return checkpoint
        return None

    @staticmethod
    def read_identity(path: Path) -> dict[str, Any] | None:
        """The identity a checkpoint file declares (None: a first-format file), from its header
        only: not verified against the digest (read() does that)."""
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            if head[:8] == MAGIC_V1:
                return None
            if len(head) < HEADER.size:
                raise CorruptCheckpoint(f"{len(head)} bytes, shorter than the header")
            if head[:8] != MAGIC:
                raise CorruptCheckpoint("not a peerd checkpoint (bad magic)")
            n = HEADER.unpack(head)[4]
            if n > MAX_IDENTITY_BYTES:
                raise CorruptCheckpoint(f"identity of {n} bytes (damaged header)")
            try:
                identity = json.loads(f.read(n))
            except ValueError:
                raise CorruptCheckpoint("identity does not parse") from None
        if not isinstance(identity, dict):
            raise CorruptCheckpoint("identity is not a mapping")
        return identity

    @staticmethod
    def read(path: Path) -> Checkpoint:
        data = path.read_bytes()
        if data[:8] == MAGIC_V1 and len(data) >= HEADER_V1.size:
            _, step, length, digest = HEADER_V1.unpack_from(data)
            ident, payload = b"", memoryview(data)[HEADER_V1.size :]
        elif len(data) < HEADER.size:
            raise CorruptCheckpoint(f"{len(data)} bytes, shorter than the header")
        elif data[:8] != MAGIC:
            raise CorruptCheckpoint("not a peerd checkpoint (bad magic)")
        else:
            _, step, length, digest, n = HEADER.unpack_from(data)
            ident, payload = data[HEADER.size : HEADER.size + n], memoryview(data)[HEADER.size + n :]
        if len(payload) != length:
            raise CorruptCheckpoint(f"payload is {len(payload)} bytes, header says {length} (torn write)")
        if _digest(ident, payload) != digest:
            raise CorruptCheckpoint("digest mismatch")
        state = torch.load(io.BytesIO(payload), weights_only=True)
        return Checkpoint(step=step, state=state, path=path, identity=json.loads(ident) if ident else None)

    def _identity_or_none(self, path: Path) -> dict[str, Any] | None:
        try:
            return self.read_identity(path)
        except (OSError, CorruptCheckpoint):
            return None

    def paths(self) -> list[Path]:
        """Checkpoint files, newest step first (temp files of writes in progress are not listed)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if NAME.fullmatch(p.name)]
        return sorted(found, key=step_of, reverse=True)
