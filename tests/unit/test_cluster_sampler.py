"""troupe/cluster/sampler.py without processes: a DistributedSampler made with its defaults on a worker of a cluster
whose servers are processes of their own counts the workers only; anything else keeps torch's defaults."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from troupe.cluster import sampler
from troupe.cluster.configuration import sources
from troupe.cluster.configuration.presets import preset

DATA = TensorDataset(torch.arange(12.0))


@pytest.fixture
def job(monkeypatch):
    """A default process group of `size` ranks in which this process is `rank`, under `cluster` (None: none)."""

    def make(cluster, size: int, rank: int) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(sources, "from_env", lambda: cluster)

    sampler.install()
    return make


def test_a_worker_of_separate_servers_counts_the_workers(job):
    cluster = preset("sandblaster", 4)  # 2 workers, then 2 servers
    assert (cluster.nworkers, cluster.nprocs, cluster.server_worker_separate) == (2, 4, True)
    job(cluster, 4, 1)
    s = DistributedSampler(DATA, shuffle=False)
    assert (s.num_replicas, s.rank) == (2, 1)
    assert list(s) == [1, 3, 5, 7, 9, 11]  # half the data, not a quarter


@pytest.mark.parametrize("case", ["no cluster", "co-located", "another group", "server", "given"])
def test_everything_else_keeps_torchs_defaults(job, case):
    cluster = None if case == "no cluster" else preset("allreduce" if case == "co-located" else "sandblaster", 4)
    size, rank = 5 if case == "another group" else 4, 3 if case == "server" else 0
    job(cluster, size, rank)
    s = DistributedSampler(DATA, num_replicas=4, rank=0) if case == "given" else DistributedSampler(DATA)
    assert (s.num_replicas, s.rank) == (size, rank)


def test_install_is_idempotent_and_patches_the_class():
    sampler.install()
    sampler.install()
    assert DistributedSampler.__init__ is sampler._init
    assert sampler._init.__wrapped__ is sampler._TORCH_INIT
