"""`troupe run`: resolve the plan, start this node's ranks (fixed or elastic), report when they end."""

from __future__ import annotations

import argparse
import os
import sys

from troupe.launcher.elastic import afresh_unless_quiet
from troupe.launcher.elastic_groups import run_elastic_groups
from troupe.launcher.elastic_servers import run_elastic_servers
from troupe.launcher.flags import Flags
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.launcher.processes import run_once
from troupe.launcher.resolve import plan_from, prepared
from troupe.runtime.rankio import RankOutput, parse_ranks
from troupe.runtime.zygote import ZygoteSlot


def run(args: argparse.Namespace, zygotes: ZygoteSlot | None = None) -> int:
    """`troupe run`'s parsed arguments: the plan resolved once, then the job started on this node (`zygotes`: a
    launcher forked by a fork server gets the server's, which knows how torch was loaded)."""
    zygotes = ZygoteSlot() if zygotes is None else zygotes
    flags = prepared(Flags.from_args(args))
    if flags.elastic.on and flags.place.node_rank != 0:
        afresh_unless_quiet(zygotes)  # before anything is said or made: it may start this launcher again
    return run_plan(plan_from(flags), zygotes)


def run_plan(plan: LaunchPlan, zygotes: ZygoteSlot) -> int:
    """Start the job; after a failure restart it from its last checkpoint, up to --max-restarts times (every
    attempt forks its ranks from the same zygote)."""
    for path in (plan.outputs.stats, plan.outputs.timeline):
        if path and os.path.exists(path):
            os.remove(path)  # stats are appended to: start each job afresh
    output, ports = rank_output(plan), Ports()
    if plan.mode == "rejoin":
        return run_elastic_servers(plan, output, ports, zygotes)
    if plan.mode == "quorum":
        return run_elastic_groups(plan, output, ports, zygotes)
    recovery = plan.recovery
    resume = "yes" if recovery.resume else "no"
    for attempt in range(recovery.max_restarts + 1):
        code = run_once(plan, output, ports, {"TROUPE_RESUME": resume}, zygotes)
        if code == 0 or code == 130 or attempt == recovery.max_restarts:
            report(plan)
            return code
        resume = "auto"
        print(f"troupe run: restarting from the last checkpoint in {recovery.directory} "
              f"(restart {attempt + 1} of {recovery.max_restarts})", file=sys.stderr)
    return code


def rank_output(plan: LaunchPlan) -> RankOutput | None:
    """Where the ranks' output goes: passed on line by line when several ranks share this terminal or
    --prefix/--log-dir/--ranks ask for it; else (one rank) inherited as it is."""
    out = plan.outputs
    ranks = parse_ranks(out.ranks) if out.ranks is not None else None
    if plan.nproc < 2 and not (out.prefix or out.log_dir or ranks is not None):
        return None
    output = RankOutput(prefix=out.prefix, ranks=ranks, log_dir=out.log_dir)
    output.clear_logs(plan.place.ranks)
    return output


def report(plan: LaunchPlan) -> None:
    """Summarise the stats file and merge the ranks' timelines (on node 0)."""
    from troupe.observe import trace

    out = plan.outputs
    if out.stats and os.path.exists(out.stats) and os.path.getsize(out.stats):
        print(f"troupe run: per-step means from {out.stats}\n{trace.summarize(out.stats)}", file=sys.stderr)
    if out.timeline and os.path.exists(out.timeline):
        trace.merge_timelines(out.timeline, plan.world_size)
        print(f"troupe run: timeline in {out.timeline} (open in chrome://tracing or ui.perfetto.dev)",
              file=sys.stderr)
    if out.tensorboard:
        print(f"troupe run: TensorBoard scalars in {out.tensorboard} (tensorboard --logdir {out.tensorboard})",
              file=sys.stderr)
