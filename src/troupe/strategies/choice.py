"""Which strategy a DistOpt steps with: SINGA's per-call dist_options, or one fixed by a cluster.

SINGA lets every call pick its regime (``sgd.update(loss, "fp16")`` then ``"plain"``), so a
DistOpt without a cluster holds an `OptionSwitch`: one GradReducer shared by every
option, each option's strategy made once on first use (its error-feedback memory and
partial-update position kept across switches), and their state saved together. Under a
parameter-server cluster the cluster's regime gives one strategy (`Fixed`) and only the
options it accepts.

Both answer DistOpt the same questions (`require`, `shadows_joins`, `per_rank_state`), from
what the regimes declare (`troupe.strategies.registry.Capabilities`), so DistOpt has no
branch of its own for any regime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from troupe.runtime.launch import DistInfo
from troupe.strategies import registry
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.partitioned import HolderGroups, Partitioned, split_by_holders
from troupe.strategies.registry import Capabilities, Regime, Setup
from troupe.sync.reducer import GradReducer

_REFUSED = {
    "add_param_group": "add_param_group is not available {where}: give the optimizer every parameter before "
                       "creating the DistOpt",
    "graph_mode": "graph mode reduces every gradient among all ranks: not available {where}; use the PyTorch "
                  "loop or SINGA's update(loss) there",
    "elastic": "elastic worker groups (troupe run --elastic) cannot run {where} yet: use one of {options}",
    "join": "join() cannot shadow {where}: the other workers of a rank's group need it for every forward; "
            "give every rank the same number of batches",
}


def refuse(feature: str, where: str) -> ValueError:
    """The error for a `feature` (a `Capabilities` field) that the regime `where` names cannot offer."""
    options = sorted(n for n, r in registry.REGIMES.items() if r.kind == "dist_option" and r.supports.elastic)
    return ValueError(_REFUSED[feature].format(where=where, options=options))


class DistOption(Regime):
    """A dist_option's regime: a DistOpt without a cluster, able to switch options per call."""

    supports = Capabilities()
    where = "under this dist_option"

    @classmethod
    def choose(cls, setup: Setup) -> OptionSwitch:
        return OptionSwitch(setup, cls.name, **cls.method_args(**setup.args))


class OptionSwitch:
    """The strategies of one DistOpt without a cluster, one per dist_option, sharing one reducer."""

    info: DistInfo | None = None
    """The World's own view of this rank (a cluster's regime may give a narrower one)."""
    owns_reducer = True
    """The reducer is the DistOpt's own: a SINGA step may open it with the step's hook before backward."""

    def __init__(self, setup: Setup, option: str = "plain", **args: Any):
        comm = setup.world.comm
        self.elastic = setup.world.membership.elastic
        self.comm, self.bucket_size, self.first_bucket_size = comm, setup.bucket_size, setup.first_bucket_size
        params = params_of(setup.optimizer)
        # Holders are the job's ranks; an elastic job's communicator holds the processes present.
        self._ranks = setup.world.world_size if self.elastic else comm.world_size
        everyone, partitioned = split_by_holders(params, self._ranks)
        self._partitioned = {h: [id(p) for p in ps] for h, ps in partitioned.items()}
        self.holders: HolderGroups | None = None
        """A partitioned model's parameters that only some ranks hold (troupe.partition)."""
        if setup.world.membership.builds_together:
            self.holders = HolderGroups.make(comm, partitioned)
        elif setup.world.partitioned:  # a joiner builds alone while the others train: no collective here
            membership = setup.world.membership
            self.holders = HolderGroups.by_place(comm, setup.world.replica_comms()[1], partitioned)
            if membership.constant_batch:  # the slices are weighed as the reducer weighs the rest
                self.holders.weight = membership.grad_weight
        elif partitioned:
            raise ValueError("under troupe run --elastic, partition the model with troupe.partition(model, plan) "
                             "(its worker group is the elastic group), not with an explicit comm")
        self.reducer = self._make_reducer(everyone)
        self.ctx = registry.Context(comm, self.reducer, setup.optimizer, everyone, setup.compression,
                                    setup.step_count, setup.name_of, elastic=self.elastic)
        self._made: dict[tuple, UpdateStrategy] = {}
        self._restored: dict[str, Any] = {}  # state from load_state_dict, for strategies made later
        self.current: UpdateStrategy = self.select(option, **args)

    def select(self, option: str, **args: Any) -> UpdateStrategy:
        """The strategy of `option` with its method's arguments (made on first use); it becomes current."""
        key = (option, tuple(sorted(args.items())))
        strategy = self._made.get(key)
        if strategy is None:
            regime = registry.lookup(option)
            if self.elastic and not regime.supports.elastic:
                raise refuse("elastic", f"with dist_option {option!r}")
            if self.holders is not None and not regime.supports.partition:
                raise ValueError(f"dist_option {option!r} averages parameters, not gradients, and cannot average "
                                 f"a partitioned model's slices: use one of {_partition_options()}")
            strategy = registry.build(option, self.ctx, **args)
            strategy.load_state_dict(self._restored)
            if self.holders is not None:
                strategy = Partitioned(strategy, self.holders, self.comm, self.reducer)
            self._made[key] = strategy
        self.current = strategy
        return strategy

    def start(self) -> None:
        """Nothing to start: every rank already holds rank 0's parameters."""

    def require(self, feature: str) -> None:
        """Raise ValueError unless this DistOpt can offer `feature` (a `Capabilities` field): every
        dist_option offers join and add_param_group; graph mode checks its own option (`graphstep`)."""
        if self.holders is not None and feature == "join":
            raise refuse(feature, "a partitioned model")
        if self.holders is not None and feature == "graph_mode":
            raise refuse(feature, "for a partitioned model")

    @property
    def shadows_joins(self) -> bool:
        """Does ``join()`` keep a rank that ran out of data in the others' reductions?"""
        return self.reducer is not None

    def add_params(self, params: Sequence[Tensor]) -> GradReducer | None:
        """Rebuild the reducer over `params` (all of them, old and new); the current option is remade."""
        everyone, partitioned = split_by_holders(params, self._ranks)
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

    def zero_grad(self, optimizer: Any, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def per_rank_state(self) -> list[str]:
        """Why the state of the strategies used so far belongs to each rank (each reason once)."""
        reasons: list[str] = []
        for s in self._made.values():
            reasons += [r for r in s.per_rank_state() if r not in reasons]
        return reasons

    def optimizer_parts(self) -> None:
        """None: the optimizer holds whole parameters."""
        return None

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
        if (self.comm.world_size == 1 and not self.elastic) or not params:  # an elastic job grows back
            return None
        reducer = GradReducer(params, self.comm, self.bucket_size, self.first_bucket_size,
                              hook_for_step=lambda: self.current.reduce_hook(),
                              describe_step=lambda: self.current.describe())
        if self.holders is not None:  # the slices are reduced whenever the buckets are, in the same place
            reducer.also_reduce = self.holders.reduce
        return reducer


class Fixed:
    """The one strategy a cluster's regime gives a worker, with the worker's view of the job."""

    owns_reducer = False

    def __init__(self, regime: type[Regime], strategy: UpdateStrategy, info: DistInfo | None = None):
        self.regime, self.current, self.info = regime, strategy, info
        self.reducer: GradReducer | None = strategy.reducer

    def select(self, option: str, **args: Any) -> UpdateStrategy:
        self.regime.accept(registry.lookup(option))
        return self.current

    def start(self) -> None:
        self.current.start()

    def require(self, feature: str) -> None:
        # A regime without join shadowing still runs join()'s block, as a plain block (its workers
        # do not wait for each other's reductions: nothing to shadow).
        if feature != "join" and not getattr(self.regime.supports, feature):
            raise refuse(feature, self.regime.where)

    @property
    def shadows_joins(self) -> bool:
        return self.regime.supports.join and self.reducer is not None

    def add_params(self, params: Sequence[Tensor]) -> GradReducer | None:
        raise refuse("add_param_group", self.regime.where)

    def zero_grad(self, optimizer: Any, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def per_rank_state(self) -> list[str]:
        return self.current.per_rank_state()

    def optimizer_parts(self) -> None:
        """None: the optimizer holds whole parameters (or FSDP2's DTensors, which say what they hold)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {}, **self.current.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current.load_state_dict(state)


def params_of(optimizer: Any) -> list[Tensor]:
    """The optimizer's parameters, each once, in param-group order."""
    seen: dict[int, Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _partition_options() -> list[str]:
    return sorted({r.name for r in registry.REGIMES.values() if r.kind == "dist_option" and r.supports.partition})
