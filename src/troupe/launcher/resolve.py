"""From `troupe run`'s flags, cluster block, job file and environment to the one `LaunchPlan`, checked
before any rank starts.

    flags = prepared(Flags.from_args(args))   # srun's environment; a cluster block with elastic: true
    plan = plan_from(flags)                   # everything else, once

Nothing here starts a process; `say` is told what was decided (the worker groups, each rank's role).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from troupe.cluster.configuration.config import ENV_VAR as CLUSTER_VAR
from troupe.launcher.checks import check_elastic, check_paths, check_recovery, refuse_elastic_flags
from troupe.launcher.flags import ClusterFlags, Flags, Place
from troupe.launcher.plan import ElasticPlan, LaunchPlan, Mode, Servers
from troupe.runtime import settings
from troupe.runtime.quorum import ENV_VAR as QUORUM_VAR
from troupe.runtime.quorum import REJOIN_VAR, ElasticOptions

if TYPE_CHECKING:
    from troupe.cluster.configuration.config import ClusterConfig


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def prepared(flags: Flags) -> Flags:
    """The flags as the job's nodes agree on them: srun's environment (--slurm) and a cluster block with
    `elastic: true` read in. Whether the launcher is elastic is known from here on."""
    if flags.slurm:
        flags = dataclasses.replace(flags, place=from_slurm(flags.place))
    if flags.cluster.file:
        flags = elastic_from_cluster(flags)
    return flags


def from_slurm(place: Place) -> Place:
    """`troupe run --slurm`: this node's place in the job from srun's environment (one task per node:
    each is one node's launcher). The master is the step's first node; port and token as a Slurm
    job's ranks compute them (`slurm_ticket`), so every node's launcher agrees without talking."""
    from troupe.runtime.ticket import slurm_ticket

    given = (("--nnodes", place.nnodes != 1), ("--node-rank", place.node_rank != 0),
             ("--master", place.master is not None), ("--token", place.token != settings.current().token))
    clash = [flag for flag, was_given in given if was_given]
    if clash:
        raise ValueError(f"--slurm reads {', '.join(clash)} from srun's environment: give one or the other")
    env = os.environ
    procid, ntasks = env.get("SLURM_PROCID"), env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if procid is None or ntasks is None:
        raise ValueError("--slurm: no srun environment here (SLURM_PROCID, SLURM_NTASKS): start it as "
                         "srun --ntasks-per-node=1 troupe run --slurm ...")
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    if nodes is not None and int(nodes) != int(ntasks):
        raise ValueError(f"--slurm: srun started {ntasks} tasks on {nodes} nodes; troupe run starts a node's "
                         "processes itself: one task per node (srun --ntasks-per-node=1)")
    s = settings.current()
    ticket = slurm_ticket(s.master_addr, s.master_port, s.token)
    return dataclasses.replace(place, nnodes=int(ntasks), node_rank=int(procid), master=(ticket.addr, ticket.port),
                               token=ticket.token)


def elastic_from_cluster(flags: Flags) -> Flags:
    """A cluster block with ``elastic: true`` (`--cluster job.conf`) is ``--elastic`` over its worker
    groups: ``--nworker-groups`` its nworker_groups, -n its processes, ``--min-groups`` its min_groups
    (the flags win where given); with separate servers, ``--elastic`` over that parameter-server job."""
    from troupe.cluster.configuration.config import flag_fields
    from troupe.cluster.configuration.sources import resolve

    place, c, e = flags.place, flags.cluster, flags.elastic
    with warnings.catch_warnings():  # a cluster that is not elastic is resolved again, warnings and all, later
        warnings.simplefilter("ignore")
        cluster = resolve(c.framework, c.file, place.total, **c.fields)
    if cluster is None or not cluster.elastic:
        return flags
    if cluster.server_worker_separate and cluster.framework != "diloco":
        # Downpour, Sandblaster: the cluster stays as given; its workers restart alone
        block = cluster.framework or "a parameter-server cluster"
        return dataclasses.replace(flags, elastic=dataclasses.replace(e, on=True),
                                   cluster=dataclasses.replace(c, servers_block=block))
    if cluster.nprocs % place.nnodes:
        raise ValueError(f"the cluster's {cluster.nprocs} processes do not divide among --nnodes {place.nnodes}")
    diloco = cluster.framework == "diloco"
    fields = {f.name: getattr(cluster, f.name) if diloco and getattr(cluster, f.name) != f.default else None
              for f in flag_fields()}  # what follows is --elastic's (with DiLoCo's fields, as flags)
    fields["nworker_groups"] = cluster.nworker_groups
    elastic = dataclasses.replace(e, on=True, min_groups=cluster.min_groups if e.min_groups is None else e.min_groups,
                                  max_groups=cluster.max_groups if e.max_groups is None else e.max_groups)
    return dataclasses.replace(flags, place=dataclasses.replace(place, nproc=cluster.nprocs // place.nnodes),
                               elastic=elastic,
                               cluster=ClusterFlags(framework="diloco" if diloco else None, fields=fields))


def plan_from(flags: Flags, say: Callable[[str], None] = _stderr) -> LaunchPlan:
    """Check `flags` (already `prepared`) and resolve the job they describe, once."""
    if flags.outputs.tensorboard:
        from troupe.observe.tensorboard import require

        require()  # one clear error here, not one per rank, and before any directory is made
    check_paths(flags)
    env = check_recovery(flags.recovery) | _output_env(flags)
    groups = None
    if flags.elastic.on:
        flags, groups = check_elastic(flags)
    else:
        refuse_elastic_flags(flags.elastic)
    flags, groups_env = worker_groups(flags, say)
    cluster = cluster_for(flags)
    place = _placed(flags.place, cluster)
    if cluster is not None:
        _announce(cluster, place, say)
        env[CLUSTER_VAR] = cluster.to_json()
    env |= groups_env | _rank_env(flags, cluster)
    mode: Mode = "fixed" if not flags.elastic.on else "quorum" if cluster is None or cluster.framework == "diloco" \
        else "rejoin"
    elastic = _elastic_plan(flags, place, mode, groups)
    if flags.ranks.shard and elastic is not None and elastic.quorum is not None and cluster is None \
            and elastic.quorum.group_size == 1:
        raise ValueError(f"--shard {flags.ranks.shard} under --elastic cuts the state inside each worker group, and "
                         f"these groups are of one process: give --nworker-groups G (groups of 2 or more processes)")
    env |= _elastic_env(elastic)
    return LaunchPlan(place=place, argv=flags.argv, mode=mode, env=env, servers=servers_of(cluster),
                      elastic=elastic, outputs=flags.outputs, recovery=flags.recovery)


def _output_env(flags: Flags) -> dict[str, str]:
    """Where the ranks write their stats, timeline and TensorBoard scalars."""
    out = flags.outputs
    paths = (("TROUPE_STATS", out.stats), ("TROUPE_TIMELINE", out.timeline), ("TROUPE_TENSORBOARD", out.tensorboard))
    return {var: os.path.abspath(path) for var, path in paths if path}


def _rank_env(flags: Flags, cluster: ClusterConfig | None) -> dict[str, str]:
    """--shard, --backend, --timeout, --threads as the ranks' environment."""
    r = flags.ranks
    env = {}
    if r.shard and not (cluster is not None and cluster.shard == r.shard):  # a sharded AllReduce carries its own
        if cluster is not None:
            raise ValueError(f"--shard {r.shard} runs with plain data parallelism only for now: drop the cluster "
                             "framework")
        env["TROUPE_SHARD"] = r.shard  # under --elastic each worker group shards, the groups present replicate
    if r.backend:
        env["TROUPE_BACKEND"] = r.backend
    if r.timeout:
        env["TROUPE_TIMEOUT"] = str(r.timeout)
    if r.threads:
        env["OMP_NUM_THREADS"] = str(r.threads)
    return env


def worker_groups(flags: Flags, say: Callable[[str], None] = _stderr) -> tuple[Flags, dict[str, str]]:
    """``--nworker-groups G`` alone (no --framework, --cluster, other cluster flag or --elastic): G synchronous
    worker groups of -n x --nnodes / G consecutive ranks and no parameter-server cluster. The job is plain
    data parallelism over every rank; a sharded DistOpt (--shard) or model (troupe.shard) shards inside each
    group and the groups replicate (HSDP). The flags left for the cluster (none) and the env var that carries
    the groups (TROUPE_GROUPS); `flags` and {} otherwise."""
    c, place = flags.cluster, flags.place
    if flags.elastic.on or c.framework or c.file or set(c.given()) != {"nworker_groups"}:
        return flags, {}
    groups = c.fields["nworker_groups"]
    place = dataclasses.replace(place, nproc=place.nproc or 2)
    flags = dataclasses.replace(flags, place=place, cluster=c.with_fields(nworker_groups=None))
    total = place.total
    if total % groups:
        on = f" x --nnodes {place.nnodes}" if place.nnodes > 1 else ""
        raise ValueError(f"--nworker-groups {groups} must divide the job's processes (-n {place.nproc}{on} = {total}) "
                         "into groups of equal size")
    if place.node_rank == 0:
        say(f"troupe run: {groups} synchronous worker groups of {total // groups} consecutive ranks "
            "(sharding stays inside a group; the groups replicate)")
    return flags, {"TROUPE_GROUPS": str(groups)}


def cluster_for(flags: Flags) -> ClusterConfig | None:
    """The parameter-server (or DiLoCo) cluster the flags ask for, checked against --elastic; None: none."""
    from troupe.cluster.configuration.sources import resolve

    c, place = flags.cluster, flags.place
    cluster = resolve(c.framework, c.file, place.total, **c.fields)
    if cluster is None:
        return None
    if flags.elastic.on and cluster.framework == "diloco":  # elastic DiLoCo's groups are a quorum's
        cluster = dataclasses.replace(cluster, elastic=True)
    elif flags.elastic.on:  # Downpour, Sandblaster, Hogwild: their workers restart alone
        from troupe.cluster.bootstrap import rejoining_problem

        problem = rejoining_problem(cluster)
        if problem:
            raise ValueError(problem)
    if cluster.nprocs % place.nnodes:
        raise ValueError(f"the cluster's {cluster.nprocs} processes do not divide among --nnodes {place.nnodes}")
    shard = flags.ranks.shard
    if shard and not cluster.server_worker_separate and (cluster.framework == "diloco" or not flags.elastic.on):
        # AllReduce's co-located servers become the ranks' parts of a sharded DistOpt, DiLoCo's outer state is cut
        # over each group (the cluster's `shard`); the cluster says in one line where that cannot be
        cluster = dataclasses.replace(cluster, shard=shard)
    return cluster


def _placed(place: Place, cluster: ClusterConfig | None) -> Place:
    """`place` with its -n decided: the cluster's share of this node, else as given, else 2."""
    nproc = cluster.nprocs // place.nnodes if cluster is not None else place.nproc or 2
    return dataclasses.replace(place, nproc=nproc)


def servers_of(cluster: ClusterConfig | None) -> Servers:
    """The cluster's server-only ranks: they run the cluster bootstrap, not the script (a server learns the
    parameters' sizes and the optimizer from worker 0, troupe.cluster.configuration.spec, so it never loads
    data or a model); and the asynchronous workers the others go on without."""
    if cluster is None:
        return Servers()
    from troupe.cluster.configuration.roles import expendable_ranks, roles

    places = {r.rank: r.server for r in roles(cluster) if r.worker is None}
    return Servers(ranks=frozenset(places), places=places, fail_over=cluster.servers_fail_over,
                   expendable=frozenset(expendable_ranks(cluster)))


def _announce(cluster: ClusterConfig, place: Place, say: Callable[[str], None]) -> None:
    """Node 0 prints the cluster and every rank's role."""
    from troupe.cluster.configuration.roles import roles

    if place.node_rank == 0:
        say(f"troupe run: cluster {cluster.to_json()}")
        for role in roles(cluster):
            say(f"troupe run:   {role.describe()}")


def _elastic_plan(flags: Flags, place: Place, mode: Mode, groups: int | None) -> ElasticPlan | None:
    """How an elastic launcher restarts its ranks; None for a fixed job."""
    e = flags.elastic
    if mode == "fixed":
        return None
    if mode == "rejoin":
        return ElasticPlan(restarts_per_rank=e.restarts_per_rank, spares=1 if e.spares is None else e.spares,
                           evict_after=e.evict_after)
    given = {"timeout": e.timeout, "evict_after": e.evict_after, "batch": e.batch, "max_groups": e.max_groups}
    total = place.total
    groups = groups or total
    options = ElasticOptions(groups=groups, group_size=total // groups, min_groups=e.min_groups or 2,
                             **{k: v for k, v in given.items() if v is not None})
    spares = options.group_size if e.spares is None else e.spares  # default: a whole group's worth
    return ElasticPlan(restarts_per_rank=e.restarts_per_rank, spares=spares, evict_after=e.evict_after,
                       quorum=options)


def _elastic_env(elastic: ElasticPlan | None) -> dict[str, str]:
    """What an elastic job's ranks are told: the quorum's options, or that they rejoin through the servers."""
    if elastic is None:
        return {}
    if elastic.quorum is not None:
        return {QUORUM_VAR: elastic.quorum.encode()}
    evict = {} if elastic.evict_after is None else {"TROUPE_EVICT_AFTER": str(elastic.evict_after)}
    return {REJOIN_VAR: "1", **evict}  # TROUPE_EVICT_AFTER: Sandblaster's servers
