"""Checkpoints in the data dir: written atomically, verified before they are loaded.

File layout (`ckpt-<step>.peerd`): a 48-byte header, then the payload (torch.save of a dict).

    offset  size  field
    0       8     magic b"PEERDCK1"
    8       8     step (u64, little endian)
    16      8     payload length in bytes (u64)
    24      24    blake2b-192 digest of the payload

A file is written to a temp name, fsynced, then renamed (daemon/datadir.write_atomic), so a crash
leaves either the old set of checkpoints or the old set plus a complete new one. A file that is
short, has a wrong magic or a wrong digest (a torn write on a filesystem that lied, a bad disk) is
never loaded: load_latest() skips it, counts it, and falls back to the next newest.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from daemon.datadir import write_atomic

logger = logging.getLogger(__name__)

MAGIC = b"PEERDCK1"
HEADER = struct.Struct("<8sQQ24s")
NAME = re.compile(r"ckpt-(\d{12})\.peerd")


class CorruptCheckpoint(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    state: dict[str, Any]
    path: Path


class CheckpointStore:
    def __init__(self, directory: Path, keep: int = 2, on_corrupt: Callable[[Path, str], None] | None = None):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory, self.keep = directory, keep
        self.on_corrupt = on_corrupt or (lambda path, why: None)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write a checkpoint of `step` atomically, then drop all but the newest `keep`."""
        if step < 0:
            raise ValueError("step must be >= 0")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        header = HEADER.pack(MAGIC, step, len(payload), hashlib.blake2b(payload, digest_size=24).digest())
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:012d}.peerd"
        write_atomic(path, header + payload)
        for old in self._paths()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None. Corrupt files are reported and skipped."""
        for path in self._paths():
            try:
                return self.read(path)
            except CorruptCheckpoint as e:
                logger.warning("skipping checkpoint %s: %s", path.name, e)
                self.on_corrupt(path, str(e))
        return None

    @staticmethod
    def read(path: Path) -> Checkpoint:
        data = path.read_bytes()
        if len(data) < HEADER.size:
            raise CorruptCheckpoint(f"{len(data)} bytes, shorter than the header")
        magic, step, length, digest = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise CorruptCheckpoint("not a peerd checkpoint (bad magic)")
        payload = memoryview(data)[HEADER.size :]
        if len(payload) != length:
            raise CorruptCheckpoint(f"payload is {len(payload)} bytes, header says {length} (torn write)")
        if hashlib.blake2b(payload, digest_size=24).digest() != digest:
            raise CorruptCheckpoint("digest mismatch")
        state = torch.load(io.BytesIO(payload), weights_only=True)
        return Checkpoint(step=step, state=state, path=path)

    def _paths(self) -> list[Path]:
        """Checkpoint files, newest step first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if NAME.fullmatch(p.name)]
        return sorted(found, key=lambda p: int(NAME.fullmatch(p.name).group(1)), reverse=True)
