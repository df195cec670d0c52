"""Metrics across ranks (the reference's reduce_variable), accuracy, and rank-0 progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

from troupe.runtime import world

T = TypeVar("T")


def reduce_variable(value: float | int | Tensor, op: str = "sum") -> float:
    """`value` combined across every rank ("sum", "mean", "max" or "min"); the same result on all ranks."""
    t = torch.as_tensor(value, dtype=torch.float64).reshape(1).clone()
    world.init().comm.all_reduce(t, op)  # type: ignore[arg-type]
    return float(t.item())


def accuracy(out: Tensor, y: Tensor) -> int:
    """Number of rows of `out` whose argmax equals the label (labels may be one-hot)."""
    if y.dim() == 2:
        y = y.argmax(dim=1)
    return int((out.argmax(dim=1) == y).sum().item())


def is_main() -> bool:
    """True on global rank 0 (the rank that prints)."""
    return world.init().comm.rank == 0


def progress(items: Iterable[T], total: int | None = None, desc: str = "", enabled: bool | None = None) -> Iterator[T]:
    """A tqdm progress bar on rank 0 (and only when stderr is a terminal or forced); plain iteration elsewhere."""
    if enabled is None:
        enabled = is_main()
    if not enabled:
        yield from items
        return
    from tqdm import tqdm  # imported here to keep `import troupe` light

    yield from tqdm(items, total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class Throughput:
    """Samples per second over a span, summed across ranks when read."""

    def __init__(self) -> None:
        self.samples = 0
        self.start = time.perf_counter()

    def add(self, n: int) -> None:
        self.samples += n

    def rate(self) -> float:
        """Samples per second of the whole job (every rank's samples, over this rank's elapsed time)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return reduce_variable(self.samples) / elapsed
