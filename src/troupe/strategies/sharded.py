"""The shard regimes (``DistOpt(opt, shard="optimizer"|"gradients")``, ``troupe run --shard``): which ranks cut the
state (the job, each worker group under HSDP, each elastic worker group), the reducer whose buckets are padded
to that cut, and the step (`troupe.strategies.sharded_step`, where the layout and its costs are described; a
partitioned model's slices: `troupe.strategies.sharded_slices`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.reliability.pieces import ElementParts
from troupe.strategies.choice import OptionSwitch, params_of, refuse
from troupe.strategies.partitioned import split_by_holders
from troupe.strategies.registry import Capabilities, Regime, Setup, lookup, register
from troupe.strategies.sharded_slices import PartitionedShardedStep, SliceShards
from troupe.strategies.sharded_step import (  # noqa: F401  (chunk_range, own_parts, SHARD_MODES: their old home)
    SHARD_MODES,
    ShardedStep,
    _ring_group,
    chunk_range,
    own_parts,
)
from troupe.sync.reducer import GradReducer
from troupe.util import Refusal


class ShardedChoice:
    """A sharded DistOpt's one strategy (`ShardedStep`) and its reducer; only plain steps."""

    info = None
    owns_reducer = True

    def __init__(self, regime: type[Regime], setup: Setup, groups: int = 1):
        self.regime = regime
        world = setup.world
        comm = world.comm
        cut = gather_in = ring = None
        if world.membership.elastic:  # the group and its place across the groups present, made anew per quorum
            k = world.membership.options.group_size
            group, across = world.replica_comms()
            gather_in = world.replica_comms(escape=False)[0]
            cut = (k, world.rank % k)
        else:
            group, across = (comm, None) if groups == 1 else world.group_comms(groups)
            if comm.backend != "nccl" and group.world_size > 1:
                ring = _ring_group(world, groups)
        self.model_params = params_of(setup.optimizer)
        """The model's parameters, as given to the optimizer (its groups then hold this rank's parts)."""
        if setup.optimizer.state:
            raise ValueError(f"shard={regime.name!r}: the optimizer already has state; make the DistOpt before "
                             "the first step (load a checkpoint into the DistOpt afterwards)")
        everyone, partitioned = split_by_holders(self.model_params, comm.world_size)
        self.partitioned = bool(partitioned)
        """A model partitioned by troupe.partition: its slices are cut over their holders (`sharded_slices`)."""
        self.reducer = GradReducer(everyone, comm, setup.bucket_size, setup.first_bucket_size,
                                   hook_for_step=lambda: self.current.reduce_hook(),
                                   describe_step=lambda: self.current.describe(),
                                   pad_to=group.world_size if cut is None else cut[0])
        kwargs = dict(mode=regime.name, comm=comm, reducer=self.reducer, optimizer=setup.optimizer, group=group,
                      across=across, ring=ring, cut=cut, gather_in=gather_in)
        if partitioned:
            self.current = PartitionedShardedStep(slices=SliceShards(comm, partitioned, regime.name), **kwargs)
        else:
            self.current = ShardedStep(**kwargs)
        if world.membership.elastic:
            world.membership.on_reconfigure.append(self.current.count_copies)  # the groups present changed
            self.current.partner_lost = world.membership.partner_lost

    def select(self, option: str, **args: Any) -> ShardedStep:
        self.regime.accept(lookup(option))
        return self.current

    def start(self) -> None:
        pass

    def require(self, feature: str) -> None:
        if not getattr(self.regime.supports, feature):
            raise refuse(feature, self.regime.where)

    @property
    def shadows_joins(self) -> bool:
        return False

    def add_params(self, params: Sequence[Tensor]) -> GradReducer | None:
        raise refuse("add_param_group", self.regime.where)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.model_params:  # what no_sync accumulated in the buckets
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def per_rank_state(self) -> list[str]:
        return self.current.per_rank_state()

    def optimizer_parts(self) -> ElementParts:
        if self.partitioned:
            raise Refusal("troupe.checkpoint cannot save a partitioned model's sharded optimizer state yet (its parts "
                          "are cut from each rank's own slices): checkpoint with shard=None, or without partition")
        return self.current.parts

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Shard(Regime):
    """Sharded data parallelism: a DistOpt whose optimizer state (and gradients) are cut over the ranks."""

    kind = "shard"
    supports = Capabilities(per_call=False, join=False, add_param_group=False, elastic=True)

    @classmethod
    def choose(cls, setup: Setup) -> ShardedChoice | OptionSwitch:
        world = setup.world
        if world.membership.elastic:
            return cls._elastic(setup)
        groups = world.sync_groups(setup.groups, "DistOpt")
        if world.comm.world_size == groups:  # each rank holds everything: nothing to cut
            return OptionSwitch(setup, "plain")
        return ShardedChoice(cls, setup, groups)

    @classmethod
    def _elastic(cls, setup: Setup) -> ShardedChoice | OptionSwitch:
        """Elastic worker groups (`troupe run --elastic --nworker-groups G`): each group of k processes cuts the
        state over its members, as a group that is present or not as a whole; the groups present replicate. A
        restarted group's process at place j heals from place j of a live group (runtime/elastic.py): its
        chunk of the optimizer state, peer to peer."""
        world, options = setup.world, setup.world.membership.options
        if setup.groups is not None and setup.groups != options.groups:
            raise ValueError(f"DistOpt(groups={setup.groups}) differs from the elastic job's {options.groups} worker "
                             "groups: under troupe run --elastic leave groups out (--nworker-groups sets them)")
        if world.partitioned:
            raise Refusal(f"shard={cls.name!r} cannot cut a partitioned model's slices under troupe run --elastic yet: "
                          "leave --elastic out, or shard=None (elastic groups heal a partitioned model's slices)")
        if options.group_size == 1:  # a group of one process: nothing to cut, the groups replicate
            return OptionSwitch(setup, "plain")
        return ShardedChoice(cls, setup)

    @classmethod
    def accept(cls, option: type[Regime]) -> None:
        if option.name != "plain":
            raise ValueError(f"dist_option {option.name!r} cannot run with shard={cls.name!r}: use dist_option "
                             f"'plain' (the sharded gradients are reduce-scattered in fp32), or shard=None to "
                             f"compress gradients with {option.name!r}")


@register
class ShardOptimizer(Shard):
    """ZeRO-1: each rank keeps the optimizer state of 1/k of the elements."""

    name = "optimizer"
    where = "with shard='optimizer'"


@register
class ShardGradients(Shard):
    """ZeRO-2: the optimizer state and the reduced gradients of 1/k of the elements."""

    name = "gradients"
    where = "with shard='gradients'"
