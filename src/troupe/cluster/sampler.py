"""torch's DistributedSampler, made with its defaults, shards the data among a cluster's workers only.

A DDP-shaped script makes ``DistributedSampler(dataset)``, whose defaults are the size of the default process
group and this rank in it. Under a parameter-server cluster whose servers are processes of their own
(Sandblaster, Downpour: ``server_worker_separate``) that group holds the servers too, which train on no data:
with the defaults the W workers would each take 1/(W + S) of the data, and W/(W + S) of every epoch would never
be trained on. Ranks are laid out workers first (`roles`), so a worker's place among the workers is its global
rank: with `install`, a sampler made without ``num_replicas`` and ``rank`` on a worker of such a cluster gets
(the number of workers, the rank). Everything else gets torch's defaults: no cluster, co-located servers (every
rank a worker), a process group that is not the cluster's (another size), a server rank (it never reads the
data), or values the script gave.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.utils.data.distributed import DistributedSampler

_TORCH_INIT = DistributedSampler.__init__
"""torch's own ``DistributedSampler.__init__`` (before `install`)."""


def workers_place() -> tuple[int, int] | None:
    """(the cluster's workers, this worker's index) where a sampler's defaults would count the servers; else None."""
    import torch.distributed as dist

    from troupe.cluster.configuration.sources import from_env

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        cluster = from_env()
    except ValueError:
        return None  # a bad TROUPE_CLUSTER is DistOpt's to report, in one line
    if cluster is None or not cluster.server_worker_separate or dist.get_world_size() != cluster.nprocs:
        return None
    rank = dist.get_rank()
    return (cluster.nworkers, rank) if rank < cluster.nworkers else None


@functools.wraps(_TORCH_INIT)
def _init(self: DistributedSampler, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
          *args: Any, **kwargs: Any) -> None:
    if num_replicas is None and rank is None:
        place = workers_place()
        if place is not None:
            num_replicas, rank = place
    _TORCH_INIT(self, dataset, num_replicas, rank, *args, **kwargs)


def install() -> None:
    """Make `DistributedSampler`'s defaults the cluster's workers (idempotent; the class itself, so a name
    imported before still gets them)."""
    if DistributedSampler.__init__ is _TORCH_INIT:
        DistributedSampler.__init__ = _init
