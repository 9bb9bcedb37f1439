"""A training script for tests: a linear model trained through peerd.torch.Optimizer, printing one
JSON line when it attaches, one at each phase's end and one when done."""

import argparse
import faulthandler
import json
import signal
import time

import torch

import peerd.torch

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waited in vain asks where it is
p = argparse.ArgumentParser()
p.add_argument("--run", required=True)
p.add_argument("--daemon", required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--every", type=int, default=10)
p.add_argument("--first-phase", type=int, default=0, help="the run's averaging.first_phase; -1: the run's default")
p.add_argument("--sleep", type=float, default=0.0, help="seconds per step: a slow loop that spans an event")
p.add_argument("--dim", type=int, default=8)
p.add_argument("--reconnect-timeout", type=float, default=60.0)
p.add_argument("--budget", type=float, default=None, help="the run's averaging.inner_budget (DropCompute)")
p.add_argument("--eval", action="store_true", help="report the loss as an evaluation at each phase's end")
p.add_argument("--overlap", action="store_true", help="a run with averaging.overlap: rounds land between steps")
p.add_argument("--round-timeout", type=float, default=None, help="the run's averaging.round_timeout")
p.add_argument("--float-loss", action="store_true", help="pass the loss as a float (the daemon shows it mid-phase)")
p.add_argument("--until", type=float, default=None, help="stop at this time.time() instead of after --steps")
p.add_argument("--seed", type=int, default=0, help="the data's order (the model's first parameters: seed 0)")
p.add_argument("--dear", action="store_true", help="in a local group, the gradients' all-reduce under DeAR")
p.add_argument(
    "--dear-bucket-bytes", type=float, default=1 << 20, help="DeAR's fusion target (0: a bucket per parameter)"
)
p.add_argument("--layers", type=int, default=1, help="linear layers (two: a model of several modules for DeAR)")
p.add_argument("--group-size", type=int, default=None, help="processes expected in the local group (torchrun's)")
p.add_argument("--save", default=None, help="write the model's state_dict here at the end")
p.add_argument("--device", default="cpu", help="where the model trains (cuda: every process on the one GPU)")
p.add_argument("--nccl", action="store_true", help="in a local group, NCCL where every member has a GPU of its own")
args = p.parse_args()

torch.manual_seed(0)
model = (
    torch.nn.Linear(args.dim, 1)
    if args.layers == 1
    else torch.nn.Sequential(
        *[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers - 1)], torch.nn.Linear(args.dim, 1)
    )
).to(args.device)
opt = peerd.torch.Optimizer(
    torch.optim.SGD(model.parameters(), lr=0.05),
    run=args.run,
    daemon=args.daemon,
    model=model,
    settings={
        "average_every": args.every,
        **({"first_phase": args.first_phase} if args.first_phase >= 0 else {}),
        **({"inner_budget": args.budget} if args.budget is not None else {}),
        **({"overlap": "true"} if args.overlap else {}),
        **({"round_timeout": args.round_timeout} if args.round_timeout is not None else {}),
    },
    reconnect_timeout=args.reconnect_timeout,
    dear=args.dear,
    group_size=args.group_size,
    dear_bucket_bytes=args.dear_bucket_bytes,
    nccl=args.nccl,
)
torch.manual_seed(args.seed)
print(json.dumps({"attached": opt.run_step}), flush=True)
target = torch.arange(args.dim, dtype=torch.float32, device=args.device) / args.dim
phases = []  # steps of each phase this loop ended (the run's step moves at a phase's end only)
phase_began, run_step = opt.local_step, opt.run_step
for i in range(args.steps if args.until is None else 10**9):
    if args.until is not None and time.time() >= args.until:
        break
    x = torch.randn(16, args.dim).to(args.device)
    loss = ((model(x).squeeze(-1) - x @ target) ** 2).mean()
    loss.backward()
    opt.step(samples=16, loss=loss.item() if args.float_loss else loss)
    opt.zero_grad()
    if opt.run_step != run_step:
        phases.append(opt.local_step - phase_began)
        phase_began, run_step = opt.local_step, opt.run_step
        print(
            json.dumps(
                {
                    "phase_end": run_step,
                    "outcome": opt.last_outcome,
                    "steps": phases[-1],
                    "group": [opt.group_rank, opt.group_size],
                    "dear_overlap": opt.dear_overlap_ratio,  # NaN without DeAR
                    "backend": opt.group_backend,
                }
            ),
            flush=True,
        )
        if args.eval:
            opt.report_eval("loss", loss.item(), higher_is_better=False)
    if (i + 1) % args.every == 0:
        print(
            json.dumps({"step": i + 1, "run_step": opt.run_step, "outcome": opt.last_outcome, "loss": loss.item()}),
            flush=True,
        )
    time.sleep(args.sleep)
opt.close()
if args.save:
    torch.save(model.state_dict(), args.save)
print(
    json.dumps({"done": opt.run_step, "local_step": opt.local_step, "phases": phases, "landed": opt.landed_rounds}),
    flush=True,
)
