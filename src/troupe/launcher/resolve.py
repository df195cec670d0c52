"""What `troupe run`'s flags, cluster block, job file and environment ask for, checked before any rank starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

from troupe.runtime import settings
from troupe.runtime.rankio import RankOutput, parse_ranks


def from_slurm(args: argparse.Namespace) -> None:
    """`troupe run --slurm`: this node's place in the job from srun's environment (one task per node:
    each is one node's launcher). The master is the step's first node; port and token as a Slurm
    job's ranks compute them (`slurm_ticket`), so every node's launcher agrees without talking."""
    from troupe.runtime.ticket import slurm_ticket

    given = (("--nnodes", args.nnodes != 1), ("--node-rank", args.node_rank != 0), ("--master", args.master is not None),
             ("--token", args.token != settings.current().token))
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
    args.nnodes, args.node_rank = int(ntasks), int(procid)
    args.master, args.token = (ticket.addr, ticket.port), ticket.token


def worker_groups_env(args: argparse.Namespace) -> dict[str, str]:
    """``--nworker-groups G`` alone (no --framework, --cluster, other cluster flag or --elastic): G synchronous
    worker groups of -n x --nnodes / G consecutive ranks and no parameter-server cluster. The job is plain
    data parallelism over every rank; a sharded DistOpt (--shard) or model (troupe.shard) shards inside each
    group and the groups replicate (HSDP). The env var that carries it (TROUPE_GROUPS); {} otherwise."""
    from troupe.cluster.configuration.flags import given

    fields = {name for name, value in given(args).items() if value is not None}
    if args.elastic or args.framework or args.cluster or fields != {"nworker_groups"}:
        return {}
    groups, args.nworker_groups = args.nworker_groups, None  # not a cluster's: cluster_env resolves none
    args.nproc = args.nproc or 2
    total = args.nproc * args.nnodes
    if total % groups:
        on = f" x --nnodes {args.nnodes}" if args.nnodes > 1 else ""
        raise ValueError(f"--nworker-groups {groups} must divide the job's processes (-n {args.nproc}{on} = {total}) "
                         "into groups of equal size")
    if args.node_rank == 0:
        print(f"troupe run: {groups} synchronous worker groups of {total // groups} consecutive ranks "
              "(sharding stays inside a group; the groups replicate)", file=sys.stderr)
    return {"TROUPE_GROUPS": str(groups)}


def cluster_env(args: argparse.Namespace) -> dict[str, str]:
    """Resolve the cluster (if any), fix -n from it, print every rank's role; the env var that carries it."""
    from troupe.cluster.configuration.config import ENV_VAR
    from troupe.cluster.configuration.flags import given
    from troupe.cluster.configuration.roles import expendable_ranks, roles
    from troupe.cluster.configuration.sources import resolve

    total = None if args.nproc is None else args.nproc * args.nnodes
    cluster = resolve(args.framework, args.cluster, total, **given(args))
    if cluster is None:
        args.nproc = args.nproc or 2
        return {}
    if args.elastic and cluster.framework == "diloco":  # elastic DiLoCo's groups are a quorum's
        cluster = dataclasses.replace(cluster, elastic=True)
    elif args.elastic:  # Downpour, Sandblaster, Hogwild: their workers restart alone
        from troupe.cluster.bootstrap import rejoining_problem

        problem = rejoining_problem(cluster)
        if problem:
            raise ValueError(problem)
        args.rejoining = True
    if cluster.nprocs % args.nnodes:
        raise ValueError(f"the cluster's {cluster.nprocs} processes do not divide among --nnodes {args.nnodes}")
    args.nproc = cluster.nprocs // args.nnodes
    args.tolerate = expendable_ranks(cluster)  # asynchronous groups: the others go on when a worker dies
    # Server-only ranks run the cluster bootstrap, not the script: a server learns the parameters'
    # sizes and the optimizer from worker 0 (troupe.cluster.configuration.spec), so it never loads data or a model.
    args.servers = {r.rank for r in roles(cluster) if r.worker is None}
    args.server_places = {r.rank: r.server for r in roles(cluster) if r.worker is None}
    args.fails_over = cluster.servers_fail_over  # --elastic: a dead server's workers fail over to another's
    if args.node_rank == 0:
        print(f"troupe run: cluster {cluster.to_json()}", file=sys.stderr)
        for role in roles(cluster):
            print(f"troupe run:   {role.describe()}", file=sys.stderr)
    return {ENV_VAR: cluster.to_json()}


def check_paths(args: argparse.Namespace) -> None:
    """The files and directories the job reads or writes on this node, checked before any rank starts."""
    script = args.script
    if not os.path.isfile(script):
        raise ValueError(f"script not found: {script}" if not os.path.exists(script)
                         else f"the script {script} is not a file")
    if not os.access(script, os.R_OK):
        raise ValueError(f"cannot read the script {script} (permission denied)")
    for flag, directory in (("--checkpoint-dir", args.checkpoint_dir), ("--log-dir", args.log_dir),
                            ("--tensorboard", args.tensorboard)):
        if directory:
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise ValueError(f"{flag} {directory}: not a directory")
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                raise ValueError(f"{flag} {directory}: cannot make the directory ({e.strerror})") from None
            if not os.access(directory, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {directory}: the directory is not writable")
    for flag, path in (("--stats", args.stats), ("--timeline", args.timeline)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"{flag} {path}: its directory {parent} does not exist or is not writable")


def elastic_from_cluster(args: argparse.Namespace) -> None:
    """A cluster block with ``elastic: true`` (`--cluster job.conf`) is ``--elastic`` over its worker
    groups: ``--nworker-groups`` its nworker_groups, -n its processes, ``--min-groups`` its min_groups
    (the flags win where given); with separate servers, ``--elastic`` over that parameter-server job."""
    from troupe.cluster.configuration.config import flag_fields
    from troupe.cluster.configuration.flags import given
    from troupe.cluster.configuration.sources import resolve

    total = None if args.nproc is None else args.nproc * args.nnodes
    with warnings.catch_warnings():  # a cluster that is not elastic is resolved again, warnings and all, later
        warnings.simplefilter("ignore")
        cluster = resolve(args.framework, args.cluster, total, **given(args))
    if cluster is None or not cluster.elastic:
        return
    if cluster.server_worker_separate and cluster.framework != "diloco":
        # Downpour, Sandblaster: the cluster stays as given; its workers restart alone
        args.elastic, args.elastic_servers = True, cluster.framework or "a parameter-server cluster"
        return
    if cluster.nprocs % args.nnodes:
        raise ValueError(f"the cluster's {cluster.nprocs} processes do not divide among --nnodes {args.nnodes}")
    diloco = cluster.framework == "diloco"
    for f in flag_fields():  # what follows is --elastic's (with DiLoCo's fields, as flags)
        setattr(args, f.name, getattr(cluster, f.name) if diloco and getattr(cluster, f.name) != f.default else None)
    args.elastic, args.nproc, args.nworker_groups = True, cluster.nprocs // args.nnodes, cluster.nworker_groups
    args.min_groups = cluster.min_groups if args.min_groups is None else args.min_groups
    args.max_groups = cluster.max_groups if args.max_groups is None else args.max_groups
    args.cluster, args.framework = None, "diloco" if diloco else None


def check_elastic(args: argparse.Namespace) -> None:
    """What this step of elastic worker groups runs: data parallelism over groups of processes (one
    each, or `--nworker-groups` groups of equal size, none across two nodes), no cluster framework."""
    from troupe.cluster.configuration.flags import given

    if args.max_restarts:
        raise ValueError("--elastic restarts a dead rank alone; --max-restarts restarts the whole job: give one")
    cluster_flags = {k: v for k, v in given(args).items() if v is not None and k != "nworker_groups"}
    diloco, downpour = args.framework == "diloco", args.framework in ("downpour", "sandblaster", "hogwild")
    block = getattr(args, "elastic_servers", None)  # a cluster block's elastic: true beside separate servers
    downpour = downpour or bool(block)
    if (args.framework and not (diloco or downpour)) or (args.cluster and not block) \
            or (cluster_flags and not (diloco or downpour)) or settings.current().cluster:
        raise ValueError("--elastic runs data parallelism over worker groups, --framework diloco, or --framework "
                         "downpour, sandblaster or hogwild (their workers restart alone); not AllReduce or "
                         "partition yet by cluster flags (--framework/--cluster/cluster flags other than "
                         "--nworker-groups; to partition inside elastic worker groups, call "
                         "troupe.partition(model, plan) in the script)")
    if downpour:
        _check_elastic_downpour(args, args.framework or block)
        return
    if args.nproc is not None and args.nproc * args.nnodes < 2:
        raise ValueError(f"--elastic needs at least 2 processes (worker groups), got -n {args.nproc}")
    groups = args.nworker_groups
    if groups is not None and groups < 2:
        raise ValueError(f"--elastic --nworker-groups needs at least 2 worker groups (one would have nobody to "
                         f"heal from), got {groups}")
    nodes, per_node = args.nnodes, args.nproc or 2
    if groups is not None and (per_node * nodes) % groups:
        on = f" x --nnodes {nodes}" if nodes > 1 else ""
        raise ValueError(f"--elastic: -n {per_node}{on} processes do not split into --nworker-groups {groups} "
                         f"groups of equal size")
    if groups is not None and per_node % (per_node * nodes // groups):
        raise ValueError(f"--elastic: a worker group of {per_node * nodes // groups} processes (--nworker-groups "
                         f"{groups}) would span two nodes of -n {per_node}: its launcher restarts it whole, on one node")
    if diloco and args.elastic_batch == "constant":
        raise ValueError("--elastic-batch constant weighs each step's gradients over the groups; under --framework "
                         "diloco the groups take their inner steps alone (a missing group's pseudo-gradient is left "
                         "out of the outer step)")
    # The groups are the quorum's business, not a cluster's: the ranks see plain data parallelism
    # (under DiLoCo, a cluster whose worker groups are the quorum's).
    args.elastic_groups, args.nworker_groups = groups, ((groups or per_node * nodes) if diloco else None)
    if args.restarts_per_rank < 0:
        raise ValueError(f"--restarts-per-rank must be >= 0, got {args.restarts_per_rank}")
    if args.spares is not None and args.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {args.spares}")


def _check_elastic_downpour(args: argparse.Namespace, framework: str) -> None:
    """Downpour, Sandblaster or Hogwild under --elastic: no quorum (each worker talks to the servers, or the
    other groups, alone), so the quorum's flags mean nothing there (`--evict-after`: how long a Sandblaster
    server, or a Hogwild group, waits for a frozen worker)."""
    for flag, value in (("--min-groups", args.min_groups), ("--max-groups", args.max_groups),
                        ("--elastic-batch", args.elastic_batch), ("--elastic-timeout", args.elastic_timeout)):
        if value is not None:
            raise ValueError(f"{flag} is for synchronous elastic groups (a quorum); under {framework} each worker "
                             "talks to the servers alone: leave it out")
    if args.restarts_per_rank < 0:
        raise ValueError(f"--restarts-per-rank must be >= 0, got {args.restarts_per_rank}")
    if args.spares is not None and args.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {args.spares}")
    if args.evict_after is not None and args.evict_after <= 0:
        raise ValueError(f"--evict-after must be > 0 seconds, got {args.evict_after}")


def rank_output(args: argparse.Namespace) -> RankOutput | None:
    """Where the ranks' output goes: passed on line by line when several ranks share this terminal or
    --prefix/--log-dir/--ranks ask for it; else (one rank) inherited as it is."""
    ranks = parse_ranks(args.ranks) if args.ranks is not None else None
    if args.nproc < 2 and not (args.prefix or args.log_dir or ranks is not None):
        return None
    output = RankOutput(prefix=args.prefix, ranks=ranks, log_dir=args.log_dir)
    first = args.node_rank * args.nproc
    output.clear_logs(range(first, first + args.nproc))
    return output
