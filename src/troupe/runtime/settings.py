"""Settings: every ``TROUPE_*`` environment variable, read in one place.

`troupe run` (and users under torchrun or mpiexec) pass options to the ranks through
the environment. `Settings.from_env()` reads and validates all of them at once:
`troupe.init()` keeps that read in the World (``world.settings``) for the job's life;
code that runs before or without a job (the CLI, data loading, the cluster text) asks
`current()`. Nothing else touches ``os.environ``. The timeouts that matter are here
together, each with the trade-off it makes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

RESUME_MODES = ("no", "yes", "auto")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the environment says to this rank (each field names its variable)."""

    ticket: str | None = None
    """TROUPE_TICKET: ADDR:PORT:TOKEN, set by `troupe run` for every rank."""
    token: str | None = None
    """TROUPE_TOKEN: the job token `troupe run --nnodes > 1` uses when --token is not given."""
    backend: str | None = None
    """TROUPE_BACKEND: "gloo" or "nccl" (default: NCCL when every local rank has a GPU)."""
    master_addr: str | None = None
    """TROUPE_MASTER_ADDR: where rank 0 listens under mpiexec (default: loopback on one host; on several,
    the hostname's address, or rank 0's address that routes to the other hosts)."""
    master_port: int = 0
    """TROUPE_MASTER_PORT: its port under mpiexec (0: any free port)."""
    timeout: float | None = None
    """TROUPE_TIMEOUT: seconds one collective may wait (default 300). Longer rides out slow
    peers and long evaluations between steps; shorter names a hung peer sooner."""
    join_timeout: float | None = None
    """TROUPE_JOIN_TIMEOUT: seconds to wait for every rank to join (default 60)."""
    heartbeat: float = 1.0
    """TROUPE_HEARTBEAT: seconds between watchdog heartbeats in the rendezvous store."""
    stall_seconds: float = 30.0
    """TROUPE_STALL_SECONDS: a collective waiting this long gets a stall report (who is late)."""
    peer_timeout: float = 45.0
    """TROUPE_PEER_TIMEOUT: a peer whose heartbeat is this old is declared hung or unreachable.
    Longer tolerates long GC pauses and swapping; shorter ends a job with a dead host sooner."""
    store_timeout: float = 3.0
    """TROUPE_STORE_TIMEOUT: seconds one watchdog call to the rendezvous store (or a reconnect) may
    take before it counts as unanswered and is retried on a fresh connection. Longer tolerates a
    congested link; shorter notices a cut-off store sooner (it must stay well below the peer timeout)."""
    watchdog: bool = True
    """TROUPE_WATCHDOG: 0 turns the heartbeat thread off."""
    ps_timeout: float = 7 * 24 * 3600.0
    """TROUPE_PS_TIMEOUT: seconds a parameter-server message may wait (a dead peer fails at once
    anyway; a server waits as long as workers train between two messages)."""
    elastic: str | None = None
    """TROUPE_ELASTIC: JSON elastic options, set by `troupe run --elastic` (runtime/quorum.py)."""
    incarnation: int = 0
    standby: str | None = None
    """TROUPE_STANDBY: HOST:PORT of node 1's launcher's standby store, set by `troupe run --elastic` on several nodes
    for a rank it starts once it knows it (runtime/failover.py)."""
    """TROUPE_INCARNATION: how many times `troupe run --elastic` has restarted this rank."""
    rejoin: bool = False
    """TROUPE_REJOIN: set by `troupe run --elastic` for a parameter-server framework: a dead worker
    restarts alone and rejoins through the servers (runtime/rejoin.py)."""
    evict_after: float = 5.0
    """TROUPE_EVICT_AFTER (`troupe run --elastic --evict-after` under Sandblaster): seconds a server waits
    for a worker whose group mates have sent their update and whose beat has stopped (it is frozen)
    before the group goes on without it; after SIGCONT it restarts and rejoins."""
    group_vote_min: int = 32
    """TROUPE_GROUP_VOTE_MIN: an elastic quorum of at least this many processes votes over its own process group
    (runtime/vote.py: two store operations a step, 2 log2(N) messages); a smaller one votes through the launcher's
    store (two operations per process, which a small quorum's store serves sooner: docs/scale.md)."""
    shard: str | None = None
    """TROUPE_SHARD: "optimizer" or "gradients", set by `troupe run --shard`: what a DistOpt made without
    ``shard=`` cuts over the ranks (strategies/sharded.py)."""
    groups: int | None = None
    """TROUPE_GROUPS: synchronous worker groups of k = world size / G consecutive ranks, set by `troupe run
    --nworker-groups G` without a cluster: a sharded model or DistOpt shards inside each group and the
    groups replicate (HSDP). Must divide the world size (checked where the world is known: `World.sync_groups`)."""
    cluster: str | None = None
    """TROUPE_CLUSTER: JSON, a framework name or a cluster file (parameter servers)."""
    stats: str | None = None
    """TROUPE_STATS: per-step stats as JSON lines, one file per rank."""
    timeline: str | None = None
    """TROUPE_TIMELINE: a Chrome trace, merged by `troupe run`."""
    tensorboard: str | None = None
    """TROUPE_TENSORBOARD: a TensorBoard run directory per rank."""
    checkpoint_dir: Path | None = None
    """TROUPE_CHECKPOINT_DIR: where scripts and servers keep checkpoints."""
    resume: str = "no"
    """TROUPE_RESUME: no | yes | auto (resume from the latest complete checkpoint); "auto" when
    torchrun restarted the job (TORCHELASTIC_RESTART_COUNT > 0) and TROUPE_RESUME is not set."""
    cache: Path = Path.home() / ".cache" / "troupe"
    """TROUPE_CACHE: where downloaded data sets are kept."""
    mnist_url: str = "https://storage.googleapis.com/cvdf-datasets/mnist/"
    """TROUPE_MNIST_URL: where load_mnist downloads from when no offline copy is found."""
    fork_server: str | None = None
    """TROUPE_FORK_SERVER: the socket of a `troupe fork-server`, which forks `troupe run`'s launchers
    (runtime/forkserver.py); unset: every `troupe run` starts its own."""

    def __post_init__(self) -> None:
        for name in ("timeout", "join_timeout", "heartbeat", "stall_seconds", "peer_timeout", "ps_timeout",
                     "store_timeout", "evict_after"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"TROUPE_{name.upper()} must be > 0 seconds, got {value}")
        if self.resume not in RESUME_MODES:
            raise ValueError(f"TROUPE_RESUME must be one of {RESUME_MODES}, got {self.resume!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"TROUPE_BACKEND must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.shard not in (None, "optimizer", "gradients"):
            raise ValueError(f"TROUPE_SHARD must be 'optimizer' or 'gradients', got {self.shard!r}")
        if self.groups is not None and self.groups < 1:
            raise ValueError(f"TROUPE_GROUPS must be >= 1 (worker groups), got {self.groups}")
        if self.group_vote_min < 1:
            raise ValueError(f"TROUPE_GROUP_VOTE_MIN must be >= 1 (processes), got {self.group_vote_min}")
        if self.master_port < 0:
            raise ValueError(f"TROUPE_MASTER_PORT must be >= 0, got {self.master_port}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every TROUPE_* variable (empty counts as unset); bad values raise ValueError naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            var = f"TROUPE_{f.name.upper()}"
            raw = env.get(var, "")
            if raw == "":
                continue
            kind = str(f.type)
            try:
                if "float" in kind:
                    values[f.name] = float(raw)
                elif "int" in kind:
                    values[f.name] = int(raw)
                elif "bool" in kind:
                    values[f.name] = raw not in ("0", "false", "no", "off")
                elif "Path" in kind:
                    values[f.name] = Path(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {kind.split(' ')[0]}") from None
        restarts = env.get("TORCHELASTIC_RESTART_COUNT", "")
        if "resume" not in values and restarts.isdigit() and int(restarts) > 0:
            # torchrun --max-restarts started this job again: resume as troupe run's restarts do
            values["resume"] = "auto"
        return cls(**values)


def current() -> Settings:
    """The environment's settings now (a process in a job uses its World's, read once at `troupe.init()`)."""
    return Settings.from_env()
