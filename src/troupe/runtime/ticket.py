"""The Ticket: what a process needs to join a job (address, port, token), without torch.

Its own module so that `troupe run`, which makes tickets and starts processes, starts
without importing torch; `troupe.runtime.launch` uses it to join.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def reserve_port(addr: str, port: int = 0) -> socket.socket:
    """A socket bound to a free port on `addr` and kept open: while it is, no other process's
    bind or outgoing connection takes the port, yet the job's rank 0 (which binds with
    SO_REUSEADDR) can still listen on it. Close it once the job has its rendezvous.

    `free_port` alone leaves a gap between the pick and rank 0's bind, in which a parallel
    test's connection or port pick has taken the port.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError:
        s.close()
        raise
    return s


@dataclass(frozen=True)
class Ticket:
    """What a process needs to join a job: rendezvous address, port and secret token.

    SINGA's NCCL-id "ticket": the parent makes one and hands it to every worker;
    only processes holding it can join.

    >>> ticket = Ticket()            # loopback, a free port, a random token
    >>> Ticket.decode(ticket.encode()) == ticket
    True
    """

    addr: str = LOOPBACK
    port: int = 0
    token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"Ticket port must be an int in [0, 65535], got {self.port!r}")
        if not self.token or ":" in self.token:
            raise ValueError("Ticket token must be a non-empty string without ':'")
        if self.port == 0:
            object.__setattr__(self, "port", free_port(self.addr))

    def encode(self) -> str:
        """The ticket as one string (for an environment variable or a command line)."""
        return f"{self.addr}:{self.port}:{self.token}"

    @classmethod
    def decode(cls, text: str) -> Ticket:
        """Inverse of `encode`."""
        try:
            addr, port, token = text.rsplit(":", 2)
            return cls(addr=addr, port=int(port), token=token)
        except ValueError as e:
            raise ValueError(f"malformed ticket {text!r}: expected ADDR:PORT:TOKEN ({e})") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07"."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if head is None or not head.group(1) and not head.group(2):
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = head.group(1), head.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def slurm_ticket(master_addr: str | None = None, master_port: int | None = None, token: str | None = None,
                 env=None) -> Ticket:
    """The ticket every task of a Slurm job step computes alike, without talking to the others: the
    address is the first node of the step's node list, the port and token are derived from the job
    id unless given (TROUPE_MASTER_ADDR / TROUPE_MASTER_PORT / TROUPE_TOKEN; set the token to a
    secret where other users share the nodes). `env`: where the SLURM_* variables are (os.environ)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "0")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    port = master_port or 20000 + int(hashlib.sha256(job.encode()).hexdigest(), 16) % 20000
    token = token or hashlib.sha256(f"troupe-slurm:{job}".encode()).hexdigest()[:32]
    return Ticket(addr=master_addr or first_host(nodes), port=port, token=token)
