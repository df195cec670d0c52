"""Step agreement: every rank checks that the others are taking the same kind of step.

Ranks that disagree (one calls ``update(loss, "fp16")`` while another calls ``"plain"``;
different parameters frozen) would otherwise issue collectives of different sizes, which
Gloo answers by aborting the process with a C++ trace. Two ways, chosen per step by the
GradReducer:

* in the flags (`flag_digest`): when the step's bucket collectives have the same shape on
  every rank whatever the step is (the plain mean all-reduce of a DistOpt whose strategy
  is fixed: the PyTorch loop), two digests of the step ride in every bucket's flags and are
  summed with them; no extra message.
* an exchange (`Agreement`): when the kind of step is chosen per call (SINGA's
  ``update(loss, option)`` and ``backward_and_*`` methods) or the hook cannot carry the
  digest exactly (compressed payloads), one tiny all-reduce of a fixed shape (max of
  ``[d, -d, bad]``, 12 bytes) goes first, started before backward and checked before the
  first bucket leaves; it also tells whether any rank saw a non-finite gradient, for
  strategies whose gradients stay local.

A step chosen per call rides in the flags too once the ranks have agreed on one whose hook
carries the digest: from then on every such step's first collective is bucket 0's all-reduce
with the digest in its flags, whatever each rank chose (the GradReducer's `_lead`). A rank
whose step has other collectives sends bucket 0's shape empty first (`FlagHeader`): if all
ranks changed kind alike they agree and go on, else every rank sees the digests differ.

Either way every rank reaches the same verdict, and on a mismatch every rank gathers the
descriptions and raises the same readable `StepMismatchError`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from troupe.runtime.comm import Communicator, Handle
from troupe.sync.bucket import DIGEST_SLOTS


PAYLOAD_BYTES = 12
"""Bytes of one agreement (three int32): what every step adds to a rank's collectives."""


class StepMismatchError(RuntimeError):
    """Ranks disagreed about what this step is."""


def flag_digest(description: str, world_size: int) -> tuple[int, int]:
    """Two independent digests small enough that their sum over `world_size` ranks is exact in
    float32 (2**24): they ride in every bucket's flags when the step's collectives have the same
    shape on every rank whatever they describe (the plain mean all-reduce of a fixed strategy).
    Every rank compares the sums with its own digest times the world size; ranks that differ
    fail that test on every rank except with probability about 2**-40."""
    bound = max(2, 2**24 // world_size)
    raw = description.encode()
    return zlib.crc32(raw) % bound, zlib.adler32(raw) % bound


def digests_agree(sums: Sequence[int], digest: Sequence[int], world_size: int) -> bool:
    """Are the digest slots, summed over the ranks, `world_size` times this rank's `digest`?"""
    return all(s == world_size * d for s, d in zip(sums, digest))


def raise_mismatch(comm: Communicator, description: str) -> None:
    """Every rank calls this on the same verdict: gather the descriptions, raise one readable error."""
    everyone = comm.all_gather_object(description)
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(everyone):
        groups.setdefault(text, []).append(rank)
    detail = "; ".join(f"ranks {ranks}: {text}" for text, ranks in groups.items())
    raise StepMismatchError(
        f"rank {comm.rank}: ranks disagree about this step ({detail}); every rank must take "
        "the same dist_option with the same parameters trainable"
    )


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
            raise_mismatch(self.comm, self.description)
        return bool(bad)


@dataclass
class FlagHeader:
    """Bucket 0's collective without gradients, this step's digest in its flags: what a rank sends
    first where the others may be sending bucket 0 itself (a step chosen per call after one whose
    hook carries the digest). `check()` waits and raises on disagreement."""

    comm: Communicator
    description: str
    buffer: torch.Tensor
    handle: Handle
    digest: tuple[int, int]

    @classmethod
    def start(cls, comm: Communicator, like: torch.Tensor, description: str, before: str = "") -> FlagHeader:
        """Start it, shaped as `like` (bucket 0's buffer: gradients, then flags ending in the digest)."""
        digest = flag_digest(description, comm.world_size)
        buffer = torch.zeros_like(like)
        buffer[-DIGEST_SLOTS:] = torch.tensor(digest, dtype=like.dtype)
        handle = comm.all_reduce(buffer, "sum", async_op=True)
        handle.label = f"{before}: the step's agreement" if before else "the step's agreement"
        return cls(comm, description, buffer, handle, digest)

    def check(self) -> None:
        """Wait; raise StepMismatchError when the sums of the digest slots are not the world's times this one."""
        self.handle.wait()
        sums = [int(v) for v in self.buffer[-DIGEST_SLOTS:].tolist()]
        if not digests_agree(sums, self.digest, self.comm.world_size):
            raise_mismatch(self.comm, self.description)
