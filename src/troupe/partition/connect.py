"""Connection layers inside a worker group: autograd functions that move activations between
the layout at module boundaries ("own b samples, all features") and what a partitioned
layer computes on, and move gradients back along the exact adjoint path.

    gather_batch   all-gather along the batch  <->  reduce-scatter (sum)
    to_owners      all-to-all: rows to their owners, features concatenated  <->  the inverse all-to-all
    to_root        gather to worker 0           <->  scatter from worker 0
    from_root      scatter from worker 0        <->  gather to worker 0

Nothing here scales: summing every worker's contribution is what makes a slice's gradient
the group's. Every collective goes through the group's Communicator. Every worker of a
group must feed the same number of samples.

Later optimisation, not built: between two consecutive dim-1 layers the all-to-all and the
next all-gather could be replaced by one all-gather of features (every worker keeps all
k*b rows of its own features and gathers the other slices' features).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd import Function

if TYPE_CHECKING:
    from troupe.runtime.comm import Communicator


@dataclass(frozen=True)
class WorkerGroup:
    """This rank's worker group: k consecutive global ranks computing one model replica."""

    comm: Communicator | None
    """Over the group's ranks (None when k == 1: nothing to exchange)."""
    workers_per_group: int
    index: int
    """This rank's worker index j inside the group (global rank % k)."""
    group: int
    """Which group (global rank // k)."""
    ngroups: int

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, worker order."""
        k = self.workers_per_group
        return tuple(range(self.group * k, (self.group + 1) * k))

    @property
    def root(self) -> int:
        """Global rank of the group's worker 0."""
        return self.group * self.workers_per_group

    @property
    def is_root(self) -> bool:
        return self.index == 0

    def holders(self, index: int) -> tuple[int, ...]:
        """Global ranks of worker `index` in every group: those holding that worker's slice."""
        return tuple(g * self.workers_per_group + index for g in range(self.ngroups))

    # --- row exchanges with worker 0 (point-to-point) ----------------------------------
    # Communicator.gather/scatter compare the group rank with the global root, which fails on
    # every group but the first; send/recv take ranks of the default group, which under an elastic
    # job are places in the quorum (`peer`), not the labels above.

    def peer(self, index: int) -> int:
        """Worker `index` of this group, as send and recv address it."""
        return self.comm.global_rank(index)

    def gather_rows(self, x: Tensor) -> Tensor:
        """On worker 0 every worker's rows in worker order; elsewhere an empty tensor."""
        if not self.is_root:
            self.comm.send(x.contiguous(), self.peer(0))
            return x.new_empty(0)
        out = x.new_empty((self.workers_per_group * x.shape[0], *x.shape[1:]))
        chunks = out.chunk(self.workers_per_group)
        chunks[0].copy_(x)
        for j, chunk in enumerate(chunks[1:], start=1):
            self.comm.recv(chunk, src=self.peer(j))
        return out

    def scatter_rows(self, full: Tensor | None, shape: Sequence[int], like: Tensor) -> Tensor:
        """Worker j's rows of worker 0's `full` (shape[0] rows each, worker order) on worker j."""
        if not self.is_root:
            out = like.new_empty(shape)
            self.comm.recv(out, src=self.peer(0))
            return out
        chunks = full.chunk(self.workers_per_group)
        handles = [self.comm.isend(c.contiguous(), self.peer(j)) for j, c in enumerate(chunks[1:], start=1)]
        for h in handles:
            h.wait()
        return chunks[0].clone()


class _GatherBatch(Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: WorkerGroup) -> Tensor:
        ctx.group = group
        out = x.new_empty((group.workers_per_group * x.shape[0], *x.shape[1:]))
        return group.comm.all_gather_into(out, x.contiguous())

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        out = grad.new_empty((grad.shape[0] // group.workers_per_group, *grad.shape[1:]))
        return group.comm.reduce_scatter(out, grad.contiguous()), None


class _ToOwners(Function):
    @staticmethod
    def forward(ctx, y: Tensor, group: WorkerGroup, feature_dim: int) -> Tensor:
        ctx.group, ctx.feature_dim = group, feature_dim
        received = group.comm.all_to_all(torch.empty_like(y, memory_format=torch.contiguous_format), y.contiguous())
        # chunk j holds worker j's features (slice j) for this worker's samples
        return torch.cat(received.chunk(group.workers_per_group), dim=feature_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        # all_to_all is its own inverse: slice j's gradient goes back to worker j
        send = torch.cat(grad.chunk(group.workers_per_group, dim=ctx.feature_dim), dim=0)
        return group.comm.all_to_all(torch.empty_like(send), send), None, None


class _ToRoot(Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: WorkerGroup) -> Tensor:
        ctx.group, ctx.shape = group, tuple(x.shape)
        return group.gather_rows(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        return group.scatter_rows(grad if group.is_root else None, ctx.shape, grad), None


class _FromRoot(Function):
    @staticmethod
    def forward(ctx, y: Tensor, anchor: Tensor, group: WorkerGroup, shape: tuple[int, ...]) -> Tensor:
        ctx.group, ctx.y_shape, ctx.shape = group, tuple(y.shape), shape
        return group.scatter_rows(y if group.is_root else None, shape, anchor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        full = group.gather_rows(grad)
        grad_y = full if group.is_root else grad.new_zeros(ctx.y_shape)
        return grad_y, None, None, None


def gather_batch(x: Tensor, group: WorkerGroup) -> Tensor:
    """Every worker's rows of `x`, concatenated in worker order (k*b rows)."""
    return x if group.workers_per_group == 1 else _GatherBatch.apply(x, group)


def to_owners(y: Tensor, group: WorkerGroup, feature_dim: int) -> Tensor:
    """From this worker's features of all k*b rows to its own b rows with every worker's
    features, concatenated along `feature_dim` in worker (slice) order."""
    return y if group.workers_per_group == 1 else _ToOwners.apply(y, group, feature_dim)


def to_root(x: Tensor, group: WorkerGroup) -> Tensor:
    """On worker 0 every worker's rows of `x` in worker order; elsewhere an empty placeholder
    that keeps `x` in the graph (its gradient comes back from worker 0)."""
    return x if group.workers_per_group == 1 else _ToRoot.apply(x, group)


def from_root(y: Tensor, group: WorkerGroup, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """This worker's `shape[0]` rows of worker 0's `y` (`y` elsewhere: to_root's placeholder;
    `shape` and `dtype` are this worker's output's)."""
    if group.workers_per_group == 1:
        return y
    # The output must require grad on every worker or none, or backward's gather to worker 0
    # would wait forever: worker 0's y requires grad through its parameters, a placeholder
    # does not. A fresh leaf ties the choice to grad mode alone, the same on every worker.
    anchor = torch.empty(0, dtype=dtype, device=y.device, requires_grad=torch.is_grad_enabled())
    return _FromRoot.apply(y, anchor, group, shape)
