"""`troupe run --elastic` over a parameter-server job: workers restart alone; separate servers may fail over."""

from __future__ import annotations

import sys

from troupe.launcher.elastic import EndedElsewhere, load_torch, supervise_restarting
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.launcher.starter import Starter
from troupe.runtime import settings
from troupe.runtime.rankio import RankOutput


def run_elastic_servers(plan: LaunchPlan, output: RankOutput | None, ports: Ports) -> int:
    """--elastic over a parameter-server job (Downpour, Sandblaster, Hogwild): node 0's launcher hosts the job's
    store; a dead worker restarts alone, on its node, and rejoins through the servers (runtime/rejoin.py) or,
    under Hogwild, by copying a live group (cluster/serving/groupsync.py); a dead separate server ends the
    job, on every node, unless its workers can fail over to another server group's (asynchronous groups,
    several server groups): then the job goes on without it."""
    from troupe.runtime.lighthouse import Keeper

    assert plan.elastic is not None
    ticket = ports.ticket(plan.place)
    nodes, node_rank, servers = plan.place.nnodes, plan.place.node_rank, plan.servers
    start = Starter(plan, ticket, ports, output)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    load_torch(plan, start, say)
    from troupe.runtime.launch import DEFAULT_JOIN_TIMEOUT

    keeper = Keeper(ticket, plan.world_size, host=node_rank == 0,
                    timeout=settings.current().join_timeout or DEFAULT_JOIN_TIMEOUT)

    def fixed(rank: int) -> str | None:
        refused = keeper.refusal(rank)  # a rank refused the job: a restart would be refused again
        if refused is not None or rank not in servers.ranks:
            return refused
        if servers.fail_over:  # let_go said no: every copy of its slices is gone
            return f"server {servers.places[rank][1]} of every server group is gone: no copy of its slices is left"
        return "a server cannot restart alone (its slices have no live copy to take over while it starts)"

    def copies(index: int) -> set[int]:
        """The servers holding server index `index`'s slices: one per server group."""
        return {r for r, (_, j) in servers.places.items() if j == index}

    def let_go(rank: int) -> str | None:
        """A dead server whose workers fail over to the same server of another server group (the job goes on)."""
        if rank not in servers.ranks or not servers.fail_over:
            return None
        keeper.server_gone(rank)
        group, index = servers.places[rank]
        if keeper.gone(copies(index)) >= copies(index):
            return None
        return (f"it was server {index} of server group {group}, which is not restarted: its workers fail over to "
                f"server {index} of the next server group")

    def ended_elsewhere() -> None:  # another node stopped the job (a server died there): stop this node's ranks
        if nodes == 1:
            return
        keeper.beat(node_rank)
        code = keeper.ended()
        if code is not None:
            say(f"troupe run: another node stopped the job (code {code}); stopping this node's ranks")
            raise EndedElsewhere(code)

    mine = [r for r in plan.place.ranks if r in servers.ranks] if servers.fail_over else []
    evict_after = plan.elastic.evict_after or settings.current().evict_after

    def frozen() -> dict[int, str]:
        """This node's separate servers frozen past --evict-after (SIGSTOP, a hang), while another copy of
        their slices lives: killed, so that their workers fail over (a frozen server cannot come back as a
        frozen worker does: nothing would take its place while it restarts)."""
        out = {}
        for rank, still in keeper.frozen(mine, evict_after).items():
            group, index = servers.places[rank]
            others = copies(index) - {rank}
            if keeper.gone(others) < others:
                out[rank] = (f"(server {index} of server group {group}) has not beaten for {still:.1f} s, past "
                             f"--evict-after {evict_after:g} s: frozen or hung")
        return out

    left_out = "was evicted by its server while it was frozen" if servers.ranks else \
        "was frozen past --evict-after: the other groups went on without it"
    code = 1
    try:
        code = supervise_restarting(plan, start, keeper, plan.elastic.spares,
                                    list(plan.place.ranks), say, fixed=fixed, finish_closes=False,
                                     also_poll=ended_elsewhere, left_out=left_out, let_go=let_go, frozen=frozen)
        return code
    except EndedElsewhere as e:
        code = e.code
        return code
    finally:
        if nodes > 1:
            keeper.end(node_rank, code)
            if node_rank == 0:  # the store is the job's: up until every node is done with it
                keeper.wait_for_nodes(nodes, NODE_SILENCE_SECONDS, say)
        keeper.stop()


NODE_SILENCE_SECONDS = 30.0
"""Elastic parameter servers on several nodes: node 0 keeps the job's store up after its own ranks are done
until every other node's launcher has ended, or said nothing for this long (it died)."""
