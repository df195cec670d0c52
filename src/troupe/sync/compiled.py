"""A user's own ``torch.compile(model)`` keeps the reduction overlapped with backward.

A compiled model's backward is one autograd node: every gradient appears when it ends,
so the GradReducer's buckets all leave at once and the whole reduction is exposed.
PyTorch solves this for DDP in dynamo ("DDPOptimizer"): while a DDP module runs its
forward, dynamo splits every graph it compiles at parameter-bucket boundaries, so the
backward becomes one node per piece and gradients arrive piece by piece. Dynamo asks
``DistributedDataParallel._get_active_ddp_module()`` whether to split, and reads only
its ``bucket_bytes_cap``.

`SplitCompiledGraphs` answers that question for a DistOpt: while it is installed (from
the DistOpt's construction until it is closed or collected) graphs that dynamo compiles
in this process are split into pieces of about the DistOpt's bucket size. A real DDP
module's forward still takes precedence (it sets and restores the attribute itself),
and ``torch._dynamo.config.optimize_ddp = False`` turns the splitting off as for DDP.
Graph mode (`troupe.graphstep`) reduces inside its own graph and lifts the split while
it compiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class SplitCompiledGraphs:
    """What dynamo's DDPOptimizer reads of a DDP module: the bucket size, in bytes, to split graphs at.

    DDPOptimizer's first piece is DDP's first bucket (1 MiB) and no later piece may be smaller,
    so a cap below 1 MiB is raised to it.
    """

    def __init__(self, bucket_bytes_cap: int):
        import torch.distributed as dist

        if bucket_bytes_cap < 1:
            raise ValueError(f"bucket_bytes_cap must be >= 1 byte, got {bucket_bytes_cap}")
        self.bucket_bytes_cap = max(bucket_bytes_cap, dist._DEFAULT_FIRST_BUCKET_BYTES)
        self.installed = False

    def install(self) -> bool:
        """Split graphs compiled from now on; False (and nothing done) when another one is in place."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        if DDP._active_ddp_module is not None:
            return False
        DDP._active_ddp_module = self  # type: ignore[assignment]
        self.installed = True
        return True

    def remove(self) -> None:
        """Stop splitting (only if this one is still the one in place)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.installed and DDP._active_ddp_module is self:
            DDP._active_ddp_module = None
        self.installed = False


@contextmanager
def unsplit() -> Iterator[None]:
    """Compile without DDPOptimizer's splitting for the duration (graph mode's own graphs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    before, DDP._active_ddp_module = DDP._active_ddp_module, None
    try:
        yield
    finally:
        DDP._active_ddp_module = before
