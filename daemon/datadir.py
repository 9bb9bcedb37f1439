"""The data directory: who owns it (a lock), the identity key, the ready file, and the runs'
manifests and checkpoints (runs/<run>/)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class DataDirError(RuntimeError):
    """The data dir cannot be used; the message is one line meant for the operator."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename: readers see the old file or the whole new one, never a torn one. A
    crash before the rename leaves the temp file, which DataDir.open() removes."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class DataDir:
    """Holds an exclusive lock on the directory for the daemon's lifetime."""

    def __init__(self, path: Path):
        self.path = path
        self._lock_fd: int | None = None

    identity_path = property(lambda self: self.path / "identity.key")
    ready_path = property(lambda self: self.path / "ready.json")
    lock_path = property(lambda self: self.path / "daemon.lock")

    def open(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise DataDirError(f"cannot create data dir {self.path}: {e.strerror}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise DataDirError(f"data dir {self.path} is not writable by this user")
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DataDirError(f"cannot open lock file in data dir {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirError(f"data dir {self.path} is in use by a live daemon (pid {owner})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self.ready_path.unlink(missing_ok=True)  # left by a crashed daemon; we own the dir now
        self.remove_temp_files()

    def remove_temp_files(self) -> list[Path]:
        """Remove the temp files of writes a crash interrupted (write_atomic's, in the data dir and
        under runs/): nobody else writes here while we hold the lock. Returns what was removed."""
        runs = self.path / "runs"
        found = [*self.path.glob(".*.tmp"), *(runs.rglob(".*.tmp") if runs.is_dir() else [])]
        removed = []
        for path in found:
            try:
                path.unlink()
                removed.append(path)
            except OSError as e:
                logger.warning("cannot remove %s, left by an interrupted write: %s", path, e.strerror)
        if removed:
            names = ", ".join(str(p.relative_to(self.path)) for p in removed)
            logger.info("removed %d temp file(s) left by interrupted writes: %s", len(removed), names)
        return removed

    def write_ready(self, info: dict[str, Any]) -> None:
        write_atomic(self.ready_path, (json.dumps(info, indent=2) + "\n").encode())

    def close(self) -> None:
        self.ready_path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def read_ready(data_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((data_dir / "ready.json").read_text())
    except (OSError, ValueError):
        return None
