"""The reference's four frameworks as `ClusterConfig` presets, and their rescaling to a job's process count.

>>> cfg = PRESETS["downpour"]
>>> cfg.nprocs, cfg.nworker_groups, cfg.nservers
(6, 2, 2)
"""

from __future__ import annotations

import dataclasses

from troupe.cluster.configuration.config import ClusterConfig

PRESETS: dict[str, ClusterConfig] = {
    "sandblaster": ClusterConfig(nworkers_per_group=3, nservers_per_group=2, server_worker_separate=True),
    "allreduce": ClusterConfig(nworkers_per_group=3, nservers_per_group=3),
    "downpour": ClusterConfig(
        nworker_groups=2, nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True
    ),
    "hogwild": ClusterConfig(nworker_groups=3, nserver_groups=3),
    "diloco": ClusterConfig(framework="diloco", nworker_groups=2, nserver_groups=2),
}
"""The reference's four frameworks, exactly as its `cluster { ... }` blocks give them; and DiLoCo
(2 worker groups of one worker; ``troupe run -n 4 --nworker-groups 2`` makes groups of 2)."""

FOLLOW_GROUPS = frozenset({"diloco", "hogwild"})
"""Presets whose groups `troupe run --nworker-groups G -n N` sets without leaving -n: N / G workers each (and
as many co-located servers: a server group per worker group)."""


def preset(name: str, nprocs: int | None = None, **overrides) -> ClusterConfig:
    """A named framework, rescaled to `nprocs` processes when given.

    Rescaling keeps the framework's shape: Sandblaster and Downpour keep their server
    count and give the remaining processes to workers; AllReduce and Hogwild use one
    worker (and one co-located server) per process; DiLoCo keeps its groups (or takes
    ``nworker_groups`` from `overrides`) and gives each nprocs / groups workers.
    """
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown framework {name!r}; choose one of {sorted(PRESETS)}") from None
    if name in FOLLOW_GROUPS and "nworker_groups" in overrides:  # the groups first, then the rescaling to nprocs
        groups = overrides.pop("nworker_groups")
        cfg = dataclasses.replace(cfg, nworker_groups=groups, nserver_groups=groups)
        if nprocs is not None and nprocs != cfg.nprocs:
            cfg = _per_group(name, cfg, nprocs)
    elif nprocs is not None and nprocs != cfg.nprocs:
        cfg = _rescale(name, cfg, nprocs)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _rescale(name: str, cfg: ClusterConfig, nprocs: int) -> ClusterConfig:
    if name == "allreduce":
        return dataclasses.replace(cfg, nworkers_per_group=nprocs, nservers_per_group=nprocs)
    if name == "hogwild":  # a group of one per process (with --nworker-groups: `_per_group`)
        return dataclasses.replace(cfg, nworker_groups=nprocs, nserver_groups=nprocs)
    if name in FOLLOW_GROUPS:
        return _per_group(name, cfg, nprocs)
    nworkers = nprocs - cfg.nservers
    if nworkers < cfg.nworker_groups or nworkers % cfg.nworker_groups:
        fits = [cfg.nservers + k * cfg.nworker_groups for k in range(1, 4)]
        raise ValueError(
            f"framework {name!r} has {cfg.nservers} server(s) and {cfg.nworker_groups} worker group(s): "
            f"-n {nprocs} leaves {nworkers} worker(s), which must be a positive multiple of {cfg.nworker_groups}; "
            f"-n {', '.join(map(str, fits))}, ... fit (the smallest: -n {fits[0]}), or give the layout yourself "
            f"(--nworker-groups, --nservers-per-group)"
        )
    return dataclasses.replace(cfg, nworkers_per_group=nworkers // cfg.nworker_groups)


def _per_group(name: str, cfg: ClusterConfig, nprocs: int) -> ClusterConfig:
    """`cfg`'s worker groups (each with its co-located server group) sharing `nprocs` processes equally."""
    groups = cfg.nworker_groups
    if nprocs % groups:
        raise ValueError(f"framework {name!r}: -n {nprocs} processes do not divide into {groups} worker groups "
                         f"(--nworker-groups); give -n a multiple of {groups}")
    k = nprocs // groups
    return dataclasses.replace(cfg, nworkers_per_group=k, nservers_per_group=k)
