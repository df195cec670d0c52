"""The Ticket: what a process needs to join a job (address, port, token), without torch.

Its own module so that `troupe run`, which makes tickets and starts processes, starts
without importing torch; `troupe.runtime.launch` uses it to join.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def reserve_port(addr: str) -> socket.socket:
    """A socket bound to a free port on `addr` and kept open: while it is, no other process's
    bind or outgoing connection takes the port, yet the job's rank 0 (which binds with
    SO_REUSEADDR) can still listen on it. Close it once the job has its rendezvous.

    `free_port` alone leaves a gap between the pick and rank 0's bind, in which a parallel
    test's connection or port pick has taken the port.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 0))
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
