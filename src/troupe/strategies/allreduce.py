"""Synchronous strategies: every rank applies the same update from the mean gradient.

`AllReduce` is the plain mean all-reduce (SINGA's backward_and_update) and, given a
compressor, each communication-saving option whose gradients are reduced bucket by
bucket during backward (fp16/bf16, top-K, threshold). The reduction itself happens in
the GradReducer's hooks while ``loss.backward()`` runs; `synchronize()` only has work to
do when gradients reached ``p.grad`` without an armed backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from troupe.compress import Compressor, residual_norm
from troupe.runtime.comm import Communicator
from troupe.strategies.base import BaseStrategy, StepStats, reduced_buckets_finite
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import Capabilities, Context, register
from troupe.sync.agree import PAYLOAD_BYTES as AGREEMENT_BYTES
from troupe.sync.hooks import ReduceHook
from troupe.sync.hooks.allreduce import MeanAllReduce
from troupe.sync.hooks.compressed import CompressedReduce
from troupe.sync.reducer import GradReducer


class AllReduce(BaseStrategy):
    """Mean all-reduce of the gradients, then the wrapped optimizer's step on every rank.

    With a `compressor` (or a `compressed_hook` that compresses in its own way, as PowerSGD's),
    buckets travel compressed (after `warmup_steps` dense steps); `residuals` is the error-feedback memory the compressor writes into (for stats and
    checkpoints).
    """

    def __init__(self, *, name: str, comm: Communicator, reducer: GradReducer | None,
                 optimizer: torch.optim.Optimizer, params: Sequence[Tensor],
                 compressor: Compressor | None = None, min_compress_size: int = 0, warmup_steps: int = 0,
                 residuals: dict[str, Tensor] | None = None, step_count: Callable[[], int] = lambda: 0,
                 signature: str | None = None, compressed_hook: ReduceHook | None = None):
        self.name = name
        self.comm, self.reducer, self.optimizer = comm, reducer, optimizer
        self.params = list(params)
        self.dense: ReduceHook = MeanAllReduce(comm)
        self.compressed = compressed_hook
        if compressor is not None:
            self.compressed = CompressedReduce(comm, compressor, min_compress_size)
        self.warmup_steps = warmup_steps
        self.residuals = residuals if residuals is not None else {}
        self.step_count = step_count
        self._signature = signature or name
        self._bytes_mark = comm.bytes_sent()

    def _compressing(self) -> bool:
        return self.compressed is not None and self.comm.world_size > 1 and self.step_count() >= self.warmup_steps

    def describe(self) -> str:
        return self._signature

    def reduce_hook(self) -> ReduceHook | None:
        return self.compressed if self._compressing() else self.dense

    def synchronize(self) -> None:
        if self.reducer is not None:
            self.reducer.reduce_now(self.reduce_hook())

    def all_finite(self) -> bool:
        return reduced_buckets_finite(self.reducer, self.params)

    def step(self) -> StepStats:
        self.optimizer.step()
        return self.stats()

    def stats(self) -> StepStats:
        """Bytes sent since the last step; for the compressed options also the ratio to a dense step."""
        now = self.comm.bytes_sent()
        sent, self._bytes_mark = now - self._bytes_mark, now
        if self.compressed is None:
            return {}
        dense = dense_bytes(self.reducer, self.comm.world_size)
        return {
            "option": self.name,
            "compressed": self._compressing(),
            "bytes_sent": sent,
            "dense_bytes": dense,
            "ratio": sent / dense if dense else 1.0,
            "residual_norm": residual_norm(self.residuals),
        }

    def per_rank_state(self) -> list[str]:
        if self.compressed is not None and self.residuals:
            return ["top-K/threshold error-feedback residuals (what each rank has not sent yet)"]
        return []


@register
class Plain(DistOption):
    """SINGA's backward_and_update: the mean all-reduce of fp32 gradients."""

    name, aliases, method = "plain", ("fp32",), "backward_and_update"
    supports = Capabilities(graph_mode=True, elastic=True)

    @classmethod
    def build(cls, ctx: Context) -> AllReduce:
        return AllReduce(name="plain", comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer,
                         params=ctx.params)


def compressed(name: str, ctx: Context, compressor: Compressor, signature: str) -> AllReduce:
    """An AllReduce whose buckets travel through `compressor` (after the configured warm-up)."""
    return AllReduce(name=name, comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer, params=ctx.params,
                     compressor=compressor, min_compress_size=ctx.config.min_compress_size,
                     warmup_steps=ctx.config.warmup_steps, residuals=ctx.residuals, step_count=ctx.step_count,
                     signature=signature)


def dense_bytes(reducer: GradReducer | None, world_size: int) -> int:
    """Wire bytes of one plain fp32 step (the step's agreement, every bucket all-reduced)."""
    if reducer is None:
        return 0
    payload = AGREEMENT_BYTES + sum(b.buffer.numel() * b.buffer.element_size() for b in reducer.buckets)
    return int(2 * (world_size - 1) / world_size * payload)
