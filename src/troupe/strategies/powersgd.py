"""dist_option "powerSGD": rank-r low-rank gradients (Vogels et al. 2019), torch's ``powerSGD_hook`` as a regime.

SINGA has no PowerSGD; troupe adds it beside SINGA's options:

    >>> sgd = troupe.DistOpt(opt, dist_option="powerSGD", powersgd_rank=2, powersgd_start=100)
    >>> loss.backward(); sgd.step()          # or SINGA's sgd.update(loss, "powerSGD")

Every gradient with two or more dimensions is sent as rank-r factors with a warm-started Q,
orthonormalisation and error feedback; vectors (biases), matrices that would not shrink by
torch's ``min_compression_rate`` (2) and tensors below ``CompressionConfig.min_compress_size``
travel uncompressed. The first `powersgd_start` steps are the plain mean all-reduce (torch's
``start_powerSGD_iter``). Given the same buckets, it computes what torch's hook does under DDP
(tests/dist/test_powersgd.py); the arithmetic is `troupe.compress.powersgd`, the two-round
reduction `troupe.sync.hooks.powersgd`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from troupe.compress.powersgd import BucketLayout, LowRankState, PowerSGDConfig
from troupe.strategies.allreduce import AllReduce
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import Capabilities, Context, register
from troupe.sync.hooks.powersgd import PowerSGDReduce
from troupe.util import check_int

STATE_KEY = "powerSGD"
"""The strategy's entry in `DistOpt.state_dict()["strategies"]` (Q and the seed draws; residuals sit beside)."""


class LowRankAllReduce(AllReduce):
    """`AllReduce` whose compressed steps go through PowerSGD; its Q matrices are checkpointed."""

    def __init__(self, *, lowrank: LowRankState, **kwargs: Any):
        super().__init__(**kwargs)
        self.lowrank = lowrank

    def per_rank_state(self) -> list[str]:
        if self.lowrank.residuals and self.lowrank.config.use_error_feedback:
            return ["PowerSGD error-feedback residuals (what each rank's low-rank approximation missed)"]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: self.lowrank.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lowrank.load_state_dict(state.get(STATE_KEY, {}))


@register
class PowerSGD(DistOption):
    """Rank-r factors of every matrix gradient, the rest whole (torch's ``powerSGD_hook``)."""

    name, method = "powerSGD", "backward_and_powerSGD_update"
    # Elastic: both rounds run before the step's vote and divide by the group's size read at each
    # call; a joiner takes Q and its source's residuals with the rest of the state. A step given up
    # after round one leaves each survivor its own Q, which the next step's shared P makes equal
    # again (Q = the mean of M^T P); the parameters never differ, every rank applies the same mean.
    # Not graph mode: the second round depends on the first, outside the compiled backward.
    supports = Capabilities(graph_mode=False, elastic=True)

    @classmethod
    def build(cls, ctx: Context, powersgd_rank: int = 1, powersgd_start: int | None = None) -> LowRankAllReduce:
        """`powersgd_rank`: columns of the factors (torch's matrix_approximation_rank; a matrix whose smaller
        side is below it is clamped to that side, as torch does, and so travels whole); `powersgd_start`:
        plain steps first (default ``CompressionConfig.warmup_steps``, 0; torch's default is 1000 and
        torch's DDP needs at least 2)."""
        config = PowerSGDConfig(rank=powersgd_rank)
        start = ctx.config.warmup_steps if powersgd_start is None else check_int("powersgd_start", powersgd_start,
                                                                                minimum=0)
        _warn_if_nothing_compresses(ctx, config)
        lowrank = LowRankState(config, residuals=ctx.residuals)
        hook = PowerSGDReduce(ctx.comm, lowrank, ctx.config.min_compress_size)
        return LowRankAllReduce(name="powerSGD", comm=ctx.comm, reducer=ctx.reducer, optimizer=ctx.optimizer,
                                params=ctx.params, compressed_hook=hook, warmup_steps=start,
                                residuals=ctx.residuals, step_count=ctx.step_count, lowrank=lowrank,
                                signature=f"powerSGD(rank={powersgd_rank}, start={start})")


def _warn_if_nothing_compresses(ctx: Context, config: PowerSGDConfig) -> None:
    """Legal but pointless: a rank so high that no matrix gradient would be compressed."""
    shapes = [tuple(p.shape) for p in ctx.params if p.requires_grad and p.dim() >= 2]
    layout = BucketLayout.plan(shapes, config, ctx.config.min_compress_size)
    if shapes and not layout.compressed:
        largest = max(shapes, key=math.prod)
        warnings.warn(f"powerSGD: powersgd_rank={config.rank} compresses no gradient (the largest matrix, shape "
                      f"{largest}, would not shrink by torch's min_compression_rate 2): every gradient travels whole",
                      stacklevel=2)
