"""The worker side of a cluster: joining it (roles, groups), and the two worker strategies.

* `PSClient` (servers in their own processes: Sandblaster, Downpour): gradients go to
  the servers as Update messages per bucket while backward runs; the fresh slices
  come back before the next forward.
* `CoLocated` (servers share the workers' processes: AllReduce, Distributed Hogwild):
  inside a group, reduce the gradients (reduce-scatter onto their owners under NCCL,
  `troupe.cluster.scatter`), each worker updates the slices its co-located server owns, then
  all-gather the slices; with several groups, every `sync_freq`
  steps each group folds its change into the master copies, asynchronously
  (`troupe.cluster.groupsync`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from troupe.runtime import comm as comm_mod
from troupe.cluster.config import ClusterConfig, Role, roles
from troupe.runtime.comm import Communicator, Handle
from troupe.runtime.launch import DistInfo, on_shutdown, shutdown
from troupe.cluster.messages import HEADER_TAG, PAYLOAD_TAG, Header, MessageError, Op, check, empty_header
from troupe.cluster.shard import ParamShard, plan_slices
from troupe.cluster.groupsync import GroupSync
from troupe.cluster.scatter import BucketScatter
from troupe.cluster.server import Server, process_alive
from troupe.cluster.shared import SharedMemory
from troupe.sync.reducer import GradReducer

log = logging.getLogger("troupe.cluster.config")

DEFAULT_PS_TIMEOUT = 7 * 24 * 3600.0
"""Seconds a parameter-server message may wait (``TROUPE_PS_TIMEOUT``); a dead peer fails at once anyway."""

def trainable(optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[int]]:
    """The optimizer's trainable parameters in order, and the param group of each."""
    params, groups, seen = [], [], set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
                groups.append(g)
    return params, groups


def join_cluster(cluster: ClusterConfig, optimizer: torch.optim.Optimizer, info: DistInfo, bucket_size: int):
    """Take this rank's role. A server rank serves and then exits the process; a worker gets
    (its view of the job: rank and world size among the workers, its strategy)."""
    everyone = roles(cluster)
    if len(everyone) != info.world_size:
        raise ValueError(
            f"the cluster needs {cluster.nprocs} processes ({cluster.nworkers} workers, {cluster.nservers} "
            f"servers, server_worker_separate={cluster.server_worker_separate}), but the job has "
            f"world_size {info.world_size}"
        )
    role = everyone[info.global_rank]
    workers = [r.rank for r in everyone if r.worker]
    if cluster.share_memory and not cluster.in_memory:
        warnings.warn("share_memory has no effect with one worker per process (nworkers_per_procs 1)")
    if cluster.fetch_freq != 1 and not cluster.server_worker_separate:
        warnings.warn(f"fetch_freq {cluster.fetch_freq} has no effect: co-located servers update the workers' copy")
    # Every rank creates every group, in the same order (torch.distributed requires it).
    # Messages get a group of their own with a long timeout: a server waits as long as the
    # workers train between two messages, and a timed-out Gloo receive breaks the channel.
    world = comm_mod.default().new_group(range(info.world_size), timeout=_ps_timeout())
    workers_comm = world.new_group(workers)
    group_comms = [
        world.new_group([r.rank for r in everyone if r.worker and r.worker[0] == g])
        for g in range(cluster.nworker_groups)
    ]
    # Distributed Hogwild: requests to the master copies and their replies, a channel each way, between
    # the ranks that sync (every worker; with in-memory Hogwild the first worker of each process).
    syncing = [r.rank for r in everyone if r.server] if cluster.in_memory else workers
    several = not cluster.server_worker_separate and len(syncing) > 1 and cluster.nserver_groups > 1
    sync_channels = (world.new_group(syncing), world.new_group(syncing)) if several else None
    k = cluster.nworkers_per_procs
    processes_comms = [world.new_group(range(p * k, (p + 1) * k)) for p in range(len(everyone) // k)] \
        if cluster.in_memory else []
    params, param_group_of = trainable(optimizer)
    processes = world.all_gather_object((socket.gethostname(), os.getpid()))
    log.info("troupe: %s", role.describe())
    if role.worker is None:
        stats = serve(cluster, role, everyone, world, optimizer, params, param_group_of, processes)
        print(f"troupe server rank {role.rank}: {stats}", file=sys.stderr, flush=True)
        shutdown()
        # Gloo's threads may still drop the last references to the server's receives while the
        # interpreter finalizes, which aborts a process that finished cleanly ("terminate called
        # without an active exception", seen once in ~20 Downpour runs): the work is done, so
        # leave without finalizing (first of the exit handlers, after stdio is flushed).
        atexit.register(_leave)
        sys.exit(0)  # a server never returns to the training script
    comm_mod.set_default(workers_comm)
    view = dataclasses.replace(info, global_rank=workers.index(role.rank), world_size=len(workers))
    alive = lambda rank: process_alive(*processes[rank])  # noqa: E731
    if cluster.server_worker_separate:
        strategy = PSClient(cluster, role, everyone, world, params, bucket_size, optimizer)
    elif cluster.in_memory:
        strategy = SharedMemory(cluster, role, processes_comms[role.rank // k], optimizer, params,
                                sync_channels if role.server else None, alive, _ps_timeout())
    else:
        strategy = CoLocated(cluster, role, group_comms[role.worker[0]], optimizer, bucket_size,
                             sync_channels, alive)
    return view, strategy


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ps_timeout() -> float:
    value = float(os.environ.get("TROUPE_PS_TIMEOUT", DEFAULT_PS_TIMEOUT))
    if value <= 0:
        raise ValueError(f"TROUPE_PS_TIMEOUT must be > 0 seconds, got {value}")
    return value


def serve(cluster, role, everyone, world, optimizer, params, param_group_of, processes):
    """Run a separate server rank's loop until every worker has finished."""
    sg, index = role.server
    slices = [s for s in plan_slices([p.numel() for p in params], cluster.nservers_per_group) if s.server == index]
    members = {
        g: {r.rank for r in everyone if r.worker and r.worker[0] == g}
        for g in range(cluster.nworker_groups)
        if cluster.server_group_of(g) == sg
    }
    dtype = params[0].dtype if params else torch.float32
    # Asynchronous groups each step the shared copy: with "mean" each counts 1/G, as synchronous workers do.
    lr_scale = 1.0 / len(members) if cluster.group_merge == "mean" else 1.0
    shard = ParamShard(slices, optimizer, param_group_of, members, dtype, cluster.staleness_bound, lr_scale)
    putters = {r.rank for r in everyone if r.worker and r.worker[0] == 0}
    workers = [r.rank for r in everyone if r.worker]
    server = Server(world, shard, workers, putters, dict(enumerate(processes)), fail_on_death=cluster.synchronous)
    path = _checkpoint_path(role.rank)
    if path is not None and os.environ.get("TROUPE_RESUME", "no") in ("yes", "auto") and os.path.isfile(path):
        shard.load_state_dict(torch.load(path, weights_only=True))
        print(f"troupe server rank {role.rank}: resumed {len(slices)} slice(s) from {path}", file=sys.stderr)
    stats = server.serve()
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(shard.state_dict(), tmp)
        os.replace(tmp, path)  # a reader sees the old checkpoint or the new one, never half of one
    return stats


def _checkpoint_path(rank: int) -> str | None:
    """Where a server keeps its slices and optimizer state (under ``TROUPE_CHECKPOINT_DIR``)."""
    directory = os.environ.get("TROUPE_CHECKPOINT_DIR")
    return os.path.join(directory, f"ps-server-{rank}.pt") if directory else None


class PSClient:
    """A worker talking to separate servers: Update per bucket during backward, fresh slices after."""

    def __init__(self, cluster: ClusterConfig, role: Role, everyone: Sequence[Role], world: Communicator,
                 params: Sequence[Tensor], bucket_size: int, optimizer: torch.optim.Optimizer):
        self.cluster, self.role, self.world = cluster, role, world
        self.rank = role.rank
        self.params = list(params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.slices = plan_slices([p.numel() for p in self.params], cluster.nservers_per_group)
        self.by_param: dict[int, list] = defaultdict(list)
        for s in self.slices:
            self.by_param[s.param].append(s)
        servers = sorted((r.server, r.rank) for r in everyone if r.server)
        self.all_servers = [rank for _, rank in servers]
        group = cluster.server_group_of(role.worker[0])
        mine = [rank for (sg, _), rank in servers if sg == group]
        self.server_of = {s.id: mine[s.server] for s in self.slices}
        self.version = {s.id: 0 for s in self.slices}
        self.reducer = GradReducer(self.params, world, bucket_size)
        self.reducer.mean_over_active = False  # buckets go to the servers, they are not all-reduced
        self._sends: list[Handle] = []
        self._expected: Counter[int] = Counter()
        self.staleness: list[int] = []
        """Per step: the most versions any slice moved beyond this worker's own update (0 when synchronous)."""
        self.closed = False
        self.steps = 0
        self._op = Op.UPDATE
        self.optimizer = optimizer
        """The wrapped optimizer: only its learning rates are used (a scheduler's changes go to the servers)."""
        self._sent_lrs: list[float] | None = None  # the first step always sends (a resumed server may differ)
        on_shutdown(self.close)  # at exit too: troupe.shutdown() runs at exit

    def start(self) -> None:
        """The first worker group Puts the initial parameters (shared out among its workers); everyone Gets."""
        group, index = self.role.worker
        if group == 0:
            for s in self.slices:
                if s.id % self.cluster.nworkers_per_group == index:
                    for server in self._replicas(s):
                        self._post(Op.PUT, s, server, self._flat(s))
        for s in self.slices:
            self._post(Op.GET, s, self.server_of[s.id])
        self._collect(count_staleness=False)

    def backward_and_update(self, loss: Tensor) -> None:
        self.steps += 1
        # Downpour's n_fetch: between fetches the servers only acknowledge and the worker keeps its values.
        self._op = Op.UPDATE if self.steps % self.cluster.fetch_freq == 0 else Op.PUSH
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if lrs != self._sent_lrs:
            self._sent_lrs = lrs
            for server in self._my_servers():
                header = Header(Op.LR, -1, 0, self.rank, len(lrs)).encode()
                self._sends.append(self.world.isend(header, server, tag=HEADER_TAG))
                self._sends.append(self.world.isend(torch.tensor(lrs, dtype=torch.float64), server, tag=PAYLOAD_TAG))
        self.reducer.backward(loss, self._send_bucket)
        self._collect(count_staleness=True)

    def close(self) -> None:
        """Tell every server this worker has finished (called at exit if not before)."""
        if self.closed:
            return
        self.closed = True
        try:
            for server in self.all_servers:
                self.world.send(Header(Op.STOP, -1, 0, self.rank, 0).encode(), server, tag=HEADER_TAG)
        except Exception as e:  # at interpreter exit the process group may be gone already
            log.warning("troupe worker %d: could not say stop to the servers: %s", self.rank, e)

    # --- internals ----------------------------------------------------------------------

    def _my_servers(self) -> list[int]:
        return sorted(set(self.server_of.values()))

    def _replicas(self, s) -> list[int]:
        """The server of slice s in every server group (all need initial values)."""
        n = self.cluster.nservers_per_group
        return [self.all_servers[g * n + s.server] for g in range(self.cluster.nserver_groups)]

    def _flat(self, s) -> Tensor:
        return self.params[s.param].detach().reshape(-1)[s.start : s.stop]

    def _post(self, op: Op, s, server: int, payload: Tensor | None = None) -> None:
        length = 0 if payload is None else payload.numel()
        header = Header(op, s.id, self.version[s.id], self.rank, length).encode()
        self._sends.append(self.world.isend(header, server, tag=HEADER_TAG))
        if payload is not None:
            self._sends.append(self.world.isend(payload.contiguous(), server, tag=PAYLOAD_TAG))
        if op in (Op.GET, Op.UPDATE, Op.PUSH):
            self._expected[server] += 1

    def _send_bucket(self, bucket) -> Handle:
        for k, p in enumerate(bucket.params):
            flat = bucket.view(k).reshape(-1)
            for s in self.by_param[self.index[id(p)]]:
                self._post(self._op, s, self.server_of[s.id], flat[s.start : s.stop])
        return Handle(None)

    @torch.no_grad()
    def _collect(self, count_staleness: bool) -> None:
        """Receive every reply owed to this worker and copy the fresh slices into the parameters."""
        worst = 0
        for server in sorted(self._expected):
            remaining = self._expected[server]
            while remaining:
                raw = empty_header()
                self.world.recv(raw, server, tag=HEADER_TAG)
                header = Header.decode(raw)
                s = self.slices[header.slice_id] if 0 <= header.slice_id < len(self.slices) else None
                check(header, src=server, expected_length=s and s.numel, allowed={Op.REPLY, Op.ACK})
                if s is None or self.server_of[s.id] != server:
                    raise MessageError(f"reply from server {server} for slice {header.slice_id} it does not hold")
                if header.op is Op.REPLY:
                    value = torch.empty(header.length, dtype=self.params[s.param].dtype)
                    self.world.recv(value, server, tag=PAYLOAD_TAG)
                    self._flat(s).copy_(value)
                worst = max(worst, header.version - self.version[s.id] - 1)
                self.version[s.id] = header.version
                remaining -= 1
        self._expected.clear()
        for h in self._sends:
            h.wait()
        self._sends = []
        if count_staleness:
            self.staleness.append(worst)


class CoLocated:
    """Workers that host their group's servers: reduce, update own slices, all-gather; groups sync every sync_freq."""

    def __init__(self, cluster: ClusterConfig, role: Role, group: Communicator, optimizer: torch.optim.Optimizer,
                 bucket_size: int, sync_channels: tuple[Communicator, Communicator] | None = None,
                 alive=lambda rank: True):
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
        self.slices = plan_slices([p.numel() for p in self.params], cluster.nservers_per_group)
        self.index = role.worker[1]
        self.mine = [s for s in self.slices if s.server == self.index]
        self.shard = ParamShard(self.mine, optimizer, param_group_of, {0: {role.rank}})
        self.me = role.rank
        self.reducer = GradReducer(self.params, group, bucket_size) if group.world_size > 1 else None
        # Reduce-scatter the gradients onto their owners where it sends less (NCCL); Gloo's reduce-scatter
        # moves what an all-reduce does, and the padding of the owners' chunks adds to it: all-reduce there.
        self.scatter = BucketScatter(group, self.reducer.buckets, self.params, self.slices) \
            if self.reducer and group.backend == "nccl" else None
        self.steps = 0
        self.staleness: list[int] = []
        """Per step: updates of this group the other groups have not seen yet (0 with one group)."""
        self.sync_channels, self.alive = sync_channels, alive
        self.groups: GroupSync | None = None
        self.closed = False
        on_shutdown(self.close)

    def start(self) -> None:
        """Parameters were broadcast from worker 0: they are every server's and every master copy's initial values."""
        for s in self.mine:
            self.shard.put(s.id, self._flat(s))
        if self.sync_channels is not None:
            n = self.cluster.nworkers_per_group
            self.groups = GroupSync(
                *self.sync_channels,
                group=self.me // n,
                ngroups=self.cluster.nworker_groups,
                rank_of=lambda k: k * n + self.index,
                slices=self.mine,
                values=self.shard.values,
                merge=self.cluster.group_merge,
                alive=self.alive,
            )
            self.groups.start()

    def _flat(self, s) -> Tensor:
        return self.params[s.param].detach().reshape(-1)[s.start : s.stop]

    @torch.no_grad()
    def _apply_own(self) -> None:
        self.shard.set_lr([g["lr"] for g in self.optimizer.param_groups])  # follow the user's scheduler
        for s in self.mine:
            grad = self.params[s.param].grad
            if grad is not None:  # unused everywhere in the group: no update, as in one process
                self.shard.update(s.id, self.me, grad.reshape(-1)[s.start : s.stop])

    def backward_and_update(self, loss: Tensor) -> None:
        if self.reducer is None:
            for p in self.params:
                p.grad = None
            loss.backward()
        else:
            self.reducer.backward(loss, self.scatter)  # with the scatter: only of the slices it owns
        self._apply_own()
        self.steps += 1
        if self.groups is not None and self.steps % self.cluster.sync_freq == 0:
            self.groups.sync(self.shard.values)
        self._all_gather()
        self.staleness.append(self.steps % self.cluster.sync_freq if self.groups is not None else 0)

    @torch.no_grad()
    def _all_gather(self) -> None:
        if self.group.world_size == 1:
            for s in self.mine:
                self._flat(s).copy_(self.shard.values[s.id])
            return
        per_server = [[s for s in self.slices if s.server == j] for j in range(self.group.world_size)]
        longest = max(sum(s.numel for s in ss) for ss in per_server)
        dtype = self.params[0].dtype
        mine = torch.zeros(longest, dtype=dtype)
        if self.mine:
            flat = torch.cat([self.shard.values[s.id] for s in self.mine])
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
            self.groups.sync(self.shard.values)
            self._all_gather()
        self.groups.close(_ps_timeout())
        print(f"troupe group sync rank {self.me}: {self.groups.stats()}", file=sys.stderr, flush=True)
