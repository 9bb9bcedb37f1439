"""DeAR inside fast local groups: gradients all-reduced as reduce-scatter + all-gather, overlapped
with backward and the next forward (Zhang et al., arXiv 2302.12445). docs/dear.md is the guide.

    collective = GlooCollective(timeout=30.0)           # or EngineCollective, or any Collective (backend.py)
    dear = DeAR(model, optimizer, collective, DeARSettings(bucket_bytes=1 << 20))
    loss = task.loss(model, batch); loss.backward(); dear.step()   # per step; dear.flush() before reading params

backend.py (the protocol a backend implements and its contract), gloo.py (torch.distributed
gloo backend), engine.py (peerd's own engine: peers/collective/halves.py), fake.py (in-process
backend for tests), buckets.py (tensor fusion), schedule.py (the
hooks and the three modes), overlap.py (overlap ratio from timestamps), tuner.py (online bucket
size from fitted latency and bandwidth), localgroup.py (which peers form a fast local group),
member.py (which daemons are a local group: by label or by measured links), hierarchy.py (lanes),
delegate.py (a spanning local group's lanes, each averaged by its daemon).
"""

from peerd.peers.dear.localgroup import LinkSample, LocalGroupRules, LocalGroups, PeerSample, local_groups
from peerd.peers.dear.tuner import Fit, FusionTuner, Retune, TunerSettings

from peerd.peers.torch_exports import attributes

# The rest imports torch: loaded on first use (peers/torch_exports.py). The daemon imports member.py, through
# this package, whether or not it trains.
__getattr__ = attributes(
    __name__,
    {
        "peerd.peers.dear.buckets": ("Bucket", "BucketPlan", "plan_buckets"),
        "peerd.peers.dear.backend": ("Collective", "CollectiveError", "Handle", "Half"),
        "peerd.peers.dear.engine": ("EngineCollective",),
        "peerd.peers.dear.overlap": ("StepStats",),
        "peerd.peers.dear.schedule": ("DeAR", "DeARSettings", "Mode"),
    },
)


__all__ = [
    "Bucket",
    "BucketPlan",
    "Collective",
    "CollectiveError",
    "DeAR",
    "DeARSettings",
    "EngineCollective",
    "Fit",
    "FusionTuner",
    "Half",
    "Handle",
    "LinkSample",
    "LocalGroupRules",
    "LocalGroups",
    "Mode",
    "PeerSample",
    "Retune",
    "StepStats",
    "TunerSettings",
    "local_groups",
    "plan_buckets",
]
