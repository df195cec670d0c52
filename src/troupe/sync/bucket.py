"""Gradient buckets: a fixed, rank-independent layout of parameters into flat buffers.

A bucket's buffer holds its parameters' gradients back to back, followed by one
"used" flag per parameter, one "active" flag for the rank and two digest slots. Summing
the flags across ranks tells every rank, in the same collective and without another
message, which parameters got no gradient on any rank this step (they keep ``grad =
None``, as in a single process), how many ranks still had data (see `DistOpt.join`), and
whether every rank described its step alike (`troupe.sync.agree`).

Gradients live in the buckets (DDP's ``gradient_as_bucket_view``): once a parameter's
gradient has been taken in, ``p.grad`` is a view of its slot, so the next backward (after
``zero_grad(set_to_none=False)``, under ``no_sync``, or without zeroing) accumulates
straight into what is reduced and nothing is copied in or out. After
``zero_grad(set_to_none=True)`` autograd hands over a fresh tensor; it is copied into the
slot once and ``p.grad`` is pointed back at the slot (as DDP does), so no bucket memory is
ever allocated again and only one copy of each gradient outlives the hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_BUCKET_SIZE = 2**19
"""Elements per bucket (2 MiB of fp32); the bucket-size sweep behind it is in benchmarks/results/before_the_harness.md."""
DIGEST_SLOTS = 2
"""Flag slots for the step digest (`troupe.sync.agree.flag_digest`)."""
FIRST_BUCKET_SIZE = 2**18
"""Cap of the first bucket (1 MiB of fp32), so the last layers' gradients go out early."""


def plan_buckets(params: Sequence[Tensor], bucket_size: int, first_bucket_size: int = FIRST_BUCKET_SIZE) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse order (about the order backward yields them).

    Buckets close in that order, so bucket i's gradients are ready no later than bucket
    i+1's and launching in index order never holds back an early gradient. A bucket closes
    as soon as it holds at least its cap, the tensor that crossed it included (as DDP; so a
    tensor of at least the cap arriving at an empty bucket travels alone, as in SINGA). The
    first bucket's cap is ``min(bucket_size, first_bucket_size)``, as DDP's, so communication
    starts early in backward. Parameters of different dtype or device never share a bucket.
    Depends only on shapes, so every rank with the same model gets the same plan.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        cap = bucket_size if buckets else min(bucket_size, first_bucket_size)
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += p.numel()
        if size >= cap:
            buckets.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    buckets.extend(members for members, _ in open_.values())
    return buckets


def padded_size(numel: int, pad_to: int = 1) -> int:
    """`numel` rounded up to a multiple of `pad_to` (a bucket's gradients cut into `pad_to` equal chunks)."""
    return -(-numel // pad_to) * pad_to


def buffer_size(params: Sequence[Tensor], pad_to: int = 1) -> int:
    """Elements of a bucket's buffer: the gradients (padded to a multiple of `pad_to`), a used flag each,
    the active flag, the digest slots."""
    return padded_size(sum(p.numel() for p in params), pad_to) + len(params) + 1 + DIGEST_SLOTS


def allocate(plan: Sequence[Sequence[Tensor]], pad_to: int = 1) -> list[Bucket]:
    """The buckets of a plan, their buffers slices of one contiguous storage per dtype and device
    in bucket order, so buckets that are ready together can be reduced as one `Span`."""
    buckets = [Bucket(i, params, torch.empty(0, dtype=params[0].dtype, device=params[0].device), pad_to=pad_to)
               for i, params in enumerate(plan)]
    bind_storage(buckets)
    return buckets


def bind_storage(buckets: Sequence[Bucket], zeroed: bool = True) -> None:
    """Give `buckets` fresh buffers, slices of one contiguous storage per dtype and device (at
    allocation, and again for buckets whose storage was `release`d). With `zeroed` False only the
    padding is zeroed: a step writes every gradient slot (a copy, or zeros in `seal`) and the flags."""
    sizes: dict[tuple, int] = {}
    for b in buckets:
        sizes[b.key] = sizes.get(b.key, 0) + b.size
    make = torch.zeros if zeroed else torch.empty
    storage = {key: make(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    offset = dict.fromkeys(sizes, 0)
    for b in buckets:
        b.bind(storage[b.key][offset[b.key] : offset[b.key] + b.size])
        if not zeroed:
            b.buffer[b.numel : b.padded].zero_()
        offset[b.key] += b.size


def release(buckets: Sequence[Bucket]) -> None:
    """Drop the buckets' buffers (sharded gradients: the full gradients live only while a step reduces them)."""
    for b in buckets:
        b.bind(None)


class Span:
    """Consecutive buckets whose buffers are adjacent, reduced by one collective (a reduce hook
    that `coalesce`s reads only `buffer` and `label`)."""

    def __init__(self, buckets: Sequence[Bucket]):
        self.buckets = list(buckets)
        first, last = self.buckets[0], self.buckets[-1]
        start = first.buffer.storage_offset()
        stop = last.buffer.storage_offset() + last.buffer.numel()
        self.buffer = first.buffer.as_strided((stop - start,), (1,), start)
        self.index = first.index
        self.label = (first.label if len(self.buckets) == 1 else
                      f"gradient bucket {first.index + 1} to {last.index + 1} (reduced as one)")


class Bucket:
    """One bucket's flat buffer and its per-step state."""

    def __init__(self, index: int, params: Sequence[Tensor], buffer: Tensor | None = None, *, pad_to: int = 1):
        self.index = index
        self.params = list(params)
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:k]) for k in range(len(self.params))]
        self.numel = sum(self.numels)
        self.padded = padded_size(self.numel, pad_to)
        """Elements of the gradient part with its padding: `pad_to` equal chunks (sharded gradients)."""
        p0 = self.params[0]
        self.key = (p0.dtype, p0.device)
        self.size = buffer_size(self.params, pad_to)
        self.slot = {id(p): k for k, p in enumerate(self.params)}
        self.label = f"gradient bucket {index + 1} ({len(self.params)} tensors, {self.numel} elements)"
        self.bind(torch.zeros(self.size, dtype=p0.dtype, device=p0.device) if buffer is None else buffer)
        self.reset()

    def bind(self, buffer: Tensor | None) -> None:
        """Make `buffer` this bucket's (None: hold none until bound again; `release`)."""
        if buffer is None:
            self.buffer, self._views = None, []
            return
        if buffer.numel() == 0 and self.size:  # `allocate` binds the storage afterwards
            self.buffer, self._views = buffer, []
            return
        if buffer.numel() != self.size:
            raise ValueError(f"bucket {self.index} needs a buffer of {self.size} elements, got {buffer.numel()}")
        self.buffer = buffer
        self._views = [buffer[o : o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, self.params)]

    @property
    def data(self) -> Tensor:
        """The gradient part of the buffer."""
        return self.buffer[: self.numel]

    @property
    def padded_data(self) -> Tensor:
        """The gradient part and its padding (zeros): `padded` elements."""
        return self.buffer[: self.padded]

    @property
    def flags(self) -> Tensor:
        """One entry per parameter, 1 where this rank had a gradient, then 1 if this rank is active.

        After the sum across ranks: how many ranks had each gradient, and how many were active.
        """
        return self.buffer[self.padded :]

    def reset(self, digest: tuple[int, ...] = (0,) * 2) -> None:
        self.digest = digest
        self.used = [False] * len(self.params)
        self.pending = len(self.params)
        self.active = True

    def view(self, k: int) -> Tensor:
        return self._views[k]

    def precedes(self, other: Bucket) -> bool:
        """Does `other`'s buffer start where this one's ends (so both can travel as one span)?"""
        b, o = self.buffer, other.buffer
        return (b.dtype == o.dtype and b.device == o.device
                and o.data_ptr() == b.data_ptr() + b.numel() * b.element_size())

    def holds(self, k: int, grad: Tensor) -> bool:
        """Does `grad` already live in slot `k` (backward accumulated into the view)?"""
        view = self._views[k]
        return grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype and grad.device == view.device

    def add_grad(self, param: Tensor, grad: Tensor, scale: float | None = None) -> bool:
        """Take one gradient into its slot (times `scale`, if given); True when every parameter has arrived.

        A gradient that already lives in its slot is only scaled, in place: nothing is copied.
        """
        k = self.slot[id(param)]
        if self.used[k]:
            raise RuntimeError(
                "a parameter received a second gradient in one step; call backward once per "
                "backward_and_update (or use retain_graph only outside DistOpt)"
            )
        view = self._views[k]
        if self.holds(k, grad):
            if scale is not None:
                view.mul_(scale)
        elif scale is None:
            view.copy_(grad)
        else:
            torch.mul(grad.view_as(view), scale, out=view)
        self.used[k] = True
        self.pending -= 1
        return self.pending == 0

    def point(self, param: Tensor) -> None:
        """Make ``param.grad`` the view of its slot (autograd's own tensor, if any, is freed)."""
        param.grad = self._views[self.slot[id(param)]]

    def keep_local(self, param: Tensor) -> None:
        """Move a gradient that stays on this rank for now (no_sync) into its slot, so the next
        micro-batches accumulate in the bucket and the reducing backward has nothing to copy.

        A gradient with a graph of its own (``create_graph=True``) or a sparse one stays where it is.
        """
        grad = param.grad
        k = self.slot[id(param)]
        if grad is None or grad.requires_grad or grad.is_sparse or self.holds(k, grad):
            return
        self._views[k].copy_(grad)
        self.point(param)

    def seal(self) -> None:
        """Zero the slots of parameters that got no gradient and write the used flags."""
        for k, used in enumerate(self.used):
            if not used:
                self.view(k).zero_()
        self.flags.copy_(torch.tensor([*self.used, self.active, *self.digest], dtype=self.buffer.dtype))

    def digest_sums(self) -> list[int]:
        """After the reduction: the sum over ranks of each digest slot."""
        return [int(v) for v in self.flags[-DIGEST_SLOTS:].tolist()]

    def unpack(self, world_size: int | None) -> int:
        """Hand the reduced gradients back to the parameters (as views of the buffer); return the active ranks.

        The reduction leaves sum / world_size; when only some ranks were active (the others
        had run out of data and joined with zeros), the mean is over the active ones. A
        parameter that no rank produced a gradient for keeps ``grad = None``.
        """
        *counts, active = self.flags[:-DIGEST_SLOTS].tolist()
        if world_size is not None and 0 < active < world_size:
            self.data.mul_(world_size / active)
        for k, p in enumerate(self.params):
            p.grad = self.view(k) if counts[k] > 0 else None
        return int(active)
