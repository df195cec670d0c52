"""GradReducer: reduces gradients while `loss.backward()` runs.

Each parameter's post-accumulate-grad hook takes its gradient into its bucket (nothing to
copy when ``p.grad`` is already the bucket's view, see `troupe.sync.bucket`) and points
``p.grad`` at the bucket; when a bucket is complete, and every bucket before it has been launched, its reduce hook starts
asynchronously. Launching strictly in bucket order keeps every rank's sequence of
collectives identical even when ranks produce gradients in different orders or skip
parameters. The first hook of a backward opens a step and queues a callback that runs
when autograd finishes: it launches what is left (with zeros for missing gradients),
waits for every handle and hands the averaged gradients back as views of the buckets,
so ``loss.backward()`` returns with ``p.grad`` already the mean over ranks (as DDP's).

`paused()` (DistOpt.no_sync) lets gradients accumulate locally, in the buckets; `reduce_now()` reduces
whatever ``p.grad`` holds without a backward (accumulation finished under no_sync,
gradients written by hand).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from troupe.runtime.watchdog import waiting
from troupe.runtime.comm import Communicator, Handle
from troupe.sync.agree import Agreement, FlagHeader, digests_agree, flag_digest, raise_mismatch
from troupe.sync.bucket import FIRST_BUCKET_SIZE, Bucket, Span, allocate, bind_storage, plan_buckets, release
from troupe.sync.hooks import ReduceHook
from troupe.sync.hooks.allreduce import MeanAllReduce

class GradReducer:
    """Buckets the given parameters and reduces their gradients as backward produces them.

    `hook_for_step()` is asked for the reduce hook when a step opens; `describe_step()` for
    the text the ranks compare before the first bucket leaves (see `troupe.sync.agree`).
    """

    def __init__(self, params: Sequence[Tensor], comm: Communicator, bucket_size: int,
                 first_bucket_size: int = FIRST_BUCKET_SIZE, *,
                 hook_for_step: Callable[[], ReduceHook | None] | None = None,
                 describe_step: Callable[[], str] | None = None,
                 on_reduced: Callable[[], None] | None = None, agreement: bool = True, pad_to: int = 1):
        self.comm = comm
        self.params = [p for p in params if p.requires_grad]
        plan = plan_buckets(self.params, bucket_size, first_bucket_size)
        self.buckets = allocate([[self.params[j] for j in members] for members in plan], pad_to)
        self._released = False
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        default = MeanAllReduce(comm)
        self.hook_for_step = hook_for_step or (lambda: default)
        self.describe_step = describe_step or (lambda: "plain")
        self.on_reduced = on_reduced or (lambda: None)
        self.also_reduce: Callable[[], None] | None = None
        """More to reduce whenever the buckets have been (a partitioned model's slices, over their holders)."""
        self.agreement = agreement
        """Check that the ranks agree before each step's first bucket (off where `comm` holds ranks
        that do not take steps: the parameter-server client's channel to the servers)."""
        self.enabled = True
        """False: backward leaves gradients local (no_sync, or a strategy that reduces otherwise)."""
        self.last_hook: ReduceHook = default
        self.last_exchange = self.last_per_call = False
        self._led: int | None = None
        """The communicator's epoch when the ranks last agreed on a step chosen per call whose hook
        carries the digest (None: they have not, or another kind came after): the next such step's
        agreement rides in bucket 0's flags (`_lead`). Every rank sets it on the same verdicts."""
        self._lead = self._per_call = False
        self._steady = True
        self._override: ReduceHook | None = None
        self._finished = 0
        self.in_step = False
        self._callback_queued = False
        self.last_active = comm.world_size
        self.defer: tuple[type[BaseException], ...] = ()
        """Errors of these types (an elastic job's lost peer) are kept in `failed` for the step to
        read, not raised out of backward."""
        self.failed: BaseException | None = None
        self.weight: Callable[[], float] | None = None
        """Read as a step opens: this rank's gradients enter the reduction times it (an elastic job's
        constant global batch, where a rank's batch may hold several groups' batches)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # --- one step ------------------------------------------------------------------------

    def open_step(self, hook: ReduceHook | None = None, *, exchange: bool = False, per_call: bool = False,
                  steady: bool = True) -> None:
        """Open a step before backward (SINGA's methods do, so the agreement overlaps backward).

        `exchange` forces the agreement collective even where the hook could carry the digest in
        its flags. `per_call`: the kind of step is chosen per call (``update(loss, option)``), so
        it may differ in shape from another rank's. Such a step exchanges its agreement first,
        unless the last one agreed on a hook that carries the digest and was `steady` (its option's
        next step has the same kind: not a compressed option's warm-up): then every rank's first
        collective is bucket 0's all-reduce, the digest in its flags (`_lead`), whatever each chose.
        """
        self._open(hook, exchange=exchange, per_call=per_call)
        self._steady = steady

    def local_step(self) -> None:
        """A step chosen per call that keeps its gradients local (no hook): where the other ranks may
        be sending bucket 0 with their step's digest, send its shape with this step's and compare."""
        if self._leads():
            header = FlagHeader.start(self.comm, self.buckets[0].buffer, self._describe(), before=self.buckets[0].label)
            self._verdict(header.check)
        self._led = None

    def _leads(self) -> bool:
        return self.agreement and bool(self.buckets) and self._led is not None and self._led == self.comm.epoch

    def _describe(self) -> str:
        trainable = "".join("1" if p.requires_grad else "0" for p in self.params)
        return f"{self.describe_step()}, trainable {trainable}"

    def _verdict(self, check: Callable[[], object]) -> None:
        """Run an agreement's check; on a mismatch (raised on every rank alike) forget the step and `_led`."""
        try:
            check()
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        """A step the ranks disagreed on: no step open, no callback pending, no agreement to build on."""
        self.in_step = self._callback_queued = False
        self._led = None

    def _open(self, hook: ReduceHook | None = None, *, exchange: bool = False, per_call: bool = False) -> None:
        """Open a step: pick the hook, start the agreement (its collective, or a digest in the flags)."""
        self._hook = hook or self.hook_for_step()
        self.last_hook, self.last_exchange, self.last_per_call = self._hook, exchange, per_call
        self._per_call = per_call
        self._scale = self._hook.prescale
        if self.weight is not None:
            w = self.weight()
            if w != 1.0:
                self._scale = w if self._scale is None else self._scale * w
        self._ensure_storage()
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._handles: list[tuple[list[Bucket], Handle]] = []
        self._description = self._describe()
        self._agreement: Agreement | FlagHeader | None = None
        self._digest: tuple[int, int] | None = None
        self._lead = False
        if self.agreement and self.buckets:
            if per_call and not exchange and self._leads():  # the others send bucket 0 first, digest in its flags
                if self._hook.carries_digest:
                    self._digest, self._lead = flag_digest(self._description, self.comm.world_size), True
                else:  # this step's collectives have another shape: bucket 0's, empty, goes first
                    self._agreement = FlagHeader.start(self.comm, self.buckets[0].buffer, self._description,
                                                       before=self.buckets[0].label)
            elif self._hook.carries_digest and not exchange and not per_call:
                self._digest = flag_digest(self._description, self.comm.world_size)
            else:
                self._agreement = Agreement.start(self.comm, self._description, before=self.buckets[0].label)
        for b in self.buckets:
            b.reset(self._digest or (0, 0))
        self.in_step = True

    def _on_grad(self, param: Tensor) -> None:
        if not self.enabled:
            return self._keep_local(param)
        if not self._callback_queued:  # the first gradient of this backward
            if not self.in_step:
                hook = self._override or self.hook_for_step()
                if hook is None:  # this step's strategy keeps gradients local
                    return self._keep_local(param)
                self._open(hook)
            rec = self.comm.recorder
            if rec is not None:
                rec.mark("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._add(param)
        if self.failed is None:
            try:
                self._launch_ready()
            except self.defer as e:
                self._fail(e)

    def _keep_local(self, param: Tensor) -> None:
        # Graph mode's compiled autograd traces this hook with the reducer paused: leave its gradients alone.
        if not torch.compiler.is_compiling():
            self._ensure_storage()
            self._bucket_of[id(param)].keep_local(param)

    def _add(self, param: Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.add_grad(param, param.grad, self._scale):
            self._ready[bucket.index] = True
        # From now on p.grad is the bucket's view (autograd's copy, if any, is freed): the next
        # backward accumulates into the bucket, and the reduced mean lands in p.grad in place.
        bucket.point(param)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._ready[self._next]:
            if self._agreement is not None:  # before the first bucket: do all ranks take this step?
                agreement, self._agreement = self._agreement, None
                self._verdict(agreement.check)
                if self._per_call:
                    self._led = self.comm.epoch if self._hook.carries_digest and self._steady else None
            if self._lead and self._next == 1:  # bucket 0 carried the agreement: its verdict before the rest
                self._check_lead()
            run = [self.buckets[self._next]]
            # Buckets ready together (at the end of backward, or without one) go as one collective; a
            # bucket 0 that carries the agreement goes alone (another rank may send it empty).
            while (self._hook.coalesce and not (self._lead and self._next == 0)
                   and self._next + len(run) < len(self.buckets)
                   and self._ready[self._next + len(run)] and run[-1].precedes(self.buckets[self._next + len(run)])):
                run.append(self.buckets[self._next + len(run)])
            for bucket in run:
                bucket.seal()
            self._handles.append((run, self._hook(run[0] if len(run) == 1 else Span(run))))
            self._next += len(run)

    def _check_lead(self) -> None:
        """Wait for bucket 0 and compare the digests in its flags (the same verdict on every rank)."""
        self._lead = False
        run, handle = self._handles[0]
        with waiting(self.comm.watchdog, run[0].label):
            handle.wait()
        if not digests_agree(self.buckets[0].digest_sums(), self._digest, self.comm.world_size):
            self._forget()
            raise_mismatch(self.comm, self._description)
        if not self._steady:  # a compressed option's last plain step: its next one has another shape
            self._led = None

    def _end_of_backward(self) -> None:
        rec = self.comm.recorder
        if rec is not None:
            rec.mark("backward_end")
        if self.failed is not None:
            self.abort()
            return
        try:
            self.finish()
        except self.defer as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        """Keep a deferred failure for the step to read (`failed`); the rest of backward runs locally."""
        self.failed = error
        self._next = len(self.buckets)

    def finish(self) -> int:
        """Launch what is left, wait for everything, hand gradients back; return the active ranks.

        A gradient that reached ``p.grad`` without this step's hook (accumulated under
        no_sync and not touched by the last backward, or written by hand) is added now.
        """
        try:
            for bucket in self.buckets:
                for k, p in enumerate(bucket.params):
                    if not bucket.used[k] and p.grad is not None:
                        self._add(p)
            self._ready = [True] * len(self.buckets)
            self._launch_ready()
            if self._lead:  # one bucket: it carried the agreement
                self._check_lead()
            for run, handle in self._handles:
                with waiting(self.comm.watchdog, run[0].label if len(run) == 1 else Span(run).label):
                    handle.wait()
            # A finished collective's work object may still hold its buffers (Gloo's reduce-scatter: a copy
            # of the whole bucket, and a sharded step's chunk): let them go now, not at the next step.
            self._handles = []
            if self._digest is not None and not all(
                    digests_agree(b.digest_sums(), self._digest, self.comm.world_size) for b in self.buckets):
                self._led = None
                raise_mismatch(self.comm, self._description)  # the same verdict on every rank
            world = self.comm.world_size if self._hook.mean_over_active else None
            self.last_active = min((bucket.unpack(world) for bucket in self.buckets), default=self.comm.world_size)
        finally:
            self.in_step = False
            self._callback_queued = False
        self._finished += 1
        if self.also_reduce is not None:
            self.also_reduce()
        rec = self.comm.recorder
        if rec is not None:
            rec.mark("reduced")
        self.on_reduced()
        return self.last_active

    def backward(self, loss: Tensor, hook: ReduceHook | None = None) -> int:
        """``loss.backward()`` with each bucket reduced by `hook` (default: `hook_for_step()`);
        returns the active ranks. Gradients are reduced even if none reached a hook."""
        finished, self._override = self._finished, hook
        try:
            loss.backward()
        except BaseException:
            self.abort()
            raise
        finally:
            self._override = None
        if self._finished == finished:
            return self.reduce_now(hook)
        return self.last_active

    def reduce_now(self, hook: ReduceHook | None = None) -> int:
        """Reduce what ``p.grad`` holds now, without a backward; return the active ranks."""
        if not self.in_step:  # a step opened ahead of a backward that produced no gradient stays
            self._open(hook)
        return self.finish()

    def shadow(self) -> int:
        """Join the other ranks' step with zero gradients, marked inactive; return how many were active."""
        for p in self.params:
            p.grad = None
        self._open(self.last_hook, exchange=self.last_exchange, per_call=self.last_per_call)
        for bucket in self.buckets:
            bucket.active = False
        return self.finish()

    def release_storage(self) -> None:
        """Free the buckets' buffers until the next step or no_sync backward needs them again (sharded
        gradients: after the reduction a rank keeps only its shard). No ``p.grad`` may view them."""
        release(self.buckets)
        self._released = True

    def _ensure_storage(self) -> None:
        if self._released:
            bind_storage(self.buckets, zeroed=False)
            self._released = False

    def label_buckets(self, name_of: Callable[[Tensor], str]) -> None:
        """Name each bucket by its parameters, for stall reports and failure messages."""
        for b in self.buckets:
            names = [name_of(p) for p in b.params]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            b.label = f"gradient bucket {b.index + 1} of {len(self.buckets)} ({shown})"

    def abort(self) -> None:
        """Forget a step whose backward failed."""
        self.in_step = False
        self._callback_queued = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Backward inside the block leaves gradients local and summed in ``p.grad`` (no_sync)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
