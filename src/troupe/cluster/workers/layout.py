"""Which parameters a worker sends to the servers when the model is partitioned (`troupe.partition`).

The workers of a group then hold different tensors: every worker the replicated layers
(partition_dim 0), worker j the j-th slice of each dim-1 layer, worker 0 the dim -1 layers.
The servers hold the union, the whole model once per server group, as one list of *job
parameters*: worker 0's trainable parameters in its optimizer's order, then worker 1's own
slices, ..., then worker k-1's. A worker Puts, Updates and Gets only the slices of the job
parameters it holds (Sandblaster: "a worker computes on its partition of the model, and only
communicates with servers handling related parameters"); every worker j of every group holds
the same ones as worker j of group 0.

A server averages a replicated slice's Updates over the group's k workers, each a gradient of
its own samples' mean loss. A partitioned slice has one sender, whose gradient already sums the
contributions of the whole group's samples (the connection layers' backward adds them), so the
server scales it by 1/k: both give the gradient of the group's mean loss.

`trainable` lists a worker's own trainable parameters (the optimizer's, in order), which every
kind of worker and the bootstrap start from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from troupe.util import holders_of

def trainable(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[int]]:
    """The optimizer's trainable parameters in order, and the param group of each."""
    params, groups, seen = [], [], set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
                groups.append(g)
    return params, groups


Entry = tuple[int, int, "int | None"]
"""(numel, param group, owner) of one trainable parameter; owner None: every worker of a group holds it."""


@dataclass(frozen=True)
class Layout:
    """The job parameters the servers hold, and where this worker's parameters sit among them."""

    numels: tuple[int, ...]
    param_group_of: tuple[int, ...]
    owners: tuple[int | None, ...]
    """Per job parameter: the index in each group of the worker holding it, None for every worker;
    empty when nothing is partitioned."""
    local: tuple[int, ...]
    """This worker's trainable parameters, in order: their job-parameter index."""

    @property
    def partitioned(self) -> bool:
        return bool(self.owners)


def entries(params: Sequence[Tensor], param_group_of: Sequence[int], k: int, nworkers: int) -> list[Entry]:
    """What one worker tells the others about its trainable parameters (`Entry` each)."""
    out: list[Entry] = []
    for p, g in zip(params, param_group_of):
        holders = holders_of(p)
        owner = None if holders is None or len(holders) == nworkers else holders[0] % k
        out.append((p.numel(), g, owner))
    return out


def build(every: Sequence[Sequence[Entry]], k: int, me: int) -> Layout:
    """The job parameters from every worker's entries (worker w is worker w % k of group w // k)
    and worker `me`'s place among them; ValueError when the workers' models do not fit together."""
    base = list(every[0])
    shared = [(n, g) for n, g, owner in base if owner is None]
    own: list[list[tuple[int, int]]] = []
    for j in range(k):
        theirs = every[j] if j < len(every) else []
        own.append([(n, g) for n, g, owner in theirs if owner is not None])
    for w, theirs in enumerate(every):
        j = w % k
        owners = {owner for _, _, owner in theirs if owner is not None}
        if owners - {j}:
            raise ValueError(f"worker {w} (worker {j} of group {w // k}) holds parameters of worker(s) "
                             f"{sorted(owners - {j})} of its group: partition with workers_per_group = "
                             f"the cluster's nworkers_per_group ({k})")
        if [(n, g) for n, g, owner in theirs if owner is None] != shared:
            raise ValueError(f"worker {w}'s replicated parameters differ from worker 0's (sizes and param "
                             "groups): every worker must build the same model and optimizer")
        if [(n, g) for n, g, owner in theirs if owner is not None] != own[j]:
            raise ValueError(f"worker {w}'s partitioned parameters differ from those of worker {j} of group 0: "
                             "every group must partition the same model with the same plan")
    if not any(own):
        n = tuple(e[0] for e in base)
        return Layout(n, tuple(e[1] for e in base), (), tuple(range(len(base))))
    numels = [n for n, _, _ in base]
    groups = [g for _, g, _ in base]
    owners: list[int | None] = [owner for _, _, owner in base]
    offset = {0: [i for i, (_, _, owner) in enumerate(base) if owner is not None]}
    for j in range(1, k):
        offset[j] = list(range(len(numels), len(numels) + len(own[j])))
        numels += [n for n, _ in own[j]]
        groups += [g for _, g in own[j]]
        owners += [j] * len(own[j])
    shared_at = [i for i, (_, _, owner) in enumerate(base) if owner is None]
    local, s, t = [], iter(shared_at), iter(offset[me % k])
    for _, _, owner in every[me]:
        local.append(next(s) if owner is None else next(t))
    return Layout(tuple(numels), tuple(groups), tuple(owners), tuple(local))
