"""The communication-saving dist_options: half precision, sparse and partial update.

`compressed_reduce` turns a Compressor into a per-bucket ReduceFn for the GradReducer,
so compression happens bucket by bucket while backward is still running, like the plain
all-reduce. `Strategies` holds what these options keep between steps (residuals, the
partial-update rotation, the last step's traffic) for one DistOpt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from troupe.sync.bucket import Bucket
from troupe.runtime.comm import Communicator, Handle
from troupe.compress import (
    Compressor,
    ErrorFeedback,
    HalfCompressor,
    ThresholdCompressor,
    TopKCompressor,
    residual_norm,
)
from troupe.compress.fp16 import half_dtype
from troupe.strategies.partial import PartialAverager
from troupe.sync.reducer import ReduceFn

if TYPE_CHECKING:
    from troupe.opt import DistOpt

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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def compressed_reduce(comm: Communicator, compressor: Compressor, min_compress_size: int = 0) -> ReduceFn:
    """A ReduceFn that sends each bucket's gradients through `compressor`.

    Parameters below `min_compress_size` elements travel dense, in one fp32 all-reduce
    with the bucket's flags. The rest is compressed as one vector named
    ``bucket<index>``; summable payloads are all-reduced, the others all-gathered and
    summed after decompression. Without small parameters the flags ride with the payload
    (gathered and summed here, or summed inside a half-precision payload, which holds
    small integers exactly: fp16 up to 2048 ranks, bf16 up to 256), so each bucket costs
    one collective. Either way the bucket ends up holding the mean and the exact sum of
    the flags, as the reducer expects.
    """
    n = comm.world_size

    def reduce(bucket: Bucket) -> Handle:
        big = [k for k in range(len(bucket.params)) if bucket.numels[k] >= min_compress_size]
        small = [k for k in range(len(bucket.params)) if bucket.numels[k] < min_compress_size]
        if not big:
            return _dense_part(comm, bucket, small)
        # The flags go with the small parameters when there are some, else with the payload.
        dense = _dense_part(comm, bucket, small) if small else None
        vec = bucket.data if not small else torch.cat([bucket.view(k).reshape(-1) for k in big])
        payload, ctx = compressor.compress(vec, f"bucket{bucket.index}")
        if compressor.summable:
            if dense is None and _carries_flags(payload, n):
                return _summed_with_flags(comm, compressor, bucket, payload, ctx)
            dense = dense or _dense_part(comm, bucket, [])
            sent = [comm.all_reduce(t, "sum", async_op=True) for t in payload]
        else:
            # Every rank's flags are gathered with its payload and summed here.
            gathered = comm.all_gather_packed(
                payload + ([] if dense else [bucket.flags]), same_sizes=compressor.fixed_size
            )

        def finish() -> None:
            if dense is not None:
                dense.wait()
            if compressor.summable:
                for h in sent:
                    h.wait()
                total = compressor.decompress(payload, ctx)
            else:
                parts = gathered.result()
                if dense is None:
                    bucket.flags.copy_(sum(p[-1] for p in parts))
                    parts = [p[:-1] for p in parts]
                total = sum(compressor.decompress(p, ctx) for p in parts)
            _write_mean(bucket, big, total.reshape(-1), n)

        return Handle(None, finish)

    return reduce


def _carries_flags(payload: list[Tensor], world_size: int) -> bool:
    """Is the payload one floating tensor whose dtype sums the flags (at most world_size) exactly?"""
    if len(payload) != 1 or not payload[0].is_floating_point():
        return False
    return world_size <= 2 / torch.finfo(payload[0].dtype).eps  # integers up to 2**(mantissa bits + 1) are exact


def _dense_part(comm: Communicator, bucket: Bucket, small: list[int]) -> Handle:
    """Start summing the small parameters' gradients and the flags in fp32; the handle writes the mean back."""
    n = comm.world_size
    dense = torch.cat([bucket.view(k).reshape(-1) for k in small] + [bucket.flags])
    inner = comm.all_reduce(dense, "sum", async_op=True)

    def finish() -> None:
        inner.wait()
        offset = 0
        for k in small:
            view = bucket.view(k)
            view.copy_(dense[offset : offset + view.numel()].view_as(view)).div_(n)
            offset += view.numel()
        bucket.flags.copy_(dense[offset:])

    return Handle(None, finish)


def _summed_with_flags(
    comm: Communicator, compressor: Compressor, bucket: Bucket, payload: list[Tensor], ctx: Any
) -> Handle:
    """One all-reduce of the payload with the flags appended (as the payload's dtype)."""
    nflags = bucket.flags.numel()
    carrier = torch.cat([payload[0], bucket.flags.to(payload[0].dtype)])
    inner = comm.all_reduce(carrier, "sum", async_op=True)

    def finish() -> None:
        inner.wait()
        bucket.flags.copy_(carrier[-nflags:])
        total = compressor.decompress([carrier[:-nflags]], ctx)
        _write_mean(bucket, list(range(len(bucket.params))), total.reshape(-1), comm.world_size)

    return Handle(None, finish)


def _write_mean(bucket: Bucket, members: list[int], total: Tensor, n: int) -> None:
    """Write ``total / n`` (the listed parameters back to back) into the bucket."""
    total = total.div_(n)
    if len(members) == len(bucket.params):
        bucket.data.copy_(total)
        return
    offset = 0
    for k in members:
        view = bucket.view(k)
        view.copy_(total[offset : offset + view.numel()].view_as(view))
        offset += view.numel()


class Strategies:
    """Runs half, sparse and partial updates for one DistOpt and keeps their state."""

    def __init__(self, opt: DistOpt, config: CompressionConfig):
        self.opt = opt
        self.config = config
        self.residuals: dict[str, Tensor] = {}
        """Error-feedback residual per bucket name (this rank's unsent gradient)."""
        self.partial: PartialAverager | None = None
        self._partial_counter = 0  # restored before the averager exists
        self.last_step_stats: dict[str, Any] = {}
        self._checked_fp32 = False

    # --- the options --------------------------------------------------------------------

    def half(self, loss: Tensor, clipping: bool, clip_value: float, dtype: str) -> None:
        torch_dtype = half_dtype(dtype)
        self._check_fp32()
        n = self.opt.world_size
        compressor = HalfCompressor(torch_dtype, clip_value if clipping else None, scale=1.0 / n)
        self._compressed_step(loss, compressor, "fp16" if torch_dtype == torch.float16 else "bf16")

    def sparse(self, loss: Tensor, spars: float, topK: bool, corr: bool) -> None:
        compressor: Compressor = TopKCompressor(spars) if topK else ThresholdCompressor(spars)
        if corr:
            compressor = ErrorFeedback(compressor, self.residuals)
        self._compressed_step(loss, compressor, "sparseTopK" if topK else "sparseThreshold")

    def partial_update(self, loss: Tensor) -> None:
        opt = self.opt
        self._check_no_ps("partialUpdate")
        if opt.world_size == 1 or opt.step_count < self.config.warmup_steps:
            return self._dense_step(loss, "partialUpdate")
        averager = self._averager()
        comm = opt.communicator
        before = comm.bytes_sent()
        opt.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        opt.optimizer.step()
        every = self.config.full_sync_every
        chunk = None
        if every and (opt.step_count + 1) % every == 0:
            averager.average_all()
        elif self.config.chunk_size:
            chunk = averager.average_next()
        opt.step_count += 1
        self._record("partialUpdate", comm.bytes_sent() - before, compressed=True, chunk=chunk)

    # --- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        counter = self.partial.counter if self.partial is not None else self._partial_counter
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}, "partial_counter": counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals.clear()
        self.residuals.update({k: v.clone() for k, v in state.get("residuals", {}).items()})
        self._partial_counter = int(state.get("partial_counter", 0))
        if self.partial is not None:
            self.partial.counter = self._partial_counter

    # --- internals --------------------------------------------------------------------

    def _compressed_step(self, loss: Tensor, compressor: Compressor, option: str) -> None:
        opt = self.opt
        self._check_no_ps(option)
        if opt.world_size == 1 or opt.step_count < self.config.warmup_steps:
            return self._dense_step(loss, option)
        comm = opt.communicator
        before = comm.bytes_sent()
        opt._backward(loss, compressed_reduce(comm, compressor, self.config.min_compress_size))
        opt._apply_update()  # the mean is the same on every rank: nan_policy decides alike everywhere
        self._record(option, comm.bytes_sent() - before, compressed=True)

    def _dense_step(self, loss: Tensor, option: str) -> None:
        """One process, or a warm-up step: the plain update."""
        before = self.opt.communicator.bytes_sent()
        self.opt.backward_and_update(loss)
        self._record(option, self.opt.communicator.bytes_sent() - before, compressed=False)

    def _check_no_ps(self, option: str) -> None:
        if getattr(self.opt, "ps", None) is not None:
            raise ValueError(f"dist_option {option!r} is not available under a parameter-server cluster: use 'plain'")

    def _averager(self) -> PartialAverager:
        if self.partial is None:
            params = self.opt._params()
            # chunk_size 0: no rotation, so one chunk of everything serves the full synchronisation.
            size = self.config.chunk_size or max(1, sum(p.numel() for p in params))
            self.partial = PartialAverager(params, self.opt.communicator, size)
            self.partial.counter = self._partial_counter
        return self.partial

    def _check_fp32(self) -> None:
        if self._checked_fp32:
            return
        for p in self.opt._params():
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(
                    f"half precision needs float32 parameters; {self.opt.param_name(p)} is {p.dtype} "
                    f"(shape {tuple(p.shape)})"
                )
        self._checked_fp32 = True

    def dense_bytes(self) -> int:
        """Wire bytes of one plain fp32 step (every bucket all-reduced)."""
        n = self.opt.world_size
        reducer = self.opt.reducer
        if reducer is None:
            return 0
        payload = sum(b.buffer.numel() * b.buffer.element_size() for b in reducer.buckets)
        return int(2 * (n - 1) / n * payload)

    def _record(self, option: str, sent: int, *, compressed: bool, chunk: int | None = None) -> None:
        dense = self.dense_bytes()
        self.last_step_stats = {
            "option": option,
            "step": self.opt.step_count,
            "compressed": compressed,
            "bytes_sent": sent,
            "dense_bytes": dense,
            "ratio": sent / dense if dense else 1.0,
            "residual_norm": residual_norm(self.residuals),
        }
        if chunk is not None:
            self.last_step_stats["chunk"] = chunk
