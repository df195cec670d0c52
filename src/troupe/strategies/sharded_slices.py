"""A partitioned model under a sharded DistOpt: tensor parallel inside a worker group, ZeRO-1/2 across.

``troupe.partition(model, plan, workers_per_group=k)`` then ``DistOpt(opt, shard="optimizer"|"gradients")``
is the 2-D layout of tensor parallel + sharded data parallel (torchtitan's TP x FSDP mesh, at ZeRO-1/2
level). A dim-1 slice (or a dim -1 layer) is held alike by G ranks, one per worker group (its holders,
``_troupe_holders``); the parameters every rank holds (dim 0, and everything outside the partitioned
layers) by all W. Each set of tensors is cut by elements over the ranks holding it:

- the replicated ones over the W ranks, in the gradient buckets, as `ShardedStep` cuts a whole model;
- each set of slices over its G holders (`SliceShards`): one flat buffer per set, padded to G chunks,
  holder i owning chunk i. After backward the set's gradients are summed over the holders and divided by
  the world size (the partition's rule: one process's gradient on the combined batch), and holder i keeps
  the mean of its chunk only; the optimizer steps holder i's parts; the updated chunks are all-gathered
  among the holders.

Each rank then holds, per element, the parameters whole and 1/W (replicated) or 1/G (slices) of the
optimizer state (and, with "gradients", of the reduced gradients): docs/planner.md prices it
(`troupe.partition.planner.memory`). With one worker group a slice has one holder and is stepped whole.
Full parameter sharding (`troupe.shard`) does not compose with a partitioned model (it refuses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies.partitioned import HolderGroups
from troupe.strategies.sharded_step import ShardedStep, chunk_range, own_parts
from troupe.util import SHARD_COPIES, SHARD_OF, Refusal


@dataclass
class SliceSet:
    """One set of slices held alike by the same ranks: their values in one flat buffer, cut over the holders."""

    comm: Communicator | None
    """The holders (None: this rank alone)."""
    params: list[Tensor]
    offsets: list[int]
    values: Tensor
    """The slices' values, padded to whole chunks: every parameter of the set is a view of it."""
    chunk: int
    rank: int
    """This rank's place among the holders: it owns chunk `rank`."""
    grad: Tensor | None = None
    """This rank's chunk of the mean gradient, after a reduction."""
    flat: Tensor | None = None
    """The set's whole gradient (kept between steps under "optimizer", freed under "gradients")."""
    parts: list[tuple[Tensor, Tensor, int]] = field(default_factory=list)
    """(parameter, its part, where the part starts in this rank's chunk) of every parameter this rank owns
    elements of."""

    @property
    def holders(self) -> int:
        return 1 if self.comm is None else self.comm.world_size


class SliceShards:
    """Every set of a partitioned model's slices this rank holds, each cut over its holders (a collective: every
    rank makes every set's communicator, in one order)."""

    def __init__(self, job: Communicator, partitioned: dict[tuple[int, ...], list[Tensor]], mode: str):
        self.mode, self.world_size = mode, job.world_size
        made = HolderGroups.make(job, partitioned)
        self.sets: list[SliceSet] = [] if made is None else [self._lay_out(c, ps) for c, ps in made.groups]
        self.part_of: dict[int, Tensor] = {id(p): part for s in self.sets for p, part, _ in s.parts}
        self.params = [p for s in self.sets for p in s.params]

    @staticmethod
    def _lay_out(comm: Communicator | None, params: list[Tensor]) -> SliceSet:
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise Refusal(f"a sharded DistOpt cuts a partitioned model's slices held by the same ranks as one flat "
                          f"buffer: they must share one dtype and device, got "
                          f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
        numels = [p.numel() for p in params]
        holders, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        chunk, _, _ = chunk_range(sum(numels), rank, holders)
        values = torch.zeros(chunk * holders, dtype=params[0].dtype, device=params[0].device)
        offsets, at = [], 0
        for p, n in zip(params, numels):
            with torch.no_grad():
                values[at : at + n].copy_(p.detach().reshape(-1))
            p.data = values[at : at + n].view_as(p)
            setattr(p, SHARD_OF, None)
            offsets.append(at)
            at += n
        s = SliceSet(comm, params, offsets, values, chunk, rank)
        for slot, start, stop in own_parts(numels, rank, holders):
            p, begin = params[slot], offsets[slot] + start
            part = torch.nn.Parameter(values[begin : offsets[slot] + stop], requires_grad=True)
            setattr(part, SHARD_COPIES, 1)  # one holder owns each chunk: summed over the job it counts once
            setattr(p, SHARD_OF, part)
            s.parts.append((p, part, begin - rank * chunk))
        return s

    def regroup(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's groups hold this rank's parts in place of the slices (none where it owns no element)."""
        sliced = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            group["params"] = [self.part_of.get(id(p), p) for p in group["params"]
                               if id(p) not in sliced or id(p) in self.part_of]

    def reduce(self) -> None:
        """Each set's gradients summed over its holders and divided by the world size; this rank keeps its chunk
        (its parts' ``grad``); the slices' own ``grad`` is None afterwards."""
        for s in self.sets:
            flat = s.flat if s.flat is not None else torch.zeros_like(s.values)
            for p, at in zip(s.params, s.offsets):
                if p.grad is None:
                    flat[at : at + p.numel()].zero_()
                else:
                    flat[at : at + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
            mine = slice(s.rank * s.chunk, (s.rank + 1) * s.chunk)
            if s.comm is not None and s.comm.backend == "nccl":
                out = flat.new_empty(s.chunk)
                s.comm.reduce_scatter(out, flat)
                flat[mine].copy_(out)
            elif s.comm is not None:  # Gloo's reduce-scatter sends what this all-reduce does (sync/hooks/shard.py)
                s.comm.all_reduce(flat, "sum")
            flat[mine].div_(self.world_size)
            if self.mode == "gradients":  # keep the chunk only: the whole set's gradient goes
                s.grad, s.flat = flat[mine].clone(), None
            else:
                s.grad, s.flat = flat[mine], flat
            for _, part, at in s.parts:
                part.grad = s.grad[at : at + part.numel()]

    def chunks(self) -> list[Tensor]:
        """This rank's chunks of the mean gradients (for the job's finiteness verdict)."""
        return [s.grad for s in self.sets if s.grad is not None and s.grad.numel()]

    def gather(self) -> None:
        """Each set's updated chunks back into every holder's slices."""
        for s in self.sets:
            if s.comm is not None:
                mine = s.values[s.rank * s.chunk : (s.rank + 1) * s.chunk].clone()
                s.comm.all_gather_into(s.values, mine)

    def comms(self) -> list[Communicator]:
        return [s.comm for s in self.sets if s.comm is not None]


class PartitionedShardedStep(ShardedStep):
    """`ShardedStep` over the replicated parameters' buckets, plus `SliceShards` for the slices."""

    def __init__(self, *, slices: SliceShards, **kwargs):
        self.slices = slices
        super().__init__(**kwargs)
        self.name = f"plain, shard={self.mode}, partitioned"
        self._comms += [c for c in slices.comms() if all(c is not d for d in self._comms)]
        self._bytes_mark = self._bytes_sent()

    def _regroup(self) -> None:
        super()._regroup()
        self.slices.regroup(self.optimizer)

    def _hand_over(self) -> None:
        self.slices.reduce()
        super()._hand_over()

    def _own_chunks(self) -> list[Tensor]:
        return super()._own_chunks() + self.slices.chunks()

    def gather(self) -> None:
        super().gather()
        self.slices.gather()

    def describe(self) -> str:
        return f"plain, shard={self.mode}, partitioned"

    def per_rank_state(self) -> list[str]:
        return ["partitioned model (each rank holds its own slices)", *super().per_rank_state()]
