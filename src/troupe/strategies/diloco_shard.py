"""DiLoCo's outer state sharded over a worker group's processes (cluster field ``shard: optimizer`` under
``framework: diloco``; ``troupe run --framework diloco --shard optimizer``), INTELLECT-1's design.

Unsharded, every process keeps theta_outer and the outer optimizer's state whole (two more copies of
the model with Nesterov momentum) and averages the whole pseudo-gradient with the processes at its
place in the other groups. Sharded, the k processes of a group cut each fragment's parameters, flattened
in order, into k chunks balanced by elements (`troupe.strategies.sharded_step.chunk_range`, the layout of
``DistOpt(shard=...)``): process j keeps chunk j of theta_outer and of the outer optimizer state, and at
each of the fragment's outer steps::

    delta_j = theta_outer_j - theta[chunk j]         # its chunk of the pseudo-gradient
    delta_j = mean over the groups of delta_j          # over its place communicator: 1/k of the bytes
    outer_optimizer.step()  with grad delta_j          # steps theta_outer_j
    theta = all-gather over the group of theta_outer   # every process of the group adopts all of it

The groups' processes at place j hold the same chunk, so the sum over the groups is the unsharded
one, element by element; an outer optimizer that updates each element from its own gradient and
state (SGD, Adam, ...) then takes the same step on the chunk as on the whole tensors. Optimizers
that look at shapes or at the whole vector (Adafactor, Muon, LBFGS) are refused by the cluster
(`ELEMENTWISE_OUTER`).

Costs per outer step and process, for P elements over G groups of k: across groups the pseudo-gradient's
exchange on P/k elements (fp32: 2(G-1)/G * 4P/k); inside the group an all-gather of (k-1)/k * 4P (the
unsharded worker sends nothing inside its group at an outer step). Outer state held: (1 + the outer
optimizer's buffers per element) * 4P/k bytes instead of * 4P. docs/diloco.md measures both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies.sharded_step import chunk_range



class OuterConfig(Protocol):
    """What DiLoCo reads of its configuration: the cluster's `ClusterConfig` is one (the cluster layer builds
    DiLoCo; the strategies never import it)."""

    sync_freq: int
    fragments: int
    delay: int
    merge_alpha: float
    pseudo_grad_dtype: str

    def make_outer_optimizer(self, params: Sequence[Any]) -> Any: ...

@dataclass(frozen=True)
class GroupCut:
    """Over what the outer state is cut: the group's communicator, this process's place in it, its size.

    Given apart from `comm` because an elastic group's communicator has one member until the group joins
    the quorum (`World.replica_comms`); the place and size are the cluster's from the start."""

    comm: Communicator
    rank: int
    k: int


def _flat(params: Sequence[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


class ShardedOuterStep:
    """One fragment's outer parameters and optimizer state, this process's chunk of them: the same
    interface as `OuterStep` (pseudo-gradients in, parameters to adopt out), plus the group's all-gather."""

    def __init__(self, cluster: OuterConfig, params: Sequence[Tensor], cut: GroupCut):
        self.group = cut.comm
        self.numel = sum(p.numel() for p in params)
        self.k, self.rank = cut.k, cut.rank
        self.chunk, self.lo, self.hi = chunk_range(self.numel, self.rank, self.k)
        dtype = params[0].dtype if params else torch.float32
        self.outer = [torch.zeros(self.hi - self.lo, dtype=dtype)]
        """This process's chunk of theta_outer (one flat tensor; empty where the chunks hold padding only)."""
        self.optimizer = cluster.make_outer_optimizer(self.outer)
        self.steps = 0
        """Outer steps taken."""

    @torch.no_grad()
    def reset(self, params: Sequence[Tensor]) -> None:
        """theta_outer's chunk = the same chunk of `params` (the job's initial values)."""
        self.outer[0].copy_(_flat(params)[self.lo : self.hi])

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[Tensor]) -> list[Tensor]:
        """theta_outer - theta on this process's chunk (a new tensor)."""
        return [self.outer[0] - _flat(params)[self.lo : self.hi]]

    def blank(self) -> list[Tensor]:
        """A zero pseudo-gradient of this chunk's shape (a group that has none still joins the sum)."""
        return [torch.zeros_like(self.outer[0])]

    @torch.no_grad()
    def step(self, mean_delta: Sequence[Tensor], params: Sequence[Tensor], alpha: float = 0.0) -> None:
        """Step this chunk of theta_outer, all-gather the chunks over the group, merge the whole into `params`."""
        self.outer[0].grad = mean_delta[0]
        try:
            self.optimizer.step()
        finally:
            self.outer[0].grad = None
        mine = torch.zeros(self.chunk, dtype=self.outer[0].dtype)
        mine[: self.hi - self.lo] = self.outer[0]
        whole = torch.empty(self.chunk * self.k, dtype=mine.dtype)
        self.group.all_gather_into(whole, mine)
        offset = 0
        for p in params:
            o = whole[offset : offset + p.numel()].view_as(p)
            if alpha == 0:
                p.copy_(o)
            else:
                p.mul_(alpha).add_(o, alpha=1 - alpha)
            offset += p.numel()
        self.steps += 1

    def held_bytes(self) -> int:
        """Bytes of outer state this process holds: its chunk of theta_outer and of the optimizer's state."""
        return state_bytes(self.outer, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"outer": [self.outer[0].clone()], "optimizer": self.optimizer.state_dict(), "steps": self.steps,
                "chunk": [self.lo, self.hi, self.numel]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        held = state.get("chunk")
        if held != [self.lo, self.hi, self.numel]:
            where = "whole outer parameters (no shard)" if held is None else \
                f"elements [{held[0]}, {held[1]}) of {held[2]}"
            raise ValueError(f"the checkpoint's DiLoCo state holds {where}, this process elements "
                             f"[{self.lo}, {self.hi}) of {self.numel} (shard {self.k} ways): resume with the same "
                             "shard and nworkers_per_group")
        self.outer[0].copy_(state["outer"][0])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


def state_bytes(outer: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of `outer` and of every tensor in `optimizer`'s per-parameter state."""
    held = sum(o.numel() * o.element_size() for o in outer)
    for state in optimizer.state.values():
        held += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor) and v.dim())
    return held
