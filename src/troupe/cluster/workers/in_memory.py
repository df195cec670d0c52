"""In-memory Hogwild (`share_memory`, `nworkers_per_procs` > 1): worker processes sharing one server group's memory.

SINGA packs `nworkers_per_procs` worker groups into one process, where they update the
parameters of that process's server group in place, without locks (the Hogwild paper).
troupe starts one OS process per worker and gives the workers of one such "process"
one parameter memory: the first of them writes the initial values into a file in
/dev/shm that every one of them maps; each worker's parameters become views into it,
and each worker's own optimizer (its own momentum) steps them in place while the others
read and write them. Across processes the server groups synchronise as Distributed
Hogwild does (`troupe.cluster.serving.groupsync`): the first worker of each process folds the
process's change into the master copies every `sync_freq` of its steps.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

import torch
from torch import Tensor

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.roles import Role
from troupe.cluster.serving.groupsync import GroupSync, SyncChannels
from troupe.cluster.serving.mastercopies import MasterCopies, SliceValues
from troupe.cluster.serving.shard import plan_slices
from troupe.reliability.nonfinite import all_finite
from troupe.runtime.comm import Communicator
from troupe.strategies.base import BaseStrategy
from troupe.cluster.workers import PS_WORKER_STATE

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class SharedMemory(BaseStrategy):
    """A worker whose parameters live in memory shared with the other workers of its process."""

    def __init__(self, cluster: ClusterConfig, role: Role, process: Communicator, optimizer: torch.optim.Optimizer,
                 params: list[Tensor], sync_channels: SyncChannels | None, alive, timeout: float):
        self.cluster, self.role, self.process = cluster, role, process
        self.optimizer = optimizer
        self.params = params
        self.per_process = cluster.nworkers_per_procs
        self.lead = role.server is not None
        """The process's first worker: it creates the memory and synchronises with the other processes."""
        self.sync_channels, self.alive, self.timeout = sync_channels, alive, timeout
        self.slices = plan_slices([p.numel() for p in params], 1)
        self.flat: Tensor | None = None
        self.values: dict[int, Tensor] = {}
        """Each slice's view of the shared memory (what the group sync reads and adopts into)."""
        self.groups: GroupSync | None = None
        self.steps = 0
        self.staleness: list[int] = []
        """Per step: this worker's updates since its process last synchronised (0 with one process)."""
        self.closed = False

    @torch.no_grad()
    def start(self) -> None:
        """Map the process's memory (every rank holds rank 0's values: they were broadcast) and share it."""
        total = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype if self.params else torch.float32
        path = None
        if self.lead:
            path = os.path.join(SHM_DIR, f"troupe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        path = self.process.all_gather_object(path)[0]  # the lead is the process's first rank
        try:
            self.flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
            if self.lead:
                self.flat.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))
            self.process.barrier()  # the values are written, and every worker has mapped the file
        finally:
            if self.lead:
                os.remove(path)  # the mappings stay; nothing is left behind, even after a crash
        offset, starts = 0, []
        for p in self.params:
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            starts.append(offset)
            offset += p.numel()
        self.values = {s.id: self.flat[starts[s.param] + s.start : starts[s.param] + s.stop] for s in self.slices}
        self.process.barrier()  # nobody updates before every worker's parameters are views
        if self.lead and self.sync_channels is not None:
            copies = MasterCopies(SliceValues.of(self.slices, self.values), self.role.server[0],
                                  self.cluster.nserver_groups, self.cluster.group_merge)
            self.groups = GroupSync(self.sync_channels, copies, rank_of=lambda k: k * self.per_process,
                                    alive=self.alive)
            self.groups.start()

    # --- the UpdateStrategy surface: gradients stay local; step() writes into the shared memory

    name = "in-memory-hogwild"
    reducer = None

    def describe(self) -> str:
        return self.name

    def reduce_hook(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def all_finite(self) -> bool:
        return all_finite([p.grad for p in self.params if p.grad is not None])  # this worker's own update

    def per_rank_state(self) -> list[str]:
        return [PS_WORKER_STATE]

    def step(self) -> dict:
        self.optimizer.step()  # in place, into the shared memory, without a lock
        self.steps += 1
        if self.groups is not None and self.steps % self.cluster.sync_freq == 0:
            self.groups.sync()
        self.staleness.append(self.steps % self.cluster.sync_freq if self.sync_channels is not None else 0)
        return {"staleness": self.staleness[-1]}

    def close(self) -> None:
        """Wait for the process's workers; its first worker then syncs a last time and serves until all are done."""
        if self.closed:
            return
        self.closed = True
        try:
            self.process.barrier()
        except RuntimeError as e:
            log.warning("troupe shared memory rank %d: a worker of this process is gone: %s", self.role.rank, e)
        if self.groups is not None:
            self.groups.sync()
            self.groups.close(self.timeout)
            print(f"troupe group sync rank {self.role.rank}: {self.groups.stats()}", file=sys.stderr, flush=True)
