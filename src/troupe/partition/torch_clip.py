"""torch.nn.utils.clip_grad_norm_ on parameters whose gradient is not all here: troupe's, or a refusal.

A user's loop calls torch's ``clip_grad_norm_(model.parameters(), max_norm)``. Where troupe holds the
gradient elsewhere, torch's alone would clip silently wrong:

- a sharded DistOpt (``shard="optimizer"|"gradients"``): after the reduction ``p.grad`` is None (the mean
  lives in the parts' ``grad``, `SHARD_OF`), so torch's sees no gradient and clips nothing;
- a partitioned model (`troupe.partition`): torch's sees this worker's slices only, so each worker clips
  by a different norm and the replicas drift apart.

For those parameters (`SHARD_OF` on one of them, or `HOLDERS` outside a cluster: `CLIP_CLUSTER`) torch's function is
`troupe.clip_grad_norm_` (the whole model's norm, agreed over the ranks; every rank calls it, as every rank calls
torch's in a data-parallel loop). Where no exchange can give the norm the loop means, clipping is refused in one line
(`CLIP_REFUSED`): under ``troupe run --elastic`` a worker of a parameter-server group of several holds its
own gradient, not the group's mean (a restarted worker rejoins alone, so backward does not average inside
the group), and clipping it clips each worker's own.

DistOpt marks its parameters (`CLIP_REFUSED`: its strategy's ``clip_refusal()``; `CLIP_CLUSTER`: under a cluster,
where torch's stays torch's on a partitioned model, as docs/partition.md says); `install`, from the troupe facade as
it loads DistOpt (or partition, shard, clip_grad_norm_), replaces torch's function, once, in ``torch.nn.utils`` and
``torch.nn.utils.clip_grad`` (a ``from torch.nn.utils import clip_grad_norm_`` made before keeps torch's own). Any
other parameters go to torch's own function unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import Tensor

from troupe.partition import clip
from troupe.util import CLIP_CLUSTER, HOLDERS, SHARD_OF

_TORCH = torch.nn.utils.clip_grad.clip_grad_norm_
"""torch's own function (before `install`)."""


def install() -> None:
    """torch.nn.utils.clip_grad_norm_ (and clip_grad.clip_grad_norm_) becomes `clip_grad_norm_` (idempotent)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        if module.clip_grad_norm_ is _TORCH:
            module.clip_grad_norm_ = clip_grad_norm_


@functools.wraps(_TORCH)
def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """torch's clip_grad_norm_, which for troupe's partitioned or sharded parameters is troupe.clip_grad_norm_
    (and refuses where clipping a worker's gradient is not clipping the job's: see the module docstring)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    clip.check(params)
    if not any(hasattr(p, SHARD_OF) or hasattr(p, HOLDERS) and not hasattr(p, CLIP_CLUSTER) for p in params):
        return _TORCH(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    total = clip.clip_grad_norm_(params, max_norm, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # troupe's leaves a non-finite norm's gradients as they are
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total
