"""`troupe run --elastic` over a parameter-server job: workers restart alone; separate servers may fail over."""

from __future__ import annotations

import argparse
import sys

from troupe.launcher.elastic import EndedElsewhere, load_torch, supervise_restarting
from troupe.launcher.ports import ticket_for
from troupe.launcher.starter import Starter
from troupe.runtime import settings


def run_elastic_servers(args: argparse.Namespace, extra_env: dict[str, str]) -> int:
    """--elastic over a parameter-server job (Downpour, Sandblaster, Hogwild): node 0's launcher hosts the job's
    store; a dead worker restarts alone, on its node, and rejoins through the servers (runtime/rejoin.py) or,
    under Hogwild, by copying a live group (cluster/serving/groupsync.py); a dead separate server ends the
    job, on every node, unless its workers can fail over to another server group's (asynchronous groups,
    several server groups): then the job goes on without it."""
    from troupe.runtime.lighthouse import Keeper
    from troupe.runtime.quorum import REJOIN_VAR

    ticket = ticket_for(args)
    first, nodes = args.node_rank * args.nproc, args.nnodes
    evict = {} if args.evict_after is None else {"TROUPE_EVICT_AFTER": str(args.evict_after)}  # Sandblaster's servers
    start = Starter(args, {**extra_env, REJOIN_VAR: "1", **evict}, ticket)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    load_torch(args, start, say)
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
            raise EndedElsewhere(code)

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
        code = supervise_restarting(args, start, keeper, 1 if args.spares is None else args.spares,
                                     list(range(first, first + args.nproc)), say, fixed=fixed, finish_closes=False,
                                     also_poll=ended_elsewhere, left_out=left_out, let_go=let_go, frozen=frozen)
        return code
    except EndedElsewhere as e:
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
