"""Step agreement: every rank checks, before a step's first gradient collective, that the
others are taking the same kind of step.

Ranks that disagree (one calls ``update(loss, "fp16")`` while another calls ``"plain"``;
different parameters frozen) would otherwise issue collectives of different sizes, which
Gloo answers by aborting the process with a C++ trace. Here each rank puts a 31-bit
digest of its step into one tiny all-reduce of a fixed shape (max of ``[d, -d, bad]``),
so every rank learns in the same collective (12 bytes: three int32) whether all digests were equal (and whether
any rank saw a non-finite gradient, for strategies whose gradients stay local). On a
mismatch every rank gathers the descriptions and raises the same readable error.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from troupe.runtime.comm import Communicator, Handle


PAYLOAD_BYTES = 12
"""Bytes of one agreement (three int32): what every step adds to a rank's collectives."""


class StepMismatchError(RuntimeError):
    """Ranks disagreed about what this step is."""


def digest(description: str) -> int:
    """A stable 31-bit digest (zlib.crc32: the same in every process, unlike ``hash``)."""
    return zlib.crc32(description.encode()) & 0x7FFFFFFF


@dataclass
class Agreement:
    """One step's agreement collective in flight; `check()` waits and raises on disagreement."""

    comm: Communicator
    description: str
    buffer: torch.Tensor
    handle: Handle

    @classmethod
    def start(cls, comm: Communicator, description: str, bad: bool = False, before: str = "") -> Agreement:
        """Start the check; `before` names what it guards (stall and failure reports say it)."""
        d = digest(description)
        buffer = torch.tensor([d, -d, int(bad)], dtype=torch.int32)
        handle = comm.all_reduce(buffer, "max", async_op=True)
        handle.label = f"{before}: the step's agreement" if before else "the step's agreement"
        return cls(comm, description, buffer, handle)

    def check(self) -> bool:
        """Wait; raise StepMismatchError when ranks disagree; return whether any rank flagged `bad`."""
        self.handle.wait()
        high, neg_low, bad = (int(v) for v in self.buffer.tolist())
        if high != -neg_low:
            everyone = self.comm.all_gather_object(self.description)
            groups: dict[str, list[int]] = {}
            for rank, text in enumerate(everyone):
                groups.setdefault(text, []).append(rank)
            detail = "; ".join(f"ranks {ranks}: {text}" for text, ranks in groups.items())
            raise StepMismatchError(
                f"rank {self.comm.rank}: ranks disagree about this step ({detail}); every rank must take "
                "the same dist_option with the same parameters trainable"
            )
        return bool(bad)
