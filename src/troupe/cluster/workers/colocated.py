"""The co-located worker: servers share the workers' processes (AllReduce, Distributed Hogwild).

Joining a cluster is `troupe.cluster.bootstrap`'s; the other kinds of worker are
`troupe.cluster.workers.ps_client` (separate servers) and `troupe.cluster.workers.in_memory`
(in-memory Hogwild); `troupe.cluster.regimes` registers all three.

`CoLocated`: inside a group, reduce the gradients (reduce-scatter onto their owners under NCCL,
`troupe.sync.hooks.scatter`), each worker updates the slices its co-located server owns, then
all-gather the slices; with several groups, every `sync_freq` steps each group folds its
change into the master copies, asynchronously (`troupe.cluster.serving.groupsync`).

A partitioned model (`troupe.partition`, `layout`): a slice of a dim-1 layer, or a dim -1 layer,
is held by one worker of the group, whose gradient already sums the group's samples (the
connection layers' backward adds them). It is not reduced in the group: divided by k it is the
gradient of the group's mean loss, as a replicated parameter's group mean is; that worker's
co-located server updates it, and it is not all-gathered. Across groups it syncs with
the master copies among the workers holding it (worker j of every group), as worker j's share
of the replicated parameters does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.roles import Role
from troupe.cluster.workers import PS_WORKER_STATE
from troupe.cluster.serving.groupsync import GroupSync, SyncChannels
from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.serving.shard import ParamShard, Slice, plan_slices
from troupe.cluster.workers.layout import Layout, trainable
from troupe.cluster.wire.links import LINK_FORM_SECONDS
from troupe.reliability.nonfinite import all_finite
from troupe.runtime.comm import Communicator
from troupe.strategies.base import BaseStrategy, reduced_buckets_finite
from troupe.sync.hooks.allreduce import MeanAllReduce
from troupe.sync.hooks.scatter import BucketScatter
from troupe.sync.reducer import GradReducer


def colocated_slices(numels: Sequence[int], owned: Sequence[bool], nservers: int, index: int) -> list[Slice]:
    """A co-located worker's slices: the replicated parameters cut over the group's servers (the same
    on every worker), then each parameter this worker alone holds in its group, whole, on its own server.

    ``Slice.param`` indexes `numels`; the replicated slices come first, so their ids agree across the
    group, and a worker's own slices agree with those of the same worker in every other group.
    """
    shared = [i for i, mine in enumerate(owned) if not mine]
    slices = [Slice(s.id, shared[s.param], s.start, s.stop, s.server)
              for s in plan_slices([numels[i] for i in shared], nservers)]
    for i in (i for i, mine in enumerate(owned) if mine):
        slices.append(Slice(len(slices), i, 0, numels[i], index))
    return slices


class CoLocated(BaseStrategy):
    """Workers that host their group's servers: reduce, update own slices, all-gather; groups sync every sync_freq."""

    def __init__(self, cluster: ClusterConfig, role: Role, group: Communicator, optimizer: torch.optim.Optimizer,
                 bucket_size: int, sync_channels: SyncChannels | None = None,
                 alive=lambda rank: True, timeout: float = 7 * 24 * 3600.0, *, layout: Layout | None = None,
                 first: Communicator | None = None, rejoined: bool = False):
        if cluster.nworkers_per_group != cluster.nservers_per_group or cluster.nworker_groups != cluster.nserver_groups:
            raise ValueError(
                "with server_worker_separate false troupe pairs each worker with one server: needs "
                f"nworkers_per_group == nservers_per_group (got {cluster.nworkers_per_group}, "
                f"{cluster.nservers_per_group}) and nworker_groups == nserver_groups (got "
                f"{cluster.nworker_groups}, {cluster.nserver_groups})"
            )
        self.cluster, self.group = cluster, group
        self.optimizer = optimizer
        self.params, param_group_of = trainable(optimizer)
        self.partitioned = layout is not None and layout.partitioned
        """A partitioned model (the same on every worker of the job): some parameters have one holder per group."""
        owned = [self.partitioned and layout.owners[j] is not None for j in (layout.local if layout else ())]
        owned += [False] * (len(self.params) - len(owned))
        self.index = role.worker[1]
        self.slices = colocated_slices([p.numel() for p in self.params], owned, cluster.nservers_per_group, self.index)
        self.shared = [s for s in self.slices if not owned[s.param]]
        """The replicated parameters' slices: reduced and all-gathered in the group."""
        self.mine = [s for s in self.slices if s.server == self.index]
        self.own = [s for s in self.mine if owned[s.param]]
        """The slices only this worker of the group holds: its server updates them, nobody gathers them."""
        dtype = self.params[0].dtype if self.params else torch.float32
        self.shard = ParamShard(self.mine, optimizer, param_group_of, {0: {role.rank}}, dtype)
        self.me = role.rank
        replicated = [p for p, mine in zip(self.params, owned) if not mine]
        self.reducer = GradReducer(replicated, group, bucket_size, hook_for_step=lambda: self._hook,
                                   describe_step=lambda: self.name) if group.world_size > 1 and replicated else None
        # Reduce-scatter the gradients onto their owners where it sends less (NCCL); Gloo's reduce-scatter
        # moves what an all-reduce does, and the padding of the owners' chunks adds to it: all-reduce there.
        self._hook = (BucketScatter(group, self.reducer.buckets, self.params, self.shared)
                      if group.backend == "nccl" else MeanAllReduce(group)) if self.reducer else None
        if self.reducer is not None:  # whenever the replicated gradients have been reduced
            self.reducer.also_reduce = self._own_to_group_mean
        self.steps = 0
        self.staleness: list[int] = []
        """Per step: updates of this group the other groups have not seen yet (0 with one group)."""
        self.sync_channels, self.alive, self.timeout = sync_channels, alive, timeout
        self.first, self.rejoined = first, rejoined
        """`troupe run --elastic`: the job's first processes (worker 0 broadcasts the parameters there; the
        workers share no data-parallel group), and whether this process is a new life of a group that died."""
        self.groups: GroupSync | None = None
        self.holding = contextlib.nullcontext()
        """Held while this worker's step changes its replica (a new life's snapshot is read between steps)."""
        self.closed = False

    def start(self) -> None:
        """Parameters were broadcast from worker 0: they are every server's and every master copy's initial
        values. A new life of a group takes them (and its optimizer state) from the live groups instead."""
        if self.first is not None:
            self.first.broadcast_tensors([p.detach() for p in self.params], src=0)
        for s in self.mine:
            self.shard.put(s.id, self._flat(s))
        if self.sync_channels is not None:
            n = self.cluster.nworkers_per_group
            copies = MasterCopies(self.shard, self.me // n, self.cluster.nworker_groups, self.cluster.group_merge)
            self.groups = GroupSync(self.sync_channels, copies, rank_of=lambda k: k * n + self.index,
                                    alive=self.alive)
            self.holding = self.groups.holding()
            self.groups.start(rejoining=self.rejoined)
            if self.rejoined:
                self._rejoin()

    def _rejoin(self) -> None:
        if not self.groups.rejoin(LINK_FORM_SECONDS):
            print(f"troupe group sync rank {self.me}: started again after every other group had finished "
                  "training: nothing to rejoin (this group's remaining steps are left out)", file=sys.stderr,
                  flush=True)
            raise SystemExit(0)
        self._all_gather()  # the replica it took, into the model

    def _flat(self, s) -> Tensor:
        return self.params[s.param].detach().reshape(-1)[s.start : s.stop]

    @torch.no_grad()
    def _apply_own(self) -> None:
        self.shard.set_lr([g["lr"] for g in self.optimizer.param_groups])  # follow the user's scheduler
        with self.shard.fused():  # one optimizer step over all of this server's slices
            for s in self.mine:
                grad = self.params[s.param].grad
                if grad is not None:  # unused everywhere in the group: no update, as in one process
                    self.shard.update(s.id, self.me, grad.reshape(-1)[s.start : s.stop])

    # --- the UpdateStrategy surface: the group's reduction runs during backward, the rest in step()

    name = "co-located"

    def describe(self) -> str:
        return self.name

    def reduce_hook(self):
        return self._hook

    def synchronize(self) -> None:
        if self.reducer is not None:
            self.reducer.reduce_now(self._hook)
        else:
            self._own_to_group_mean()

    @torch.no_grad()
    def _own_to_group_mean(self) -> None:
        """A slice's gradient on its one holder sums the k workers' mean losses (the connection layers'
        backward adds the group's contributions): divided by k it is the gradient of the group's mean
        loss, as a replicated parameter's is after the group's reduction, for clipping and the update."""
        for s in self.own:
            grad = self.params[s.param].grad
            if grad is not None:
                grad.div_(self.cluster.nworkers_per_group)

    def all_finite(self) -> bool:
        """The group's verdict: after an all-reduce every worker holds the same buckets; after the
        reduce-scatter only its own slices are the group's, and a partitioned model's slices are
        each one worker's, so the workers agree on a flag."""
        ok = reduced_buckets_finite(self.reducer, self.params)
        if self.reducer is not None and self.own:
            ok = ok and all_finite([self.params[s.param].grad for s in self.own
                                    if self.params[s.param].grad is not None])
        if isinstance(self._hook, BucketScatter) or (self.partitioned and self.group.world_size > 1):
            device = self.params[0].device if self.params else None
            flag = torch.tensor([1.0 if ok else 0.0], device=device)
            self.group.all_reduce(flag, "min")
            ok = bool(flag.item() == 1.0)
        return ok

    def per_rank_state(self) -> list[str]:
        return [PS_WORKER_STATE]

    def step(self) -> dict:
        with self.holding:
            self._apply_own()
        self.steps += 1
        if self.groups is not None and self.steps % self.cluster.sync_freq == 0:
            self.groups.sync()
        self._all_gather()
        self.staleness.append(self.steps % self.cluster.sync_freq if self.groups is not None else 0)
        return {"staleness": self.staleness[-1]}

    @torch.no_grad()
    def _all_gather(self) -> None:
        alone = self.group.world_size == 1
        for s in self.mine if alone else self.own:
            self._flat(s).copy_(self.shard.values[s.id])
        if alone or not self.shared:
            return
        per_server = [[s for s in self.shared if s.server == j] for j in range(self.group.world_size)]
        longest = max(sum(s.numel for s in ss) for ss in per_server)
        dtype = self.params[0].dtype
        mine = torch.zeros(longest, dtype=dtype)
        if per_server[self.index]:
            flat = torch.cat([self.shard.values[s.id] for s in per_server[self.index]])
            mine[: flat.numel()] = flat
        for ss, got in zip(per_server, self.group.all_gather(mine)):
            offset = 0
            for s in ss:
                self._flat(s).copy_(got[offset : offset + s.numel])
                offset += s.numel

    def close(self) -> None:
        """With several groups: fold the last changes into the master copies, then serve until every group is done."""
        if self.closed or self.groups is None:
            return
        self.closed = True
        if self.steps % self.cluster.sync_freq:
            self.groups.sync()
            self._all_gather()
        self.groups.close(self.timeout)
        print(f"troupe group sync rank {self.me}: {self.groups.stats()}", file=sys.stderr, flush=True)
