"""The layout of the file a daemon and its attached process share (/dev/shm; daemon/attached.py
writes it, peerd/attachment.py maps it): one definition for both sides.

    bytes 0..20    HEADER: MAGIC, the format (1, or 2 with overlap), numel
    bytes 20..24   GROUP_EPOCH: the epoch of the local group the daemon has formed (the processes
                   attached to the run; a member whose group has another regroups)
    bytes 24..32   END_AT: the boundary step of a phase the daemon ends early (0: none)
    bytes 32..56   format 2, COUNT each: LANDED (rounds landed between two EndPhases), APPLIED (how
                   many of them the process's parameters hold), THETA_SEQ (odd while θ is written)
    bytes 56..64   PHASE_STEPS, a COUNT: the steps of the phase under way (the process writes it at
                   each step, the daemon zeroes it at each attach and EndPhase; the daemon's
                   local step, in status and metrics, and the step it announces move with it)
    HEADER_BYTES   the inner vector: numel float32 values in the model's layout order
    then           format 2: θ, numel float32 values
"""

import struct

MAGIC = b"PEERDSHM"
HEADER = struct.Struct("<8sIQ")  # magic, format, numel; padded to HEADER_BYTES
HEADER_BYTES = 64
GROUP_EPOCH = struct.Struct("<I")
GROUP_EPOCH_OFFSET = 20
END_AT = struct.Struct("<Q")
END_AT_OFFSET = 24
COUNT = struct.Struct("<Q")
LANDED_OFFSET, APPLIED_OFFSET, THETA_SEQ_OFFSET, PHASE_STEPS_OFFSET = 32, 40, 48, 56


def file_size(numel: int, theta: bool) -> int:
    """Bytes of a shared file of `numel` values, with θ (format 2) or without."""
    return HEADER_BYTES + 4 * numel * (2 if theta else 1)
