"""Cluster bootstrap: every rank's role, the job's process groups, and a server rank's whole life.

A server needs nothing from the training script: worker 0 describes the trainable
parameters (sizes, dtype, param groups) and the optimizer (class path and
hyper-parameters) as JSON (`troupe.cluster.configuration.spec`), and the bootstrap hands that to every
rank while the job's groups are made. A server rank's life is one step, `serve_rank`, taken in one
of two places:

* under `troupe run` the launcher knows the server-only ranks and starts them as
  ``python -m troupe.cluster.bootstrap`` (`main`) instead of the script: they never load data or
  build a model, and `main` returns the server's exit code;
* under torchrun, mpiexec or spawned test ranks every rank runs the script, and a server
  rank's first `DistOpt` is where it becomes a server (SINGA's spelling): `worker_strategy`
  takes the step there and ends the process (``SystemExit(0)``); it never returns to the script.

Why the second place cannot go: troupe does not choose what an external launcher's rank runs, so
the earliest troupe code a server rank meets is the script's ``import troupe`` or `troupe.init()`.
Serving from there would break scripts that work today: a server joins the job's groups in the order
the workers make them and waits for worker 0's description, which exists only once worker 0 has
built its optimizer; any collective a script runs over the whole job before its `DistOpt` (a
broadcast of its data, a barrier, a metric) would wait forever for the rank that went serving; and
the cluster is often known only from the DistOpt's own argument (``DistOpt(..., cluster=...)``, a
SINGA job file), not from the environment.

A worker gets back its view of the job (rank and world size among the workers) and its
`UpdateStrategy`, built by the cluster's worker regime (`troupe.cluster.regimes`:
`PSClient`, `CoLocated` or `SharedMemory`). Only this module decides
that a rank is a server; `DistOpt` never branches on it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.roles import Role, expendable_ranks, roles
from troupe.cluster.configuration.sources import from_env
from troupe.cluster.configuration.spec import TrainingSpec
from troupe.cluster.serving.server import Server, ServerStats, TakeOver, process_alive
from troupe.cluster.serving.groupsync import SyncChannels
from troupe.cluster.serving.lives import FORM_SECONDS, Lives
from troupe.cluster.serving.mastercopies import MasterCopies
from troupe.cluster.serving.serversync import ServerSync
from troupe.cluster.serving.shard import ParamShard, plan_slices
from troupe.cluster.workers import layout
from troupe.cluster.workers.layout import Layout, trainable
from troupe.compress.fp16 import half_dtype
from troupe.cluster.wire.links import LINK_FORM_SECONDS, Links
from troupe.runtime.comm import Communicator, Outside
from troupe.runtime.rejoin import Rejoining, gone_key
from troupe.runtime.launch import DistInfo, meet_where_rank0_listens
from troupe.runtime.settings import Settings
from troupe.runtime.world import World, init, shutdown
from troupe.strategies import registry
from troupe.strategies.base import UpdateStrategy

# Not __name__: started as ``python -m troupe.cluster.bootstrap`` this module is __main__.
log = logging.getLogger("troupe.cluster.bootstrap")

SPEC_KEY = "ps/spec"
"""`troupe run --elastic`: worker 0's description of the job, for workers that restart."""

DEFAULT_PS_TIMEOUT = 7 * 24 * 3600.0
"""Seconds a parameter-server message may wait (``TROUPE_PS_TIMEOUT``); a dead peer fails at once anyway."""


@dataclass
class Job:
    """One rank's view of the cluster: its role and the groups every rank made, in the same order."""

    cluster: ClusterConfig
    runtime: World
    role: Role
    everyone: list[Role]
    world: Communicator
    """Every rank, with the long parameter-server timeout: messages travel here."""
    workers: list[int]
    workers_comm: Communicator
    group_comms: list[Communicator]
    sync_channels: SyncChannels | None
    processes_comms: list[Communicator]
    timeout: float
    processes: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """(hostname, pid) of every rank, to tell a dead peer from a slow one."""
    server_channel: Communicator | None = None
    """Several separate server groups: the servers' own channel for their synchronisation."""
    place_comms: list[Communicator] = dataclasses.field(default_factory=list)
    """DiLoCo: per place j in a group, worker j of every group (the outer step's all-reduce)."""
    links: Links | None = None
    """`troupe run --elastic`: the messages' channels between servers and workers, one per pair, that a
    restarted worker opens again (`troupe.cluster.wire.links`; None: they travel in `world`)."""
    rejoined: bool = False
    """This process restarts a worker that died: it joined the running job alone, through its servers."""
    gone: set[int] = dataclasses.field(default_factory=set)
    """`troupe run --elastic`: the separate servers that had died when this worker dialled them."""

    @property
    def fails_over(self) -> bool:
        """`troupe run --elastic` over asynchronous groups and several server groups: a dead server's workers
        go on with the same server of another server group (none is restarted)."""
        return self.links is not None and self.cluster.servers_fail_over

    @property
    def restarts_alone(self) -> bool:
        """`troupe run --elastic` over a parameter-server job: a dead worker restarts alone; the workers
        share no collective after the job's start."""
        return isinstance(self.runtime.membership, Rejoining)

    @property
    def channel(self) -> Communicator | Links:
        """Where the parameter-server messages travel."""
        return self.links if self.links is not None else self.world

    def alive(self, rank: int) -> bool:
        """False once `rank`'s process has ended (on this host) or its heartbeat has gone silent
        for TROUPE_PEER_TIMEOUT (on any host: a dead machine, a cut cable, a partition)."""
        dog = self.runtime.watchdog
        return process_alive(*self.processes[rank]) and (dog is None or dog.alive(rank))


@dataclass(frozen=True)
class WorkerContext:
    """What a cluster worker's strategy is built from (its regime's `build`, `troupe.cluster.regimes`)."""

    cluster: ClusterConfig
    job: Job
    """This rank's role and every group of the job."""
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    bucket_size: int
    nan_policy: str
    layout: Layout
    """The job parameters the workers agreed on (a partitioned model's union)."""
    step_count: Callable[[], int] = lambda: 0
    """The DistOpt's step counter (steps taken so far, skipped ones included)."""


def worker_strategy(cluster: ClusterConfig, optimizer: torch.optim.Optimizer, world: World, bucket_size: int,
                    nan_policy: str = "raise", step_count: Callable[[], int] = lambda: 0
                    ) -> tuple[DistInfo, UpdateStrategy]:
    """Take this rank's role. A server rank (under an external launcher) serves and ends the process here; a
    worker gets (its view of the job: rank and world size among the workers, its strategy), and the
    World's data-parallel communicator becomes the workers'."""
    info = world.info
    job = joined(cluster, world)
    params, param_group_of = trainable(optimizer)
    arranged: Layout | None = None
    problem = ""
    if job.role.worker is not None:  # the workers agree on the job parameters (a partitioned model's union)
        try:
            arranged = worker_layout(job, params, param_group_of)
        except ValueError as e:
            problem = str(e)
    describe = (lambda: _describe(optimizer, params, param_group_of, arranged, problem)) if info.global_rank == 0 else None
    spec = exchange(job, describe) if not job.rejoined else _spec_from_store(job)
    if job.role.worker is None:  # a server rank that ran the script up to its DistOpt (see the module's docstring)
        _serve_instead_of_the_script(job, spec)
    if job.links is not None:
        _dial(job)
    world.use_for_data_parallel(job.workers_comm)
    view = dataclasses.replace(info, global_rank=job.workers.index(job.role.rank), world_size=len(job.workers))
    if info.launcher == "external" and len(job.workers) < info.world_size and job.role.rank == 0:
        # The script's own group holds the servers too: what reads its size shards the data among them.
        # A DistributedSampler made with its defaults counts the workers only (troupe/cluster/sampler.py).
        log.warning("troupe: the script's process group has %d ranks, %d of them servers, which train on no data: "
                    "a DistributedSampler made with its defaults counts the %d workers only; anything else that "
                    "shards by dist.get_world_size() should use DistOpt.world_size and .global_rank, or the workers "
                    "train on %d/%d of the data", info.world_size, info.world_size - len(job.workers),
                    len(job.workers), len(job.workers), info.world_size)
    context = WorkerContext(cluster, job, params, optimizer, bucket_size, nan_policy, arranged, step_count)
    strategy = registry.lookup(cluster.worker_regime, "cluster").build(context)
    world.on_shutdown(strategy.close)  # tell the servers (or peers) this worker is done, at exit too
    return view, strategy


def joined(cluster: ClusterConfig, runtime: World) -> Job:
    """This rank's `Job`, joined once per World: by the first of `troupe.partition` (which needs
    the worker groups before the model is cut) and `DistOpt` (which needs the roles)."""
    if runtime.cluster_job is None:
        runtime.cluster_job = join(cluster, runtime)
        if runtime.cluster_job.role.worker is not None:
            runtime.use_for_data_parallel(runtime.cluster_job.workers_comm)
    return runtime.cluster_job


def worker_layout(job: Job, params: list, param_group_of: list[int]) -> Layout:
    """The job parameters (a collective over the workers): with a partitioned model, the union of
    what the workers of a group hold; otherwise every worker's own list."""
    cluster = job.cluster
    k = cluster.nworkers_per_group
    mine = layout.entries(params, param_group_of, k, len(job.workers))
    if job.restarts_alone:  # every worker holds the whole model (partition is refused under --elastic)
        return layout.build([mine] * len(job.workers), k, job.workers.index(job.role.rank))
    every = job.workers_comm.all_gather_object(mine) if len(job.workers) > 1 else [mine]
    arranged = layout.build(every, k, job.workers.index(job.role.rank))
    return arranged


def _describe(optimizer: torch.optim.Optimizer, params: list, param_group_of: list[int], arranged: Layout | None,
              problem: str) -> TrainingSpec:
    """Worker 0's description of the job for the servers (its ValueError travels to every rank)."""
    if problem:
        raise ValueError(problem)
    spec = TrainingSpec.from_optimizer(optimizer, params, param_group_of)
    if arranged is not None and arranged.partitioned:
        spec = dataclasses.replace(spec, numels=arranged.numels, param_group_of=arranged.param_group_of,
                                   owners=arranged.owners)
    return spec


def join(cluster: ClusterConfig, runtime: World) -> Job:
    """Check the job's size against the cluster, take this rank's role and make every group."""
    info = runtime.info
    everyone = roles(cluster)
    if len(everyone) != info.world_size:
        raise ValueError(
            f"the cluster needs {cluster.nprocs} processes ({cluster.nworkers} workers, {cluster.nservers} "
            f"servers, server_worker_separate={cluster.server_worker_separate}), but the job has "
            f"world_size {info.world_size}"
        )
    role = everyone[info.global_rank]
    membership = runtime.membership
    if isinstance(membership, Rejoining):
        return _rejoining_job(cluster, runtime, membership, everyone, role)
    if runtime.watchdog is not None:
        runtime.watchdog.expendable = expendable_ranks(cluster)
    if cluster.share_memory and not cluster.in_memory:
        warnings.warn("share_memory has no effect with one worker per process (nworkers_per_procs 1)")
    if cluster.fetch_freq != 1 and not cluster.server_worker_separate:
        warnings.warn(f"fetch_freq {cluster.fetch_freq} has no effect: co-located servers update the workers' copy")
    timeout = runtime.settings.ps_timeout
    # Every rank creates every group, in the same order (torch.distributed requires it).
    # Messages get a group of their own with a long timeout: a server waits as long as the
    # workers train between two messages, and a timed-out Gloo receive breaks the channel.
    world = runtime.job.new_group(range(info.world_size), timeout=timeout)
    workers = [r.rank for r in everyone if r.worker]
    workers_comm = world.new_group(workers)
    group_comms = [
        world.new_group([r.rank for r in everyone if r.worker and r.worker[0] == g])
        for g in range(cluster.nworker_groups)
    ]
    # Distributed Hogwild: requests to the master copies and their replies, a channel each way, between
    # the ranks that sync (every worker; with in-memory Hogwild the first worker of each process).
    syncing = [r.rank for r in everyone if r.server] if cluster.in_memory else workers
    several = not cluster.server_worker_separate and len(syncing) > 1 and cluster.nserver_groups > 1
    sync_channels = SyncChannels.pair(world.new_group(syncing), world.new_group(syncing)) \
        if several and not cluster.groups_wait else None
    # DiLoCo: the outer step all-reduces among the workers with the same place in their groups.
    k_group = cluster.nworkers_per_group
    place_comms = [world.new_group([g * k_group + j for g in range(cluster.nworker_groups)])
                   for j in range(k_group)] if cluster.groups_wait else []
    k = cluster.nworkers_per_procs
    processes_comms = [world.new_group(range(p * k, (p + 1) * k)) for p in range(len(everyone) // k)] \
        if cluster.in_memory else []
    # Separate server groups sync on a channel of their own (troupe.cluster.serving.serversync says why).
    server_channel = world.new_group([r.rank for r in everyone if r.worker is None]) \
        if cluster.server_worker_separate and cluster.nserver_groups > 1 else None
    log.info("troupe: %s", role.describe())
    return Job(cluster, runtime, role, everyone, world, workers, workers_comm, group_comms, sync_channels,
               processes_comms, timeout, server_channel=server_channel, place_comms=place_comms)


def rejoining_problem(cluster: ClusterConfig) -> str | None:
    """Why `cluster`'s workers cannot restart alone (`troupe run --elastic`), or None."""
    if cluster.partition_dim is not None:
        return f"--elastic runs a parameter-server job without partition; got partition_dim {cluster.partition_dim!r}"
    if cluster.server_worker_separate:
        return None
    if cluster.nworker_groups < 2 or cluster.groups_wait or cluster.in_memory or cluster.nworkers_per_group != 1:
        return ("--elastic runs a parameter-server job whose servers are separate (Downpour, Sandblaster), or "
                "Distributed Hogwild over groups of one process each (--framework hogwild); got "
                f"{cluster.nworker_groups} worker group(s) of {cluster.nworkers_per_group} worker(s), "
                f"nworkers_per_procs {cluster.nworkers_per_procs}, co-located servers")
    return None


def _rejoining_job(cluster: ClusterConfig, runtime: World, membership: Rejoining, everyone: list[Role],
                   role: Role) -> Job:
    """A rank of a parameter-server job whose workers restart alone (`troupe run --elastic`): its messages
    travel on links (`troupe.cluster.wire.links`), and its workers share no collective, so a restarted one
    needs nobody but its servers. The job's first processes still meet in one group, for the servers'
    own channel and the exchange of the job's description (which a restarted worker reads from the store)."""
    problem = rejoining_problem(cluster)
    if problem:
        raise ValueError(problem)
    timeout = runtime.settings.ps_timeout
    workers = [r.rank for r in everyone if r.worker]
    if runtime.watchdog is not None:
        runtime.watchdog.unwatched = set(workers)
        if cluster.servers_fail_over:  # a dead server's silence is its workers' failover, not the job's end
            runtime.watchdog.expendable = {r.rank for r in everyone if r.worker is None}
    if role.worker is not None:
        membership.data_place = (workers.index(role.rank), len(workers))
        membership.start_beating()  # its servers (or the other Hogwild groups) tell it frozen from slow by this
    elif cluster.servers_fail_over:
        membership.start_beating()  # its launcher kills it once frozen, and its workers fail over
    links, sync_channels = None, None
    if cluster.server_worker_separate:
        links = Links(membership.store, role.rank, timeout, connect=lambda: membership.connect(LINK_FORM_SECONDS))
    else:
        sync_channels = _relinking(membership, runtime, role, timeout)
    if membership.rejoined:
        solo = runtime.job  # a group of this process alone
        return Job(cluster, runtime, role, everyone, solo, workers, solo, _own_group(cluster, role, solo),
                   sync_channels, [], timeout, links=links, rejoined=True)
    world = runtime.job.new_group(range(runtime.info.world_size), timeout=timeout)
    solo = Communicator(dist.new_group([role.rank], use_local_synchronization=True), watchdog=runtime.watchdog,
                        recorder=runtime.recorder, totals=runtime.traffic)
    server_channel = world.new_group([r.rank for r in everyone if r.worker is None]) \
        if cluster.server_worker_separate and cluster.nserver_groups > 1 else None
    log.info("troupe: %s (restarts alone)", role.describe())
    return Job(cluster, runtime, role, everyone, world, workers, solo, _own_group(cluster, role, solo),
               sync_channels, [], timeout, server_channel=server_channel, links=links)


def _relinking(membership: Rejoining, runtime: World, role: Role, timeout: float) -> SyncChannels:
    """Distributed Hogwild's group sync on links a new life of a group opens again (`troupe.cluster.serving.lives`)."""
    connect = lambda: membership.connect(LINK_FORM_SECONDS)  # noqa: E731
    serving = Links(membership.store, role.rank, timeout, connect=connect, form=FORM_SECONDS)
    asking = Links(membership.store, role.rank, timeout, connect=connect, form=FORM_SECONDS)
    settings = runtime.settings
    lives = Lives(serving, asking, connect, role.rank, settings.incarnation, settings.evict_after)
    return SyncChannels.relinking(serving, asking, lives)


def _own_group(cluster: ClusterConfig, role: Role, solo: Communicator) -> list:
    """A worker's group communicators when its workers share no collective (each talks to the servers
    alone; only a partitioned model's workers would, and partition is refused here): its own is itself."""
    return [solo if role.worker is not None and g == role.worker[0] else Outside()
            for g in range(cluster.nworker_groups)]


def _dial(job: Job) -> None:
    """A worker opens its links to every server (its Updates go to its group's; its Stop to all) but those
    that died (a restarted worker's, `Job.fails_over`)."""
    servers = sorted(r.rank for r in job.everyone if r.server)
    if job.fails_over:
        job.gone = {rank for rank in servers if job.runtime.membership.store.check([gone_key(rank)])}
    for rank in servers:
        if rank not in job.gone:
            job.links.dial(rank, job.runtime.settings.incarnation)


def _spec_from_store(job: Job) -> TrainingSpec:
    """A restarted worker's copy of worker 0's description of the job (written at the job's start)."""
    return TrainingSpec.from_json(job.runtime.membership.store.get(SPEC_KEY).decode())


def exchange(job: Job, describe: Callable[[], TrainingSpec] | None = None) -> TrainingSpec:
    """Worker 0's `TrainingSpec` to every rank (JSON, never pickled code); a server checks it can
    build its shard. Every rank learns of any rank's failure here and raises, so none is left waiting.

    `describe` (on rank 0 only) makes the spec; the other ranks pass None.
    """
    text = ""
    if describe is not None:
        try:
            text = describe().to_json()
        except ValueError as e:
            text = json.dumps({"error": str(e)})
    text = _broadcast_text(job.world, text)
    if job.restarts_alone and job.role.rank == 0:  # for a worker that restarts later
        job.runtime.membership.store.set(SPEC_KEY, text)
    spec, error = None, None
    try:
        data = json.loads(text)
        if "error" in data:
            error = f"worker 0 cannot describe the job to the servers: {data['error']}"
        else:
            spec = TrainingSpec.from_json(text)
            if job.role.worker is None:
                _make_shard(job, spec)  # the optimizer's class and hyper-parameters work here
    except (ValueError, TypeError, KeyError) as e:
        error = f"rank {job.role.rank} ({job.role.kind}): cannot use worker 0's description of the job: {e}"
    gathered = job.world.all_gather_object((socket.gethostname(), os.getpid(), error))
    job.processes = [(host, pid) for host, pid, _ in gathered]
    errors = [e for _, _, e in gathered if e]
    if errors:
        raise ValueError(errors[0])
    return spec


def _broadcast_text(world: Communicator, text: str) -> str:
    """`text` from rank 0 to every rank (length first, then the UTF-8 bytes)."""
    raw = text.encode()
    length = torch.tensor([len(raw)], dtype=torch.int64)
    world.broadcast(length, src=0)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if world.rank != 0:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    world.broadcast(data, src=0)
    return bytes(data.tolist()).decode()


def serve_rank(job: Job, spec: TrainingSpec) -> None:
    """A server rank's life: serve until every worker has finished, report, and leave the job."""
    stats = serve(job, spec)
    print(f"troupe server rank {job.role.rank}: {stats}", file=sys.stderr, flush=True)
    # What this server sent, by operation ([payload bytes, wire bytes]): a server started without the
    # training script has no other way to report its counters (troupe bench run bytes_per_step).
    traffic = {op: [t.payload_bytes, t.wire_bytes] for op, t in sorted(job.runtime.traffic.items())}
    print(f"troupe server rank {job.role.rank}: traffic {json.dumps(traffic)}", file=sys.stderr, flush=True)
    shutdown()
    # Gloo's threads may still drop the last references to the server's receives while the
    # interpreter finalizes, which aborts a process that finished cleanly ("terminate called
    # without an active exception", seen once in ~20 Downpour runs): the work is done, so
    # leave without finalizing (first of the exit handlers, after stdio is flushed).
    atexit.register(_leave)


def _serve_instead_of_the_script(job: Job, spec: TrainingSpec) -> NoReturn:
    """SINGA's spelling under an external launcher: this server rank's DistOpt serves, then the process ends
    (the script's code after its DistOpt is a worker's)."""
    serve_rank(job, spec)
    sys.exit(0)


def _make_shard(job: Job, spec: TrainingSpec) -> ParamShard:
    cluster, (sg, index) = job.cluster, job.role.server
    slices = [s for s in plan_slices(spec.numels, cluster.nservers_per_group) if s.server == index]
    members = {
        g: {r.rank for r in job.everyone if r.worker and r.worker[0] == g}
        for g in range(cluster.nworker_groups)
        if cluster.server_group_of(g) == sg
    }
    # Asynchronous groups each step the shared copy: with "mean" each counts 1/G, as synchronous workers do.
    lr_scale = 1.0 / len(members) if cluster.group_merge == "mean" else 1.0
    owners = {s.id: spec.owner(s.param) for s in slices}
    position = {r.rank: r.worker[1] for r in job.everyone if r.worker}
    return ParamShard(slices, spec.optimizer, spec.param_group_of, members, spec.dtype, cluster.staleness_bound,
                      lr_scale, owners=owners, position=position, group_size=cluster.nworkers_per_group,
                      staleness_lr=cluster.staleness_lr, steps_ahead=int(cluster.fetch != "wait"))


def wire_dtype(cluster: ClusterConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients and fetched values travel in between workers and separate servers."""
    return dtype if cluster.wire_dtype == "fp32" else half_dtype(cluster.wire_dtype)


def serve(job: Job, spec: TrainingSpec) -> ServerStats:
    """Run a separate server rank's loop until every worker has finished (resuming from and
    writing its checkpoint under ``TROUPE_CHECKPOINT_DIR``)."""
    shard = _make_shard(job, spec)
    putters = {r.rank for r in job.everyone if r.worker and r.worker[0] == 0}
    path = _checkpoint_path(job)
    server = Server(job.world, shard, job.workers, putters, job.alive,
                    fail_on_death=job.cluster.synchronous, wire_dtype=wire_dtype(job.cluster, shard.dtype),
                    wire_topk=job.cluster.wire_topk, sync=_server_sync(job, shard),
                    on_exit=None if path is None else lambda: _save(shard, path), links=job.links,
                    take_over=_take_over(job), **_eviction(job))
    if path is not None and job.runtime.settings.resume in ("yes", "auto") and os.path.isfile(path):
        shard.load_state_dict(torch.load(path, weights_only=True))
        print(f"troupe server rank {job.role.rank}: resumed {len(shard.slices)} slice(s) from {path}",
              file=sys.stderr)
    stats = server.serve()
    if path is not None:
        _save(shard, path)
    return stats


def _take_over(job: Job) -> TakeOver | None:
    """`Job.fails_over`: this server serves the worker groups whose server dies, once they fail over here."""
    if not job.fails_over:
        return None
    group_of = {r.rank: r.worker[0] for r in job.everyone if r.worker}
    return TakeOver(group_of, mean=job.cluster.group_merge == "mean")


def _eviction(job: Job) -> dict:
    """With links (`troupe run --elastic`): how a server tells a frozen worker from a slow one (its beat)."""
    membership = job.runtime.membership
    if job.links is None or not isinstance(membership, Rejoining):
        return {}
    store = membership.connect(LINK_FORM_SECONDS)  # the server's own connection (its loop and links have theirs)
    return {"evict_after": job.runtime.settings.evict_after, "beats": store}


def _server_sync(job: Job, shard: ParamShard) -> ServerSync | None:
    """Several separate server groups: this server syncs with server `index` of every other group."""
    cluster, (group, index) = job.cluster, job.role.server
    if cluster.nserver_groups == 1:
        return None
    peers = {r.server[0]: r.rank for r in job.everyone if r.server and r.server[1] == index and r.server[0] != group}
    copies = MasterCopies(shard, group, cluster.nserver_groups, cluster.group_merge)
    return ServerSync(job.server_channel, copies, peers, cluster.sync_freq, set().union(*shard.members.values()),
                      rank=job.role.rank)


def _save(shard: ParamShard, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(shard.state_dict(), tmp)
    os.replace(tmp, path)  # a reader sees the old checkpoint or the new one, never half of one


def _leave() -> None:
    # Under mpiexec the launcher counts a rank that leaves without MPI_Finalize as failed
    # (mpi4py finalizes at exit, in a handler this one skips): finalize here first.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _checkpoint_path(job: Job) -> str | None:
    """Where a server keeps its slices and optimizer state (under ``TROUPE_CHECKPOINT_DIR``)."""
    directory = job.runtime.settings.checkpoint_dir
    return os.path.join(directory, f"ps-server-{job.role.rank}.pt") if directory else None


def server_ranks(cluster: ClusterConfig) -> set[int]:
    """The ranks that only serve (they need no training script)."""
    return {r.rank for r in roles(cluster) if r.worker is None}


def main() -> int:
    """A server rank without the training script (what `troupe run` starts on server-only ranks)."""
    cluster = from_env()
    if cluster is None:
        print("troupe.cluster.bootstrap: no cluster (TROUPE_CLUSTER is not set)", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        # A server's work is messages and element-wise optimizer steps on its slices; its processes
        # share the machine with the workers (troupe run --threads N sets OMP_NUM_THREADS).
        torch.set_num_threads(1)
    try:
        meet_where_rank0_listens(Settings.from_env())  # a script may make its own process group
    except ValueError as e:  # refused: "rank R: why"
        print(f"troupe server {e}", file=sys.stderr, flush=True)
        return 1
    except (TimeoutError, ConnectionError) as e:  # rank 0 never came
        print(f"troupe server rank {os.environ.get('RANK', '?')}: {e}", file=sys.stderr, flush=True)
        return 1
    runtime = init()
    try:
        job = joined(cluster, runtime)
    except RuntimeError as e:  # the workers stopped before the job's groups were made (their error is theirs)
        print(f"troupe server rank {runtime.info.global_rank}: the job stopped before it began "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr, flush=True)
        return 1
    if job.role.worker is not None:
        print(f"troupe.cluster.bootstrap: {job.role.describe()} is a worker: run the training script there",
              file=sys.stderr)
        return 2
    try:
        spec = exchange(job)
    except ValueError as e:  # every rank raises the same error: say it once, here, and fail the job
        print(f"troupe server rank {job.role.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # a worker died before it described the job
        print(f"troupe server rank {job.role.rank}: the job stopped before it began "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr, flush=True)
        return 1
    serve_rank(job, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
