"""World: this process's membership in the job, as one object made by `troupe.init()`.

It holds the rank facts (`DistInfo`), the settings read from the environment at init,
the communicators (the whole job; the data-parallel one; named subgroups), the
recorder (stats, timeline, TensorBoard) and the watchdog, and runs the shutdown hooks.
`troupe.shutdown()` ends it. `_current` below is the only per-job state kept in a
module: everything else is handed what it needs (a strategy gets its communicator).

>>> world = troupe.init()             # joins the job (idempotent)
>>> world.rank, world.world_size
>>> world.comm.all_reduce(t)           # the data-parallel communicator
>>> pipe = world.group("pipe", [0, 1]) # a named subgroup, made once by every rank
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from troupe.observe import trace
from troupe.observe.trace import Recorder
from troupe.runtime import watchdog as watchdog_mod
from troupe.runtime.comm import Communicator, Traffic
from troupe.util import one_line_refusals
from troupe.runtime.elastic import Fixed
from troupe.runtime.membership import Membership
from troupe.runtime.launch import DistInfo, Joined, Ticket, join
from troupe.runtime.settings import Settings


class World:
    """One process's place in one job: who it is, whom it talks to, what watches and records it."""

    def __init__(self, joined: Joined, env: Settings):
        self.info: DistInfo = joined.info
        self.settings = env
        """Every TROUPE_* variable, read once when this process joined."""
        self._keep = joined.keep
        side = joined.side_store
        self.watchdog = None if side is None else \
            watchdog_mod.start(side.store, self.info.global_rank, self.info.world_size, env, side.connect, side.where,
                               refusals=side.refused if self.info.global_rank == 0 else None)
        self.recorder: Recorder | None = trace.start(self.info.global_rank, env.stats, env.timeline, env.tensorboard)
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)
        """What every communicator of this process has counted, by operation."""
        self.job = Communicator(watchdog=self.watchdog, recorder=self.recorder, totals=self.traffic)
        """Every rank of the job."""
        self.comm = self.job
        """The data-parallel communicator: the whole job, or a parameter-server cluster's workers."""
        self.groups: dict[str, Communicator] = {}
        self.cluster_job: object | None = None
        """The parameter-server job this rank joined (`troupe.cluster.bootstrap.Job`), once it has."""
        self._hooks: list[Callable[[], None]] = []
        self.closed = False
        self.finished = False
        """`finish` ran: troupe's last work is done (at `close`, or when the script destroyed the default group)."""
        self.exit_failure: str | None = None
        """What failed in `finish` when the script's ``destroy_process_group()`` ran it (the exit code says so)."""
        self.membership: Membership = joined.membership or Fixed()
        """Which processes step together (runtime/membership.py): `Fixed` (never changes), an elastic job's
        quorum (`Elastic`) or a parameter-server worker that restarts alone (`Rejoining`)."""
        self.partitioned = False
        """`troupe.partition` sliced this rank's model (an elastic DistOpt reduces the slices by place)."""
        self.replica_group: Communicator | None = None
        """An elastic job's partitioned model: the communicator over this process's worker group that its
        layers exchange through (`replica_comms(escape=False)`'s group)."""
        self._replicas: list[tuple[Communicator, Communicator]] = []
        if self.membership.elastic:
            self.membership.on_reconfigure.append(self._rebind)
            self.job.escape = self.membership.interrupted

    # --- the rank facts (what troupe.init() returned before the World: DistInfo) ----------

    global_rank = property(lambda self: self.info.global_rank)
    rank = global_rank
    local_rank = property(lambda self: self.info.local_rank)
    world_size = property(lambda self: self.info.world_size)
    local_world_size = property(lambda self: self.info.local_world_size)
    device = property(lambda self: self.info.device)
    backend = property(lambda self: self.info.backend)
    launcher = property(lambda self: self.info.launcher)

    # --- communicators --------------------------------------------------------------------

    def group(self, name: str, ranks: Sequence[int] | None = None, *, timeout: float | None = None) -> Communicator:
        """The subgroup called `name`. The first call gives its global `ranks` and makes it:
        every rank of the job must make the same groups in the same order (torch.distributed's
        rule); a rank outside `ranks` gets an object that refuses to be used."""
        if ranks is None:
            if name not in self.groups:
                raise KeyError(f"no group named {name!r} (made so far: {sorted(self.groups)})")
            return self.groups[name]
        ranks = sorted(int(r) for r in ranks)
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size or len(set(ranks)) != len(ranks):
            raise ValueError(f"group {name!r}: ranks must be distinct and in [0, {self.world_size}), got {ranks}")
        if name in self.groups:
            raise ValueError(f"a group named {name!r} already exists")
        self.groups[name] = self.job.new_group(ranks, timeout=timeout)
        return self.groups[name]

    def sync_groups(self, groups: int | None, who: str) -> int:
        """How many synchronous worker groups split this job: `groups` as `who` gave it, else ``TROUPE_GROUPS``
        (``troupe run --nworker-groups G`` without a cluster), else 1. It must divide the world size."""
        if groups is None:
            given = "TROUPE_GROUPS (troupe run --nworker-groups)"
            return check_groups(self.settings.groups or 1, self.world_size, given)
        return check_groups(groups, self.world_size, f"{who}: groups")

    def group_comms(self, groups: int) -> tuple[Communicator, Communicator]:
        """(group, place): the communicators over this rank's worker group (group g holds the k = world
        size / `groups` consecutive ranks [g*k, (g+1)*k)) and over the ranks at its place j in every group
        (j, j+k, j+2k, ...). Made once per `groups` (named ``shard/{g}x{k}`` and ``replicate/{j}x{k}``)
        and then reused: every rank makes every group and place, in one order (torch.distributed's rule)."""
        n, k = self.world_size, self.world_size // groups

        def once(name: str, ranks: range) -> Communicator:
            return self.groups[name] if name in self.groups else self.group(name, ranks)

        made = [once(f"shard/{g}x{k}", range(g * k, (g + 1) * k)) for g in range(groups)]
        places = [once(f"replicate/{j}x{k}", range(j, n, k)) for j in range(k)]
        return made[self.rank // k], places[self.rank % k]

    def replica_comms(self, *, escape: bool = True) -> tuple[Communicator, Communicator]:
        """An elastic job of worker groups of several processes: (group, place), the communicators over
        this process's own group and over the processes at its place in every group present.

        They are made anew for every quorum (as its process group forms, every member makes every
        group's and every place's subgroup, in order) and adopted by the same two objects, so a
        strategy or layer may hold them. `escape`: a wait gives up once the step was decided without
        this rank (the step's reductions); without it a wait is for its peers alone (a partitioned
        model's forward, which another group's loss must not interrupt). Every rank calls this in
        the same order."""
        membership = self.membership
        if not membership.elastic:
            raise RuntimeError("replica_comms is an elastic job's (troupe run --elastic)")
        pair = tuple(Communicator(watchdog=self.watchdog, recorder=self.recorder, totals=self.traffic)
                     for _ in range(2))
        for comm in pair:
            comm.escape = membership.interrupted if escape else None
        if not self._replicas:
            membership.on_reconfigure.append(self._regroup)  # troupe.track joins the first quorum after this
        self._replicas.append(pair)
        if membership.joined:
            self._regroup()
        return pair

    def _regroup(self) -> None:
        membership = self.membership
        quorum, k, timeout = membership.quorum, membership.options.group_size, membership.options.timeout
        groups = [self.job.new_group(range(i * k, (i + 1) * k), timeout=timeout) for i in range(len(quorum.members))]
        places = [self.job.new_group(range(j, quorum.size, k), timeout=timeout) for j in range(k)]
        for group, place in self._replicas:
            group.adopt(groups[quorum.members.index(membership.group)])
            place.adopt(places[membership.place])

    def _rebind(self) -> None:
        """A new quorum's process group is the default one: the whole-job communicators re-read it."""
        for comm in {id(c): c for c in (self.job, self.comm)}.values():
            comm.rebind()

    def use_for_data_parallel(self, comm: Communicator) -> None:
        """Make `comm` what data-parallel code reduces over (a cluster's workers, without its servers)."""
        self.comm = comm

    # --- leaving ----------------------------------------------------------------------------

    def on_shutdown(self, hook: Callable[[], None]) -> None:
        """Run `hook()` when this process leaves the job (`shutdown()` or exit), before the groups go."""
        self._hooks.append(hook)

    def set_step(self, step: int) -> None:
        """The training step this rank is at (what the watchdog reports)."""
        if self.watchdog is not None:
            self.watchdog.step = step

    def finish(self) -> None:
        """troupe's last work in the job, while its groups still exist: run the hooks, stop the watchdog,
        flush the recorder (once; a failing hook raises after the rest has run)."""
        if self.finished:
            return
        self.finished = True
        hooks, self._hooks = self._hooks, []
        try:
            for hook in reversed(hooks):  # e.g. a parameter-server worker telling its servers it is done
                hook()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.membership.close()  # an elastic quorum's connection, a rejoining worker's beat
            if self.recorder is not None:
                self.recorder.close()

    def close(self) -> None:
        """Leave the job: `finish`, then destroy the process group."""
        if self.closed:
            return
        self.closed = True
        try:
            self.finish()
        finally:
            self._release()

    def _release(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Collect now what still references the groups' work objects: their last references must not
        # be dropped by a backend thread during interpreter shutdown (that aborts the process).
        self.groups.clear()
        self.job = self.comm = None  # type: ignore[assignment]
        gc.collect()

    def __repr__(self) -> str:
        i = self.info
        return (f"World(rank {i.global_rank}/{i.world_size}, local {i.local_rank}/{i.local_world_size}, "
                f"{i.backend}, {i.launcher}, groups={sorted(self.groups)})")


def check_groups(groups: object, world_size: int, given: str) -> int:
    """`groups` if it is a positive divisor of `world_size`, else a ValueError naming `given` and both values."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or world_size % groups:
        raise ValueError(f"{given} must be a positive divisor of the world size ({world_size}), got {groups!r}")
    return groups


_current: World | None = None


def init(
    ticket: Ticket | str | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    *,
    rank: int | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    join_timeout: float | None = None,
) -> World:
    """Join the job (idempotent) and return the World: rank, world size, device, communicators.

    Args:
        ticket: given by the multiprocessing launcher; otherwise read from the
            environment of `troupe run`, `torchrun` or `mpiexec`.
        rank: global rank, when it differs from ``local_rank`` (several nodes).
        backend: "gloo" or "nccl"; default NCCL when every local rank has a GPU.
        timeout: seconds a collective may wait (``TROUPE_TIMEOUT``, default 300).
        join_timeout: seconds to wait for all ranks to join (``TROUPE_JOIN_TIMEOUT``, 60).
    """
    global _current
    if _current is not None:
        return _current
    one_line_refusals()  # what troupe refuses by design, in a rank, reads as one line under every launcher
    env = Settings.from_env()
    joined = join(env, ticket, local_rank, world_size, rank=rank, backend=backend, timeout=timeout,
                  join_timeout=join_timeout)
    _current = World(joined, env)
    _finish_before_destroy(_current)
    atexit.register(_freeze_at_exit)  # runs after shutdown: atexit calls the last registered first
    atexit.register(_shutdown_at_exit)  # leave in order: background threads must not outlive the store
    return _current


def current() -> World | None:
    """The World this process is in, or None before `init()` (never joins)."""
    return _current


def info() -> World:
    """This process's place in the job, joining it first if needed."""
    return init()


def _freeze_at_exit() -> None:
    """At exit, once the job is left: move every object into the collector's permanent generation, so
    that the interpreter's final collections skip them. With torch imported those collections are
    most of the time a process takes to end after its script, paid by every rank of every job. Objects are still freed by reference counting as modules are torn down; only
    garbage in reference cycles is left to the OS (Python does not promise to finalize what still
    exists at exit anyway)."""
    gc.freeze()


class _FinishFirst:
    """Registered with torch's process-group state like a torchcomms communicator: torch calls `finalize`
    first when the default group is destroyed, so a script's own ``destroy_process_group()`` lets troupe
    finish (a parameter-server worker's goodbye, the final master-copy sync) before its groups go."""

    def __init__(self, world: World):
        self.world = world

    def finalize(self) -> None:
        world = self.world
        if world.finished:
            return
        try:
            world.finish()
        except Exception as e:  # destroy_process_group goes on; the process fails at exit (`_shutdown_at_exit`)
            world.exit_failure = _failure_line(world, e)
            print(world.exit_failure, file=sys.stderr, flush=True)


def _finish_before_destroy(world: World) -> None:
    if world.membership.elastic:  # its quorum's groups come and go under troupe's own destroys: it finishes at exit
        return
    # c10d's private list of communicators destroy_process_group() finalizes first: torch has no public hook that
    # runs before the user's destroy, and troupe's last work must finish while the groups still exist.
    comms = getattr(c10d._world, "comms", None)  # torch 2.13; without it troupe finishes at exit instead
    if isinstance(comms, list):
        comms.append(_FinishFirst(world))


def _failure_line(world: World, e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (f"troupe: rank {world.info.global_rank}: troupe's last work in the job failed ({type(e).__name__}: "
            f"{text[0] if text else ''})")


def _shutdown_at_exit() -> None:
    """`shutdown` at exit: a failure there (or earlier, in the script's destroy_process_group) fails the
    process with one line and exit code 1; an exception in an atexit hook would leave the exit code 0."""
    world = _current
    failure = world.exit_failure if world is not None else None  # said when it happened
    try:
        shutdown()
    except Exception as e:
        if failure is None:
            failure = _failure_line(world, e) if world is not None else f"troupe: leaving the job failed: {e}"
            print(failure, file=sys.stderr, flush=True)
    if failure is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def shutdown() -> None:
    """Leave the job: destroy the process group so a later `init()` starts afresh."""
    global _current
    world, _current = _current, None
    if world is not None:
        world.close()
        if world.exit_failure is not None:  # in the script's destroy_process_group, said there
            raise RuntimeError(world.exit_failure)
    elif dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()

