"""The daemon's lifecycle states. Transitions go through Daemon._set_state only."""

from __future__ import annotations

from enum import Enum


class DaemonState(Enum):
    STARTING = "STARTING"  # opening the data dir, starting p2pd, joining the DHT and the runs
    READY = "READY"  # serving: health SERVING, ready.json written
    DRAINING = "DRAINING"  # leaving runs and stopping servers after SIGTERM/Shutdown
    STOPPED = "STOPPED"  # everything stopped; the process is about to exit


ALLOWED = {
    DaemonState.STARTING: {DaemonState.READY, DaemonState.DRAINING, DaemonState.STOPPED},
    DaemonState.READY: {DaemonState.DRAINING},
    DaemonState.DRAINING: {DaemonState.STOPPED},
    DaemonState.STOPPED: set(),
}
