"""Copies between a model's tensors and one flat float32 vector (the state vector, or DiLoCo's
parameters), in the tensors' order, without allocating; and the state vector's tensors."""

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


@torch.no_grad()
def state_tensors(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], int]:
    """The tensors of the state vector, in order, and how many of them (the first) are parameters.

    Optimizer state is created lazily by torch on the first step; a fixed layout needs it from the
    start, so it is materialized with one zero-gradient step whose effects are undone (parameters
    restored, state tensors zeroed, which is what SGD's momentum and Adam's moments and step count
    start from). Only state tensors shaped like their parameter are part of the vector (Adam's
    scalar step count stays local)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(not optimizer.state.get(p) for p in params):
        saved = [(p.detach().clone(), p.grad) for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, (value, grad) in zip(params, saved):
            p.copy_(value)
            p.grad = grad
            for v in optimizer.state[p].values():
                if torch.is_tensor(v):
                    v.zero_()
    extra = [
        v
        for p in params
        for _, v in sorted(optimizer.state[p].items())
        if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape
    ]
    return params + extra, len(params)
