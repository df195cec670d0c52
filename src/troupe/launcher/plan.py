"""The launch plan: what this node's launcher runs, resolved once (`resolve.plan_from`) and passed down.

    plan = plan_from(Flags.from_args(args))   # flags + cluster block + job file + environment
    plan.mode                                 # "fixed", "quorum" (elastic worker groups) or "rejoin"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from troupe.launcher.flags import Outputs, Place, Recovery

if TYPE_CHECKING:
    from troupe.runtime.quorum import ElasticOptions

Mode = Literal["fixed", "quorum", "rejoin"]
"""fixed: one failure stops every rank (`processes`); quorum: elastic worker groups, a dead one
restarts and heals from the others (`elastic_groups`); rejoin: --elastic over a parameter-server
job, a dead worker restarts alone and rejoins through the servers (`elastic_servers`)."""


@dataclass(frozen=True, kw_only=True)
class Servers:
    """The cluster's server-only ranks and what may fail without stopping the job."""

    ranks: frozenset[int] = frozenset()
    """Ranks that run the cluster bootstrap, not the script."""
    places: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """Server rank -> (its server group, its index in that group)."""
    fail_over: bool = False
    """--elastic: a dead server's workers fail over to the same server of another server group."""
    expendable: frozenset[int] = frozenset()
    """Workers of asynchronous groups: when one dies, the others go on."""

    def copies(self, index: int) -> set[int]:
        """The servers holding server index `index`'s slices: one per server group."""
        return {r for r, (_, j) in self.places.items() if j == index}


@dataclass(frozen=True, kw_only=True)
class ElasticPlan:
    """How an elastic launcher restarts its ranks."""

    restarts_per_rank: int = 10
    spares: int = 1
    """Warm spares kept where ranks start afresh (--spares, or the mode's default)."""
    evict_after: float | None = None
    """--evict-after as given (the rejoin mode's frozen-server check; the quorum's is in `quorum`)."""
    quorum: ElasticOptions | None = None
    """The quorum mode's options (what every worker and the lighthouse are told); None under rejoin."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What this node's launcher runs: resolved once from flags, cluster block, job file and environment."""

    place: Place
    """This node's place; its nproc is decided."""
    argv: tuple[str, ...]
    """The script and its arguments."""
    mode: Mode = "fixed"
    env: Mapping[str, str] = field(default_factory=dict)
    """What every rank's environment adds to the launcher's (cluster, groups, shard, outputs, backend)."""
    servers: Servers = field(default_factory=Servers)
    elastic: ElasticPlan | None = None
    """None: a fixed job."""
    outputs: Outputs = field(default_factory=Outputs)
    recovery: Recovery = field(default_factory=Recovery)

    def __post_init__(self) -> None:
        if self.place.nproc is None:
            raise ValueError("a launch plan needs this node's process count (-n)")
        if (self.mode == "fixed") != (self.elastic is None):
            raise ValueError(f"mode {self.mode!r} and elastic {self.elastic!r} disagree")
        if self.mode == "quorum" and self.elastic is not None and self.elastic.quorum is None:
            raise ValueError("the quorum mode needs its ElasticOptions")

    @property
    def nproc(self) -> int:
        assert self.place.nproc is not None
        return self.place.nproc

    @property
    def world_size(self) -> int:
        return self.nproc * self.place.nnodes
