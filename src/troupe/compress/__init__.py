"""Gradient compressors for the communication-saving dist_options, and a registry by name.

>>> from troupe.compress import make_compressor, ErrorFeedback
>>> c = ErrorFeedback(make_compressor("topk", spars=0.01))
>>> payload, ctx = c.compress(grad, "bucket0")
>>> approx = c.decompress(payload, ctx)
"""

from __future__ import annotations

from typing import Any

from troupe.compress.base import Compressor, NoCompression
from troupe.compress.feedback import ErrorFeedback, residual_norm
from troupe.compress.fp16 import HalfCompressor
from troupe.compress.threshold import ThresholdCompressor
from troupe.compress.topk import TopKCompressor, topk_count

COMPRESSORS: dict[str, Any] = {
    "none": NoCompression,
    "fp16": lambda **kw: HalfCompressor("fp16", **kw),
    "bf16": lambda **kw: HalfCompressor("bf16", **kw),
    "topk": TopKCompressor,
    "threshold": ThresholdCompressor,
}
"""Compressor names and their constructors (keyword arguments pass through)."""


def make_compressor(name: str, **kwargs: Any) -> Compressor:
    """The compressor registered as `name`, built with `kwargs`."""
    try:
        factory = COMPRESSORS[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}") from None
    return factory(**kwargs)


__all__ = [
    "COMPRESSORS",
    "Compressor",
    "ErrorFeedback",
    "HalfCompressor",
    "NoCompression",
    "ThresholdCompressor",
    "TopKCompressor",
    "make_compressor",
    "residual_norm",
    "topk_count",
]
