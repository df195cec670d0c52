"""Partial synchronisation: local updates, then one chunk of the parameters averaged per step.

SINGA's backward_and_partial_update: every rank steps its own optimizer with its own
gradient; then the parameters (not the gradients), taken in backward order, are cut into
chunks of about `chunk_size` elements, and only one chunk per step is averaged across
ranks, rotating, so each parameter is averaged once every K = len(chunks) steps.
Optimizer state (momentum) is never averaged. troupe cuts inside a tensor when a chunk
is full, so the chunks are equal (the last may be shorter) and each step sends about
1/K of a dense all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of one parameter (flattened)."""

    param: int
    start: int
    stop: int


def plan_chunks(params: Sequence[Tensor], chunk_size: int) -> list[list[Piece]]:
    """Cut the parameters, in reverse order, into chunks of `chunk_size` elements.

    Parameters of different dtype or device never share a chunk. The plan depends only
    on shapes and dtypes, so it is the same on every rank.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size!r}")
    groups: dict[str, list[int]] = {}
    for i in reversed(range(len(params))):
        groups.setdefault(f"{params[i].dtype}/{params[i].device}", []).append(i)
    chunks: list[list[Piece]] = []
    for key in sorted(groups):
        current: list[Piece] = []
        room = chunk_size
        for i in groups[key]:
            start, numel = 0, params[i].numel()
            while start < numel:
                take = min(room, numel - start)
                current.append(Piece(i, start, start + take))
                start += take
                room -= take
                if room == 0:
                    chunks.append(current)
                    current, room = [], chunk_size
        if current:
            chunks.append(current)
    return chunks


class PartialAverager:
    """Averages one chunk of the parameters per call, rotating; `counter` says which is next."""

    def __init__(self, params: Sequence[Tensor], comm: Communicator, chunk_size: int):
        self.params = list(params)
        self.comm = comm
        self.chunks = plan_chunks(self.params, chunk_size)
        self.counter = 0
        """Chunk averagings done so far; the next chunk is ``counter % len(chunks)``."""

    @property
    def next_chunk(self) -> int:
        return self.counter % len(self.chunks) if self.chunks else 0

    @torch.no_grad()
    def average_next(self) -> int:
        """Average the next chunk across ranks (all ranks must call); returns its index."""
        if not self.chunks:
            return -1
        index = self.next_chunk
        self._average(self.chunks[index])
        self.counter += 1
        return index

    @torch.no_grad()
    def average_all(self) -> None:
        """Average every parameter (periodic full synchronisation); the rotation is unchanged."""
        for chunk in self.chunks:
            self._average(chunk)

    def _flat(self, piece: Piece) -> Tensor:
        return self.params[piece.param].detach().view(-1)[piece.start : piece.stop]

    def _average(self, chunk: list[Piece]) -> None:
        buffer = torch.cat([self._flat(p) for p in chunk])
        self.comm.all_reduce(buffer, "mean")
        offset = 0
        for p in chunk:
            n = p.stop - p.start
            self._flat(p).copy_(buffer[offset : offset + n])
            offset += n
