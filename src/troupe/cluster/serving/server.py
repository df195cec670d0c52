"""The server loop: receive a message from any worker, check it, apply it to the ParamShard, reply.

A frame (`troupe.cluster.wire.frames`: a worker's messages of one step) is handled message by message,
and the replies it causes leave as one frame per worker once it is done.

All state lives in `ParamShard`; this file only moves messages. A worker that stops
(Op.STOP) or dies (a send to it fails, or its process is gone) is forgotten: updates its group was waiting for
complete without it, and the loop ends when every worker is gone. With several separate server
groups a server then also waits until every server group has finished (their messages travel on a
channel of their own, `troupe.cluster.serving.serversync`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from troupe.runtime.comm import Communicator
from troupe.cluster.wire import sparse
from troupe.cluster.wire.frames import HEADER_BYTES, Frame, pack
from troupe.cluster.wire.messages import (HEADER_TAG, PAYLOAD_TAG, SPARSE, WITH_PAYLOAD, Header, MessageError, Op, check,
                                     empty_header)
from troupe.cluster.serving.serversync import ServerSync
from troupe.cluster.serving.shard import ParamShard
from troupe.cluster.wire.links import Links, reason
from troupe.runtime import liveness
from troupe.compress.topk import topk_count

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.5
"""Seconds between checks that the live workers' processes still exist."""


@dataclass
class ServerStats:
    """What one server did, for logs and benchmarks."""

    updates: int
    seconds: float
    staleness_mean: float
    staleness_max: int
    skipped: int
    """Group updates of a slice skipped because a worker's gradient was not finite (nan_policy)."""
    rejected: int
    dead_workers: list[int]
    sync: str = ""
    """With several server groups: what the synchronisation with the neighbour servers did."""
    returns: int = 0
    """`troupe run --elastic`: restarted workers that dialled back in."""
    took_over: tuple[int, ...] = ()
    """`troupe run --elastic`: the worker groups this server took over when their server died."""

    @property
    def updates_per_second(self) -> float:
        return self.updates / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"{self.updates} slice updates in {self.seconds:.1f}s ({self.updates_per_second:.0f}/s), "
            f"staleness mean {self.staleness_mean:.2f} max {self.staleness_max}, {self.skipped} skipped (non-finite), "
            f"{self.rejected} message(s) rejected, workers gone without stopping: {self.dead_workers or 'none'}"
            + (f"; {self.sync}" if self.sync else "")
            + (f"; {self.returns} worker restart(s) taken back" if self.returns else "")
            + (f"; took over worker group(s) {list(self.took_over)}" if self.took_over else "")
        )


@dataclass(frozen=True)
class TakeOver:
    """`troupe run --elastic` over an asynchronous cluster of several server groups: a server is never
    restarted; when one dies, the workers it served fail over to the server with its index in the next
    live server group (`troupe.cluster.workers.ps_client`), whose replica of the same slices they then
    step. That server serves their groups from their first Get on."""

    group_of: dict[int, int]
    """Every worker's worker group."""
    mean: bool
    """group_merge "mean": each group's update counts 1/G of the G groups the server serves, then too."""


@dataclass(frozen=True)
class _Later:
    """A reply whose values are read once the frame's updates have been stepped (`ParamShard.flush`)."""

    slice_id: int
    ack: bool


class Server:
    """Serves one `ParamShard` to the workers of the groups it is responsible for."""

    def __init__(
        self,
        comm: Communicator,
        shard: ParamShard,
        workers: list[int],
        putters: set[int],
        alive: Callable[[int], bool] | None = None,
        fail_on_death: bool = False,
        wire_dtype: torch.dtype | None = None,
        wire_topk: float | None = None,
        sync: ServerSync | None = None,
        on_exit: Callable[[], None] | None = None,
        links: Links | None = None,
        evict_after: float | None = None,
        beats: torch.distributed.Store | None = None,
        take_over: TakeOver | None = None,
    ):
        self.comm = links if links is not None else comm
        self.shard = shard
        self.rank = comm.rank
        self.live = set(workers)
        """Workers that have not stopped or died; every worker says Stop to every server."""
        self.putters = putters
        """Workers allowed to Put initial values (the first worker group)."""
        self.waiting_gets: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.max_len = max((s.numel for s in shard.slices.values()), default=0)
        self.rejected = 0
        self.dead: list[int] = []
        self.alive = alive or (lambda worker: True)
        """Whether a worker still exists (its process on this host, its heartbeat on any host), to
        tell a dead or cut-off worker from a slow one."""
        self.fail_on_death = fail_on_death
        """Synchronous clusters cannot go on without a worker: end the job with a clear error instead."""
        self.no_values: dict[tuple[int, int], deque[bool]] = defaultdict(deque)
        """Per (worker, slice), for each of its updates not answered yet, oldest first: whether it was a
        Push or a Skip (the answer is an Ack) rather than an Update (a Reply with values). Under
        background fetch a worker may have two in flight."""
        self.wire = wire_dtype or shard.dtype
        """The dtype of Update and Push payloads and of every Reply (`ClusterConfig.wire_dtype`); Puts are the shard's."""
        self.topk = wire_topk
        """Updates and Pushes come as the top-K of each slice, (index, value) pairs (`ClusterConfig.wire_topk`)."""
        self.sync = sync
        """Several separate server groups: this server's side of their synchronisation (None: one group)."""
        self.on_exit = on_exit
        """Run (the checkpoint) when the watch thread ends a server whose loop waits for a message that will
        never come."""
        self._lock = sync.lock if sync is not None else threading.Lock()
        """The loop, the watch thread and the neighbours' thread all change the shard."""
        self._frame: Frame | None = None
        """The frame being handled: payloads come from its body instead of the network."""
        self._outbox: dict[int, list[tuple[Header, torch.Tensor | None] | _Later]] | None = None
        """While a frame is handled: the replies it causes, per worker, sent as one frame each at its end."""
        self._later: set[int] | None = None
        """While a frame is handled: the slices with a reply in the outbox still waiting for their values."""
        self.max_frame = (2 * len(shard.slices) + 2) * (HEADER_BYTES + 8 * max(self.max_len, shard.ngroups))
        """The largest frame a worker may send: each slice's Put and Get, and a learning rate message."""
        self._start = time.perf_counter()
        self.links = links
        """`troupe run --elastic`: the workers' links (`troupe.cluster.wire.links`); a worker whose link
        fails is waited for until it dials again, restarted (None: the job's group carries the messages)."""
        self.returning: set[int] = set()
        """With links: workers that died and will be back (their launcher restarts them)."""
        self.evict_after, self.beats = evict_after, beats
        """With links: the store the workers beat in (runtime/liveness.py); a worker its group waits for whose beat
        has not moved for `evict_after` seconds is frozen: it is evicted (`_evict_frozen`)."""
        self._notices: list = []
        """Evicted headers sent to frozen workers (delivered when they wake; never waited for)."""
        self.returns = 0
        self.take_over = take_over
        self.took_over: list[int] = []
        if links is not None:
            links.on_link = self._linked
            links.on_lost = self._link_lost

    def serve(self) -> ServerStats:
        """Run until every worker has stopped or died (and, with several server groups, every group has finished)."""
        self._start = time.perf_counter()
        if self.sync is not None:
            self.sync.start(self.alive)
        if self.links is None:
            threading.Thread(target=self._watch, name="troupe-ps-watch", daemon=True).start()
        else:
            self.links.listen(self.live, empty_header)
            if self.evict_after is not None and self.beats is not None \
                    and any(len(m) > 1 for m in self.shard.members.values()):  # only a group of several waits
                threading.Thread(target=self._evict_frozen, name="troupe-ps-evict", daemon=True).start()
        while self.live or self.returning:
            raw = empty_header()
            src = self.comm.recv(raw, tag=HEADER_TAG)
            with self._lock:
                try:
                    self._handle(src, raw)
                except MessageError as e:
                    self.rejected += 1
                    log.error("troupe server rank %d: rejected a message from rank %d: %s", self.rank, src, e)
                except RuntimeError as e:  # with links: the worker died in the middle of its message
                    if self.links is None:
                        raise
                    self._lost(src, reason(e))
                self._progress()
        if self.links is not None:
            self.links.close()
        with self._lock:
            self._finish_sync()
            return self._stats()

    def _progress(self) -> None:
        if self.sync is not None:
            self.sync.progress(self.live | self.returning)

    def _finish_sync(self) -> None:
        """With several server groups: the last sync, then wait until every group has finished (lock held)."""
        if self.sync is not None:
            self.sync.progress(self.live | self.returning)
            self.sync.wait_done()
            self.sync.close()

    def _stats(self) -> ServerStats:
        stale = self.shard.staleness
        return ServerStats(
            updates=self.shard.updates,
            seconds=time.perf_counter() - self._start,
            staleness_mean=sum(stale) / len(stale) if stale else 0.0,
            staleness_max=max(stale, default=0),
            skipped=self.shard.skipped,
            rejected=self.rejected,
            dead_workers=sorted(self.dead),
            sync="" if self.sync is None else self.sync.stats(),
            returns=self.returns,
            took_over=tuple(self.took_over),
        )

    # --- messages ----------------------------------------------------------------------

    def _handle(self, src: int, raw: torch.Tensor) -> None:
        header = Header.decode(raw)  # without a valid header the payload length is unknown: drop it
        if header.frame:
            self._handle_frame(src, header)
            return
        try:
            self._validate(src, header)
        except MessageError:
            self._drain(header, src)
            raise
        self._apply(src, header)

    def _handle_frame(self, src: int, opener: Header) -> None:
        """Each message of the frame in order, as if it had come alone; the replies leave at the end.
        A message that fails its checks is rejected and skipped; one whose header cannot be read ends
        the frame (where the next message starts is unknown). The updates the frame completes are
        applied in one optimizer step (`ParamShard.fused`), and its replies take their values after it."""
        self._frame, self._outbox, self._later = Frame.receive(self.comm, opener, src, self.max_frame), {}, set()
        try:
            with self.shard.fused():
                self._serve_frame(src, opener)
        finally:
            self._make_replies()
            self._frame, outbox = None, self._outbox
            self._outbox = self._later = None
            for worker, messages in outbox.items():
                self._send(worker, messages)

    def _serve_frame(self, src: int, opener: Header) -> None:
        length = self._expected_length(opener)
        if length is None:
            raise MessageError(f"a frame from rank {src} opened by {opener.op.name} for slice {opener.slice_id}, "
                               "not held here (where its next message starts is unknown)")
        header = opener.with_length(length)
        while True:
            try:
                self._validate(src, header)
            except MessageError as e:
                self._drain(header, src)
                self._reject(src, e)
            else:
                self._settle(header)
                try:
                    self._apply(src, header)
                except MessageError as e:  # its payload is consumed: the next message lines up
                    self._reject(src, e)
            if not self._frame.left:
                return
            header = self._frame.next_header()

    def _settle(self, header: Header) -> None:
        """Step the frame's waiting updates and fill in its replies before a message that would change what
        they say: anything but an update, or an update of a slice already answered in this frame."""
        op = SPARSE.get(header.op, header.op)
        if op not in (Op.UPDATE, Op.PUSH, Op.SKIP) or header.slice_id in self._later:
            self.shard.flush()
            self._make_replies()

    def _make_replies(self) -> None:
        """Fill in the frame's replies that wait for their slice's values (after `ParamShard.flush`)."""
        for messages in self._outbox.values():
            for i, message in enumerate(messages):
                if isinstance(message, _Later):
                    messages[i] = self._message(message.slice_id, message.ack)
        self._later.clear()

    def _reject(self, src: int, e: MessageError) -> None:
        self.rejected += 1
        log.error("troupe server rank %d: rejected a message of a frame from rank %d: %s", self.rank, src, e)

    def _validate(self, src: int, header: Header) -> None:
        """Raise `MessageError` unless this server can apply the message."""
        slice_ = self.shard.slices.get(header.slice_id)
        if src not in self.live:
            raise MessageError(f"{header.op.name} from rank {src}, which is not a live worker of this server")
        op = SPARSE.get(header.op, header.op)  # what the message does, once its pairs are scattered
        if op in (Op.UPDATE, Op.PUSH) and (header.op in SPARSE) != (self.topk is not None):
            raise MessageError(f"{header.op.name} from rank {src}: this cluster's updates are " +
                               (f"top-K pairs (wire_topk {self.topk})" if self.topk else "dense (wire_topk unset)"))
        expected = self._expected_length(header)
        allowed = {Op.GET, Op.PUT, Op.UPDATE, Op.PUSH, Op.SKIP, Op.STOP, Op.LR, *SPARSE}
        check(header, src=src, expected_length=expected, allowed=allowed)
        if op in (Op.GET, Op.PUT, Op.UPDATE, Op.PUSH, Op.SKIP) and slice_ is None:
            raise MessageError(f"{header.op.name} from rank {src} for slice {header.slice_id}, not held here")
        if header.op is Op.PUT and src not in self.putters:
            raise MessageError(f"PUT from rank {src}: only the first worker group puts initial values")
        if op in (Op.PUT, Op.UPDATE, Op.PUSH, Op.SKIP) and not self.shard.holds(src, header.slice_id):
            raise MessageError(f"{header.op.name} from rank {src} for slice {header.slice_id}, which another "
                               "worker of its group holds (a partitioned model)")
        if op in (Op.UPDATE, Op.PUSH, Op.SKIP) and header.slice_id not in self.shard.initialised:
            raise MessageError(f"{header.op.name} from rank {src} for slice {header.slice_id} before any PUT")

    def _expected_length(self, header: Header) -> int | None:
        """The payload length a message of this op and slice must have (None: an unknown slice)."""
        if header.op is Op.LR:
            return self.shard.ngroups
        if header.op not in WITH_PAYLOAD:
            return 0
        slice_ = self.shard.slices.get(header.slice_id)
        if slice_ is None:
            return None
        if header.op in SPARSE:
            if self.topk is None:
                raise MessageError(f"{header.op.name} from rank {header.sender}: this cluster's updates are dense "
                                   "(wire_topk unset)")
            return topk_count(self.topk, slice_.numel)
        return slice_.numel

    def _payload(self, src: int, header: Header) -> torch.Tensor:
        """The payload `header` announces: the next part of the frame being handled, or a receive."""
        size, dtype = self._payload_size(header), self._payload_dtype(header.op)
        if self._frame is not None:  # top-K pairs are bytes holding int32 indices and values
            return self._frame.take(size, dtype, align=8 if header.op in SPARSE else None)
        payload = torch.empty(size, dtype=dtype)
        self.comm.recv(payload, src, tag=PAYLOAD_TAG)
        return payload

    def _apply(self, src: int, header: Header) -> None:
        payload = None
        if header.length:
            payload = self._payload(src, header)
            if header.op in SPARSE:  # checked before anything is applied; a bad one is rejected, consumed
                numel = self.shard.slices[header.slice_id].numel
                index, values = sparse.decode(payload, header.length, self.wire, numel)
                payload = sparse.densify(index, values, numel, self.shard.dtype)
                header = replace(header, op=SPARSE[header.op], length=numel)
            payload = payload.to(torch.float64 if header.op is Op.LR else self.shard.dtype)
        if header.op is Op.LR:
            self.shard.set_lr(payload.tolist())
        elif header.op is Op.PUT:
            if header.slice_id in self.shard.initialised:
                return  # the first Put wins (or the server resumed from a checkpoint)
            self.shard.put(header.slice_id, payload)
            for worker, _ in self.waiting_gets.pop(header.slice_id, []):
                self._reply(worker, header.slice_id)
        elif header.op is Op.GET:
            if src not in self.shard.group_of and self.take_over is not None:
                self._take_over(src)
            if header.slice_id in self.shard.initialised:
                self._reply(src, header.slice_id)
            else:
                self.waiting_gets[header.slice_id].append((src, header.version))
        elif header.op in (Op.UPDATE, Op.PUSH, Op.SKIP):
            acks = self.no_values[(src, header.slice_id)]
            acks.append(header.op is not Op.UPDATE)  # a Push or a Skip: the worker keeps its values
            try:
                done = self.shard.update(header.slice_id, src, payload, header.version)
            except ValueError as e:
                acks.pop()
                raise MessageError(str(e)) from None
            self._replies(header.slice_id, done)
        elif header.op is Op.STOP:
            self._forget(src)

    def _take_over(self, worker: int) -> None:
        """A worker of another server group's worker groups Gets here: its server died and it failed over.
        Serve its whole group from now on (its other workers fail over here too)."""
        group = self.take_over.group_of.get(worker)
        if group is None:
            return
        workers = {w for w, g in self.take_over.group_of.items() if g == group}
        scale = 1.0 / len(set(self.shard.members) | {group}) if self.take_over.mean else None
        self.shard.serve_group(group, workers, workers & self.live, scale)
        if self.sync is not None:
            self.sync.own_workers |= workers
        self.took_over.append(group)
        late = self.sync is not None and self.sync.finishing
        print(f"troupe server rank {self.rank}: serving worker group {group} too (worker {worker} failed over "
              "to this server: its own is gone)" + ("; this server's own workers have finished and so has its "
              "sync with the other server groups: what the group does from now on stays on this server" if late
              else ""), file=sys.stderr, flush=True)

    def _drain(self, header: Header, src: int) -> None:
        # Consume the payload a rejected header announces, so the next message from src lines up.
        if self._frame is not None:  # beyond the frame's end: a MessageError ends the frame
            self._frame.skip(self._payload_size(header) * self._payload_dtype(header.op).itemsize)
        elif header.op is Op.LR and 0 < header.length <= self.shard.ngroups:
            self.comm.recv(torch.empty(header.length, dtype=torch.float64), src, tag=PAYLOAD_TAG)
        elif 0 < header.length <= self.max_len:
            self.comm.recv(torch.empty(self._payload_size(header), dtype=self._payload_dtype(header.op)), src,
                           tag=PAYLOAD_TAG)

    def _payload_dtype(self, op: Op) -> torch.dtype:
        """What a message's payload arrives as: learning rates in float64, Puts in full, sparse ones as bytes,
        the rest on the wire's."""
        if op in SPARSE:
            return torch.uint8
        return torch.float64 if op is Op.LR else self.shard.dtype if op is Op.PUT else self.wire

    def _payload_size(self, header: Header) -> int:
        """Elements of the payload `header` announces (bytes, for `length` sparse pairs)."""
        return sparse.payload_bytes(header.length, self.wire) if header.op in SPARSE else header.length

    def _replies(self, slice_id: int, workers: list[int]) -> None:
        for worker in workers:
            self._reply(worker, slice_id)
        for held_slice, held_workers in self.shard.released():  # the staleness bound lets them go
            for worker in held_workers:
                self._reply(worker, held_slice)

    def _reply(self, worker: int, slice_id: int) -> None:
        acks = self.no_values.get((worker, slice_id))
        ack = bool(acks and acks.popleft())  # a Push: acknowledge without values
        if self._outbox is None:
            self._send(worker, [self._message(slice_id, ack)])
        elif self.shard.waiting(slice_id) or slice_id in self._later:  # its values come at the frame's flush
            self._outbox.setdefault(worker, []).append(_Later(slice_id, ack))
            self._later.add(slice_id)
        else:
            self._outbox.setdefault(worker, []).append(self._message(slice_id, ack))

    def _message(self, slice_id: int, ack: bool) -> tuple[Header, torch.Tensor | None]:
        """The Ack or Reply (with the slice's values now) for `slice_id`."""
        version, value = self.shard.get(slice_id)
        if ack:
            return Header(Op.ACK, slice_id, version, self.rank, 0), None
        value = value.to(self.wire, copy=self._outbox is not None)  # a frame leaves after more updates
        return Header(Op.REPLY, slice_id, version, self.rank, value.numel()), value

    def _send(self, worker: int, messages: list[tuple[Header, torch.Tensor | None]]) -> None:
        if worker not in self.live:  # gone while the frame was handled
            return
        try:
            for tensor, tag in pack(messages):
                self.comm.send(tensor, worker, tag)
        except RuntimeError as e:  # Gloo: "Connection closed by peer"
            self._lost(worker, reason(e))

    def _linked(self, worker: int) -> None:
        """With links: `worker` dialled (at the job's start, or restarted): serve it (again)."""
        with self._lock:
            if worker in self.returning:
                self.returning.discard(worker)
                if worker in self.shard.group_of:  # one of this server's groups (the others only say Stop here)
                    self.returns += 1
                    print(f"troupe server rank {self.rank}: worker {worker} is back (restarted)", file=sys.stderr,
                          flush=True)
            self.live.add(worker)
            self.shard.add_worker(worker)

    def _link_lost(self, worker: int, why: str) -> None:
        with self._lock:
            self._lost(worker, why)
            self._progress()

    def _lost(self, worker: int, why: str) -> None:
        if self.links is not None:
            if worker not in self.live:  # it said Stop already (its link then closes), or is lost already
                return
            self.links.lose(worker, why, tell=False)
            if worker in self.shard.group_of:
                print(f"troupe server rank {self.rank}: worker {worker} is gone ({why}); serving the others until "
                      "it is back", file=sys.stderr, flush=True)
                self.dead.append(worker)
            self._forget(worker)
            self.returning.add(worker)
            # What its last life was owed dies with it: a restart starts with a Get.
            for key in [k for k in self.no_values if k[0] == worker]:
                del self.no_values[key]
            for slice_id, waiting in list(self.waiting_gets.items()):
                self.waiting_gets[slice_id] = [(w, v) for w, v in waiting if w != worker]
            return
        if self.fail_on_death:
            print(f"troupe server rank {self.rank}: worker {worker} died ({why}); a synchronous cluster cannot "
                  "go on without it: stopping", file=sys.stderr, flush=True)
            os._exit(1)  # may run in the watch thread: end the process, the workers then fail fast
        print(f"troupe server rank {self.rank}: worker {worker} is gone ({why}); serving the others",
              file=sys.stderr, flush=True)
        self.dead.append(worker)
        self._forget(worker)

    def _evict_frozen(self) -> None:
        """With links: evict a worker its group waits for (its mates' updates of a step are in, its own is not)
        whose beat has not moved for `evict_after` seconds: frozen (SIGSTOP), not slow. The group goes on
        without it at once; an Evicted header waits in its link, the first thing it reads when it wakes: it
        exits, and its launcher restarts it, to rejoin as a dead worker does."""
        watch, watched = liveness.Silence(self.beats), set()  # the late workers' beats
        while True:
            time.sleep(WATCH_INTERVAL)
            with self._lock:
                if not (self.live or self.returning):
                    return
                late = set().union(*self.shard.missing().values()) & self.live
                for worker in watched - late:
                    watch.forget(worker)
                watched = set(late)
                try:
                    silent = watch.look(sorted(late))
                except (RuntimeError, ConnectionError, OSError):  # the launcher's store is gone: the job ends
                    return
                for worker, still in silent.items():
                    if still > self.evict_after:
                        watch.forget(worker)
                        watched.discard(worker)
                        self._evict(worker)
                self._progress()

    def _evict(self, worker: int) -> None:
        try:  # isend: a frozen worker posts no receive until it wakes, and this thread must not wait for it
            self._notices.append(self.comm.isend(Header(Op.EVICTED, 0, 0, self.rank, 0).encode(), worker,
                                                 tag=HEADER_TAG))
        except RuntimeError:
            pass
        self._lost(worker, f"its group waited {self.evict_after:g} s for its update and its beat had stopped "
                           "(frozen): evicted, it restarts when it wakes")

    def _forget(self, worker: int) -> None:
        self.live.discard(worker)
        for slice_id, workers in self.shard.remove_worker(worker):
            self._replies(slice_id, workers)
        self._replies(-1, [])  # a group that left no longer holds the others back

    def _watch(self) -> None:
        """Forget workers gone without saying Stop (killed, crashed, or cut off by the network).

        Runs in a thread because the loop blocks in a receive from any rank; Gloo cannot
        probe a peer without blocking on it, so liveness comes from outside: the process on
        this host (by pid) and the heartbeat in the job's store on any host (`alive`).
        """
        while True:
            time.sleep(WATCH_INTERVAL)
            with self._lock:
                if not self.live:
                    return
                for worker in sorted(self.live):
                    if not self.alive(worker):
                        self._lost(worker, "its process ended or its heartbeat stopped")
                if not self.live:
                    # The loop is blocked in a receive nobody will answer: end the server here.
                    self._finish_sync()
                    if self.on_exit is not None:
                        self.on_exit()
                    stats = self._stats()
                    print(f"troupe server rank {self.rank}: every worker finished or died; {stats}", file=sys.stderr)
                    sys.stderr.flush()
                    os._exit(0)


def process_alive(host: str | None, pid: int | None) -> bool:
    """False when process `pid` on this host has ended; True for other hosts (they cannot be checked)."""
    if host != socket.gethostname() or pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
