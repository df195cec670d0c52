"""SINGA's backward_and_sparse_update: part of each bucket's gradient as (index, value) pairs.

`topK=True` sends the ceil(spars * n) largest magnitudes (spars in (0, 1]), `topK=False`
every element with ``|g| >= spars``; `corr` adds back what earlier steps left out (error
feedback, kept in the DistOpt's shared residuals, so switching options keeps it).
"""

from __future__ import annotations

from troupe.compress import Compressor, ErrorFeedback, ThresholdCompressor, TopKCompressor
from troupe.strategies.allreduce import AllReduce, compressed
from troupe.strategies.choice import DistOption
from troupe.strategies.registry import Capabilities, Context, register


@register
class SparseThreshold(DistOption):
    """Every element at or above the threshold `spars`."""

    name, method, fixed_args = "sparseThreshold", "backward_and_sparse_update", {"topK": False}
    supports = Capabilities(elastic=True)  # the group's size is read at each step; residuals heal with the rest

    @classmethod
    def build(cls, ctx: Context, spars: float = 0.05, topK: bool = False, corr: bool = True) -> AllReduce:
        compressor: Compressor = TopKCompressor(spars) if topK else ThresholdCompressor(spars)
        if corr:
            compressor = ErrorFeedback(compressor, ctx.residuals)
        name = "sparseTopK" if topK else "sparseThreshold"
        return compressed(name, ctx, compressor, f"{name}(spars={spars}, corr={corr})")


@register
class SparseTopK(SparseThreshold):
    """The fraction `spars` of largest magnitudes."""

    name, fixed_args = "sparseTopK", {"topK": True}
