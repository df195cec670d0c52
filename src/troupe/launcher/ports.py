"""The launcher's ports: the job's rendezvous ticket, with the ports it reserves held open until rank 0 listens."""

from __future__ import annotations

import errno
import socket

from troupe.launcher.flags import Place
from troupe.runtime.ticket import LOOPBACK, Ticket, reserve_port


class Ports:
    """The ports this launcher reserved: held open for its life, so that no other process takes them."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def reserve(self, addr: str) -> int:
        """A free port on `addr` that stays this launcher's until its rank 0 listens on it."""
        self._held.append(reserve_port(addr))
        return self._held[-1].getsockname()[1]

    def hold_master(self, host: str, port: int) -> None:
        """Node 0 with --master HOST:PORT: its rendezvous listens on PORT and a script's env:// one on PORT + 1.
        Hold both until rank 0 listens, so that a port another process took is refused here, in one line."""
        for p in (port, port + 1):
            try:
                self._held.append(reserve_port(host, p))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:  # not an address of this machine (a name, another host): rank 0 will say
                    return
                what = "its rendezvous" if p == port else "the script's env:// rendezvous (MASTER_PORT, the next port)"
                raise ValueError(f"--master {host}:{port}: port {p}, for {what}, is in use on this machine; "
                                 "pick another port") from None

    def ticket(self, place: Place) -> Ticket:
        """The job's ticket: --master and --token, or a port reserved on loopback and a fresh token."""
        if not 0 <= place.node_rank < place.nnodes:
            raise ValueError(f"--node-rank {place.node_rank} is out of range for --nnodes {place.nnodes}")
        if place.nnodes > 1 and (place.master is None or not place.token):
            raise ValueError("a job on several nodes needs --master HOST:PORT and the same --token (or TROUPE_TOKEN) "
                             "on each")
        host, port = place.master or (LOOPBACK, self.reserve(LOOPBACK))
        if place.master and place.node_rank == 0:
            self.hold_master(host, port)
        return Ticket(addr=host, port=port, token=place.token) if place.token else Ticket(addr=host, port=port)

    def torch_port(self, ticket: Ticket, place: Place) -> int:
        """MASTER_PORT for torch's env:// contract, so a plain torch.distributed (DDP) script runs unchanged:
        the port after troupe's with --master (every node computes the same one), else one reserved here."""
        return ticket.port + 1 if place.master else self.reserve(ticket.addr)
