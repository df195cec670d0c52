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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from troupe.reliability.nonfinite import all_finite
from troupe.runtime.comm import Communicator
from troupe.strategies.allreduce import dense_bytes
from troupe.strategies.base import BaseStrategy, StepUndo
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import Capabilities, Context, register
from troupe.sync.agree import Agreement
from troupe.sync.hooks import ReduceHook
from troupe.sync.hooks.allreduce import MeanAllReduce
from troupe.sync.reducer import GradReducer
from troupe.util import check_int


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
    check_int("chunk_size", chunk_size)
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


class PartialUpdate(BaseStrategy):
    """SINGA's partial update as a strategy: backward stays local, `step()` steps the wrapped
    optimizer on this rank's own gradient, then averages one chunk of the parameters.

    The first `warmup_steps` steps (and one process) are plain mean all-reduce steps. Ranks
    check that they agree (and whether any gradient is non-finite, for nan_policy) in one
    tiny collective in `synchronize()`, since their gradients are not reduced.

    Under ``troupe run --elastic`` (`elastic`) the local step and the chunk's averaging, the step's
    collective, run before the members' vote (`ahead_of_vote`): a member lost in it fails the vote,
    not the job, and a step the vote leaves out is undone (`left_out`: the parameters, the optimizer's
    state and the chunk counter as they were; a copy of each every step). A restarted group copies a
    live one's parameters, optimizer state and chunk counter.
    """

    name = "partialUpdate"

    def __init__(self, *, comm: Communicator, reducer: GradReducer | None, optimizer: torch.optim.Optimizer,
                 params: Sequence[Tensor], chunk_size: int, full_sync_every: int = 0, warmup_steps: int = 0,
                 step_count: Callable[[], int] = lambda: 0, elastic: bool = False):
        self.comm, self.reducer, self.optimizer = comm, reducer, optimizer
        self.params = list(params)
        self.dense = MeanAllReduce(comm)
        self.full_sync_every, self.warmup_steps = full_sync_every, warmup_steps
        self.step_count = step_count
        # chunk_size 0: no rotation, so one chunk of everything serves the full synchronisation.
        size = chunk_size or max(1, sum(p.numel() for p in self.params))
        # (an elastic job's communicator holds the groups present: a restarted group builds before it joins)
        self.averager = PartialAverager(self.params, comm, size) if comm.world_size > 1 or elastic else None
        self.chunk_size = chunk_size
        self.elastic = elastic
        self._bad = False
        self._bytes_mark = comm.bytes_sent()
        self._taken: dict[str, Any] | None = None
        """Under --elastic: the stats of this step, taken ahead of the vote."""
        self._saved: tuple[StepUndo, int] | None = None

    def _local(self) -> bool:
        return self.averager is not None and self.step_count() >= self.warmup_steps

    def describe(self) -> str:
        return f"partialUpdate(chunk_size={self.chunk_size}, full_sync_every={self.full_sync_every})"

    def reduce_hook(self) -> ReduceHook | None:
        return None if self._local() else self.dense

    def synchronize(self) -> None:
        if not self._local():
            if self.reducer is not None:
                self.reducer.reduce_now(self.dense)
            return
        trainable = "".join("1" if p.requires_grad else "0" for p in self.params)
        bad = not all_finite([p.grad for p in self.params if p.grad is not None])
        self._bad = Agreement.start(self.comm, f"{self.describe()}, trainable {trainable}", bad).check()

    def all_finite(self) -> bool:
        if self._local():
            return not self._bad
        return all_finite([b.data for b in self.reducer.buckets] if self.reducer else
                          [p.grad for p in self.params if p.grad is not None])

    def ahead_of_vote(self) -> None:
        """Under --elastic, a local step (not a warm-up's, nor a non-finite one): keep the parameters, the
        optimizer's state and the counter, then step and average the chunk before the vote."""
        if not self.elastic or not self._local() or self._bad:
            return
        self._saved = StepUndo(self.params, self.optimizer), self.averager.counter
        self._taken = self._step()

    def left_out(self) -> None:
        """The vote left this step out: undo what `ahead_of_vote` took."""
        if self._saved is not None:
            undo, self.averager.counter = self._saved
            undo.undo()
        self._taken = self._saved = None

    def step(self) -> dict[str, Any]:
        if self._taken is not None:
            stats, self._taken, self._saved = self._taken, None, None
            return stats
        return self._step()

    def _step(self) -> dict[str, Any]:
        local = self._local()
        self.optimizer.step()
        chunk = None
        if local:
            every = self.full_sync_every
            if every and (self.step_count() + 1) % every == 0:
                self.averager.average_all()
            elif self.chunk_size:
                chunk = self.averager.average_next()
        now = self.comm.bytes_sent()
        sent, self._bytes_mark = now - self._bytes_mark, now
        dense = dense_bytes(self.reducer, self.comm.world_size)
        stats = {"option": self.name, "compressed": local, "bytes_sent": sent, "dense_bytes": dense,
                 "ratio": sent / dense if dense else 1.0, "residual_norm": 0.0}
        if chunk is not None:
            stats["chunk"] = chunk
        return stats

    def per_rank_state(self) -> list[str]:
        return ["partial update (each rank's parameters and momentum differ)"]

    def state_dict(self) -> dict[str, Any]:
        return {"partial_counter": self.averager.counter if self.averager else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.averager is not None:
            self.averager.counter = int(state.get("partial_counter", 0))


@register
class Partial(DistOption):
    """SINGA's backward_and_partial_update (chunk size, full syncs and warm-up from `CompressionConfig`)."""

    name, method = "partialUpdate", "backward_and_partial_update"
    supports = Capabilities(partition=False, elastic=True)

    @classmethod
    def build(cls, ctx: Context) -> PartialUpdate:
        c = ctx.config
        return PartialUpdate(comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer, params=ctx.params,
                             chunk_size=c.chunk_size, full_sync_every=c.full_sync_every,
                             warmup_steps=c.warmup_steps, step_count=ctx.step_count, elastic=ctx.elastic)
