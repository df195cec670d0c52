"""SINGA's dist_option names, and the strategy each one builds.

`build(option, ctx, **args)` makes the strategy for one option; `ctx` carries what every
strategy is given (communicator, reducer, optimizer, parameters, configuration, the
error-feedback memory). The SINGA method each option calls, and the fixed arguments it
passes, stay here too, so `DistOpt.update(loss, option)` and ``DistOpt(opt,
dist_option=...)`` mean the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from troupe.compress import Compressor, ErrorFeedback, HalfCompressor, ThresholdCompressor, TopKCompressor
from troupe.compress.fp16 import half_dtype
from troupe.runtime.comm import Communicator
from troupe.strategies.allreduce import AllReduce
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.compressed import CompressionConfig
from troupe.strategies.partial import PartialUpdate
from troupe.sync.reducer import GradReducer

DIST_OPTIONS = {
    "plain": "backward_and_update",
    "fp32": "backward_and_update",
    "fp16": "backward_and_update_half",
    "bf16": "backward_and_update_half",
    "partialUpdate": "backward_and_partial_update",
    "sparseTopK": "backward_and_sparse_update",
    "sparseThreshold": "backward_and_sparse_update",
}
"""`dist_option` names (SINGA's) and the DistOpt method each one calls."""

DIST_OPTION_ARGS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bf16"},
    "sparseTopK": {"topK": True},
    "sparseThreshold": {"topK": False},
}
"""Fixed keyword arguments a `dist_option` passes to its method."""


@dataclass
class Context:
    """What every strategy of one DistOpt is built from."""

    comm: Communicator
    reducer: GradReducer | None
    optimizer: torch.optim.Optimizer
    params: Sequence[Tensor]
    config: CompressionConfig
    step_count: Callable[[], int]
    name_of: Callable[[Tensor], str]
    residuals: dict[str, Tensor] = field(default_factory=dict)
    """Error-feedback memory, shared by the sparse options (checkpointed by DistOpt)."""


def check_option(option: str) -> str:
    """The method name of a dist_option, or a ValueError listing the valid names."""
    try:
        return DIST_OPTIONS[option]
    except KeyError:
        raise ValueError(f"unknown dist_option {option!r}; choose one of {sorted(DIST_OPTIONS)}") from None


def build(option: str, ctx: Context, **args: Any) -> UpdateStrategy:
    """The strategy for `option` with its method's keyword arguments (``spars=0.01``, ``clipping=True`` ...)."""
    method = check_option(option)
    kwargs = {**DIST_OPTION_ARGS.get(option, {}), **args}
    return _BUILDERS[method](option, ctx, **kwargs)


def _plain(option: str, ctx: Context) -> UpdateStrategy:
    return AllReduce(name="plain", comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer, params=ctx.params)


def _compressed(name: str, ctx: Context, compressor: Compressor, signature: str) -> UpdateStrategy:
    return AllReduce(name=name, comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer, params=ctx.params,
                     compressor=compressor, min_compress_size=ctx.config.min_compress_size,
                     warmup_steps=ctx.config.warmup_steps, residuals=ctx.residuals, step_count=ctx.step_count,
                     signature=signature)


def _half(option: str, ctx: Context, clipping: bool = False, clip_value: float = 100, dtype: str = "fp16"):
    torch_dtype = half_dtype(dtype)
    for p in ctx.params:
        if p.requires_grad and p.dtype != torch.float32:
            raise ValueError(f"half precision needs float32 parameters; {ctx.name_of(p)} is {p.dtype} "
                             f"(shape {tuple(p.shape)})")
    compressor = HalfCompressor(torch_dtype, clip_value if clipping else None, scale=1.0 / ctx.comm.world_size)
    name = "fp16" if torch_dtype == torch.float16 else "bf16"
    return _compressed(name, ctx, compressor, f"{name}(clipping={clipping}, clip_value={clip_value})")


def _sparse(option: str, ctx: Context, spars: float = 0.05, topK: bool = False, corr: bool = True):
    compressor: Compressor = TopKCompressor(spars) if topK else ThresholdCompressor(spars)
    if corr:
        compressor = ErrorFeedback(compressor, ctx.residuals)
    name = "sparseTopK" if topK else "sparseThreshold"
    return _compressed(name, ctx, compressor, f"{name}(spars={spars}, corr={corr})")


def _partial(option: str, ctx: Context) -> UpdateStrategy:
    c = ctx.config
    return PartialUpdate(comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer, params=ctx.params,
                         chunk_size=c.chunk_size, full_sync_every=c.full_sync_every, warmup_steps=c.warmup_steps,
                         step_count=ctx.step_count)


_BUILDERS: dict[str, Callable[..., UpdateStrategy]] = {
    "backward_and_update": _plain,
    "backward_and_update_half": _half,
    "backward_and_sparse_update": _sparse,
    "backward_and_partial_update": _partial,
}
