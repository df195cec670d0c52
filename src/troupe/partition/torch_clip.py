"""torch.nn.utils.clip_grad_norm_ on parameters whose gradient is not all here: troupe's, or a refusal.

A user's loop calls torch's ``clip_grad_norm_(model.parameters(), max_norm)``. Where troupe holds the
gradient elsewhere, torch's alone would clip silently wrong:

- a sharded DistOpt (``shard="optimizer"|"gradients"``): after the reduction ``p.grad`` is None (the mean
  lives in the parts' ``grad``, `SHARD_OF`), so torch's sees no gradient and clips nothing;
- a partitioned model (`troupe.partition`): torch's sees this worker's slices only, so each worker clips
  by a different norm and the replicas drift apart.

For those parameters (`SHARD_OF` on one of them, or `HOLDERS` outside a cluster: `CLUSTER`) torch's function is
`troupe.clip_grad_norm_` (the whole model's norm, agreed over the ranks; every rank calls it, as every rank calls
torch's in a data-parallel loop). Where no exchange can give the norm the loop means, clipping is refused in one line
(`CLIP_REFUSED`): under ``troupe run --elastic`` a worker of a parameter-server group of several holds its
own gradient, not the group's mean (a restarted worker rejoins alone, so backward does not average inside
the group), and clipping it clips each worker's own.

`watch` (from DistOpt's construction) marks the parameters and replaces torch's function, once, in
``torch.nn.utils`` and ``torch.nn.utils.clip_grad`` (a ``from torch.nn.utils import clip_grad_norm_`` made
before the first DistOpt keeps torch's own). Any other parameters go to torch's own function unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from troupe.util import HOLDERS, SHARD_OF, Refusal

CLIP_REFUSED = "_troupe_clip_refused"
"""The attribute `watch` sets on a DistOpt's parameters where clipping their gradient cannot mean what the loop
means: why, in one line."""

_TORCH = torch.nn.utils.clip_grad.clip_grad_norm_
"""torch's own function (before `install`)."""


CLUSTER = "_troupe_clip_cluster"
"""The attribute `watch` sets on the parameters of a DistOpt under a cluster (``--framework``): there torch's function
stays torch's on a partitioned model, as docs/partition.md says (each worker's own gradient, keeping Hogwild's groups
independent; troupe.clip_grad_norm_ is the collective)."""


def watch(params: Iterable[Tensor], strategy: Any, cluster: Any) -> None:
    """Mark a DistOpt's parameters where clipping them is refused (`refusal`) or stays torch's own (`CLUSTER`), and
    let torch's clip_grad_norm_ clip troupe's other parameters (`install`)."""
    why = refusal(strategy)
    for p in params:
        if why is not None:
            setattr(p, CLIP_REFUSED, why)
        if cluster is not None:
            setattr(p, CLUSTER, True)
    install()


def refusal(strategy: Any) -> str | None:
    """Why clipping a worker's gradient under `strategy` clips something other than the loop means, or None."""
    from troupe.cluster.workers.ps_client import PSClient

    if not isinstance(strategy, PSClient) or strategy.cluster.nworkers_per_group < 2:
        return None
    from troupe.runtime import settings

    env = settings.current()  # troupe run --elastic: TROUPE_ELASTIC, or TROUPE_REJOIN for a parameter-server job
    if not (env.elastic or env.rejoin) or strategy.average is not None:
        return None
    name = "Sandblaster" if strategy.cluster.nworker_groups == 1 else "a parameter-server job"
    return (f"clip_grad_norm_ under troupe run --elastic: {name}'s workers of a group of "
            f"{strategy.cluster.nworkers_per_group} each hold their own gradient (a restarted worker rejoins alone), "
            "not the group's mean, so each would clip its own: run without --elastic, or with --nworkers-per-group 1")


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
    check(params)
    if not any(hasattr(p, SHARD_OF) or hasattr(p, HOLDERS) and not hasattr(p, CLUSTER) for p in params):
        return _TORCH(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    from troupe.partition.clip import clip_grad_norm_ as troupes

    total = troupes(params, max_norm, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # troupe's leaves a non-finite norm's gradients as they are
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total
