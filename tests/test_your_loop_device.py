"""The copies between a model and the shared vector (peerd/torch.py), on every device present: the
CPU here, a GPU where CUDA is (the vector then page-locked in place). No daemon: the vector is a
mapped file laid out as daemon/attached.py's SharedVector."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from peerd.attachment import HEADER_BYTES
from peerd.torch import from_vector, pin, to_vector, unpin

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
