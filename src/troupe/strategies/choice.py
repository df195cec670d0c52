"""Which strategy a DistOpt steps with: SINGA's per-call dist_options, or one fixed by a cluster.

SINGA lets every call pick its regime (``sgd.update(loss, "fp16")`` then ``"plain"``), so a
DistOpt without a cluster holds an `OptionSwitch`: one GradReducer shared by every
option, each option's strategy made once on first use (its error-feedback memory and
partial-update position kept across switches), and their state saved together. Under a
parameter-server cluster the bootstrap gives one strategy (`Fixed`) and only "plain"
(the cluster's own exchange) is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies import registry
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.compressed import CompressionConfig
from troupe.strategies.partitioned import HolderGroups, Partitioned, split_by_holders
from troupe.sync.reducer import GradReducer


class OptionSwitch:
    """The strategies of one DistOpt without a cluster, one per dist_option, sharing one reducer."""

    local = True
    """The reducer is the DistOpt's own (it can be rebuilt, and shadow a joined rank's steps)."""

    def __init__(self, comm: Communicator, params: Sequence[Tensor], optimizer: torch.optim.Optimizer,
                 config: CompressionConfig, step_count: Callable[[], int], name_of: Callable[[Tensor], str],
                 bucket_size: int, first_bucket_size: int, option: str = "plain", **args: Any):
        self.comm, self.bucket_size, self.first_bucket_size = comm, bucket_size, first_bucket_size
        everyone, partitioned = split_by_holders(params, comm.world_size)
        self._partitioned = {h: [id(p) for p in ps] for h, ps in partitioned.items()}
        self.holders = HolderGroups.make(comm, partitioned)
        """A partitioned model's parameters that only some ranks hold (troupe.partition)."""
        self.reducer = self._make_reducer(everyone)
        self.ctx = registry.Context(comm, self.reducer, optimizer, everyone, config, step_count, name_of)
        self._made: dict[tuple, UpdateStrategy] = {}
        self._restored: dict[str, Any] = {}  # state from load_state_dict, for strategies made later
        self.current: UpdateStrategy = self.select(option, **args)

    def select(self, option: str, **args: Any) -> UpdateStrategy:
        """The strategy of `option` with its method's arguments (made on first use); it becomes current."""
        key = (option, tuple(sorted(args.items())))
        strategy = self._made.get(key)
        if strategy is None:
            if self.holders is not None and registry.check_option(option) == "backward_and_partial_update":
                raise ValueError(f"dist_option {option!r} averages parameters, not gradients, and cannot average "
                                 "a partitioned model's slices: use 'plain', 'fp16', 'bf16' or a sparse option")
            strategy = registry.build(option, self.ctx, **args)
            strategy.load_state_dict(self._restored)
            if self.holders is not None:
                strategy = Partitioned(strategy, self.holders, self.comm, self.reducer)
            self._made[key] = strategy
        self.current = strategy
        return strategy

    def add_params(self, params: Sequence[Tensor]) -> GradReducer | None:
        """Rebuild the reducer over `params` (all of them, old and new); the current option is remade."""
        everyone, partitioned = split_by_holders(params, self.comm.world_size)
        if {h: [id(p) for p in ps] for h, ps in partitioned.items()} != self._partitioned:
            raise ValueError("add_param_group cannot add partitioned parameters: partition the whole model "
                             "before creating the DistOpt")
        if self.reducer is not None:
            self.reducer.remove()
        self.reducer = self._make_reducer(everyone)
        self.ctx.reducer, self.ctx.params = self.reducer, everyone
        key = next(k for k, s in self._made.items() if s is self.current)
        self._made.clear()
        self.select(key[0], **dict(key[1]))
        return self.reducer

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"residuals": {k: v.clone() for k, v in self.ctx.residuals.items()}}
        for s in self._made.values():
            state.update(s.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ctx.residuals.clear()
        self.ctx.residuals.update({k: v.clone() for k, v in state.get("residuals", {}).items()})
        self._restored = state
        for s in self._made.values():
            s.load_state_dict(state)

    def _make_reducer(self, params: Sequence[Tensor]) -> GradReducer | None:
        if self.comm.world_size == 1 or not params:
            return None
        reducer = GradReducer(params, self.comm, self.bucket_size, self.first_bucket_size,
                              hook_for_step=lambda: self.current.reduce_hook(),
                              describe_step=lambda: self.current.describe())
        if self.holders is not None:  # the slices are reduced whenever the buckets are, in the same place
            reducer.also_reduce = self.holders.reduce
        return reducer


class Fixed:
    """The one strategy a parameter-server cluster gives a worker."""

    local = False

    def __init__(self, strategy: UpdateStrategy):
        self.current = strategy
        self.reducer: GradReducer | None = strategy.reducer  # every cluster worker strategy has one (or None)

    def select(self, option: str, **args: Any) -> UpdateStrategy:
        if registry.check_option(option) != "backward_and_update":
            raise ValueError(f"dist_option {option!r} is not available under a parameter-server cluster: use "
                             "'plain' (the cluster's workers and servers exchange updates their own way)")
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {}, **self.current.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current.load_state_dict(state)
