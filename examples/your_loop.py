"""Your own training loop on a peerd run: a small character-level transformer on Python's own source.

    peerd start --run my-run --data-dir /tmp/peerd-a              # the daemon: network, rounds, metrics
    python examples/your_loop.py my-run --daemon /tmp/peerd-a --steps 600

Run the pair on every machine (other daemons with --initial-peers). On a machine of several GPUs,
one process per GPU, all attached to the one daemon (its local group, one peer of the run):

    torchrun --nproc-per-node 8 examples/your_loop.py my-run --daemon /tmp/peerd-a

Everything below is plain PyTorch except the two lines marked "peerd". docs/your-loop.md says what
they do.
"""

import argparse
import math
import os
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

import peerd.torch

p = argparse.ArgumentParser()
p.add_argument("run", help="the run's ID (as `peerd start --run` and `peerd export` take it)")
p.add_argument("--daemon", required=True, help="the daemon's --data-dir")
p.add_argument("--steps", type=int, default=600, help="train until the run's step reaches this")
p.add_argument("--every", type=int, default=50, help="inner steps per outer step (for a run this creates)")
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--seed", type=int, default=0, help="data order; the run's parameters come from the run")
p.add_argument("--save", help="write the model's state_dict here at the end")
p.add_argument(
    "--dear",
    action="store_true",
    help="in a local group: the all-reduce overlapped with compute (DeAR; clipping then sees no gradients)",
)
args = p.parse_args()
RANK = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun's process on this machine (0 under plain python)
if args.device == "cuda":  # one GPU per process; more processes than GPUs share them
    args.device = f"cuda:{RANK % torch.cuda.device_count()}"
torch.manual_seed(args.seed + RANK)  # each process its own data order
torch.set_num_threads(1)

# A text every machine with Python has: the standard library's top-level modules, as bytes.
files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
text = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)[:1_000_000]), dtype=torch.uint8).long()
train, held_out = text[:-50_000], text[-50_000:]
CONTEXT, BATCH = 64, 32


def batch(data: torch.Tensor, starts: torch.Tensor):
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    chunk = data[idx].to(args.device)
    return chunk[:, :-1], chunk[:, 1:]


class TinyLM(torch.nn.Module):
    def __init__(self, d=64, layers=2, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.zeros(CONTEXT, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 256)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.blocks(self.embed(x) + self.pos[: x.shape[1]], mask=mask, is_causal=True))


@torch.no_grad()
def evaluate(model) -> float:
    starts = torch.linspace(0, len(held_out) - CONTEXT - 2, 64).long()
    x, y = batch(held_out, starts)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() / math.log(2)  # bits per character


model = TinyLM().to(args.device)
inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
opt = peerd.torch.Optimizer(
    inner,
    run=args.run,
    daemon=args.daemon,
    model=model,  # peerd: attach
    settings={"average_every": args.every},
    dear=args.dear,
)
# Warm-up over the run's steps (opt.live_step), not this process's: the same on every member of a
# local group, including one that joins late.
schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda _: min(1.0, (opt.live_step + 1) / 50))
print(
    f"attached at run step {opt.run_step} (rank {opt.group_rank} of {opt.group_size}); "
    f"eval {evaluate(model):.3f} bits/char",
    flush=True,
)

step = 0
while opt.live_step < args.steps:  # the run's step: a local group's members stop together
    x, y = batch(train, torch.randint(0, len(train) - CONTEXT - 2, (BATCH,)))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(samples=BATCH, loss=loss)  # peerd: an inner step; every `every` steps, the outer step
    opt.zero_grad()
    schedule.step()
    step += 1
    if step % 100 == 0:
        print(
            f"step {step} run step {opt.run_step} loss {loss.item() / math.log(2):.3f} round {opt.last_outcome or '-'}",
            flush=True,
        )

print(f"done: run step {opt.run_step}; eval {evaluate(model):.3f} bits/char", flush=True)
opt.close()
if args.save and RANK == 0:
    torch.save(model.state_dict(), args.save)
sys.exit(0)
