"""The launcher's ports: the job's rendezvous ticket, with the ports it reserves held open until rank 0 listens."""

from __future__ import annotations

import argparse
import errno

from troupe.runtime.ticket import LOOPBACK, Ticket, reserve_port


_HELD: list = []  # the launcher's reserved ports: open for its life, so no other process takes them


def reserved(addr: str) -> int:
    """A free port on `addr` that stays this launcher's until its rank 0 listens on it."""
    _HELD.append(reserve_port(addr))
    return _HELD[-1].getsockname()[1]


def hold_master_ports(host: str, port: int) -> None:
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

def ticket_for(args: argparse.Namespace) -> Ticket:
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
    if args.nnodes > 1 and (args.master is None or not args.token):
        raise ValueError("a job on several nodes needs --master HOST:PORT and the same --token (or TROUPE_TOKEN) on each")
    host, port = args.master or (LOOPBACK, reserved(LOOPBACK))
    if args.master and args.node_rank == 0:
        hold_master_ports(host, port)
    return Ticket(addr=host, port=port, token=args.token) if args.token else Ticket(addr=host, port=port)
