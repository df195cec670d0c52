"""Gradients of a partitioned model: each parameter reduced only among the ranks that hold it.

`troupe.partition` labels every parameter with its holders (``_troupe_holders``: the
global ranks holding the same tensor): the whole job for a replicated (dim 0) layer,
worker j of every group for slice j of a dim-1 layer, worker 0 of every group for a
dim -1 layer. A partitioned layer's gradient on a holder already sums the contributions
of its whole group's samples (the connection layers' backward adds them), so the rule
that gives one process's gradient on the combined batch is the same for every
parameter: sum over the holders, divide by the world size.

The replicated parameters go through the strategy's GradReducer as usual (overlapped
with backward, compressed if the option says so); `Partitioned` wraps that strategy and
reduces the rest, one fused all-reduce per holder group, right after the reducer's buckets
(its `also_reduce`), or in `synchronize()` when there is no reducer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.reliability.nonfinite import all_finite
from troupe.runtime.comm import Communicator
from troupe.strategies.base import BaseStrategy, StepStats, UpdateStrategy
from troupe.sync.reducer import GradReducer
from troupe.util import holders_of, pack, unpack_into


def split_by_holders(params: Sequence[Tensor], world_size: int) -> tuple[list[Tensor], dict[tuple[int, ...], list[Tensor]]]:
    """(parameters every rank holds, {holders: parameters} for the partitioned rest)."""
    everyone, partitioned = [], {}
    for p in params:
        holders = holders_of(p)
        if holders is None or len(holders) == world_size:
            everyone.append(p)
        else:
            partitioned.setdefault(tuple(holders), []).append(p)
    return everyone, partitioned


def broadcast_replicated(comm: Communicator, params: Sequence[Tensor]) -> None:
    """Check every rank has the same parameters and give them rank 0's values; a partitioned model's
    slices differ by rank by design (troupe.partition broadcast them whole) and are left alone."""
    replicated, _ = split_by_holders(params, comm.world_size)
    comm.check_same([(tuple(p.shape), str(p.dtype)) for p in replicated], "the optimizer's parameters")
    comm.broadcast_tensors(replicated)


class HolderGroups:
    """One communicator per set of holders this rank belongs to, made on every rank in one order."""

    @classmethod
    def make(cls, job: Communicator, partitioned: dict[tuple[int, ...], list[Tensor]]) -> HolderGroups | None:
        """Every rank's holder sets (a collective on every rank, even one that holds no slice: a rank
        without a dim -1 layer still takes part in the groups); None when no rank has any."""
        mine = sorted(partitioned)
        every = sorted({h for theirs in job.all_gather_object(mine) for h in theirs}) if job.world_size > 1 else mine
        return cls(job, partitioned, every) if every else None

    @classmethod
    def by_place(cls, job: Communicator, place: Communicator,
                 partitioned: dict[tuple[int, ...], list[Tensor]]) -> HolderGroups:
        """An elastic job's (no collective: a joiner builds alone): a rank's slices are held by the
        processes at its place in every group, so the holders present in a step are `place`'s members
        (the World's place communicator, made anew for every quorum)."""
        if len(partitioned) > 1:
            raise ValueError(f"under troupe run --elastic a rank's slices must all be held at its own place in every "
                             f"worker group, found {len(partitioned)} sets of holders: {sorted(partitioned)}")
        return cls(job, partitioned, made={h: place for h in partitioned})

    def __init__(self, job: Communicator, partitioned: dict[tuple[int, ...], list[Tensor]],
                 every: list[tuple[int, ...]] = (), made: dict[tuple[int, ...], Communicator] | None = None):
        self.job = job
        """Whose size divides the sums (an elastic job's quorum: the processes present)."""
        self.weight: Callable[[], float] | None = None
        """This rank's gradients enter the sums times it (an elastic job's constant global batch, as the reducer's)."""
        mine = sorted(partitioned)
        if made is None:  # every rank creates every group, in the same order (torch.distributed's rule)
            made = {h: job.new_group(list(h)) if len(h) > 1 else None for h in every}
        self.groups: list[tuple[Communicator | None, list[Tensor]]] = [(made[h], partitioned[h]) for h in mine]
        self.params = [p for _, ps in self.groups for p in ps]
        # Each group's gradients live in one flat buffer, as the buckets' do (`troupe.sync.bucket`):
        # ``p.grad`` becomes a view of it, so the next backward accumulates where the reduction reads.
        self.flats = [_flat_slots(params) for _, params in self.groups]

    @property
    def world_size(self) -> int:
        return self.job.world_size

    def _weigh(self, flat: Tensor) -> None:
        """This rank's share before the sum (under a constant global batch; else nothing to do)."""
        w = 1.0 if self.weight is None else self.weight()
        if w != 1.0:
            flat.mul_(w)

    def reduce(self) -> None:
        """Sum each partitioned gradient over its holders and divide by the world size (in place)."""
        for (comm, params), flat_slots in zip(self.groups, self.flats):
            if flat_slots is None:
                self._reduce_copied(comm, params)
                continue
            flat, slots = flat_slots
            for p, slot in zip(params, slots):
                _take(p, slot)
            self._weigh(flat)
            if comm is not None:
                comm.all_reduce(flat, "sum")
            flat.div_(self.world_size)

    def _reduce_copied(self, comm: Communicator | None, params: list[Tensor]) -> None:
        """A group of mixed dtypes or devices has no one flat buffer: pack, reduce, copy back."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = pack(grads)
        self._weigh(flat)
        if comm is not None:
            comm.all_reduce(flat, "sum")
        flat.div_(self.world_size)
        unpack_into(flat, grads)
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g


def _flat_slots(params: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]] | None:
    """One new flat buffer and its views shaped as `params` (None where they differ in dtype or device)."""
    if len({(p.dtype, p.device) for p in params}) != 1:
        return None
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat, views


def _take(param: Tensor, slot: Tensor) -> None:
    """Point ``param.grad`` at `slot`, copying the gradient in unless it lives there already (None: zeros)."""
    grad = param.grad
    if grad is None:
        slot.zero_()
    elif grad.data_ptr() != slot.data_ptr():
        slot.copy_(grad)
    param.grad = slot


class Partitioned(BaseStrategy):
    """`inner` for the replicated parameters, plus the holder-group reduction of the partitioned ones."""

    def __init__(self, inner: UpdateStrategy, holders: HolderGroups, job: Communicator,
                 reducer: GradReducer | None):
        self.inner, self.holders, self.job = inner, holders, job
        self.reducer = reducer
        self.name = inner.name

    @property
    def optimizer(self) -> Any:
        """The inner strategy's optimizer (DiLoCo's inner step keeps and restores its state)."""
        return self.inner.optimizer

    def describe(self) -> str:
        return self.inner.describe()

    def reduce_hook(self):
        return self.inner.reduce_hook()

    def synchronize(self) -> None:
        self.inner.synchronize()  # with a reducer, its also_reduce reduces the slices too
        if self.reducer is None:
            self.holders.reduce()

    def all_finite(self) -> bool:
        # The partitioned gradients differ from group to group: agree on one verdict.
        verdict = torch.tensor([0.0 if self.inner.all_finite() and all_finite(
            [p.grad for p in self.holders.params if p.grad is not None]) else 1.0])
        self.job.all_reduce(verdict, "max")
        return verdict.item() == 0.0

    def step(self) -> StepStats:
        return self.inner.step()

    def start(self) -> None:
        self.inner.start()

    def per_rank_state(self) -> list[str]:
        return ["partitioned model (each rank holds its own slices)", *self.inner.per_rank_state()]

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()
