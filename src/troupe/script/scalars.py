"""`troupe.log`: the user's own scalars (epoch loss, accuracy, learning rate) beside troupe's step stats.

They go where the World's recorder writes: TensorBoard (``--tensorboard DIR`` /
``TROUPE_TENSORBOARD``: DIR/rank<R>, tags as named) and the stats file (``--stats`` /
``TROUPE_STATS``: one ``{"rank", "step", "log": {...}}`` line per call). With neither
configured, or before `troupe.init()`, the values are checked and dropped: the same
script runs with and without recording.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from troupe.runtime import world as world_mod


def log(values: Mapping[str, Any], step: int, *, all_ranks: bool = False) -> None:
    """Record scalars at `step`; by default only the data-parallel rank 0 records (its values
    are usually already reduced), with ``all_ranks=True`` every rank into its own run directory.

    >>> troupe.log({"eval/accuracy": acc, "train/epoch_loss": loss}, step=epoch)

    Values are numbers or one-element tensors (read with ``.item()`` only where recorded).
    Never communicates, so any subset of ranks may call it.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"troupe.log takes a dict of name -> number, got {type(values).__name__}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"troupe.log: step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"troupe.log: step must be >= 0, got {step}")
    for name, value in values.items():
        _check(name, value)
    world = world_mod.current()
    if world is None or world.recorder is None or not values:
        return
    if not all_ranks and world.comm.rank != 0:
        return
    world.recorder.log(int(step), {name: float(value) for name, value in values.items()})


def _check(name: Any, value: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"troupe.log: scalar names must be non-empty strings, got {name!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"troupe.log: {name!r} is a tensor of shape {tuple(value.shape)}; "
                             "give a number or a one-element tensor (e.g. loss.mean())")
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"troupe.log: {name!r} is a {value.dtype} tensor, not a real number")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"troupe.log: {name!r} must be a real number or a one-element tensor, "
                        f"got {type(value).__name__} {value!r}")
