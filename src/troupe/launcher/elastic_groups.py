"""`troupe run --elastic` over synchronous worker groups: the quorum (the lighthouse) lives in node 0's launcher."""

from __future__ import annotations

import argparse
import sys

from troupe.launcher.elastic import early_failure, keep_store_until_done, load_torch, supervise_restarting
from troupe.launcher.ports import ticket_for
from troupe.launcher.starter import Starter
from troupe.runtime import settings


def run_elastic_groups(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    """Start the ranks of an elastic job, keep its quorum here, and restart a dead rank alone."""
    from troupe.runtime.lighthouse import Lighthouse, Reporter
    from troupe.runtime.quorum import ENV_VAR, ElasticOptions

    ticket = ticket_for(args)
    given = {"timeout": args.elastic_timeout, "evict_after": args.evict_after, "batch": args.elastic_batch,
             "max_groups": args.max_groups}
    total = args.nproc * args.nnodes
    groups = args.elastic_groups or total
    options = ElasticOptions(groups=groups, group_size=total // groups, min_groups=args.min_groups or 2,
                             **{k: v for k, v in given.items() if v is not None})
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    start = Starter(args, {**extra_env, ENV_VAR: options.encode()}, ticket)
    load_torch(args, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    # The quorum lives in node 0's launcher; another node's tells it what it sees of its own ranks.
    lighthouse = Lighthouse(ticket, options, say=say).start() if args.node_rank == 0 \
        else Reporter(ticket, settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT)
    # Spares start once the first quorum has formed, not before: their imports would slow the ranks' start.
    count = options.group_size if args.spares is None else args.spares  # default: a whole group's worth
    first = args.node_rank * args.nproc
    try:
        code = supervise_restarting(args, start, lighthouse, count, list(range(first, first + args.nproc)),
                                     say, group_size=options.group_size, early=early_failure(lighthouse, args),
                                     fixed=lighthouse.refusal)
        if code == 0 and args.nnodes > 1 and args.node_rank == 0:
            keep_store_until_done(lighthouse, options)
        return code
    finally:
        lighthouse.stop()
