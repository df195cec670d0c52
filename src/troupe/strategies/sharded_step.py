"""The step of sharded optimizer state and gradients (ZeRO-1 / ZeRO-2), by elements, inside DistOpt's buckets.

``DistOpt(opt, shard="optimizer")`` (or ``troupe run --shard optimizer``) keeps the model as it
is and cuts the work of the update over the k ranks: every gradient bucket's elements are
padded to k equal chunks and rank r owns chunk r of every bucket. During backward each bucket
is reduce-scattered (`troupe.sync.hooks.shard`), so rank r receives the mean gradient of its
chunk only; the wrapped optimizer steps only the parts of parameters in rank r's chunks (its
state is made for those parts alone: 1/k of it); then each bucket's updated chunks are
all-gathered back into the parameters. ``shard="gradients"`` also frees the full gradient
buckets once they are reduced, keeping only the rank's chunk of the mean.

Across worker groups (``DistOpt(opt, shard=..., groups=G)``, or ``troupe run --nworker-groups G``):
the k = world size / G ranks of each group shard the state among themselves and the groups replicate
(HSDP). Each bucket is reduced inside the group, then each rank all-reduces its own chunk with the
ranks at its place in the other groups (1/k of the gradients crosses groups); the all-gather stays
inside the group.

Bytes per parameter, fp32 Adam (docs/sharding.md measures them): plain 16; ``"optimizer"``
8 + 8/k; ``"gradients"`` 4 + 12/k. Chunks are cut by elements, not whole tensors, so every
rank holds its 1/k within one bucket's padding (k - 1 elements a bucket) whatever the sizes
of the parameters (torch's ``ZeroRedundancyOptimizer`` assigns whole tensors).

How it fits: the model's parameters become views of one flat buffer per bucket, laid out as
the bucket's gradients are, so the all-gather lands in them in place; the wrapped optimizer's
param groups are rewritten to hold this rank's parts (flat views of the same buffers, in the
same groups, so LR schedulers and per-group options keep working); ``p.grad`` of a model
parameter is None after the reduction (the mean lives in its parts' ``grad``), so clip with
`troupe.clip_grad_norm_`, which sums the parts over the ranks (each part counted once: its G copies
each add 1/G, `SHARD_COPIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.reliability.nonfinite import all_finite
from troupe.reliability.pieces import ElementParts
from troupe.runtime.comm import Communicator, Handle
from troupe.strategies.base import BaseStrategy, StepStats
from troupe.sync.bucket import Bucket
from troupe.sync.hooks.shard import ShardReduce
from troupe.sync.reducer import GradReducer
from troupe.util import SHARD_COPIES, SHARD_OF


SHARD_MODES = ("optimizer", "gradients")
"""``DistOpt(shard=...)``: what is cut over the ranks besides the optimizer's work."""


def chunk_range(numel: int, rank: int, k: int) -> tuple[int, int, int]:
    """(chunk length, start, stop) of rank's chunk of a bucket of `numel` elements padded to k chunks;
    [start, stop) is clipped to the real elements (the last chunks may hold padding only)."""
    chunk = -(-numel // k)
    return chunk, min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def own_parts(numels: Sequence[int], rank: int, k: int) -> list[tuple[int, int, int]]:
    """The parts of a bucket's tensors (slot, start, stop) inside rank's chunk, in slot order; a tensor
    has at most one part per rank (a chunk is one contiguous range of the bucket)."""
    _, lo, hi = chunk_range(sum(numels), rank, k)
    parts, offset = [], 0
    for slot, n in enumerate(numels):
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            parts.append((slot, start - offset, stop - offset))
        offset += n
    return parts


class ShardedStep(BaseStrategy):
    """The update of a sharded DistOpt: reduce-scatter in backward, step the own parts, all-gather.

    `comm` is the job (the finiteness verdict), `group` the ranks that share the state (the job itself
    without worker groups), `across` the ranks at this rank's place in the other groups (None: none)."""

    def __init__(self, *, mode: str, comm: Communicator, reducer: GradReducer, optimizer: torch.optim.Optimizer,
                 group: Communicator | None = None, across: Communicator | None = None,
                 ring: Communicator | None = None, cut: tuple[int, int] | None = None,
                 gather_in: Communicator | None = None):
        self.name, self.mode = f"plain, shard={mode}", mode
        self.comm, self.reducer, self.optimizer = comm, reducer, optimizer
        self.group = comm if group is None else group
        self.across = across
        self.k, self.rank = (self.group.world_size, self.group.rank) if cut is None else cut
        """The group's size and this rank's place in it (`cut`: given apart from `group` in an elastic job, whose
        group communicator has one member until the group joins a quorum)."""
        self.gather_in = self.group if gather_in is None else gather_in
        self.partner_lost: Callable[[BaseException], None] | None = None
        """An elastic job's: a process of this group lost in the gather after a committed step (never returns)."""
        """Where the updated chunks are all-gathered (an elastic job: the group, without giving up when another
        group is lost, which would cost this group its partner's chunks after a committed step)."""
        self.values: list[Tensor] = []
        """Per bucket, the flat buffer its parameters are views of (the bucket's layout, padded)."""
        self.grads: list[Tensor] = []
        """Per bucket, this rank's chunk of the mean gradient (a view of the bucket itself under "optimizer")."""
        self.part_of: dict[int, Tensor] = {}
        """Model parameter id -> this rank's part of it (a leaf view of `values`)."""
        self._at: dict[int, int] = {}
        """Model parameter id -> where its part starts in this rank's chunk of its bucket."""
        self.parts = ElementParts([list(g["params"]) for g in optimizer.param_groups], {})
        """The optimizer's groups as given, and each part's parameter and first element (for checkpoints)."""
        for b in reducer.buckets:
            self._lay_out(b)
        self.count_copies()
        self.hook = ShardReduce(self.group, lambda b: self.grads[b.index], across, ring=ring)
        reducer.also_reduce = self._hand_over
        if mode == "gradients":  # the full buckets exist only while a step reduces them
            reducer.release_storage()
        self._regroup()
        self._comms = list({id(c): c for c in (comm, self.group, across, ring) if c is not None}.values())
        self._bytes_mark = self._bytes_sent()
        self._finite = True

    def _lay_out(self, bucket: Bucket) -> None:
        chunk, lo, _ = chunk_range(bucket.numel, self.rank, self.k)
        values = torch.zeros(bucket.padded, dtype=bucket.key[0], device=bucket.key[1])
        for p, offset, n in zip(bucket.params, bucket.offsets, bucket.numels):
            with torch.no_grad():
                values[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = values[offset : offset + n].view_as(p)
            setattr(p, SHARD_OF, None)
        self.values.append(values)
        if self.mode == "optimizer":
            self.grads.append(bucket.padded_data[self.rank * chunk : (self.rank + 1) * chunk])
        else:
            self.grads.append(torch.zeros(chunk, dtype=bucket.key[0], device=bucket.key[1]))
        for slot, start, stop in own_parts(bucket.numels, self.rank, self.k):
            p, at = bucket.params[slot], bucket.offsets[slot]
            part = torch.nn.Parameter(values[at + start : at + stop], requires_grad=True)
            self.part_of[id(p)], self._at[id(p)] = part, at + start - self.rank * chunk
            self.parts.start[id(part)] = (p, start)
            setattr(p, SHARD_OF, part)

    @property
    def copies(self) -> int:
        """Ranks holding the same part: one per worker group (present, in an elastic job)."""
        return 1 if self.across is None else self.across.world_size

    def count_copies(self) -> None:
        """Mark each part with its copies (`troupe.clip_grad_norm_` counts each part once over the job); again
        when an elastic job's quorum changes."""
        for part in self.part_of.values():
            setattr(part, SHARD_COPIES, self.copies)

    def _regroup(self) -> None:
        """The wrapped optimizer's groups hold this rank's parts in place of the sharded parameters."""
        sharded = {id(p) for b in self.reducer.buckets for p in b.params}
        for group in self.optimizer.param_groups:
            group["params"] = [self.part_of[id(p)] if id(p) in sharded else p
                               for p in group["params"] if id(p) in self.part_of or id(p) not in sharded]

    def _hand_over(self) -> None:
        """After the reduction: each part's grad views this rank's chunk of the mean (None where no rank had
        a gradient, as in one process); the model's ``p.grad`` is None; "gradients" frees the buckets."""
        for b in self.reducer.buckets:
            for p in b.params:
                part = self.part_of.get(id(p))
                if part is not None:
                    at = self._at[id(p)]
                    part.grad = None if p.grad is None else self.grads[b.index][at : at + part.numel()]
                p.grad = None
        if self.mode == "gradients":
            self.reducer.release_storage()
        self._agree_on_finite()

    def _agree_on_finite(self) -> None:
        """Each rank checks its own chunks; one small all-reduce gives every rank the verdict. Where any
        rank's chunk is not finite, every rank's first part with a gradient is made NaN, so that a check
        of the parts on one rank (torch's GradScaler) skips the step on every rank alike."""
        bad = torch.tensor([0.0 if all_finite(self._own_chunks()) else 1.0])
        self.comm.all_reduce(bad, "sum")
        self._finite = bool(bad.item() == 0)
        if not self._finite:
            first = next((part for part in self.part_of.values() if part.grad is not None), None)
            if first is not None and first.numel():
                first.grad.view(-1)[0] = float("nan")

    def _own_chunks(self) -> list[Tensor]:
        """This rank's chunks of the mean gradients."""
        return [g for g in self.grads if g.numel()]

    # --- UpdateStrategy -----------------------------------------------------------------------

    def describe(self) -> str:
        return f"plain, shard={self.mode}"

    def reduce_hook(self) -> ShardReduce:
        return self.hook

    def synchronize(self) -> None:
        self.reducer.reduce_now(self.hook)

    def all_finite(self) -> bool:
        """The verdict the ranks agreed on when the reduction ended."""
        return self._finite

    def step(self) -> StepStats:
        self.optimizer.step()
        try:
            self.gather()
        except RuntimeError as e:
            if self.partner_lost is None:
                raise
            self.partner_lost(e)  # the step was committed everywhere; this group restarts and heals
        now = self._bytes_sent()
        sent, self._bytes_mark = now - self._bytes_mark, now
        return {"option": f"shard={self.mode}", "bytes_sent": sent}

    def _bytes_sent(self) -> int:
        return sum(c.bytes_sent() for c in self._comms)

    def gather(self) -> None:
        """Every bucket's updated chunks back into every rank's parameters (one all-gather per bucket, inside
        the group: every group stepped the same chunks alike)."""
        handles: list[Handle] = []
        for values in self.values:
            chunk = values.numel() // self.k
            mine = values[self.rank * chunk : (self.rank + 1) * chunk].clone()
            handles.append(self.gather_in.all_gather_into(values, mine, async_op=True))
        for h in handles:
            h.wait()

    def per_rank_state(self) -> list[str]:
        """None: a checkpoint saves each part's state as its slice of the whole parameter's, so it reshards
        (across worker groups, where G ranks hold each part, that is not tested yet: kept per rank)."""
        if self.across is None:
            return []
        return [f"the optimizer state is sharded by elements over the {self.k} ranks of each worker group "
                f"(shard={self.mode!r}); resharding such a checkpoint is not supported yet"]


def _ring_group(world, groups: int) -> Communicator:
    """Gloo: this rank's worker group again, as a process group of its own that carries only the ring
    reduce-scatter (its thread sends while backward goes on; `Communicator.ring_reduce_scatter`). Every
    rank makes every group's, in order (torch.distributed's rule), once per job."""
    n = world.comm.world_size
    k = n // groups
    made = []
    for g in range(groups):
        name = f"ring/{g}x{k}"
        made.append(world.groups[name] if name in world.groups else world.group(name, range(g * k, (g + 1) * k)))
    return made[world.comm.rank // k]
