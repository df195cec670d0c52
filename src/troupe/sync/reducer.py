"""GradReducer: overlaps gradient reduction with backward.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket; when
a bucket is complete, and every bucket before it has been launched, its reduction
starts asynchronously. Launching strictly in bucket order keeps every rank's
sequence of collectives identical even when ranks produce gradients in different
orders or skip parameters. After backward the remaining buckets are launched (with
zeros for missing gradients), every handle is waited on, and the averaged gradients
are handed back to the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from troupe.observe import trace
from troupe.reliability import watchdog
from troupe.sync.bucket import FIRST_BUCKET_SIZE, Bucket, plan_buckets
from troupe.runtime.comm import Communicator, Handle

ReduceFn = Callable[[Bucket], Handle]
"""Starts the reduction of a sealed bucket; when its handle completes, ``bucket.data``
holds the averaged gradients and ``bucket.flags`` the per-parameter sum of used flags.
A ReduceFn may set a ``prescale`` attribute: gradients are then multiplied by it as they
are copied into the bucket."""


def mean_all_reduce(comm: Communicator) -> ReduceFn:
    """The plain strategy: gradients enter the bucket already divided by the world size (its
    `prescale`, saving a pass), then the whole buffer (gradients and flags) is summed."""

    def reduce(bucket: Bucket) -> Handle:
        return comm.all_reduce(bucket.buffer, "sum", async_op=True)

    reduce.prescale = 1.0 / comm.world_size  # type: ignore[attr-defined]
    return reduce


class GradReducer:
    """Buckets the given parameters and reduces their gradients as backward produces them."""

    def __init__(self, params: Sequence[Tensor], comm: Communicator, bucket_size: int,
                 first_bucket_size: int = FIRST_BUCKET_SIZE):
        self.comm = comm
        self.params = [p for p in params if p.requires_grad]
        plan = plan_buckets(self.params, bucket_size, first_bucket_size)
        self.buckets = [Bucket(i, [self.params[j] for j in members]) for i, members in enumerate(plan)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.reduce_fn: ReduceFn = mean_all_reduce(comm)
        self.mean_over_active = True
        """Rescale to the mean over active ranks (see DistOpt.join); off for reduce_fns that
        send buckets elsewhere instead of reducing them (the parameter-server client)."""
        self.armed = False
        self.last_fn: ReduceFn = self.reduce_fn
        self._ready: list[bool] = []
        self._next = 0
        self._handles: list[Handle] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def begin(self, reduce_fn: ReduceFn | None = None) -> None:
        """Start a step: clear gradients and buckets, listen for gradients."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.reset()
        self._active_fn = reduce_fn or self.reduce_fn
        self.last_fn = self._active_fn
        self._scale = getattr(self._active_fn, "prescale", None)
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._handles = []
        self.armed = True

    def _on_grad(self, param: Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.add_grad(param, param.grad, self._scale):
            self._ready[bucket.index] = True
            self._launch_ready()
        # The averaged gradient comes back as a view of the bucket; free autograd's copy now.
        param.grad = None

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._ready[self._next]:
            bucket = self.buckets[self._next]
            bucket.seal()
            self._handles.append(self._active_fn(bucket))
            self._next += 1

    def finish(self) -> int:
        """After backward: launch what is left, wait for everything, hand gradients back.

        Returns how many ranks were active (had data) this step.
        """
        self.armed = False
        self._ready = [True] * len(self.buckets)
        self._launch_ready()
        for bucket, handle in zip(self.buckets, self._handles):
            with watchdog.waiting(bucket.label):
                handle.wait()
        world = self.comm.world_size if self.mean_over_active else None
        return min(bucket.unpack(world) for bucket in self.buckets)

    def shadow(self) -> int:
        """Join the other ranks' step with zero gradients, marked inactive; return how many were active."""
        self.begin(self.last_fn)
        for bucket in self.buckets:
            bucket.active = False
        return self.finish()

    def backward(self, loss: Tensor, reduce_fn: ReduceFn | None = None) -> int:
        """``loss.backward()`` with each bucket reduced by `reduce_fn` as it fills; returns the active ranks."""
        self.begin(reduce_fn)
        try:
            loss.backward()
        except BaseException:
            self.abort()
            raise
        rec = trace._recorder
        if rec is not None:
            rec.mark("backward_end")
        return self.finish()

    def label_buckets(self, name_of: Callable[[Tensor], str]) -> None:
        """Name each bucket by its parameters, for stall reports and failure messages."""
        for b in self.buckets:
            names = [name_of(p) for p in b.params]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            b.label = f"gradient bucket {b.index + 1} of {len(self.buckets)} ({shown})"

    def abort(self) -> None:
        """Stop listening after a failed backward (the step is abandoned)."""
        self.armed = False

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
