"""The communication-saving dist_options' configuration (`CompressionConfig`).

`troupe.strategies.registry` reads it when it builds a strategy: `AllReduce` given a compressor
(warm-up, small parameters sent dense) or `PartialUpdate` (chunks). The hook that compresses each
bucket on the wire is `troupe.sync.hooks.compressed.CompressedReduce`.
"""

from __future__ import annotations

from dataclasses import dataclass

from troupe.util import check_int

DEFAULT_CHUNK_SIZE = 2**17
"""Elements averaged per partial-update step (the MNIST CNN's 431k parameters make 4 chunks)."""


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """How the communication-saving dist_options behave (given to `DistOpt(compression=...)`)."""

    warmup_steps: int = 0
    """The first steps (by `DistOpt.step_count`) use the plain dense all-reduce."""
    min_compress_size: int = 0
    """Parameters with fewer elements are reduced dense in fp32 (biases, norms)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Partial update: parameter elements averaged per step; 0 averages no chunks (pure local SGD)."""
    full_sync_every: int = 0
    """Partial update: every this many steps average all parameters instead of one chunk; 0 never."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "min_compress_size", "chunk_size", "full_sync_every"):
            check_int(name, getattr(self, name), minimum=0)
