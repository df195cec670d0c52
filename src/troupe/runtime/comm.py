"""Communicator: the only module in troupe that calls torch.distributed collectives.

Every call counts what it puts on the wire, so benchmarks and per-step stats can read
bytes per collective without instrumenting the backend.
"""

from __future__ import annotations

import contextlib

import datetime
import queue
import threading
import weakref
from concurrent import futures
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from troupe.observe.trace import Recorder, _now_us
from troupe.runtime.watchdog import Watchdog, waiting
from troupe.util import pack, unpack_into

Op = Literal["sum", "mean", "max", "min"]
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class Traffic:
    """What one kind of collective has cost this rank so far."""

    calls: int = 0
    payload_bytes: int = 0
    """Bytes of the tensors handed to the collective on this rank."""
    wire_bytes: int = 0
    """Bytes this rank sends under the textbook algorithm (ring all-reduce: 2(n-1)/n of the payload)."""


# torch 2.13 renamed reduce_scatter_tensor (which now warns) to reduce_scatter_single
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _complete(handle: Handle, async_op: bool, result):
    """What a collective returns: its handle when asynchronous, else `result` once it has completed."""
    if async_op:
        return handle
    handle.wait()
    return result


class Handle:
    """A collective in flight. `wait()` completes it and then runs its epilogue once."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None, label: str = "a collective",
                 dog: Watchdog | None = None, escape: Callable[[], str | None] | None = None):
        self._work, self._then, self.done = work, then, False
        self.label = label
        """What the stall inspector and failure messages call this collective."""
        self._dog, self._escape = dog, escape

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            with waiting(self._dog, self.label):
                if self._escape is None:
                    self._work.wait()
                else:
                    _wait_or_escape(self._work, self._escape)
        if self._then is not None:
            self._then()
        self.done = True


ESCAPE_SLICE = datetime.timedelta(seconds=0.1)


def _wait_or_escape(work: dist.Work, escape: Callable[[], str | None]) -> None:
    """Wait for `work` in slices; between them ask `escape` whether to give up (an elastic job's
    member was lost: only its ring neighbours see their sockets close, the others would wait for
    the whole timeout)."""
    while True:
        try:
            work.wait(ESCAPE_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it ended in the meantime: its own verdict, success or error
                work.wait()
                return
            reason = escape()
            if reason is not None:
                raise RuntimeError(reason) from None


class Future(Handle):
    """A Handle whose epilogue produces a value: `result()` completes it and returns the value."""

    def __init__(self, work: dist.Work | None, produce: Callable[[], object], dog: Watchdog | None = None,
                 escape: Callable[[], str | None] | None = None):
        self._value: object = None

        def then() -> None:
            self._value = produce()

        super().__init__(work, then, dog=dog, escape=escape)

    def result(self) -> object:
        self.wait()
        return self._value


class Communicator:
    """Collectives over one process group, with byte counters.

    >>> comm = Communicator()                     # the default (world) group
    >>> comm.all_reduce(t, op="mean")              # in place
    >>> h = comm.all_reduce(t, async_op=True); ...; h.wait()
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, watchdog: Watchdog | None = None,
                 recorder: Recorder | None = None, totals: dict[str, Traffic] | None = None):
        """`watchdog` names a failed peer when a collective fails; `recorder` gets every collective's
        span; `totals` adds this communicator's counts to the process's (the World's)."""
        if not dist.is_initialized():
            raise RuntimeError("Communicator needs an initialised process group: call troupe.init() first")
        # Hold the group weakly (torch's registry holds it until destroy_process_group): a
        # strong reference would keep Gloo's threads alive into interpreter shutdown, where
        # their last release of a work object aborts the process.
        self._group = None if group is None else weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.traffic: dict[str, Traffic] = defaultdict(Traffic)
        self.watchdog, self.recorder = watchdog, recorder
        self.escape: Callable[[], str | None] | None = None
        """Asked between slices of a wait (an elastic job: was this step decided without us?)."""
        self._totals = totals if totals is not None else defaultdict(Traffic)
        self.epoch = 0
        """How many times the group was made anew (`rebind`, `adopt`): what the members agreed on
        before a new epoch, a joiner does not know (the GradReducer's flag agreement starts over)."""

    def rebind(self) -> None:
        """Re-read rank and size after the default group was made anew (an elastic job's new quorum)."""
        if self._group is not None:
            raise RuntimeError("only a communicator over the whole job (the default group) can be rebound")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.epoch += 1

    def adopt(self, other: Communicator) -> None:
        """Use `other`'s process group from now on, keeping this object (the one a strategy holds) and
        its counters: an elastic job makes its subgroups anew for every quorum."""
        self._group, self.rank, self.world_size, self.backend = other._group, other.rank, other.world_size, other.backend
        self.epoch += 1

    def global_rank(self, rank: int) -> int:
        """The rank in the default group (what send and recv take) of this group's `rank`."""
        return rank if self._group is None else dist.get_global_rank(self.group, rank)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the whole job)."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError("this communicator's process group is gone (troupe.shutdown() was called)")
        return group

    # --- bookkeeping -------------------------------------------------------------

    def _count(self, op: str, payload: int, wire: float) -> None:
        for t in (self.traffic[op], self._totals[op]):
            t.calls += 1
            t.payload_bytes += payload
            t.wire_bytes += int(wire)

    def bytes_sent(self) -> int:
        """Wire bytes over all collectives so far."""
        return sum(t.wire_bytes for t in self.traffic.values())

    def reset_counters(self) -> None:
        self.traffic.clear()

    def _trace(self, work: dist.Work, op: str, nbytes: int) -> None:
        """With a timeline or stats enabled, record when this collective really completes."""
        rec = self.recorder
        if rec is None:
            return
        start = _now_us()
        work.get_future().add_done_callback(lambda _: rec.span(op, start, _now_us(), bytes=nbytes))

    def _staged(self, tensor: Tensor) -> Tensor:
        """NCCL reduces device tensors only: stage a CPU tensor through this rank's GPU."""
        if self.backend == "nccl" and tensor.device.type != "cuda":
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor

    # --- collectives -------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: Op = "sum", async_op: bool = False) -> Handle | Tensor:
        """Reduce `tensor` in place across ranks; "mean" sums, then divides by the world size."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        n = self.world_size
        nbytes = tensor.numel() * tensor.element_size()
        self._count("all_reduce", nbytes, 2 * (n - 1) / n * nbytes)
        work_tensor = self._staged(tensor)
        work = dist.all_reduce(work_tensor, _REDUCE_OPS[op], group=self.group, async_op=True)
        self._trace(work, "all_reduce", nbytes)

        def finish() -> None:
            if op == "mean":
                work_tensor.div_(n)
            if work_tensor is not tensor:
                tensor.copy_(work_tensor)

        handle = Handle(work, finish, label=f"all_reduce of {nbytes} bytes", dog=self.watchdog, escape=self.escape)
        return _complete(handle, async_op, tensor)

    def fused_all_reduce(self, tensors: Sequence[Tensor], op: Op = "sum", async_op: bool = False) -> Handle | None:
        """All-reduce several tensors of one dtype as one flat buffer, results copied back in place."""
        if not tensors:
            return Handle(None) if async_op else None
        flat = pack(tensors)
        inner = self.all_reduce(flat, op, async_op=True)

        def unpack() -> None:
            inner.wait()
            unpack_into(flat, tensors)

        handle = Handle(None, unpack)
        return _complete(handle, async_op, None)

    def broadcast(self, tensor: Tensor, src: int = 0, async_op: bool = False) -> Handle | Tensor:
        """Copy `src`'s tensor into every rank's `tensor`."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("broadcast", nbytes, nbytes if self.rank == src else 0)
        work_tensor = self._staged(tensor)
        work = dist.broadcast(work_tensor, src, group=self.group, async_op=True)
        self._trace(work, "broadcast", nbytes)
        handle = Handle(work, (lambda: tensor.copy_(work_tensor)) if work_tensor is not tensor else None,
                        label=f"broadcast of {nbytes} bytes", dog=self.watchdog, escape=self.escape)
        return _complete(handle, async_op, tensor)

    def reduce_scatter(self, output: Tensor, input: Tensor, async_op: bool = False) -> Handle | Tensor:
        """Sum `input` (world_size equal chunks, rank order) across ranks; this rank's chunk of the sum lands in `output`."""
        n = self.world_size
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, needs {n} x {output.numel()}")
        nbytes = input.numel() * input.element_size()
        # Gloo's CPU reduce-scatter moves what an all-reduce of the input would (checked against the
        # hosts' interface counters: docs/collectives.md); NCCL's ring sends (n-1)/n of it.
        self._count("reduce_scatter", nbytes, (n - 1) / n * nbytes * (1 if self.backend == "nccl" else 2))
        out, src = self._staged(output), self._staged(input)
        work = _reduce_scatter(out, src.contiguous(), group=self.group, async_op=True)
        self._trace(work, "reduce_scatter", nbytes)

        def finish() -> None:
            if out is not output:
                output.copy_(out)

        handle = Handle(work, finish, label=f"reduce_scatter of {nbytes} bytes", dog=self.watchdog,
                        escape=self.escape)
        return _complete(handle, async_op, output)

    def ring_reduce_scatter(self, buffer: Tensor, async_op: bool = False) -> Handle | Tensor:
        """Sum `buffer` (world_size equal chunks) over the ranks on a ring of point-to-point messages, in
        place: chunk `rank` of `buffer` ends holding the sum, the other chunks partial sums.

        Each rank sends (n-1)/n of the buffer in n-1 steps, where Gloo's own reduce-scatter sends
        2(n-1)/n (an all-reduce underneath): at 1 Gbit/s on 4 simulated hosts it takes 0.47-0.58x the
        time of Gloo's (docs/sharding.md). The steps run on this communicator's own thread, one ring
        after another in the order called, so that a caller can start it and go on with backward; the
        communicator must then carry nothing else (a group of its own, `World.group`)."""
        n = self.world_size
        if buffer.numel() % n:
            raise ValueError(f"ring_reduce_scatter: {buffer.numel()} elements do not cut into {n} equal chunks")
        nbytes = buffer.numel() * buffer.element_size()
        self._count("reduce_scatter", nbytes, (n - 1) / n * nbytes)
        if n == 1:
            return _complete(Handle(None), async_op, buffer)
        lane = self.__dict__.get("_lane")
        if lane is None:
            lane = self._lane = _Lane(f"troupe ring reduce-scatter (rank {self.rank} of {n})")
        done = lane.submit(lambda: self._ring(buffer))
        handle = Handle(None, done.result, label=f"ring reduce_scatter of {nbytes} bytes")
        return _complete(handle, async_op, buffer)

    def _ring(self, buffer: Tensor) -> None:
        n, rank = self.world_size, self.rank
        chunks = buffer.view(n, -1)
        right, left = self.global_rank((rank + 1) % n), self.global_rank((rank - 1) % n)
        incoming = torch.empty_like(chunks[0])
        for step in range(n - 1):  # chunk c leaves rank c + 1 and collects every rank's part on its way to c
            ops = [dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], right, group=self.group),
                   dist.P2POp(dist.irecv, incoming, left, group=self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            chunks[(rank - step - 2) % n].add_(incoming)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's `tensor` (all the same shape), in rank order."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("all_gather", nbytes, (self.world_size - 1) * nbytes)
        src = self._staged(tensor)
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        with waiting(self.watchdog, f"all_gather of {nbytes} bytes"):
            dist.all_gather(out, src.contiguous(), group=self.group)
        return [o.to(tensor.device) for o in out]

    def all_gather_into(self, output: Tensor, input: Tensor, async_op: bool = False) -> Handle | Tensor:
        """Every rank's `input` (all the same shape) concatenated along dim 0 in rank order, into `output`."""
        n = self.world_size
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather_into: output has {output.numel()} elements, needs {n} x {input.numel()}")
        nbytes = input.numel() * input.element_size()
        self._count("all_gather", nbytes, (n - 1) * nbytes)
        out, src = self._staged(output), self._staged(input).contiguous()
        work = _all_gather_into(out, src, group=self.group, async_op=True)
        self._trace(work, "all_gather", nbytes)
        handle = Handle(work, (lambda: output.copy_(out)) if out is not output else None,
                        label=f"all_gather of {nbytes} bytes", dog=self.watchdog, escape=self.escape)
        return _complete(handle, async_op, output)

    def all_to_all(self, output: Tensor, input: Tensor) -> Tensor:
        """Rank r sends chunk j of `input` (world_size equal chunks along dim 0) to rank j, which
        receives it as chunk r of `output`."""
        n = self.world_size
        if input.shape[0] % n or output.numel() != input.numel():
            raise ValueError(f"all_to_all: input of shape {tuple(input.shape)} must split into {n} equal chunks "
                             f"along dim 0 and output must have as many elements, has {output.numel()}")
        nbytes = input.numel() * input.element_size()
        self._count("all_to_all", nbytes, (n - 1) / n * nbytes)
        out, src = self._staged(output), self._staged(input).contiguous()
        with waiting(self.watchdog, f"all_to_all of {nbytes} bytes"):
            dist.all_to_all_single(out, src, group=self.group)
        if out is not output:
            output.copy_(out)
        return output

    def all_gather_varsize(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's 1-D `tensor`, whose length may differ per rank (even be zero)."""
        if tensor.dim() != 1:
            raise ValueError(f"all_gather_varsize takes a 1-D tensor, got shape {tuple(tensor.shape)}")
        sizes = self.all_gather(torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device))
        sizes = [int(s) for s in torch.cat(sizes).tolist()]
        longest = max(sizes)
        if longest == 0:
            return [tensor.new_empty(0) for _ in sizes]
        padded = tensor.new_zeros(longest)
        padded[: tensor.numel()] = tensor
        gathered = self.all_gather(padded)
        return [g[:n] for g, n in zip(gathered, sizes)]

    def all_gather_packed(self, tensors: Sequence[Tensor], *, same_sizes: bool = False) -> Future:
        """Start gathering several 1-D tensors (any dtypes) from every rank in one message.

        Lengths may differ per rank and be zero. ``result()`` is, per rank in rank order,
        a list of tensors with the dtypes of `tensors`. Unless `same_sizes` promises that
        every rank passes the same lengths, the lengths travel first (a small all-gather
        started now); the payload follows when the handle is waited on, padded to the
        longest rank's (the wire bytes count the padding: it is sent).
        """
        for t in tensors:
            if t.dim() != 1:
                raise ValueError(f"all_gather_packed takes 1-D tensors, got shape {tuple(t.shape)}")
        dtypes = [t.dtype for t in tensors]
        itemsizes = [torch.empty(0, dtype=d).element_size() for d in dtypes]
        device = tensors[0].device if tensors else torch.device("cpu")
        blob = (
            torch.cat([t.contiguous().view(torch.uint8) for t in tensors])
            if tensors
            else torch.empty(0, dtype=torch.uint8, device=device)
        )
        lengths = [t.numel() for t in tensors]

        def unpack(gathered: list[Tensor], rank_lengths: list[list[int]]) -> list[list[Tensor]]:
            out = []
            for raw, lens in zip(gathered, rank_lengths):
                parts, offset = [], 0
                for dtype, size, n in zip(dtypes, itemsizes, lens):
                    chunk = raw[offset : offset + n * size]
                    parts.append((chunk if offset % size == 0 else chunk.clone()).view(dtype))
                    offset += n * size
                out.append(parts)
            return out

        if same_sizes:
            work, gathered = self._all_gather_async(blob)
            everyone = [lengths] * self.world_size
            return Future(work, lambda: unpack([g.to(device) for g in gathered], everyone), self.watchdog, self.escape)

        work, sizes = self._all_gather_async(torch.tensor(lengths, dtype=torch.int64, device=device))

        def exchange_payload() -> list[list[Tensor]]:
            everyone = [[int(v) for v in s.tolist()] for s in sizes]
            nbytes = [sum(n * size for n, size in zip(lens, itemsizes)) for lens in everyone]
            longest = max(nbytes)
            if longest == 0:
                return unpack([blob.new_empty(0) for _ in everyone], everyone)
            padded = blob.new_zeros(longest)
            padded[: blob.numel()] = blob
            inner, gathered = self._all_gather_async(padded)
            inner.wait()
            return unpack([g.to(device) for g in gathered], everyone)

        return Future(work, exchange_payload, self.watchdog, self.escape)

    def _all_gather_async(self, tensor: Tensor) -> tuple[dist.Work, list[Tensor]]:
        nbytes = tensor.numel() * tensor.element_size()
        self._count("all_gather", nbytes, (self.world_size - 1) * nbytes)
        src = self._staged(tensor).contiguous()
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        return dist.all_gather(out, src, group=self.group, async_op=True), out

    def gather(self, tensor: Tensor, dst: int = 0) -> list[Tensor] | None:
        """Every rank's `tensor` on rank `dst` (None elsewhere)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("gather", nbytes, 0 if dist.get_rank() == dst else nbytes)
        src = self._staged(tensor).contiguous()
        out = [torch.empty_like(src) for _ in range(self.world_size)] if dist.get_rank() == dst else None
        with waiting(self.watchdog, f"gather of {nbytes} bytes"):
            dist.gather(src, out, dst=dst, group=self.group)
        return None if out is None else [o.to(tensor.device) for o in out]

    def scatter(self, out: Tensor, chunks: Sequence[Tensor] | None = None, src: int = 0) -> Tensor:
        """Rank `src` sends ``chunks[r]`` to rank r, which receives it into `out`."""
        if (dist.get_rank() == src) != (chunks is not None):
            raise ValueError(f"scatter: chunks must be given on the source rank {src} only")
        nbytes = out.numel() * out.element_size()
        self._count("scatter", nbytes, (self.world_size - 1) * nbytes if dist.get_rank() == src else 0)
        dst = self._staged(out)
        staged = None if chunks is None else [self._staged(c).contiguous() for c in chunks]
        with waiting(self.watchdog, f"scatter of {nbytes} bytes"):
            dist.scatter(dst, staged, src=src, group=self.group)
        if dst is not out:
            out.copy_(dst)
        return out

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's picklable `obj`, in rank order (for one-off checks, not hot paths)."""
        out: list[object] = [None] * self.world_size
        with waiting(self.watchdog, "all_gather_object"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_same(self, signature: list, what: str) -> None:
        """Raise the same readable ValueError on every rank unless every rank passes an equal `signature`
        (a list of entries: the first differing entry and the rank that has it are named)."""
        if self.world_size == 1:
            return
        everyone = self.all_gather_object(signature)
        for r, theirs in enumerate(everyone):
            if theirs != signature:
                diff = next((i for i, (a, b) in enumerate(zip(signature, theirs)) if a != b), None)
                where = (
                    f"first difference at entry {diff}: {signature[diff]} here vs {theirs[diff]} on rank {r}"
                    if diff is not None
                    else f"{len(signature)} entries here vs {len(theirs)} on rank {r}"
                )
                raise ValueError(f"rank {dist.get_rank()}: {what} differs across ranks ({where}); "
                                 "every rank must build the same model")

    @torch.no_grad()
    def broadcast_tensors(self, tensors: Sequence[Tensor], src: int = 0, cap: int = 2**24) -> None:
        """Copy `src`'s values into every rank's `tensors`: fused messages per dtype and device of at most
        about `cap` elements each (a fused copy of a whole large model would double its memory while it
        travels); a contiguous tensor of `cap` elements or more travels alone, in place."""
        if self.world_size == 1:
            return
        groups: dict[tuple, list[Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for key in sorted(groups, key=str):
            batch: list[Tensor] = []
            for t in [*groups[key], None]:
                if t is not None and t.numel() >= cap and t.is_contiguous():
                    self.broadcast(t.detach(), src=src)
                    continue
                if batch and (t is None or sum(b.numel() for b in batch) + t.numel() > cap):
                    flat = pack(batch)
                    self.broadcast(flat, src=src)
                    unpack_into(flat, batch)
                    batch = []
                if t is not None:
                    batch.append(t)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        self._count("barrier", 0, 0)
        with waiting(self.watchdog, "barrier"):
            dist.barrier(group=self.group)

    # --- point-to-point (parameter-server messages) ----------------------------------
    # Ranks here are global ranks, as torch.distributed's send/recv take them.

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send `tensor` to global rank `dst` (blocks until handed to the transport)."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("send", nbytes, nbytes)
        with self._marked(f"send to rank {dst}"):
            dist.send(self._staged(tensor).contiguous(), dst, group=self.group, tag=tag)

    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into `tensor` from `src`, or from any rank when None; returns the sender."""
        self._count("recv", tensor.numel() * tensor.element_size(), 0)
        work_tensor = self._staged(tensor)
        with self._marked("a receive from any rank" if src is None else f"a receive from rank {src}"):
            sender = dist.recv(work_tensor, src, group=self.group, tag=tag)
        if work_tensor is not tensor:
            tensor.copy_(work_tensor)
        return sender

    def _marked(self, what: str):
        """The watchdog knows this rank is blocked on a peer (so a rank cut off from the job while
        waiting stops, naming what it lost); errors are the caller's to handle."""
        return self.watchdog.waiting(what) if self.watchdog is not None else contextlib.nullcontext()

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Handle:
        """Start sending `tensor` to `dst`; keep `tensor` unchanged until the handle is waited on."""
        nbytes = tensor.numel() * tensor.element_size()
        self._count("send", nbytes, nbytes)
        return Handle(dist.isend(self._staged(tensor).contiguous(), dst, group=self.group, tag=tag),
                      dog=self.watchdog, escape=self.escape)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Handle:
        """Start receiving into `tensor` from `src`."""
        self._count("recv", tensor.numel() * tensor.element_size(), 0)
        return Handle(dist.irecv(tensor, src, group=self.group, tag=tag), dog=self.watchdog, escape=self.escape)

    def new_group(self, ranks: Sequence[int], timeout: float | None = None) -> Communicator:
        """A communicator over a subset of global ranks; every rank of the job must call it, in the same order.

        `timeout` (seconds) overrides the job's for this group's operations.
        """
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        group = dist.new_group(sorted(ranks), **kwargs)
        if dist.get_rank() not in ranks:
            return Outside()
        comm = Communicator(group, watchdog=self.watchdog, recorder=self.recorder, totals=self._totals)
        comm.escape = self.escape
        return comm


class _Lane:
    """One daemon thread running the calls handed to it, in order (a daemon: a ring that waits for a dead
    peer must not keep the process from exiting)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], object]) -> futures.Future:
        done: futures.Future = futures.Future()
        self._calls.put((call, done))
        return done

    def _run(self) -> None:
        while True:
            call, done = self._calls.get()
            try:
                done.set_result(call())
            except BaseException as e:  # the waiter raises it
                done.set_exception(e)


class Outside:
    """What `new_group` returns on a rank outside the group: using it is a bug."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"this rank ({dist.get_rank()}) is not a member of the group; cannot call {name}")
