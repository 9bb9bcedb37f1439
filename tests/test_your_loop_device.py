"""The copies between a model and the shared vector (peerd/torch.py), on every device present: the
CPU here, a GPU where CUDA is (the vector then page-locked in place). No daemon: the vector is a
mapped file laid out as daemon/attached.py's SharedVector."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from peerd.shared_file import HEADER_BYTES
from peerd.torch import from_vector, move_by, pin, to_vector, unpin

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
