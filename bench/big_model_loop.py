"""The user script of bench/big_model.py: a stack of `--layers` Linear(dim, dim) layers trained
through peerd.torch.Optimizer (plain SGD: the script's own inner state stays small), printing one
JSON line when it attaches and one at each phase's end. Runs until killed or `--steps`.

    python -m bench.big_model_loop RUN --daemon DATA_DIR --dim 4123 --layers 5 --every 4
"""

import argparse
import json

import torch

import peerd.torch

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--daemon", required=True)
p.add_argument("--dim", type=int, required=True)
p.add_argument("--layers", type=int, required=True)
p.add_argument("--every", type=int, default=4, help="inner steps per outer step (H)")
p.add_argument("--steps", type=int, default=10**9)
p.add_argument("--batch", type=int, default=4)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
opt = peerd.torch.Optimizer(
    torch.optim.SGD(model.parameters(), lr=1e-3),
    run=args.run,
    daemon=args.daemon,
    model=model,
    settings={"average_every": args.every, "first_phase": 0},
)
print(json.dumps({"attached": opt.run_step, "params": sum(p.numel() for p in model.parameters())}), flush=True)
run_step = opt.run_step
for _ in range(args.steps):
    x = torch.randn(args.batch, args.dim)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step(samples=args.batch, loss=loss)
    opt.zero_grad()
    if opt.run_step != run_step:
        run_step = opt.run_step
        print(json.dumps({"phase_end": run_step, "outcome": opt.last_outcome}), flush=True)
opt.close()
