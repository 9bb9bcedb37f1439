"""One lab host's training loop for bench.vs_peers: charlm under one system, until a shared deadline.

    python -m bench.vs_peers_host train --system peerd|hivemind|torchft|alone --out DIR --index I --ip IP ...
    python -m bench.vs_peers_host lighthouse --out FILE --ip IP --lifetime SECONDS

bench.vs_peers starts one per host, inside the host's network namespace. Every system runs the
same loop on the same model, data and inner optimizer (the charlm task's: its model built from seed 0
on every host, its batches drawn from the host's own seed, AdamW); only the line marked "system"
differs. The process writes its events as JSON lines to DIR/<host>.jsonl: "ready" when the system
is set up, a "snapshot" (the model's parameters, saved to DIR) at every multiple of --snapshot-every
seconds of training, and "done" at the deadline. It trains only after DIR/go.json names the start
and the deadline (wall-clock time: one machine, one clock), so that every host and every system
gets the same training time, set-up excluded; a restarted process finds go.json already there and
trains at once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from functools import partial
from pathlib import Path

GO_TIMEOUT = 300.0  # seconds a ready host waits for go.json before it gives up (the bench's set-up bound is shorter)
MAX_STEPS = 1_000_000  # a bound on the loop besides the deadline
LIGHTHOUSE_PORT = 29510  # torchft's lighthouse, on the first host
# hivemind's own advice (hivemind/optim/optimizer.py's docstring): 3-5 s of matchmaking for small
# local runs, an averaging timeout of about twice an all-reduce (about 0.3 s here; 30 s leaves room for loss).
HIVEMIND_MATCHMAKING_S = 5.0
HIVEMIND_AVERAGING_TIMEOUT_S = 30.0
# torchft's DiLoCo as its own tests set it up (torchft/_test/diloco_trainer.py): Nesterov SGD at lr
# 0.7, momentum 0.9 as the outer optimizer (the DiLoCo paper's). Its timeouts are its defaults (60 s):
# the tests' 10 s made a quorum time out, and the process raise, where hosts drifted more than 10 s
# apart (3 hosts on 2 cores here).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


class Events:
    """Appends one JSON line per event to the host's file (several incarnations append to one file)."""

    def __init__(self, path: Path, incarnation: int):
        self.path, self.incarnation = path, incarnation

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "incarnation": self.incarnation, "wall": time.time(), **fields}) + "\n")


def wait_for_go(out: Path) -> dict:
    deadline = time.monotonic() + GO_TIMEOUT
    while time.monotonic() < deadline:
        try:
            return json.loads((out / "go.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)  # polling a file another process writes: no event to wait on across namespaces
    raise TimeoutError(f"no {out / 'go.json'} after {GO_TIMEOUT:.0f} s")


def setup_system(args, model, inner, h):
    """The system's step (called after backward) and its close, set up on this host. Blocks until the
    system is ready to train (attached, DHT joined, manager up)."""
    if args.system == "alone":
        return inner.step, lambda: None
    if args.system == "peerd":
        import peerd.torch

        # The run's defaults but H and --settings (bench.vs_peers: overlap on, which a run a script
        # creates must ask for: docs/your-loop.md).
        settings = dict(kv.split("=", 1) for kv in args.settings.split(",") if kv)
        opt = peerd.torch.Optimizer(
            inner, run=args.run, daemon=args.daemon, model=model, settings={"average_every": args.every, **settings}
        )
        return partial(opt.step, samples=h.batch_size), opt.close
    if args.system == "hivemind":
        import logging

        import hivemind
        import torch

        logging.getLogger("hivemind").setLevel(logging.ERROR)
        initial = json.loads(Path(args.initial_peers).read_text()) if args.index else None
        # The host's address only, and never UPnP/NAT-PMP or AutoNAT: nothing leaves the lab.
        dht = hivemind.DHT(
            start=True, initial_peers=initial, host_maddrs=[f"/ip4/{args.ip}/tcp/0"], nat_port_map=False, auto_nat=False
        )
        if not args.index:
            Path(args.initial_peers).write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
        # The charlm task's AdamW; hivemind builds it from a factory over the same parameters.
        group = inner.param_groups[0]
        opt = hivemind.Optimizer(
            dht=dht,
            run_id=args.run,
            # A round when the hosts together took about H steps each.
            target_batch_size=args.hosts * h.batch_size * args.every,
            batch_size_per_step=h.batch_size,
            optimizer=partial(torch.optim.AdamW, lr=group["lr"], weight_decay=group["weight_decay"]),
            params=model.parameters(),
            use_local_updates=True,
            matchmaking_time=HIVEMIND_MATCHMAKING_S,
            averaging_timeout=HIVEMIND_AVERAGING_TIMEOUT_S,
            verbose=False,
        )

        def close():
            opt.shutdown()
            dht.shutdown()

        return opt.step, close
    if args.system == "torchft":
        # torchft advertises socket.gethostname() (its checkpoint server's URL); in a lab namespace the
        # machine's name resolves outside the lab, so this process's name is its host's address.
        socket.gethostname = lambda: args.ip
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the namespace's only link
        import torch
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        store = torch.distributed.TCPStore(host_name=args.ip, port=0, is_master=True, wait_for_workers=False)

        def state_dict():
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(state):
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])

        manager = Manager(
            pg=ProcessGroupGloo(),
            # One host may train on while the others are away (a restart): a quorum of one.
            min_replica_size=1,
            use_async_quorum=False,  # DiLoCo requires it
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            replica_id=f"h{args.index}",
            store_addr=args.ip,
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=args.lighthouse,
            hostname=args.ip,
        )
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        diloco = DiLoCo(manager, [model], inner, outer, sync_every=args.every, pin_memory=False)
        diloco.__enter__()  # its hooks on the inner optimizer: every H-th step is an outer step

        def close():
            diloco.__exit__(None, None, None)
            manager.shutdown(wait=False)
            store.set("closed", "1")  # `store` is held until here: a collected master store stops serving

        return inner.step, close
    raise ValueError(f"unknown system {args.system!r}")


def train(args) -> int:
    import torch

    from peerd.daemon.tasks import get_task

    torch.set_num_threads(1)
    out = Path(args.out)
    events = Events(out / f"h{args.index}.jsonl", args.incarnation)
    task = get_task("charlm")
    h = task.parse_hparams({})
    model, inner = task.build(h, 0)  # the same initial parameters on every host, for every system
    step, close = setup_system(args, model, inner, h)  # system
    data = task.data(h, 1000 * args.incarnation + args.index)  # each host (and each restart) its own order
    events("ready")
    go = wait_for_go(out)
    tick = max(int((time.time() - go["start"]) // args.snapshot_every) + 1, 1)
    steps = 0

    def snapshot(name: str, t: float) -> None:
        path = out / f"h{args.index}-{args.incarnation}-{name}.pt"
        torch.save(model.state_dict(), path)
        events("snapshot", t=round(t, 2), tick=name, step=steps, file=path.name)

    while time.time() < go["start"]:
        time.sleep(0.01)  # until the shared start, which go.json names a moment ahead
    # Where the loop's time goes: wall seconds in forward + backward and in the system's step (the
    # inner step, and peerd's phase ends: hand-over, round), and CPU seconds of the loop's thread and
    # of the whole process (its other threads: gRPC's, the lease's, hivemind's, torchft's).
    compute_s = step_s = 0.0
    cpu_thread, cpu_process = time.thread_time(), time.process_time()
    while steps < MAX_STEPS and (now := time.time()) < go["deadline"]:
        if now >= go["start"] + tick * args.snapshot_every:
            snapshot(str(tick), now - go["start"])
            tick = int((now - go["start"]) // args.snapshot_every) + 1  # ticks missed in a long round: skipped
        began = time.perf_counter()
        loss = task.loss(model, next(data))
        loss.backward()
        stepping = time.perf_counter()
        step()
        inner.zero_grad()
        done = time.perf_counter()
        compute_s, step_s = compute_s + stepping - began, step_s + done - stepping
        steps += 1
    cpu_thread, cpu_process = time.thread_time() - cpu_thread, time.process_time() - cpu_process
    snapshot("final", time.time() - go["start"])
    events(
        "done",
        steps=steps,
        samples=steps * h.batch_size,
        compute_s=round(compute_s, 2),
        step_s=round(step_s, 2),
        cpu_loop_thread_s=round(cpu_thread, 2),
        cpu_loop_process_s=round(cpu_process, 2),
    )
    close()
    return 0


def lighthouse(args) -> int:
    """torchft's lighthouse (its Rust server) on the first host, for --lifetime seconds at most."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=1)
    Path(args.out).write_text(json.dumps({"address": f"http://{args.ip}:{LIGHTHOUSE_PORT}"}))
    time.sleep(args.lifetime)  # the bench kills it earlier; this only bounds a forgotten one
    server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vs_peers_host", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--system", required=True, choices=("peerd", "hivemind", "torchft", "alone"))
    t.add_argument("--out", required=True, help="the system's shared directory: events, snapshots, go.json")
    t.add_argument("--index", type=int, required=True, help="the host's index; 0 bootstraps the others")
    t.add_argument("--ip", required=True, help="the host's address in the lab")
    t.add_argument("--hosts", type=int, required=True)
    t.add_argument("--every", type=int, default=50, help="H: inner steps per round")
    t.add_argument("--incarnation", type=int, default=0, help="restarts of this host so far")
    t.add_argument("--snapshot-every", type=float, default=10.0, help="seconds of training between two snapshots")
    t.add_argument("--run", default="vs-peers", help="peerd's run ID, hivemind's run_id")
    t.add_argument("--daemon", help="peerd: the host's daemon's data dir")
    t.add_argument("--settings", default="", help="peerd: the run's averaging settings beyond H, KEY=VALUE,...")
    t.add_argument("--initial-peers", help="hivemind: a file with the first host's DHT addresses")
    t.add_argument("--lighthouse", help="torchft: the lighthouse's address")
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--out", required=True, help="a file to write the lighthouse's address to")
    lh.add_argument("--ip", required=True)
    lh.add_argument("--lifetime", type=float, default=3600.0)
    args = p.parse_args(argv)
    return train(args) if args.command == "train" else lighthouse(args)


if __name__ == "__main__":
    sys.exit(main())
