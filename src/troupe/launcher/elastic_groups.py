"""`troupe run --elastic` over synchronous worker groups: the quorum (the lighthouse) lives in node 0's launcher."""

from __future__ import annotations

import sys

from troupe.launcher.elastic import (
    ElasticProcesses,
    EndedElsewhere,
    StoreWatch,
    keep_store_until_done,
    load_torch,
    supervise_restarting,
)
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.policies import QuorumPolicy
from troupe.launcher.ports import Ports
from troupe.launcher.standby import Follower, Standby, groups_without_node_0
from troupe.launcher.starter import Starter
from troupe.runtime import settings
from troupe.runtime.rankio import RankOutput
from troupe.runtime.zygote import ZygoteSlot


def run_elastic_groups(plan: LaunchPlan, output: RankOutput | None, ports: Ports, zygotes: ZygoteSlot) -> int:
    """Start the ranks of an elastic job, keep its quorum here, and restart a dead rank alone."""
    from troupe.runtime.lighthouse import Lighthouse, Reporter

    assert plan.elastic is not None and plan.elastic.quorum is not None
    ticket = ports.ticket(plan.place)
    options, place = plan.elastic.quorum, plan.place
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    start = Starter(plan, ticket, ports, output, zygotes=zygotes)
    load_torch(plan, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    # The quorum lives in node 0's launcher; another node's tells it what it sees of its own ranks. Node 1's keeps a
    # standby of it when the other nodes can go on without node 0 (launcher/standby.py).
    join_timeout = settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT
    lighthouse: Lighthouse | Reporter | Standby | Follower
    watch: StoreWatch | Standby | Follower | None = None
    if place.node_rank == 0:
        lighthouse = Lighthouse(ticket, options, say=say).start()
    elif len(groups_without_node_0(options, plan.nproc, place.nnodes)) >= options.min_groups:
        # A rank started once the standby is known is told where it is; once it took over, that is its store.
        told = lambda addr: start.env.extra.__setitem__("TROUPE_STANDBY", addr)  # noqa: E731
        follow = lambda standby: setattr(start.env, "ticket", standby)  # noqa: E731
        lighthouse = watch = Standby(ticket, options, plan.nproc, say, join_timeout, on_take_over=follow,
                                     on_standby=told) if place.node_rank == 1 \
            else Follower(ticket, say, join_timeout, on_take_over=follow, on_standby=told)
    else:
        lighthouse, watch = Reporter(ticket, join_timeout), StoreWatch(ticket, say)
    code = 1
    try:
        processes = ElasticProcesses(start, lighthouse, plan.elastic.spares, watch)
        code = supervise_restarting(plan, processes, lighthouse, QuorumPolicy(lighthouse, output), say,
                                    group_size=options.group_size)
        if code == 0 and place.nnodes > 1 and (place.node_rank == 0 or getattr(lighthouse, "took_over", False)):
            keep_store_until_done(lighthouse, options)
        return code
    except EndedElsewhere as e:  # node 0's launcher is gone (`StoreWatch`), or ended the job (`Standby`)
        code = e.code
        return code
    finally:
        if watch is not None:
            watch.stop()
        if place.node_rank == 0 and place.nnodes > 1:
            lighthouse.end(code)  # on purpose: node 1's standby must not take over
        lighthouse.stop()
