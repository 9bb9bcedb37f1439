"""The collective engine: group all-reduce (reduce-scatter + all-gather) over interchangeable transports.

    transport = TcpTransport("127.0.0.1", 0); address = await transport.start()
    engine = GroupAllReduce(Group(run_id, members, addresses, me), transport, numel)
    outcome = await engine.all_reduce(tensor, weight, round_no)   # -> Outcome

Loss-tolerant mode (UDP datagrams, nothing retransmitted; docs/loss-tolerance.md):

    transport = UdpTransport(host, 0, secret=engine_key, session=group_key, max_datagram=1472, rate_bps=...)
    engine = LossyAllReduce(Group(run_id, members, addresses, me), transport, numel)
    outcome = await engine.all_reduce(tensor, weight, round_no)   # COMPLETED, PARTIAL or ABORTED

wire.py (the header), transport.py (the interface), tcp.py (direct TCP), p2p.py (libp2p streams,
for members behind NAT), fallback.py (TCP, else libp2p, per link), linkauth.py (links keyed by the
run secret), group.py (members, shards, chunks, timeouts), gather_timeout.py (a group's gather timeout
from its members' measured rounds), codec.py (fp32/fp16/int8 payloads), rounds.py (what a round has seen), inbox.py (the one class that
admits what arrives, its buffers, the tensor's backup), chunks.py (its admission rule for a stream's
chunks), reduction.py (the one reduction kernel, and this member's shard), decision.py (complete or
abort, the digest), allreduce.py (the round and its contract), halves.py (reduce-scatter and
all-gather as separate steps, for DeAR; the Inbox's rule for their ops), outcome.py (what a round returns);
datagram.py (one authenticated UDP datagram), udp.py and udpsend.py (the datagram transport),
lossy.py (the loss-tolerant rule and packet grid), packets.py (the Inbox's admission rule for the
packet grid), lossy_allreduce.py (the loss-tolerant round).
"""

from peerd.peers.collective.group import AllReduceSettings, Group, shard_bounds
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective.tcp import TcpTransport
from peerd.peers.collective.transport import FilteredTransport, Transport
from peerd.peers.collective.udp import UdpTransport

from peerd.peers.torch_exports import attributes

# The two rounds import torch: loaded on first use (peers/torch_exports.py).
__getattr__ = attributes(
    __name__,
    {
        "peerd.peers.collective.allreduce": ("GroupAllReduce",),
        "peerd.peers.collective.lossy_allreduce": ("LossyAllReduce",),
    },
)


__all__ = [
    "AllReduceSettings",
    "FilteredTransport",
    "Group",
    "GroupAllReduce",
    "LossyAllReduce",
    "Outcome",
    "Status",
    "TcpTransport",
    "Transport",
    "UdpTransport",
    "shard_bounds",
]
