"""The `troupe` command: `troupe run` starts a job's local processes, `troupe info` describes the machine,
`troupe bench` runs and renders benchmarks (troupe.bench), `troupe plan` prices partition plans
(troupe.partition.planner)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from troupe.runtime import settings

if TYPE_CHECKING:
    from troupe.runtime.zygote import ZygoteSlot


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
    _add_run_parser(sub)
    sub.add_parser("info", help="what this machine offers: torch, backends, devices, MPI")
    serve = sub.add_parser("fork-server", help="fork `troupe run`'s launchers from this process, which imports torch "
                                               "once (for many short jobs: export TROUPE_FORK_SERVER=SOCKET)")
    serve.add_argument("socket", help="the path of the Unix socket to listen on")
    from troupe.bench.arguments import add_bench_parser

    add_bench_parser(sub, positive=_positive)
    _add_plan_parser(sub)
    return parser


def _add_run_parser(sub) -> None:
    """`troupe run [flags] SCRIPT [ARGS]` (troupe.launcher does the work)."""
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
    _add_elastic_flags(run)
    _add_cluster_flags(run)
    _add_output_flags(run)
    run.add_argument("script", help="the training script (a .py file)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_elastic_flags(run: argparse.ArgumentParser) -> None:
    """--elastic and the flags that tune it."""
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


def _add_output_flags(run: argparse.ArgumentParser) -> None:
    """Where the ranks' output and the job's records go."""
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
    from troupe.runtime import envrdv
    from troupe.runtime.forking import ForkedChild

    envrdv.withdraw()  # `troupe run` under srun or mpiexec: its ranks get their own RANK, not this process's
    if argv is None and sys.argv[1:2] == ["run"]:
        from troupe.runtime.forkserver import run_served

        served = run_served(sys.argv[1:])  # a launcher forked by a `troupe fork-server` (runtime/forkserver.py)
        if served is not None:
            return served
    try:
        return _main(argv)
    except ForkedChild as rank:  # a rank forked from the zygote this launcher forked from itself (`ZygoteSlot.fork`)
        request = rank.request
    from troupe.runtime.zygote import run_rank

    run_rank(request)  # outside the except block: the program's exceptions are its own, unchained
    return 0


def _main(argv: list[str] | None, zygotes: ZygoteSlot | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "conformance"]:  # the matrix's own options follow (argparse would take them as ours)
        argv = ["bench", "conformance", "--", *argv[2:]]
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from troupe.launcher.machine import describe_machine

        print(describe_machine())
        return 0
    if args.command == "fork-server":
        from troupe.runtime.forkserver import serve

        request, zygotes = serve(args.socket)  # returns only in a launcher it forked, which runs here
        return _main(request["argv"], zygotes)
    if args.command == "bench":
        from troupe.bench.command import main as bench_main

        return bench_main(args)
    if args.command == "plan":
        from troupe.partition.planner.command import main as plan_main

        return plan_main(args)
    from troupe.launcher.job import run

    try:
        return run(args, zygotes)
    except (ValueError, ImportError) as e:  # bad arguments; a missing optional package (tensorboard)
        print(f"troupe run: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # another node's launcher under --elastic: node 0's never answered
        print(f"troupe run: {e}", file=sys.stderr)
        return 1


def _add_cluster_flags(run: argparse.ArgumentParser) -> None:
    from troupe.cluster.configuration.flags import add_flags
    from troupe.cluster.configuration.presets import PRESETS

    group = run.add_argument_group("cluster (parameter servers; SINGA's ClusterProto)")
    group.add_argument("--framework", choices=sorted(PRESETS), default=None, help="a preset cluster topology")
    group.add_argument("--cluster", metavar="FILE", default=None, help="a `cluster { ... }` block or TOML file")
    add_flags(group, integer=_positive)  # one flag per ClusterConfig field that declares one


if __name__ == "__main__":
    sys.exit(main())
