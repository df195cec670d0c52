"""Small helpers every layer uses, written once: argument checks and flat-buffer packing.

A leaf module: it imports nothing from troupe, and torch only when packing (the command
line's argument checks use it without paying for torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


class Refusal(ValueError):
    """A combination troupe refuses by design, named with what to do instead: said in one line, not a traceback."""


class LostLauncher(ConnectionError):
    """The launcher that holds the job's store (node 0's `troupe run`) is gone: a rank cannot go on, and its
    traceback says nothing more than this one line does (its launcher, or the other node's, says the rest)."""


class _OneLineRefusals:
    """sys.excepthook: an uncaught `Refusal` or `LostLauncher` is printed as ``troupe: MESSAGE`` (the interpreter
    then exits 1); anything else goes to the hook that was there before."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, kind, value, tb) -> None:
        if isinstance(value, (Refusal, LostLauncher)):
            import sys

            print(f"troupe: {value}", file=sys.stderr, flush=True)
        else:
            self.previous(kind, value, tb)


def one_line_refusals() -> None:
    """Make an uncaught `Refusal` one line on stderr, whatever the launcher (idempotent)."""
    import sys

    if not isinstance(sys.excepthook, _OneLineRefusals):
        sys.excepthook = _OneLineRefusals(sys.excepthook)


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` (bools refused), else a ValueError naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors back to back in one new flat tensor (all of one dtype and device)."""
    import torch

    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack_into(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of `flat` back into `tensors` (the inverse of `pack`)."""
    import torch

    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


HOLDERS = "_troupe_holders"
"""The attribute `troupe.partition` sets on every parameter: the sorted global ranks holding the
same tensor (every data-parallel rank for a replicated layer, fewer for a partitioned one).
Here, in the leaf module, so the layers that send parameters (strategies, cluster) can read
it without importing the partitioner."""


REPLACED = "_troupe_replaced"
"""The attribute `troupe.partition` sets on the parameters of a layer it replaced by a partitioned one: the
layer's name. An optimizer made before the partition holds these (no longer the model's), and `DistOpt` refuses it."""


SHARD_OF = "_troupe_part"
"""The attribute ``DistOpt(shard=...)`` sets on every parameter it shards: this rank's part of it (a flat
tensor whose ``grad`` is the mean gradient of that part), or None where this rank owns no part of it
(`troupe.clip_grad_norm_` sums the parts over the ranks)."""
CLIP_REFUSED = "_troupe_clip_refused"
"""The attribute DistOpt sets on its parameters where clipping their gradient cannot mean what the loop means (the
strategy's ``clip_refusal()``): why, in one line (`troupe.partition.torch_clip`)."""
CLIP_CLUSTER = "_troupe_clip_cluster"
"""The attribute DistOpt sets on its parameters under a cluster (``--framework``): there torch's clip_grad_norm_ stays
torch's on a partitioned model, as docs/partition.md says (each worker's own gradient, Hogwild's groups independent)."""
SHARD_COPIES = "_troupe_part_copies"
"""The attribute a sharded DistOpt sets on each part (`SHARD_OF`): how many ranks hold the same part (one
in each worker group; 1 without groups), so that summed over the job each part counts once."""


def holders_of(param: Tensor) -> tuple[int, ...] | None:
    """The ranks holding `param` (None: not labelled, i.e. every rank holds it)."""
    return getattr(param, HOLDERS, None)
