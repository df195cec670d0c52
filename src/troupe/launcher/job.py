"""`troupe run`: start the job's ranks on this node, fixed or elastic, and report when they end."""

from __future__ import annotations

import argparse
import os
import sys

from troupe.launcher.elastic import afresh_unless_quiet
from troupe.launcher.elastic_groups import run_elastic_groups
from troupe.launcher.elastic_servers import run_elastic_servers
from troupe.launcher.processes import run_once
from troupe.launcher.resolve import (check_elastic, check_paths, cluster_env, elastic_from_cluster, from_slurm,
                                     rank_output, worker_groups_env)


def run(args: argparse.Namespace) -> int:
    """Start the job; after a failure restart it from its last checkpoint, up to --max-restarts times."""
    if args.slurm:
        from_slurm(args)
    if args.cluster:
        elastic_from_cluster(args)
    if args.elastic and args.node_rank != 0:
        afresh_unless_quiet()
    if args.tensorboard:
        from troupe.observe.tensorboard import require

        require()  # one clear error here, not one per rank, and before any directory is made
    check_paths(args)
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
        check_elastic(args)
    else:
        for flag, value in (("--min-groups", args.min_groups), ("--evict-after", args.evict_after),
                            ("--elastic-timeout", args.elastic_timeout), ("--spares", args.spares),
                            ("--elastic-batch", args.elastic_batch), ("--max-groups", args.max_groups)):
            if value is not None:
                raise ValueError(f"{flag} needs --elastic")
    extra_env.update(worker_groups_env(args))
    cluster = cluster_env(args)
    extra_env.update(cluster)
    if args.shard:
        if args.elastic or cluster:
            raise ValueError(f"--shard {args.shard} runs with plain data parallelism only for now: drop "
                             f"{'--elastic' if args.elastic else 'the cluster framework'}")
        extra_env["TROUPE_SHARD"] = args.shard
    args.output = rank_output(args)
    if args.elastic and getattr(args, "rejoining", False):
        return run_elastic_servers(args, extra_env)
    if args.elastic:
        return run_elastic_groups(args, extra_env)
    resume = "yes" if args.resume else "no"
    for attempt in range(args.max_restarts + 1):
        code = run_once(args, {**extra_env, "TROUPE_RESUME": resume})
        if code == 0 or code == 130 or attempt == args.max_restarts:
            _report(args)
            return code
        resume = "auto"
        print(f"troupe run: restarting from the last checkpoint in {ckpt_dir} "
              f"(restart {attempt + 1} of {args.max_restarts})", file=sys.stderr)
    return code


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
