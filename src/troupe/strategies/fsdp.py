"""The regime of a model that `troupe.shard` sharded with torch's FSDP2 (ZeRO-3 / FSDP, and HSDP).

FSDP2 does the data-parallel work itself: each parameter is a DTensor holding 1/k of it,
gathered block by block for forward and backward, and its gradient is reduce-scattered
(then, across worker groups, all-reduced) while backward runs. So the strategy here has no
GradReducer and nothing to wait for: `step()` is the wrapped optimizer's step on the local
shards, `all_finite()` agrees on a verdict over the shards, and `no_sync()` turns FSDP2's
gradient sync off for accumulation.

`troupe.shard` marks the parameters it made (`SHARDED_BY`); `claim_params` (DistOpt) picks
this regime for them, and marks the parameters of every other DistOpt (`CLAIMED_BY`), so that
sharding a model after its DistOpt was made is refused. torch.distributed.tensor is imported
only when a model was sharded (it costs almost a second).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from troupe.strategies.base import BaseStrategy, StepStats
from troupe.strategies.choice import Fixed, params_of
from troupe.strategies.registry import Capabilities, Regime, Setup, register
from troupe.util import pack, unpack_into

if TYPE_CHECKING:
    from troupe.runtime.comm import Communicator

SHARDED_BY = "_troupe_sharding"
"""The attribute troupe.shard sets on each parameter it sharded: the model's `Sharding`."""
CLAIMED_BY = "_troupe_distopt"
"""The attribute a DistOpt sets on the parameters it reduces (troupe.shard then refuses them)."""

INSTEAD = "make the DistOpt with the default dist_option (troupe.shard's FSDP2 reduces the gradients itself)"


@dataclass(frozen=True, eq=False)
class Sharding:
    """What troupe.shard made of one model: its FSDP2 modules (blocks first, the root last) and mesh."""

    root: weakref.ref
    """The model (held weakly: every parameter refers to this record)."""
    groups: int
    """Worker groups that replicate the shards (HSDP); 1: the job shards one copy of the model."""
    group_size: int
    """Processes sharing one copy of the model (each holds about 1/group_size of it)."""

    def modules(self) -> list[nn.Module]:
        """The FSDP2 modules of the model, root first (``set_requires_gradient_sync`` applies to each)."""
        from torch.distributed.fsdp import FSDPModule

        root = self.root()
        if root is None:
            raise RuntimeError("the model troupe.shard sharded is gone")
        return [m for m in root.modules() if isinstance(m, FSDPModule)]


def sharding_of(params: Sequence[Tensor]) -> Sharding | None:
    """The Sharding of the model whose parameters these are; None when none is troupe.shard's.

    Raises ValueError for parameters of several sharded models, for a mix of sharded and plain
    parameters, and for DTensor parameters that troupe.shard did not make."""
    made = {id(s): s for s in (getattr(p, SHARDED_BY, None) for p in params) if s is not None}
    if not made:
        if any(_is_dtensor(p) for p in params):
            raise ValueError("the optimizer's parameters are DTensors that troupe.shard did not make: shard the "
                             "model with model = troupe.shard(model) (not fully_shard directly), then make the "
                             "optimizer over model.parameters()")
        return None
    if len(made) > 1:
        raise ValueError(f"the optimizer holds the parameters of {len(made)} models sharded by troupe.shard: "
                         "shard one model (its blocks are named with blocks=) and make one DistOpt over it")
    plain = [i for i, p in enumerate(params) if getattr(p, SHARDED_BY, None) is None]
    if plain:
        raise ValueError(f"the optimizer mixes parameters of the model troupe.shard sharded with {len(plain)} "
                         f"other parameter(s) (positions {plain[:5]}): shard the whole model, or give the "
                         "other parameters their own optimizer")
    return next(iter(made.values()))


def claim_params(optimizer: torch.optim.Optimizer, dist_option: str, cluster: Any = None,
                 shard: str | None = None) -> type[Regime] | None:
    """DistOpt's question: the FSDP2 regime when the optimizer's parameters are troupe.shard's (the
    dist_option, the cluster and DistOpt's own `shard` mode checked); else None, and the parameters
    are marked as this DistOpt's."""
    params = params_of(optimizer)
    if sharding_of(params) is None:
        for p in params:
            setattr(p, CLAIMED_BY, True)
        return None
    if shard is not None:
        raise ValueError(f"DistOpt(shard={shard!r}) on a model troupe.shard already sharded (parameters, gradients "
                         "and optimizer state): leave shard out")
    if dist_option not in ("plain", "fp32", FullySharded.name):
        raise ValueError(f"dist_option {dist_option!r} cannot run on a model sharded by troupe.shard: {INSTEAD}; "
                         "for bf16 compute give troupe.shard(model, mixed_precision='bf16')")
    check_cluster(cluster)
    return FullySharded


def check_cluster(cluster: Any) -> None:
    """Raise unless a sharded model can train under `cluster`: none, or SINGA's AllReduce framework
    (co-located servers, one synchronous worker group), whose servers FSDP2's shards then are."""
    if cluster is None or (cluster.worker_regime == "co-located" and cluster.nworker_groups == 1):
        return
    raise ValueError(f"a model sharded by troupe.shard cannot train under the cluster's {cluster.worker_regime!r} "
                     "workers: leave the cluster out (or use --framework allreduce); for sharded worker groups that "
                     "replicate every step use troupe.shard(model, groups=G) (HSDP)")


class ShardedStep(BaseStrategy):
    """The step of a model sharded by FSDP2: its gradients were reduce-scattered (and, across worker
    groups, all-reduced) in backward, so the wrapped optimizer steps the local shards."""

    name = "fsdp"
    reducer = None

    def __init__(self, comm: Communicator, optimizer: torch.optim.Optimizer, params: Sequence[Tensor],
                 sharding: Sharding):
        self.comm, self.optimizer, self.params, self.sharding = comm, optimizer, list(params), sharding

    def start(self) -> None:
        """Nothing to start: troupe.shard gave every rank rank 0's values before sharding."""

    def describe(self) -> str:
        return self.name

    def reduce_hook(self) -> None:
        return None

    def synchronize(self) -> None:
        """Nothing to wait for: FSDP2's backward ends after its last reduction."""

    def all_finite(self) -> bool:
        """Every rank's shards finite: one all-reduce of the count of non-finite local gradients."""
        bad = torch.zeros(1)
        for p in self.params:
            if p.grad is not None:
                bad += (~torch.isfinite(_local(p.grad))).sum()
        if self.comm.world_size > 1:
            self.comm.all_reduce(bad, "sum")
        return not bool(bad.item())

    def step(self) -> StepStats:
        self.optimizer.step()
        return {}

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside the block keeps unsharded gradients on each rank, summed with the next
        backward's, which reduces the sum (FSDP2's ``set_requires_gradient_sync``)."""
        modules = self.sharding.modules()
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    def per_rank_state(self) -> list[str]:
        """None: the parameters and their optimizer state are DTensors, which DCP saves and reshards."""
        return []


class ElasticShardedStep(ShardedStep):
    """An elastic job's sharded model (`troupe.shard` under ``troupe run --elastic --nworker-groups G``): FSDP2
    reduce-scatters each gradient over the worker group's own process group in backward (the mean over its k
    processes); `synchronize`, before the step's vote, all-reduces every local shard's gradient with the
    processes at this place in the other groups present (1/k of the gradients crosses groups, as under HSDP)
    and divides by their number. A group that joins heals place by place: process j copies process j of a live
    group, which holds the same shards."""

    def __init__(self, comm: Communicator, optimizer: torch.optim.Optimizer, params: Sequence[Tensor],
                 sharding: Sharding, across: Communicator, membership: Any):
        super().__init__(comm, optimizer, params, sharding)
        self.across, self.membership = across, membership

    def synchronize(self) -> None:
        """The mean over the groups present of each local gradient shard (a parameter without a gradient in any
        group gets zeros; one without in every group keeps None); under a constant global batch each group's
        counts for the batches it took."""
        with torch.no_grad():
            grads = [None if p.grad is None else _local(p.grad) for p in self.params]
            shards = [torch.zeros_like(_local(p)) if g is None else g for p, g in zip(self.params, grads)]
            n = sum(t.numel() for t in shards)
            flat = torch.cat([pack(shards).float(), torch.tensor([float(g is not None) for g in grads])])
            if self.membership.constant_batch:
                flat[:n].mul_(self.membership.grad_weight())
            self.across.all_reduce(flat, "sum")
            flat[:n].div_(self.across.world_size)
            unpack_into(flat[:n], shards)  # in place into each gradient's local shard
            for p, g, shard, had in zip(self.params, grads, shards, flat[n:].tolist()):
                if g is None and had > 0:
                    p.grad = torch.zeros_like(p)
                    _local(p.grad).copy_(shard)


@register
class FullySharded(Regime):
    """A model sharded by `troupe.shard` (FSDP2): DistOpt picks it from the parameters, never by name alone."""

    name, method = "fsdp", "backward_and_update"
    supports = Capabilities(per_call=False, join=False, graph_mode=False, add_param_group=False, partition=False,
                            elastic=True)
    where = "for a model sharded by troupe.shard"
    replicated = False

    @classmethod
    def choose(cls, setup: Setup) -> Fixed:
        params = params_of(setup.optimizer)
        sharding = sharding_of(params)
        if sharding is None:
            raise ValueError("dist_option 'fsdp' trains a model sharded by troupe.shard: call model = "
                             "troupe.shard(model) before making the optimizer over model.parameters()")
        world = setup.world
        if world.membership.elastic:  # FSDP2 inside the worker group; the shards' gradients across the groups present
            return Fixed(cls, ElasticShardedStep(world.comm, setup.optimizer, params, sharding,
                                                 world.replica_comms()[1], world.membership))
        return Fixed(cls, ShardedStep(world.job, setup.optimizer, params, sharding))

    @classmethod
    def accept(cls, option: type[Regime]) -> None:
        if option is not cls and option.name != "plain":
            raise ValueError(f"dist_option {option.name!r} cannot run on a model sharded by troupe.shard: "
                             "use update(loss) or update(loss, 'plain')")

    @classmethod
    def build(cls, ctx: Any) -> Any:
        raise ValueError("dist_option 'fsdp' trains a model sharded by troupe.shard: call model = "
                         "troupe.shard(model) before making the optimizer and the DistOpt")


def _is_dtensor(t: Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return module is not None and isinstance(t, module.DTensor)


def _local(t: Tensor) -> Tensor:
    """This rank's part of `t` (its local shard for a DTensor)."""
    return t.to_local() if _is_dtensor(t) else t
