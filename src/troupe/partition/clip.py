"""Gradient clipping by the norm of the whole model, when parts of it live on other ranks.

`torch.nn.utils.clip_grad_norm_` sees only this rank's tensors: under partition a rank
holds one slice of a dim-1 layer and none of another group's dim -1 layer, so each rank
would clip by a different norm and the replicas would drift apart. `clip_grad_norm_`
here counts every distinct tensor once (a tensor held by h ranks adds 1/h of its squares
from each of them), agrees on the norm with one all-reduce, and scales every gradient by
the same factor. Call it after `sgd.synchronize()`, as torch's.

A model sharded by `troupe.shard` has DTensor gradients: each rank adds the squares of its
local shard, divided by the ranks that hold the same shard (the worker groups, under HSDP).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

import torch
from torch import Tensor

from troupe.partition.partitioner import HOLDERS, _job_comm
from troupe.runtime import world
from troupe.runtime.comm import Communicator
from troupe.util import CLIP_REFUSED, SHARD_COPIES, SHARD_OF, Refusal


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float, norm_type: float = 2.0, *,
                    comm: Communicator | None = None) -> Tensor:
    """Clip the gradients of `parameters` (every rank's, together) to total norm `max_norm`; return the norm.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the whole unpartitioned model, on every rank;
    on a model without partitioned layers it is torch's (one 8-byte all-reduce more). Under
    ``troupe run --elastic`` the norm is agreed inside the worker group (no exchange for a whole model).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    check(parameters)  # where a worker's gradient is not the job's (troupe.partition.torch_clip): one line
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    if any(hasattr(p, SHARD_OF) for p in parameters):
        return _clip_parts(parameters, max_norm, norm_type, comm)
    params = [p for p in parameters if p.grad is not None]
    job = _job_comm(comm)
    everyone = job.world_size
    shares = lambda p: len(getattr(p, HOLDERS, ())) or everyone  # noqa: E731
    w = world.init() if comm is None else None
    if w is not None and w.membership.elastic:
        # Every group present holds the same reduced gradients, so one group's norm is the job's: agreed
        # on inside the group (its partitioned model's communicator; none for a whole model), which a
        # group lost meanwhile cannot fail. A slice has one holder in the group, the rest all k.
        job, k = w.replica_group, w.membership.options.group_size
        everyone = 1 if job is None else k
        shares = lambda p: everyone if len(getattr(p, HOLDERS, ())) in (0, w.world_size) else 1  # noqa: E731
    parts, holders = [], []
    for p in params:
        part, copies = _local_part(p.grad, everyone)
        parts.append(part)
        holders.append(copies or shares(p))
    return _clip(parts, holders, max_norm, norm_type, job if everyone > 1 else None, [p.grad for p in params])


def check(parameters: list[Tensor]) -> None:
    """Raise the one-line refusal marked on any of `parameters` (telling `troupe run --elastic`'s launcher)."""
    why = next((getattr(p, CLIP_REFUSED) for p in parameters if hasattr(p, CLIP_REFUSED)), None)
    if why is None:
        return
    from troupe.runtime import settings
    from troupe.runtime.launch import _refuse

    env = settings.current()
    if env.ticket:
        _refuse(env, _rank(), why)  # the launcher stops the job rather than restart a rank refused again
    raise Refusal(why)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else -1


def _clip_parts(parameters: list[Tensor], max_norm: float, norm_type: float, comm: Communicator | None) -> Tensor:
    """A sharded DistOpt's model (``shard=...``): every rank holds the mean gradient of its own parts,
    which together cover each tensor once per worker group (`SHARD_COPIES` copies of each part), so the
    job's sum of the parts' norms, each divided by its copies, is the model's."""
    grads, copies = [], []
    for p in parameters:
        part = getattr(p, SHARD_OF, None) if hasattr(p, SHARD_OF) else p
        if part is not None and part.grad is not None:
            grads.append(part.grad)
            copies.append(getattr(part, SHARD_COPIES, 1))
    return _clip(grads, copies, max_norm, norm_type, _job_comm(comm), grads)


def _clip(parts: list[Tensor], holders: list[int], max_norm: float, norm_type: float, job: Communicator | None,
          grads: list[Tensor]) -> Tensor:
    """Scale `grads` by what clips the total norm of `parts` to `max_norm`; return that norm. The ranks of `job`
    (None: this rank alone) hold the parts, each part in `holders` ranks alike: every holder adds its share of the
    squares, so that, summed over the job, each distinct tensor counts once."""
    # on the gradients' device (a CUDA rank's norms stay there; the communicator stages as needed)
    local = torch.zeros(1, dtype=torch.float64, device=parts[0].device if parts else "cpu")
    for g, n in zip(parts, holders):
        g = g.detach().double()
        if g.numel() == 0:  # a shard of a parameter with fewer rows than ranks
            continue
        if norm_type == math.inf:
            local = torch.maximum(local, g.abs().max().reshape(1))
        else:
            local += g.abs().pow(norm_type).sum() / n
    if job is not None and job.world_size > 1:
        job.all_reduce(local, "max" if norm_type == math.inf else "sum")
    total = local if norm_type == math.inf else local.pow(1.0 / norm_type)
    total = total.to(torch.float32).reshape(())
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return total


def _local_part(grad: Tensor, everyone: int) -> tuple[Tensor, int]:
    """This rank's part of `grad` and how many ranks hold that same part (0: not a DTensor, the
    parameter's holders decide)."""
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    if module is None or not isinstance(grad, module.DTensor):
        return grad, 0
    mesh = grad.device_mesh
    if mesh.size() != everyone or any(p.is_partial() for p in grad.placements):
        raise ValueError(f"clip_grad_norm_: a DTensor gradient must be sharded or replicated over all {everyone} "
                         f"ranks (troupe.shard's), got placements {grad.placements} on {mesh.size()} ranks")
    copies = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())
    return grad.to_local(), copies
