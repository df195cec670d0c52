"""The cluster frameworks' worker regimes, registered in `troupe.strategies.registry`.

SINGA's four frameworks are settings of one `ClusterConfig`; what a worker runs follows
from them (`ClusterConfig.worker_regime`): a client of separate servers (Sandblaster,
Downpour), a worker hosting its group's servers (AllReduce, Distributed Hogwild), or
workers sharing one process's memory (in-memory Hogwild), or DiLoCo's workers (synchronous
groups, an outer optimizer step over them every sync_freq steps). Each is a `Regime` whose
`choose` runs the bootstrap, which decides a rank's role before any worker strategy
exists: a server rank serves there and never returns.

`DistOpt` imports this module (which registers the regimes) and stays light: the bootstrap and
the worker strategies are imported when a regime is chosen and builds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from troupe.strategies.choice import Fixed
from troupe.strategies.registry import Capabilities, Regime, Setup, register

if TYPE_CHECKING:
    from troupe.cluster.bootstrap import WorkerContext

_INSTEAD = {
    "backward_and_update_half": "for {option} on the wire set the cluster's wire_dtype: {option} "
                                "(troupe run --wire-dtype {option}; separate servers)",
    "backward_and_sparse_update": "to send only the largest part of each update set the cluster's wire_topk, "
                                  "e.g. wire_topk: 0.01 (troupe run --wire-topk 0.01; separate servers)",
    "backward_and_partial_update": "to average seldom use Distributed Hogwild's sync_freq (troupe run "
                                   "--framework hogwild --sync-freq N) or Downpour's fetch_freq",
}
"""What does under a cluster what each dist_option does without one."""


class ClusterWorker(Regime):
    """A worker of a parameter-server cluster: one strategy for the whole job, the cluster's own exchange."""

    kind = "cluster"
    supports = Capabilities(per_call=False, join=False, graph_mode=False, add_param_group=False)
    where = "under a parameter-server cluster"

    @classmethod
    def accept(cls, option: type[Regime]) -> None:
        if option.method != "backward_and_update":
            instead = _INSTEAD.get(option.method, "").format(option=option.name)
            raise ValueError(f"dist_option {option.name!r} is not available under a parameter-server cluster: "
                             f"use 'plain' (the cluster's workers and servers exchange updates their own way)"
                             + (f"; {instead}" if instead else ""))

    @classmethod
    def choose(cls, setup: Setup) -> Fixed:
        # The bootstrap owns roles: on a server rank this call serves and ends the process.
        from troupe.cluster import bootstrap

        info, strategy = bootstrap.worker_strategy(setup.cluster, setup.optimizer, setup.world, setup.bucket_size,
                                                   setup.nan_policy, setup.step_count)
        return Fixed(cls, strategy, info)


@register
class SeparateServers(ClusterWorker):
    """Sandblaster and Downpour: the worker sends updates to separate server ranks and fetches values."""

    name = "ps-client"

    @classmethod
    def build(cls, ctx: WorkerContext) -> Any:
        from troupe.cluster.workers.ps_client import PSClient

        job, role = ctx.job, ctx.job.role
        group = job.group_comms[role.worker[0]]
        several = ctx.cluster.nworkers_per_group > 1
        agree = group if ctx.layout.partitioned and several else None
        # A replica's workers (not partitioned, not restarting alone, an exact wire) average their gradients where
        # the loop looks at them before step(): clipping then sees the group's gradient, as in one process. A
        # half-precision or top-K wire keeps each worker's own (rounded or selected as its own, as SINGA sends).
        exact = ctx.cluster.wire_dtype == "fp32" and ctx.cluster.wire_topk is None
        average = group if several and exact and not ctx.layout.partitioned and job.links is None else None
        return PSClient(ctx.cluster, role, job.everyone, job.channel, ctx.params, ctx.bucket_size, ctx.optimizer,
                        ctx.nan_policy, layout=ctx.layout, agree=agree, average=average, rejoined=job.rejoined,
                        alone=job.workers_comm if job.links is not None else None, fail_over=job.fails_over,
                        gone=sorted(job.gone))


@register
class CoLocatedServers(ClusterWorker):
    """AllReduce and Distributed Hogwild: each worker hosts one server of its group."""

    name = "co-located"

    @classmethod
    def build(cls, ctx: WorkerContext) -> Any:
        from troupe.cluster.workers.colocated import CoLocated

        job, role = ctx.job, ctx.job.role
        first = job.world if job.restarts_alone and not job.rejoined else None  # no data-parallel group to broadcast in
        return CoLocated(ctx.cluster, role, job.group_comms[role.worker[0]], ctx.optimizer, ctx.bucket_size,
                         job.sync_channels, job.alive, job.timeout, layout=ctx.layout, first=first,
                         rejoined=job.rejoined)


@register
class ShardedCoLocatedServers(ClusterWorker):
    """AllReduce with ``shard:`` in its cluster block: the group's co-located servers become the ranks' parts
    of a sharded DistOpt (`troupe.strategies.sharded`, ZeRO-1 / ZeRO-2), each holding 1/k of the state."""

    name = "co-located-sharded"
    where = "under framework allreduce with shard"
    supports = Capabilities(per_call=False, join=False, add_param_group=False, partition=False)

    @classmethod
    def choose(cls, setup: Setup) -> Any:
        from troupe.strategies.registry import lookup

        if setup.world.comm.world_size != setup.cluster.nworkers:
            raise ValueError(f"shard {setup.cluster.shard} needs every rank to be a worker of the one group "
                             f"({setup.cluster.nworkers} workers, {setup.world.comm.world_size} ranks)")
        return lookup(setup.cluster.shard, "shard").choose(setup)


@register
class InMemoryHogwild(ClusterWorker):
    """Several workers of one process share its parameter memory (``nworkers_per_procs > 1``)."""

    name = "in-memory-hogwild"

    @classmethod
    def build(cls, ctx: WorkerContext) -> Any:
        from troupe.cluster.workers.in_memory import SharedMemory

        job, role = ctx.job, ctx.job.role
        process = job.processes_comms[role.rank // ctx.cluster.nworkers_per_procs]
        return SharedMemory(ctx.cluster, role, process, ctx.optimizer, ctx.params,
                            job.sync_channels if role.server else None, job.alive, job.timeout)


@register
class DiLoCoWorker(ClusterWorker):
    """DiLoCo: synchronous inside each worker group, an outer optimizer step over the groups every sync_freq steps."""

    name = "diloco"
    where = "under framework diloco"

    @classmethod
    def build(cls, ctx: WorkerContext) -> Any:
        from troupe.strategies.diloco import DiLoCo, group_step

        job, role = ctx.job, ctx.job.role
        group = job.group_comms[role.worker[0]]
        shard = _outer_shard(ctx.cluster, group, group.rank, ctx.layout.partitioned)
        inner = group_step(ctx.params, group, ctx.optimizer, ctx.bucket_size,
                           workers=ctx.cluster.nworkers, partitioned_model=ctx.layout.partitioned)
        return DiLoCo(ctx.cluster, inner, job.place_comms[role.worker[1]], ctx.params, ctx.step_count, shard)


def _outer_shard(cluster: Any, group: Any, place: int, partitioned: bool) -> Any:
    """DiLoCo with ``shard: optimizer``: how the outer state is cut over the group (None: kept whole)."""
    if cluster.shard is None:
        return None
    from troupe.strategies.diloco_shard import GroupCut

    if partitioned:
        raise ValueError(f"shard {cluster.shard} under framework diloco cuts the outer state over a group's "
                         "processes, which needs the whole model in each of them: leave out troupe.partition or shard")
    return GroupCut(group, place, cluster.nworkers_per_group)


@register
class ElasticDiLoCoWorker(ClusterWorker):
    """DiLoCo over elastic worker groups: the quorum's groups are the groups present.

    Its group and place communicators are made anew for every quorum (every member makes every
    group's and every place's subgroup, in order, as the quorum's process group forms), so the
    strategy keeps the same objects: each adopts its new subgroup."""

    name = "elastic-diloco"
    where = "under framework diloco with troupe run --elastic"
    supports = Capabilities(per_call=False, join=False, graph_mode=False, add_param_group=False, elastic=True)

    @classmethod
    def choose(cls, setup: Setup) -> Fixed:
        from troupe.strategies.allreduce import AllReduce
        from troupe.strategies.choice import params_of
        from troupe.strategies.diloco import group_step
        from troupe.strategies.diloco_elastic import ElasticDiLoCo

        world, membership = setup.world, setup.world.membership
        if not membership.elastic:
            raise ValueError("a cluster with elastic: true runs under troupe run --elastic (or --cluster FILE) only")
        if setup.nan_policy == "skip":
            raise ValueError("nan_policy 'skip' cannot run elastic DiLoCo: a group skipping a step would leave the "
                             "others waiting in its exchange; use 'raise' (the group restarts) or 'ignore'")
        params = [p for p in params_of(setup.optimizer) if p.requires_grad]
        k = setup.cluster.nworkers_per_group
        if k == 1:  # a group of one process: nothing to reduce inside it; the quorum's processes are the groups
            inner = AllReduce(name="plain", comm=world.comm, reducer=None, optimizer=setup.optimizer, params=params)
            place = world.comm
        else:
            group, place = world.replica_comms()  # made anew for every quorum, adopted by these objects
            inner = group_step(params, group, setup.optimizer, setup.bucket_size, workers=world.world_size,
                               partitioned_model=world.partitioned, elastic=True,
                               first_bucket_size=setup.first_bucket_size)
        shard = None if k == 1 else _outer_shard(setup.cluster, group, world.rank % k, world.partitioned)
        strategy = ElasticDiLoCo(setup.cluster, inner, place, params, setup.step_count, shard)
        membership.on_reconfigure.append(strategy.reconfigured)  # its exchanges in flight are redone
        membership.holds_work.append(strategy.holds_work)
        return Fixed(cls, strategy)
