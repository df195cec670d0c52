"""Every regime troupe can train under, in one table: SINGA's dist_options and the cluster frameworks.

A regime is a class that registers itself here (`register`): its name (and aliases), what
it declares it can do (`Capabilities`), and `build`, which makes the `UpdateStrategy` one
DistOpt steps with. The SINGA dist_options register in `allreduce`, `half`, `sparse` and
`partial`; the parameter-server worker kinds in `troupe.cluster.regimes`. `DistOpt` never
names a regime: it asks `resolve(dist_option, cluster)` for one and lets it `choose`.

    >>> @register
    ... class Plain(Regime):
    ...     name, aliases, method = "plain", ("fp32",), "backward_and_update"
    ...     supports = Capabilities(graph_mode=True)
    ...     @classmethod
    ...     def build(cls, ctx, **args): return AllReduce(...)

SINGA's method names (`DistOpt.backward_and_update_half` ...) and the fixed arguments a
dist_option passes to its method come from the same classes, so `DistOpt.update(loss,
option)`, ``DistOpt(opt, dist_option=...)`` and graph mode mean the same thing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.compressed import CompressionConfig
from troupe.sync.reducer import GradReducer

if TYPE_CHECKING:
    from troupe.runtime.world import World


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a regime can do, declared by the regime (DistOpt asks, never probes)."""

    per_call: bool = True
    """SINGA's ``update(loss, option)`` may switch to another dist_option on any call."""
    join: bool = True
    """``DistOpt.join()`` shadows a rank that ran out of data (False: the block is a plain block)."""
    graph_mode: bool = False
    """The whole step compiles with the reduction inside the graph (``compile_step``, ``use_graph``)."""
    add_param_group: bool = True
    """Parameters may join after the DistOpt is made."""
    partition: bool = True
    """A partitioned model's slices can be reduced among their holders (``troupe.partition``)."""
    elastic: bool = False
    """Worker groups may leave and rejoin while the others train on."""


@dataclass
class Context:
    """What a dist_option's strategy is built from (one per DistOpt, shared by its options)."""

    comm: Communicator
    reducer: GradReducer | None
    optimizer: torch.optim.Optimizer
    params: Sequence[Tensor]
    config: CompressionConfig
    step_count: Callable[[], int]
    name_of: Callable[[Tensor], str]
    residuals: dict[str, Tensor] = field(default_factory=dict)
    """Error-feedback memory, shared by the sparse options (checkpointed by DistOpt)."""
    elastic: bool = False
    """`troupe run --elastic`: a step's collectives run before the members' vote on it."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What a DistOpt hands the regime it resolved, to choose this rank's strategy."""

    world: World
    optimizer: torch.optim.Optimizer
    bucket_size: int
    first_bucket_size: int
    compression: CompressionConfig
    nan_policy: str
    step_count: Callable[[], int]
    name_of: Callable[[Tensor], str]
    cluster: Any = None
    """The job's ClusterConfig (None without a cluster)."""
    groups: int | None = None
    """A sharded DistOpt's synchronous worker groups (HSDP), as given (None: ``TROUPE_GROUPS``, else 1)."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """The dist_option's method arguments (``spars=0.01``, ``clipping=True``)."""


class Regime:
    """One way of training on many workers: a dist_option or a cluster's worker kind.

    Subclasses set the class variables and `build`; `register` puts them in `REGIMES`.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[Literal["dist_option", "cluster", "shard"]] = "dist_option"
    method: ClassVar[str] = "backward_and_update"
    """SINGA's DistOpt method a dist_option calls (`troupe.singa.SingaMethods`)."""
    fixed_args: ClassVar[Mapping[str, Any]] = {}
    """Keyword arguments the dist_option always passes to its method (``topK=True``)."""
    supports: ClassVar[Capabilities] = Capabilities()
    where: ClassVar[str] = ""
    """How errors name the regime ("under a parameter-server cluster")."""
    replicated: ClassVar[bool] = True
    """Every rank holds whole parameters, which DistOpt makes rank 0's (False: troupe.shard's FSDP2 shards)."""

    @classmethod
    def build(cls, ctx: Any, **args: Any) -> UpdateStrategy:
        raise NotImplementedError(f"regime {cls.name!r} does not build a strategy")

    @classmethod
    def method_args(cls, **given: Any) -> dict[str, Any]:
        """The fixed arguments plus those of `given` (not None) that this regime's builder takes."""
        takes = _build_parameters(cls)  # once per regime: SINGA's update() asks on every step
        return {**cls.fixed_args, **{k: v for k, v in given.items() if v is not None and k in takes}}

    @classmethod
    def choose(cls, setup: Setup) -> Any:
        """This rank's strategies under this regime (`troupe.strategies.choice`: an OptionSwitch or Fixed)."""
        raise NotImplementedError(f"regime {cls.name!r} cannot be chosen for a DistOpt")

    @classmethod
    def accept(cls, option: type[Regime]) -> None:
        """A cluster regime: raise unless a step may run `option` under it (DistOpt and ``update()``)."""


@functools.cache
def _build_parameters(regime: type[Regime]) -> frozenset[str]:
    return frozenset(inspect.signature(regime.build).parameters)


REGIMES: dict[str, type[Regime]] = {}
"""Every registered regime by name and alias (filled by each regime's module)."""


def register(cls: type[Regime]) -> type[Regime]:
    """Class decorator: add `cls` to `REGIMES` under its name and aliases (a name is taken once)."""
    for name in (cls.name, *cls.aliases):
        if REGIMES.get(name, cls) is not cls:
            raise ValueError(f"regime name {name!r} is already taken by {REGIMES[name].__qualname__}")
        REGIMES[name] = cls
    return cls


def lookup(name: str, kind: str = "dist_option") -> type[Regime]:
    """The registered regime of `kind` called `name`, or a ValueError listing the valid names."""
    regime = REGIMES.get(name) if isinstance(name, str) else None
    if regime is None or regime.kind != kind:
        known = sorted(n for n, r in REGIMES.items() if r.kind == kind)
        label = {"dist_option": "dist_option", "shard": "shard mode"}.get(kind, f"{kind} regime")
        raise ValueError(f"unknown {label} {name!r}; choose one of {known}")
    return regime


def check_option(option: str) -> str:
    """The SINGA method name of a dist_option, or a ValueError listing the valid names."""
    return lookup(option).method


def dist_options() -> dict[str, str]:
    """`dist_option` names (SINGA's, with aliases) and the DistOpt method each one calls."""
    return {name: r.method for name, r in REGIMES.items() if r.kind == "dist_option"}


def graph_options() -> tuple[str, ...]:
    """The dist_options graph mode can compile (their reduction runs inside the graph)."""
    return tuple(name for name, r in REGIMES.items() if r.kind == "dist_option" and r.supports.graph_mode)


def resolve(dist_option: str, cluster: Any = None, shard: str | None = None) -> type[Regime]:
    """The regime a DistOpt trains under: the cluster's worker regime when the job has a cluster
    (which must accept `dist_option`), the shard mode's when `shard` is given (the same), else
    `dist_option`'s own."""
    option = lookup(dist_option)
    if shard is not None:
        if cluster is not None:
            raise ValueError(f"shard={shard!r} cannot run under a cluster framework ({cluster.worker_regime}) yet: "
                             "drop the cluster (plain data parallelism) to shard")
        regime = lookup(shard, "shard")
        regime.accept(option)
        return regime
    if cluster is None:
        return option
    regime = lookup(cluster.worker_regime, "cluster")
    regime.accept(option)
    return regime


def build(option: str, ctx: Context, **args: Any) -> UpdateStrategy:
    """The strategy for `option` with its method's keyword arguments (``spars=0.01``, ``clipping=True`` ...)."""
    regime = lookup(option)
    return regime.build(ctx, **{**regime.fixed_args, **args})
