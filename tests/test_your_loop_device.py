"""The copies between a model and the shared vector (peerd/torch.py), on every device present: the
CPU here, a GPU where CUDA is (the vector then page-locked in place). No daemon: the vector is a
mapped file laid out as daemon/attached.py's SharedVector. Then a local group's processes on a GPU
(skipped without one): the NCCL path of its collective, and two processes on one GPU under a daemon."""

from __future__ import annotations

import json
import math
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peerd.attachment import Slot
from peerd.local_group import Collective, backend_for, device_key
from peerd.shared_file import HEADER_BYTES
from peerd.torch import from_vector, move_by, pin, to_vector, unpin

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "attach_script.py"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def mapped_vector(tmp_path, numel: int) -> tuple[mmap.mmap, torch.Tensor]:
    # Where the daemon puts it (daemon/attached.py shared_directory): tmpfs, which CUDA can pin.
    shm = Path("/dev/shm")
    path = (shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) / f"peerd-test-{os.getpid()}-{numel}"
    path.write_bytes(b"\0" * (HEADER_BYTES + 4 * numel))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), HEADER_BYTES + 4 * numel)
    path.unlink()  # the mapping stays
    return mapped, torch.frombuffer(mapped, dtype=torch.float32, offset=HEADER_BYTES, count=numel)


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_go_to_the_vector_and_back_cast_and_in_order(device, tmp_path):
    torch.manual_seed(0)
    params = [
        torch.randn(3, 5, device=device),
        torch.randn(7, device=device, dtype=torch.bfloat16),
        torch.randn(2, 2, 2, device=device, dtype=torch.float16),
    ]
    numel = sum(p.numel() for p in params)
    _mapped, vector = mapped_vector(tmp_path, numel)
    address = pin(vector) if device == "cuda" else 0
    if device == "cuda":
        assert address, "cudaHostRegister refused the shared mapping"
    to_vector(params, vector, bool(address))
    assert torch.equal(vector, torch.cat([p.float().cpu().flatten() for p in params]))
    vector.mul_(2)  # what the daemon's outer step does: new values in the vector
    old = [p.clone() for p in params]
    from_vector(vector, params, bool(address))
    for p, q in zip(params, old):
        assert p.device.type == device and p.dtype == q.dtype
        assert torch.equal(p, (q.float() * 2).to(q.dtype))
    unpin(address)


@pytest.mark.parametrize("device", DEVICES)
def test_a_landed_round_moves_the_parameters_by_theta_minus_the_phase_end(device, tmp_path):
    """With overlap (daemon/attached.py, "landing"): θ follows the vector in the mapping, and both
    are page-locked as one span where CUDA is."""
    params = [torch.full((3,), 1.0, device=device), torch.full((2,), 2.0, device=device, dtype=torch.bfloat16)]
    numel = 5
    _mapped, both = mapped_vector(tmp_path, 2 * numel)
    vector, theta = both[:numel], both[numel:]
    address = pin(vector, theta) if device == "cuda" else 0
    if device == "cuda":
        assert address, "cudaHostRegister refused the shared mapping"
    vector.copy_(torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0]))  # s: where the averaged phase ended
    theta.copy_(torch.tensor([0.25, 0.5, 0.75, 2.0, 3.0]))  # the round's θ
    move_by(params, theta, vector, bool(address))
    # x + (θ − s): the first tensor 1 + [-0.25, 0, 0.25], the second (bf16) 2 + [1, 2].
    assert params[0].device.type == device and params[1].dtype == torch.bfloat16
    assert torch.equal(params[0].cpu(), torch.tensor([0.75, 1.0, 1.25]))
    assert torch.equal(params[1].float().cpu(), torch.tensor([3.0, 4.0]))
    unpin(address)


def test_nccl_is_chosen_only_where_every_member_has_a_gpu_of_its_own():
    """peerd/local_group.py backend_for: what every member of an epoch derives alike from the keys
    they wrote (device_key: host/GPU UUID, or the device type)."""
    gpus = ["h1/GPU-a", "h1/GPU-b", "h2/GPU-a"]
    assert backend_for(gpus, nccl=True) == ("nccl", "every member on a GPU of its own")
    assert backend_for(gpus, nccl=False)[0] == "gloo"  # not asked for
    assert backend_for(["h1/GPU-a", "h1/GPU-a"], nccl=True) == (
        "gloo",
        "members share a GPU (NCCL takes one rank per device)",
    )
    assert backend_for(["h1/GPU-a", "cpu"], nccl=True) == ("gloo", "not every member trains on CUDA")
    assert device_key(torch.device("cpu")) == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: NCCL runs on CUDA devices only")
def test_a_group_over_nccl_sums_on_the_gpu(tmp_path):
    """The NCCL path of a local group's Collective on the one GPU there is: a group of one rank (NCCL
    refuses two ranks on one device, so more needs a machine of several GPUs)."""
    slot = Slot(epoch=1, rank=0, size=1, store=str(tmp_path / "store"))
    group = Collective(
        slot, timeout=30, rendezvous=30, superseded=lambda: False, device=torch.device("cuda"), nccl=True
    )
    try:
        assert (group.backend, group.device.type) == ("nccl", "cuda"), group.why
        t = torch.arange(5, dtype=torch.float32, device="cuda")
        group.sum_(t)
        assert torch.equal(t.cpu(), torch.arange(5, dtype=torch.float32))
        assert group.same([t])[0]
    finally:
        group.close()


@pytest.mark.heavy
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the processes train on CUDA")
@pytest.mark.parametrize("dear", [False, True], ids=["all-reduce", "dear"])
def test_two_processes_on_one_gpu_train_as_one_local_group(spawn, dear):
    """Two processes of a script whose model is on the GPU, attached to one daemon:
    one local group (Gloo through host memory: the two share the GPU, so NCCL is not taken even when
    asked for), phases completed as a group, the members' digests equal at every phase's end (a
    mismatch raises in the script), and the loss falls."""
    a = spawn("gpu-a", ["--run", "gpu"])
    args = ["--run", "gpu", "--daemon", a.data_dir, "--device", "cuda", "--nccl", "--layers", 3]
    args += ["--steps", 60, "--every", 10] + (["--dear"] if dear else [])
    # Two processes as torchrun starts them (its own --run option would take the script's --run).
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *map(str, args), "--group-size", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"},
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-3000:]
    out = [json.loads(line) for text in outs for line in text.splitlines() if line.startswith("{")]
    ends = [o for o in out if "phase_end" in o]
    assert len(ends) >= 2 * 5, out  # both processes, the phases of 60 steps by 10
    assert {tuple(o["group"]) for o in ends} == {(0, 2), (1, 2)}, ends
    assert {o["backend"] for o in ends} == {"gloo"}, ends
    assert all(math.isnan(o["dear_overlap"]) != dear for o in ends), ends
    losses = [o["loss"] for o in out if "loss" in o]
    assert losses[-1] < losses[0], losses
