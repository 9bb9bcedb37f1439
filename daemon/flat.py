"""Copies between a model's tensors and one flat float32 vector (the state vector, or DiLoCo's
parameters), in the tensors' order, without allocating."""

from __future__ import annotations

import torch


def to_flat(tensors: list[torch.Tensor], flat: torch.Tensor, start: int = 0, end: int | None = None) -> None:
    """Copy the tensors into flat, or only into flat[start:end]."""
    end, offset = flat.numel() if end is None else end, 0
    for t in tensors:
        a, b = max(start, offset), min(end, offset + t.numel())
        if a < b:
            flat[a:b].copy_(t.detach().view(-1)[a - offset : b - offset])
        offset += t.numel()


def from_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy flat into the tensors, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.view(-1).copy_(flat[offset : offset + t.numel()])
            offset += t.numel()
