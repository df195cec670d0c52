"""`troupe run`'s flags as typed values, read once from argparse's Namespace and never written back.

`resolve` turns them (with the cluster block, the job file and the environment) into the one
`LaunchPlan` the launcher runs; a rewrite of a flag (srun's environment, an elastic cluster block)
makes a new `Flags`, it never edits the parsed Namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Place:
    """This node's place in the job."""

    nproc: int | None = None
    """Processes on this node; None until a cluster (or the default, 2) decides."""
    nnodes: int = 1
    node_rank: int = 0
    master: tuple[str, int] | None = None
    """Node 0's rendezvous (HOST, PORT); None: this machine's loopback, on a free port."""
    token: str | None = None
    """The job token every node's launcher shares (None or "": a fresh one)."""

    @property
    def total(self) -> int | None:
        """Processes in the whole job (None while -n is undecided)."""
        return None if self.nproc is None else self.nproc * self.nnodes

    @property
    def ranks(self) -> range:
        """This node's ranks (-n must be decided)."""
        assert self.nproc is not None
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)


@dataclass(frozen=True, kw_only=True)
class ElasticFlags:
    """--elastic and the flags that only mean something with it."""

    on: bool = False
    min_groups: int | None = None
    max_groups: int | None = None
    batch: str | None = None
    """--elastic-batch: shrink or constant (None: the quorum's default)."""
    timeout: float | None = None
    """--elastic-timeout."""
    evict_after: float | None = None
    restarts_per_rank: int = 10
    spares: int | None = None

    def given(self) -> dict[str, Any]:
        """The quorum's flags given (by their flag names), for the checks that refuse them."""
        return {"--min-groups": self.min_groups, "--max-groups": self.max_groups, "--elastic-batch": self.batch,
                "--elastic-timeout": self.timeout, "--evict-after": self.evict_after, "--spares": self.spares}


@dataclass(frozen=True, kw_only=True)
class ClusterFlags:
    """--framework, --cluster FILE and one flag per ClusterConfig field that declares one."""

    framework: str | None = None
    file: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Every cluster field's flag by field name (None where not given)."""
    servers_block: str | None = None
    """The framework of a cluster block with `elastic: true` beside separate servers (Downpour,
    Sandblaster): --elastic over that parameter-server job."""

    def given(self) -> dict[str, Any]:
        """The cluster field flags that were given."""
        return {k: v for k, v in self.fields.items() if v is not None}

    def with_fields(self, **values: Any) -> ClusterFlags:
        return dataclasses.replace(self, fields={**self.fields, **values})


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """Where the ranks' output and the job's records go."""

    stats: str | None = None
    timeline: str | None = None
    tensorboard: str | None = None
    prefix: bool = False
    log_dir: str | None = None
    ranks: str | None = None
    """--ranks: the ranks whose output this terminal shows (0, 0,2, 0-3); None: all."""


@dataclass(frozen=True, kw_only=True)
class RankSettings:
    """What every rank is told through its environment, straight from a flag."""

    backend: str | None = None
    threads: int | None = None
    timeout: float | None = None
    shard: str | None = None


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """Checkpoints and whole-job restarts (--checkpoint-dir, --resume, --max-restarts)."""

    checkpoint_dir: str | None = None
    resume: str | None = None
    max_restarts: int = 0

    @property
    def directory(self) -> str | None:
        """Where the job saves and a restart resumes from."""
        return self.resume or self.checkpoint_dir


@dataclass(frozen=True, kw_only=True)
class Flags:
    """Everything `troupe run` was given on its command line."""

    place: Place = field(default_factory=Place)
    elastic: ElasticFlags = field(default_factory=ElasticFlags)
    cluster: ClusterFlags = field(default_factory=ClusterFlags)
    outputs: Outputs = field(default_factory=Outputs)
    ranks: RankSettings = field(default_factory=RankSettings)
    recovery: Recovery = field(default_factory=Recovery)
    argv: tuple[str, ...] = ()
    """The script and its arguments."""
    slurm: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Flags:
        """Read `troupe run`'s parsed arguments (the Namespace is not kept)."""
        from troupe.cluster.configuration.flags import given

        a = args
        return cls(
            place=Place(nproc=a.nproc, nnodes=a.nnodes, node_rank=a.node_rank, master=a.master, token=a.token),
            elastic=ElasticFlags(on=a.elastic, min_groups=a.min_groups, max_groups=a.max_groups,
                                 batch=a.elastic_batch, timeout=a.elastic_timeout, evict_after=a.evict_after,
                                 restarts_per_rank=a.restarts_per_rank, spares=a.spares),
            cluster=ClusterFlags(framework=a.framework, file=a.cluster, fields=given(a)),
            outputs=Outputs(stats=a.stats, timeline=a.timeline, tensorboard=a.tensorboard, prefix=a.prefix,
                            log_dir=a.log_dir, ranks=a.ranks),
            ranks=RankSettings(backend=a.backend, threads=a.threads, timeout=a.timeout, shard=a.shard),
            recovery=Recovery(checkpoint_dir=a.checkpoint_dir, resume=a.resume, max_restarts=a.max_restarts),
            argv=(a.script, *a.args),
            slurm=a.slurm,
        )
