"""Tensor fusion: cut a model's gradients into buckets, each a view into one flat buffer.

    plan = plan_buckets(model, bucket_bytes=4 << 20, world=4)
    plan.buckets[0]        # the first bucket whose gradients are all ready in backward

The rule (as torch DDP's): parameters in reverse registration order, which is the order backward
produces their gradients for a model whose forward uses its modules in registration order, are
appended to the current bucket; a bucket closes once it holds at least `bucket_bytes`. A parameter
is never split, so a bucket may exceed `bucket_bytes` by one parameter; `bucket_bytes=0` gives one
parameter per bucket (no fusion) and `math.inf` one bucket for the whole model. Each bucket is
padded to a multiple of `world` elements so that its shards are equal (collective.py); padding stays
zero. The flat buffer is allocated once per plan: steps reuse it.

For the forward pre-hooks each bucket knows the modules that own its parameters, in registration
order. Correctness does not rest on that order (the scheduler hooks every owner, see schedule.py);
only how early the all-gathers are queued does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True, slots=True, eq=False)
class Bucket:
    index: int  # position in backward order: bucket 0's gradients are ready first
    params: tuple[nn.Parameter, ...]  # in backward order
    offsets: tuple[int, ...]  # where each parameter's gradient starts in `buffer`
    buffer: torch.Tensor  # view into the plan's flat buffer; numel a multiple of world
    modules: tuple[nn.Module, ...]  # owners of `params`, in registration (forward) order
    names: tuple[str, ...]  # qualified names of `params`, for status and errors

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def grad_views(self) -> list[torch.Tensor]:
        """One view of `buffer` per parameter, shaped like it (allocates views, not data)."""
        return [self.buffer[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]


@dataclass(frozen=True, slots=True, eq=False)
class BucketPlan:
    flat: torch.Tensor  # every bucket's buffer, back to back
    buckets: tuple[Bucket, ...]
    bucket_bytes: float  # the target the plan was cut for
    world: int

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def sizes(self) -> list[int]:
        """Bytes of each bucket, in backward order (for status and metrics)."""
        return [b.nbytes for b in self.buckets]


class Owned(NamedTuple):
    name: str  # qualified parameter name
    param: nn.Parameter
    module: nn.Module  # the module that registers it
    order: int  # the module's position in registration order


def trainable_parameters(model: nn.Module) -> list[Owned]:
    """The model's trainable parameters in registration order, each with its owning module.

    A parameter shared by several modules belongs to the first that registers it."""
    seen: set[int] = set()
    out = []
    for order, (prefix, module) in enumerate(model.named_modules()):
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(Owned(f"{prefix}.{name}" if prefix else name, p, module, order))
    return out


def plan_buckets(model: nn.Module, bucket_bytes: float, world: int) -> BucketPlan:
    """Cut `model`'s trainable float32 parameters into buckets of about `bucket_bytes` (see above)."""
    if bucket_bytes < 0 or math.isnan(bucket_bytes):
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters")
    for entry in params:
        if entry.param.dtype != torch.float32:
            raise ValueError(f"parameter {entry.name} is {entry.param.dtype}; DeAR buckets hold float32 only")
    groups: list[list[Owned]] = [[]]
    filled = 0
    for entry in reversed(params):
        if groups[-1] and filled >= bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(entry)
        filled += entry.param.numel() * 4
    sizes = [_padded(sum(e.param.numel() for e in g), world) for g in groups]
    flat = torch.zeros(sum(sizes))
    buckets, start = [], 0
    for index, (group, size) in enumerate(zip(groups, sizes)):
        offsets = [0]
        for e in group[:-1]:
            offsets.append(offsets[-1] + e.param.numel())
        owners = {e.order: e.module for e in group}
        buckets.append(
            Bucket(
                index=index,
                params=tuple(e.param for e in group),
                offsets=tuple(offsets),
                buffer=flat[start : start + size],
                modules=tuple(owners[order] for order in sorted(owners)),
                names=tuple(e.name for e in group),
            )
        )
        start += size
    return BucketPlan(flat=flat, buckets=tuple(buckets), bucket_bytes=bucket_bytes, world=world)


def _padded(numel: int, world: int) -> int:
    return -(-numel // world) * world
