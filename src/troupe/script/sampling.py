"""Each rank its share of a map-style dataset, reshuffled every epoch: `DistributedSampler` and `loader`.

Re-exported from `troupe.data`; see there. Every rank draws the same permutation from
``(seed, epoch)`` and takes every ``world_size``-th index starting at its rank, so the
shares are disjoint and, together, the epoch. A checkpoint keeps the job's position in the
permutation (not each rank's), so a job resumed on another number of ranks sees the rest
of the epoch, each sample once. Owns no process state: the rank and world size are read
once, from the World, when a sampler is made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

Tail = Literal["pad", "drop", "uneven"]
TAILS: tuple[str, ...] = ("pad", "drop", "uneven")
"""What happens to the samples left over when the dataset does not divide by world_size:
pad: repeat samples from the start of the permutation so every rank gets as many (torch's default);
drop: leave them out, every rank gets ``n // world_size``;
uneven: keep every sample exactly once, the first ``n % world_size`` ranks get one more."""


def _data_parallel_place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) of this process among the ranks that feed data: the World's data-parallel communicator."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size, or neither (got rank={rank}, world_size={world_size})")
    if rank is not None and world_size is not None:
        return rank, world_size
    from troupe.runtime import world as world_mod  # the World joins the job: only when asked to

    world = world_mod.init()
    if world.membership.elastic:  # each worker group its own share, however many groups are present now
        return world.rank, world.world_size
    place = world.membership.data_place
    if place is not None:  # a parameter-server worker that restarts alone: its share among all the workers
        return place
    if world.settings.cluster and world.comm is world.job:
        # Until the DistOpt's bootstrap has split the job, world.comm still counts the servers.
        raise RuntimeError("under a parameter-server cluster (TROUPE_CLUSTER) make the sampler after the DistOpt: "
                           "only then does this process know its rank among the workers")
    return world.comm.rank, world.comm.world_size


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class DistributedSampler(Sampler[int]):
    """This rank's indices of a map-style dataset, a fresh global shuffle every epoch.

    >>> sampler = troupe.data.DistributedSampler(dataset, tail="uneven")   # after troupe.init() / the DistOpt
    >>> for epoch in range(epochs):
    ...     sampler.set_epoch(epoch)                  # the same permutation on every rank
    ...     with sgd.join():                          # tail="uneven": ranks may differ by one batch
    ...         for i in sampler: ...

    Args:
        dataset_or_len: the dataset (anything with ``len``) or its number of samples.
        rank, world_size: this rank among the ranks that feed data; default the World's
            data-parallel communicator (`troupe.init()`; under a parameter-server cluster the
            workers, known once the DistOpt is made; under `troupe.partition` every worker of
            a group feeds its own share, so the global rank).
        shuffle: a permutation per epoch from ``(seed, epoch)``; False: 0, 1, 2, ... in order.
        seed: the same on every rank.
        tail: "pad", "drop" or "uneven" (see `TAILS`). With "pad" or "drop" the indices are
            those of ``torch.utils.data.DistributedSampler`` (``drop_last=False/True``).

    With "uneven" a rank may have one batch more than another: under synchronous
    all-reduce, ``with sgd.join():`` lets the ranks that run out shadow the others' last
    steps with zero gradients, and each such step averages the gradients of the ranks
    that still had a batch (each rank's mean loss counts once, so a short last batch
    weighs as much as a full one). A partitioned model (`troupe.partition`) cannot be
    joined: there use "pad" or "drop" (and ``drop_last=True`` for equal batches).
    """

    def __init__(self, dataset_or_len: Sized | int, *, rank: int | None = None, world_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, tail: Tail = "pad"):
        if isinstance(dataset_or_len, int) and not isinstance(dataset_or_len, bool):
            size = dataset_or_len
        elif hasattr(dataset_or_len, "__len__"):
            size = len(dataset_or_len)  # type: ignore[arg-type]
        else:
            raise TypeError(f"dataset_or_len must be a sized dataset or an int, got {type(dataset_or_len).__name__}")
        if size < 1:
            raise ValueError(f"the dataset is empty (dataset_or_len gives {size} samples)")
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
        rank, world_size = _data_parallel_place(rank, world_size)
        _int("world_size", world_size, 1)
        _int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        if tail == "drop" and size < world_size:
            raise ValueError(f"tail='drop' leaves nothing: the dataset has {size} samples, fewer than world_size "
                             f"{world_size} (use tail='pad' or 'uneven')")
        _int("seed", seed, -(2**63))
        self.size, self.rank, self.world_size = size, rank, world_size
        self.shuffle, self.seed, self.tail = bool(shuffle), seed, tail
        self.epoch = 0
        self._next = 0      # where the next iteration begins in the epoch's permutation (set by load_state_dict)
        self._base = 0      # where the current iteration began
        self._yielded = 0   # indices handed out since the current iteration began

    # --- sizes ------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """How many indices this rank gets in a whole epoch."""
        return self._share_len(0)

    @property
    def total_size(self) -> int:
        """Indices handed out per epoch over all ranks (the dataset size with "uneven")."""
        return self._rest_len(0)

    def __len__(self) -> int:
        """Indices the next iteration yields: `num_samples`, less those consumed before a resume."""
        return self._share_len(self._next)

    def _rest_len(self, start: int) -> int:
        """Indices handed out over all ranks from permutation position `start` to the epoch's end."""
        left, w = self.size - start, self.world_size
        if self.tail == "pad":
            return math.ceil(left / w) * w
        return left - left % w if self.tail == "drop" else left

    def _share_len(self, start: int, rank: int | None = None) -> int:
        """How many of them `rank` (default: this one) gets."""
        return len(range(self.rank if rank is None else rank, self._rest_len(start), self.world_size))

    # --- the indices --------------------------------------------------------------------------

    def _rest(self, epoch: int, start: int) -> list[int]:
        """Every rank's indices from position `start` of `epoch`'s permutation on; rank r's at r, r + world_size, ...

        The rest of a permutation is cut to this world's tail rule: "pad" repeats the
        permutation from its start, "drop" leaves out the last few. From `start` 0 that is a
        whole epoch; a resumed epoch starts where the checkpoint's world had got to.
        """
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)  # as torch's DistributedSampler, so "pad"/"drop" match it
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self._rest_len(start)
        rest = order[start:]
        while len(rest) < total:  # "pad": repeat from the start (more than once on tiny datasets)
            rest += order[: total - len(rest)]
        return rest[:total]

    def global_indices(self, epoch: int | None = None) -> list[int]:
        """Every rank's indices of `epoch` (default: the current one), rank r's at r, r + world_size, ..."""
        return self._rest(self.epoch if epoch is None else epoch, 0)

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of a whole `epoch` (default: the current one), ignoring any resume point."""
        return self.global_indices(epoch)[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        # Not a generator itself: the resume point is taken when iteration starts, not at the first next().
        return self._count(self._begin()[self.rank :: self.world_size])

    def _begin(self) -> list[int]:
        """Start an iteration at the resume point: every rank's indices from there (rank r's at r, r + world_size, ...)."""
        self._base, self._next, self._yielded = self._next, 0, 0
        return self._rest(self.epoch, self._base)

    def _count(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            self._yielded += 1
            yield i

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s permutation from the next iteration on (call it at the start of every epoch)."""
        _int("epoch", epoch, 0)
        if epoch != self.epoch:  # set_epoch(the epoch just loaded) keeps the resume point
            self._next = self._base = self._yielded = 0
        self.epoch = epoch

    # --- checkpoints ----------------------------------------------------------------------------

    def position(self, consumed: int | None = None) -> int:
        """How many samples of the epoch's permutation the ranks together have taken, when this one took `consumed`.

        The ranks take turns through the permutation (rank r the r-th of every world_size),
        so while every rank has taken as many indices (a synchronous loop: one batch each
        per step), all of them have taken the permutation's first ``consumed * world_size``
        samples: a count that means the same on any number of ranks. A rank that has taken
        its whole share counts the epoch as done: a synchronous loop ends on every rank at
        the same step (with "uneven", after ``join()``); a save is collective, so no rank
        can save while another still has batches left.
        """
        consumed = self._yielded if consumed is None else _int("consumed", consumed, 0)
        share = self._share_len(self._base)
        if consumed > share:
            raise ValueError(f"consumed {consumed} is more than this rank's {share} samples "
                             f"{'left in the resumed epoch' if self._base else 'per epoch'}")
        taken = consumed * self.world_size if consumed < share else self._rest_len(self._base)
        return self._base + min(taken, self.size - self._base)  # "pad": the repeats add nothing new

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where the job is in the epoch: the epoch and `position` (the same on every rank); resumes on any world size.

        `consumed` defaults to the indices this rank took since the iteration began (since
        the resume, in a resumed epoch), which is what the training loop has taken when a
        DataLoader with ``num_workers=0`` reads them; with workers the DataLoader reads ahead:
        pass ``consumed=batches_done * batch_size``.
        """
        consumed = self._yielded if consumed is None else consumed
        position = self.position(consumed)
        return {"epoch": self.epoch, "position": position, "consumed": consumed, "size": self.size,
                "rank": self.rank, "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle,
                "tail": self.tail}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off: the next iteration hands out the rest of its epoch.

        `state` may come from another number of ranks (any rank's copy: the position is the
        job's). On the same number the rest is exactly the uninterrupted run's; on another,
        the permutation's samples not yet taken are split anew among this world's ranks,
        each once ("pad" repeats, "drop" leaves out, fewer than world_size of them to make
        equal shares).
        """
        for key in ("size", "seed", "shuffle", "tail"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the sampler state was saved with {key}={state[key]!r}, this sampler has "
                                 f"{key}={getattr(self, key)!r}: its position means nothing here")
        epoch = _int("epoch", state["epoch"], 0)
        if "position" in state:
            position = _int("position", state["position"], 0)
            if position > self.size:
                raise ValueError(f"position {position} is past the end of the epoch ({self.size} samples)")
        else:  # saved before positions: each rank had consumed as many
            saved_world = _int("world_size", state.get("world_size", self.world_size), 1)
            consumed = _int("consumed", state["consumed"], 0)
            whole = DistributedSampler(self.size, rank=0, world_size=saved_world, shuffle=self.shuffle,
                                       seed=self.seed, tail=self.tail)
            if consumed > whole.num_samples:
                raise ValueError(f"consumed {consumed} is more than this rank's {whole.num_samples} samples per epoch")
            position = whole.position(consumed)
        self.epoch, self._next, self._base, self._yielded = epoch, position, position, 0

    def __repr__(self) -> str:
        return (f"DistributedSampler({self.size} samples, rank {self.rank}/{self.world_size}, tail={self.tail!r}, "
                f"shuffle={self.shuffle}, seed={self.seed}, epoch {self.epoch})")


class OwnBatches(Sampler[list[int]]):
    """A `DistributedSampler`'s own batches, for a DataLoader whose workers read them ahead (`StepLoader`):
    the position is counted as the loop takes each batch (`take`), not as the workers are handed its indices."""

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.rest: list[int] = []
        """Every rank's indices of this iteration (from the resume point), set as it begins."""

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def batch(self, rank: int, b: int) -> list[int]:
        """Batch b of `rank`'s share of this iteration."""
        s = self.sampler
        return self.rest[rank :: s.world_size][b * self.batch_size : (b + 1) * self.batch_size]

    def _begin(self) -> int:
        count = len(self)  # before the sampler's `_begin`, which moves the resume point into the base
        self.rest = self.sampler._begin()
        return count

    def take(self, b: int, ranks: Sequence[int]) -> tuple[list[int], list[int]]:
        """The loop takes batch b for `ranks` (this sampler's first): its own indices, counted in the
        position, and the other ranks' batch b."""
        s = self.sampler
        if ranks[0] != s.rank:
            raise ValueError(f"the batch ranks {list(ranks)} must start with this sampler's rank {s.rank}")
        own = self.batch(s.rank, b)
        s._yielded += len(own)
        return own, [i for r in ranks[1:] for i in self.batch(r, b)]

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self._begin()):
            yield self.batch(self.sampler.rank, b)


class StepBatches(OwnBatches):
    """A `DistributedSampler`'s batches, each drawn as the loop asks for it, holding the batches of
    every rank `ranks()` names then (its own first) at the same place of their shares.

    `troupe.data.loader` uses it under ``troupe run --elastic-batch constant``: the groups present
    take the missing groups' batches too (the membership names them per step), so a step's batch is
    the fault-free run's global batch. The sampler keeps the position (its own indices taken).
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool,
                 ranks: Callable[[], Sequence[int]]):
        super().__init__(sampler, batch_size, drop_last)
        self.ranks = ranks

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self._begin()):
            own, extra = self.take(b, self.ranks())  # now: after the previous step chose the quorum of this one
            yield own + extra


class StepLoader(DataLoader):
    """``troupe run --elastic-batch constant`` with DataLoader workers: the workers read this rank's own
    batches ahead, as usual; the batches of the missing groups this rank's group takes (`ranks()`, asked
    as the loop takes each batch, after the previous step chose the quorum) are read here, in the loop's
    process, and appended (`concat_batches`). With every group present nothing is read here."""

    def __init__(self, dataset: Dataset, ranks: Callable[[], Sequence[int]], **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.ranks = ranks

    def __iter__(self) -> Iterator[Any]:
        own: OwnBatches = self.batch_sampler  # type: ignore[assignment]
        for b, batch in enumerate(super().__iter__()):
            _, extra = own.take(b, self.ranks())
            if extra:
                batch = concat_batches(batch, self.collate_fn([self.dataset[i] for i in extra]))
            yield batch


def concat_batches(first: Any, second: Any) -> Any:
    """Two collated batches as one, sample after sample (what ``default_collate`` makes of tensors, numbers,
    strings, and tuples, lists and dicts of them)."""
    if isinstance(first, Tensor):
        return torch.cat([first, second])
    if isinstance(first, dict):
        return type(first)({k: concat_batches(v, second[k]) for k, v in first.items()})
    if isinstance(first, (list, tuple)) and all(isinstance(x, (str, bytes)) for x in (*first, *second)):
        return type(first)([*first, *second])  # default_collate's strings: one per sample
    if isinstance(first, (list, tuple)) and len(first) == len(second):
        fields = [concat_batches(x, y) for x, y in zip(first, second)]
        return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)
    raise TypeError(f"troupe run --elastic-batch constant with DataLoader workers appends the missing groups' "
                    f"batches to this rank's: it cannot join two collated batches of type {type(first).__name__} "
                    "(a collate_fn of your own must return tensors, or tuples, lists or dicts of them)")


_OURS = ("sampler", "batch_sampler", "shuffle")


def as_dataset(data: Dataset | Tensor | Sequence[Tensor]) -> Dataset:
    """`data` itself, or a TensorDataset when it is a tensor or a tuple/list of tensors such as (x, y)."""
    if isinstance(data, Tensor):
        data = (data,)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, Tensor) for t in data):
        lengths = [len(t) if t.dim() else None for t in data]
        if None in lengths or len(set(lengths)) != 1:
            raise ValueError(f"the tensors must share their first dimension (one row per sample), got shapes "
                             f"{[tuple(t.shape) for t in data]}")
        return TensorDataset(*data)
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TypeError(f"loader needs a map-style dataset (with __getitem__ and __len__) or tensors (x, y), "
                        f"got {type(data).__name__}")
    return data  # type: ignore[return-value]


def loader(dataset: Dataset | Tensor | Sequence[Tensor], batch_size: int, *, shuffle: bool = True, seed: int = 0,
           tail: Tail = "pad", rank: int | None = None, world_size: int | None = None,
           **dataloader_kwargs: Any) -> DataLoader:
    """A DataLoader over this rank's share of `dataset`; ``loader.sampler`` is its `DistributedSampler`.

    >>> train = troupe.data.loader((x, y), batch_size=64, tail="drop")
    >>> for epoch in range(epochs):
    ...     train.sampler.set_epoch(epoch)
    ...     for xb, yb in train: ...

    `dataset` is a map-style dataset or tensors (x, y) sharing their first dimension;
    other keyword arguments (num_workers, drop_last, pin_memory, collate_fn, ...) go to
    the DataLoader. `batch_size` is per rank.

    Under ``troupe run --elastic-batch constant`` each batch also holds the batches of the missing
    worker groups this rank's group takes, chosen as the loop takes it (`StepBatches`): the global
    batch stays the whole job's (a rank's batch may then be several times `batch_size`). With
    ``num_workers > 0`` the workers read this rank's own batches ahead and the missing groups' are
    read in the loop's process when a group is missing (`StepLoader`).
    """
    _int("batch_size", batch_size, 1)
    clash = sorted(set(_OURS) & set(dataloader_kwargs))
    if clash:
        raise TypeError(f"loader makes its own sampler: do not pass {', '.join(clash)} (shuffle/seed/tail choose it)")
    dataset = as_dataset(dataset)
    sampler = DistributedSampler(dataset, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, tail=tail)
    membership = _constant_batch_membership() if rank is None else None
    if membership is None:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **dataloader_kwargs)
    drop_last = bool(dataloader_kwargs.pop("drop_last", False))
    if dataloader_kwargs.get("num_workers", 0):
        data = StepLoader(dataset, membership.batch_ranks, batch_sampler=OwnBatches(sampler, batch_size, drop_last),
                          **dataloader_kwargs)
    else:
        batches = StepBatches(sampler, batch_size, drop_last, membership.batch_ranks)
        data = DataLoader(dataset, batch_sampler=batches, **dataloader_kwargs)
    object.__setattr__(data, "sampler", sampler)  # what `.sampler` means for every troupe loader (DataLoader forbids setting it)
    return data


def _constant_batch_membership() -> Any:
    """The elastic membership when the job keeps a constant global batch, else None."""
    from troupe.runtime import world as world_mod

    membership = world_mod.init().membership
    return membership if membership.constant_batch else None
