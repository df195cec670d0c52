"""`troupe run --elastic` over a parameter-server job: workers restart alone; separate servers may fail over."""

from __future__ import annotations

import sys

from troupe.launcher.elastic import (
    ElasticProcesses,
    EndedElsewhere,
    OtherNodes,
    StoreWatch,
    load_torch,
    supervise_restarting,
)
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.policies import ServerFailover
from troupe.launcher.ports import Ports
from troupe.launcher.starter import Starter
from troupe.runtime import settings
from troupe.runtime.rankio import RankOutput
from troupe.runtime.zygote import ZygoteSlot

NODE_SILENCE_SECONDS = 30.0
"""Elastic parameter servers on several nodes: node 0 keeps the job's store up after its own ranks are done
until every other node's launcher has ended, or said nothing for this long (it died)."""


def run_elastic_servers(plan: LaunchPlan, output: RankOutput | None, ports: Ports, zygotes: ZygoteSlot) -> int:
    """--elastic over a parameter-server job (Downpour, Sandblaster, Hogwild): node 0's launcher hosts the job's
    store; a dead worker restarts alone, on its node, and rejoins through the servers (runtime/rejoin.py) or,
    under Hogwild, by copying a live group (cluster/serving/groupsync.py); a dead separate server ends the
    job, on every node, unless its workers can fail over to another server group's (asynchronous groups,
    several server groups): then the job goes on without it (`policies.ServerFailover`)."""
    from troupe.runtime.keeper import Keeper

    assert plan.elastic is not None
    ticket = ports.ticket(plan.place)
    nodes, node_rank, servers = plan.place.nnodes, plan.place.node_rank, plan.servers
    start = Starter(plan, ticket, ports, output, zygotes=zygotes)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    load_torch(plan, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    keeper = Keeper(ticket, plan.world_size, host=node_rank == 0,
                    timeout=settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT)
    evict_after = plan.elastic.evict_after or settings.current().evict_after
    policy = ServerFailover(keeper, servers, list(plan.place.ranks), evict_after)
    watch = StoreWatch(ticket, say) if node_rank != 0 else None
    processes = ElasticProcesses(start, keeper, plan.elastic.spares,
                                 OtherNodes(keeper, node_rank, say, watch) if nodes > 1 else None)
    left_out = "was evicted by its server while it was frozen" if servers.ranks else \
        "was frozen past --evict-after: the other groups went on without it"
    code = 1
    try:
        code = supervise_restarting(plan, processes, keeper, policy, say, finish_closes=False, left_out=left_out)
        return code
    except EndedElsewhere as e:
        code = e.code
        return code
    finally:
        if watch is not None:
            watch.stop()
        if nodes > 1:
            keeper.end(node_rank, code)
            if node_rank == 0:  # the store is the job's: up until every node is done with it
                keeper.wait_for_nodes(nodes, NODE_SILENCE_SECONDS, say)
        keeper.stop()
