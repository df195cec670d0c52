"""Each rank's role in a cluster: a worker (group, index), a server (group, index), or both.

Ranks are laid out workers first, so a worker's global rank is its index among all
workers; with `server_worker_separate` the servers follow them, otherwise server j
shares the process of worker j:

>>> from troupe.cluster.configuration.presets import PRESETS
>>> [r.kind for r in roles(PRESETS["downpour"])]
['worker', 'worker', 'worker', 'worker', 'server', 'server']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from troupe.cluster.configuration.config import ClusterConfig


@dataclass(frozen=True)
class Role:
    """What one rank does: a worker (group, index in group) and/or a server (group, index)."""

    rank: int
    worker: tuple[int, int] | None
    """(worker group, index within the group), or None on a server-only rank."""
    server: tuple[int, int] | None
    """(server group, index within the group), or None on a worker-only rank."""

    @property
    def kind(self) -> Literal["worker", "server", "worker+server"]:
        if self.worker and self.server:
            return "worker+server"
        return "worker" if self.worker else "server"

    def describe(self) -> str:
        parts = []
        if self.worker:
            parts.append(f"worker {self.worker[1]} of group {self.worker[0]}")
        if self.server:
            parts.append(f"server {self.server[1]} of group {self.server[0]}")
        return f"rank {self.rank}: " + " + ".join(parts)


def roles(config: ClusterConfig) -> list[Role]:
    """The role of every rank, ``len(roles(config)) == config.nprocs``.

    One server per process; `nworkers_per_procs` > 1 (in-memory Hogwild) gives each of a
    process's workers an OS process of its own, the first also hosting the server group.
    """
    if config.nservers_per_procs != 1:
        raise ValueError(f"troupe runs one server per process: nservers_per_procs must be 1 (got "
                         f"{config.nservers_per_procs})")
    if config.in_memory:
        shape = (config.server_worker_separate, config.share_memory, config.nworkers_per_group,
                 config.nservers_per_group)
        if shape != (False, True, 1, 1):
            raise ValueError(
                f"nworkers_per_procs {config.nworkers_per_procs} is in-memory Hogwild: the workers of a process share "
                "its server group's memory, which needs server_worker_separate false, share_memory true and "
                f"groups of one worker and one server (got server_worker_separate {shape[0]}, share_memory "
                f"{shape[1]}, nworkers_per_group {shape[2]}, nservers_per_group {shape[3]})"
            )
        k = config.nworkers_per_procs
        return [Role(r, (r, 0), (r // k, 0) if r % k == 0 else None) for r in range(config.nworkers)]
    workers = [(w // config.nworkers_per_group, w % config.nworkers_per_group) for w in range(config.nworkers)]
    servers = [(s // config.nservers_per_group, s % config.nservers_per_group) for s in range(config.nservers)]
    if config.server_worker_separate:
        return [Role(r, w, None) for r, w in enumerate(workers)] + [
            Role(len(workers) + i, None, s) for i, s in enumerate(servers)
        ]
    return [Role(r, w, s) for r, (w, s) in enumerate(zip(workers, servers))]


def expendable_ranks(cluster: ClusterConfig) -> set[int]:
    """Ranks the job goes on without when they die or are cut off: with asynchronous worker
    groups, every worker but rank 0 (which hosts the job's rendezvous). With co-located servers
    the vanished worker's group, server and master copies go with it. Groups that wait for one
    another (DiLoCo's outer step) cannot go on without any of them."""
    if cluster.nworker_groups <= 1 or cluster.groups_wait:
        return set()
    return {r.rank for r in roles(cluster) if r.worker and r.rank != 0}
