"""The worker side of separate servers (Sandblaster, Downpour): Update messages per slice, fresh slices back.

A worker's gradients go to the servers of its group as Update messages, one per slice;
`step()` copies the fresh slices in. Under a partitioned model (`troupe.partition`) a worker
sends and fetches only the slices of the parameters it holds (`troupe.cluster.workers.layout`).
The Updates leave in `step()`, after anything the loop does to the gradients between backward and step (clipping); once a step shows that
the loop leaves them alone, they leave during backward instead, bucket by bucket,
overlapped with it (`ClusterConfig.send_updates`). nan_policy: a worker checks its
gradients before they leave, and Skips every slice of a non-finite step. With
`ClusterConfig.wire_topk` each slice's Update carries only the top-K of (its gradient + what
this worker left out of that slice before), as (index, value) pairs (`troupe.cluster.wire.sparse`);
the rest is kept as the slice's residual (error feedback), in `state_dict()`.
With `ClusterConfig.fetch` "background" a step does not wait for its replies: a thread receives
them while the next step computes, and that step's `step()` copies them in. A step's messages to
one server leave as one frame, and its replies come back as one (`troupe.cluster.wire.frames`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NoReturn

import torch
from torch import Tensor

from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.roles import Role
from troupe.cluster.workers import PS_WORKER_STATE
from troupe.cluster.serving.shard import plan_slices
from troupe.cluster.wire import sparse
from troupe.cluster.wire.frames import HEADER_BYTES, Inbox, pack
from troupe.cluster.wire.messages import HEADER_TAG, PAYLOAD_TAG, SPARSE, Header, MessageError, Op, check
from troupe.cluster.workers.layout import Layout
from troupe.cluster.wire.links import Links, reason
from troupe.compress.feedback import ErrorFeedback, residual_norm
from troupe.compress.fp16 import half_dtype
from troupe.reliability.nonfinite import all_finite
from troupe.runtime.comm import Communicator, Handle
from troupe.runtime.quorum import REJOIN_EXIT
from troupe.strategies.base import BaseStrategy
from troupe.sync.bucket import Bucket
from troupe.sync.hooks.send import SendBuckets
from troupe.sync.reducer import GradReducer

log = logging.getLogger(__name__)

SPARSE_OF = {dense: op for op, dense in SPARSE.items()}
"""Update -> SparseUpdate, Push -> SparsePush: what a top-K worker sends instead."""


def finite(flats: Sequence[Tensor]) -> bool:
    """Every element finite (one sum per tensor; an overflowing sum is confirmed element by element)."""
    return all_finite(flats) or all(bool(torch.isfinite(t).all()) for t in flats)


def _leave_evicted(rank: int, server: int) -> NoReturn:
    """A server left this worker out of its group's updates while it was frozen (`troupe run --elastic`): end
    the process now, as a crash would (its sends to the server will never be taken, and a goodbye would wait
    for them); its launcher restarts it, and it rejoins from its record."""
    print(f"troupe: worker rank {rank} was evicted by server rank {server}: its group went on without it while "
          "it was frozen; exiting, to be restarted and rejoin", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(REJOIN_EXIT)  # its launcher starts it again at once (not a failure: no restart spent)


class PSClient(BaseStrategy):
    """A worker talking to separate servers: an Update per slice, fresh slices back in `step()`.

    When the Updates leave (`ClusterConfig.send_updates`): backward packs the gradients into
    buckets (``p.grad`` becomes a view of them) and `step()` sends what ``p.grad`` holds then,
    so clipping or unscaling between backward and step reaches the servers. Under "auto", a
    step whose gradients nobody touched after backward (same bucket memory, same version
    counter) lets the next steps send each bucket as backward fills it, overlapped with the
    rest of backward; a loop that touches them keeps sending in `step()`. Touching them
    after they left (only some steps clip) is an error that names the setting.

    `nan_policy` (DistOpt's): every worker checks its gradients before they leave; one with a
    non-finite gradient sends Skip instead of Update for every slice, so the group's update of
    every slice is skipped on the servers (as one process skips the step) and the message
    protocol stays in step. Under "skip" the Updates always leave in `step()` (the verdict
    must come before any of them); under "raise", buckets sent during backward before a
    non-finite one have been applied when the error is raised.
    """

    name = "ps-client"

    def __init__(self, cluster: ClusterConfig, role: Role, everyone: Sequence[Role], world: Communicator | Links,
                 params: Sequence[Tensor], bucket_size: int, optimizer: torch.optim.Optimizer,
                 nan_policy: str = "raise", *, layout: Layout | None = None, agree: Communicator | None = None,
                 average: Communicator | None = None, rejoined: bool = False, alone: Communicator | None = None,
                 fail_over: bool = False,
                 gone: Sequence[int] = ()):
        self.cluster, self.role, self.world = cluster, role, world
        self.rejoined = rejoined
        """A restarted worker (`troupe run --elastic`): the servers hold the values, it only Gets them.
        `alone`: with links for messages (`troupe run --elastic`), the communicator of this worker alone that
        the gradient buckets are packed on (nothing is all-reduced among the workers).
        `fail_over` (`troupe run --elastic`, several server groups, asynchronous): a server whose link fails is
        gone for good (none is restarted), and this worker's slices it held go to the same server of the
        next live server group (`_fail_over`); `gone`: the servers known gone when this worker starts."""
        self.rank = role.rank
        self.params = list(params)
        # The job parameters the servers hold: this worker's own, or a partitioned model's union.
        numels = layout.numels if layout is not None else tuple(p.numel() for p in self.params)
        position = layout.local if layout is not None else tuple(range(len(self.params)))
        self.owners = layout.owners if layout is not None else ()
        self.index = {id(p): position[i] for i, p in enumerate(self.params)}
        self.local = {position[i]: p for i, p in enumerate(self.params)}
        self.slices = plan_slices(numels, cluster.nservers_per_group)
        self.mine = [s for s in self.slices if s.param in self.local]
        """The slices of the parameters this worker holds: the only ones it Puts, Updates and Gets."""
        self.by_param: dict[int, list] = defaultdict(list)
        for s in self.mine:
            self.by_param[s.param].append(s)
        self.agree = agree
        """A partitioned model's worker group: its workers agree on the step's nan verdict."""
        self.average = average
        """A replica's worker group (Sandblaster; Downpour's groups of several): where the Updates leave in
        step(), backward leaves the group's mean gradient in ``p.grad``, so a loop that clips clips what one
        process would (each worker's own norm is not the group's). The servers average the group's Updates:
        k equal means give what k own gradients give."""
        servers = sorted((r.server, r.rank) for r in everyone if r.server)
        self.all_servers = [rank for _, rank in servers]
        self.server_group = cluster.server_group_of(role.worker[0])
        self.fail_over = fail_over
        self.gone = set(gone)
        """Servers that died (`fail_over`): their slices are served by the next live server group's."""
        self.failovers: list[dict] = []
        """Per failover: the step, the servers gone and the servers their slices went to."""
        self.server_of = {s.id: self._route(s.server) for s in self.slices}
        self.version = {s.id: 0 for s in self.mine}
        self.nan_policy = nan_policy
        self.wire = None if cluster.wire_dtype == "fp32" else half_dtype(cluster.wire_dtype)
        """Updates, Pushes and the values fetched travel in this dtype (None: the parameters' own)."""
        self.residuals: dict[str, Tensor] = {}
        """Top-K (`ClusterConfig.wire_topk`): per slice ("slice<id>"), what this worker has not sent yet."""
        self.feedback = None if cluster.wire_topk is None else \
            ErrorFeedback(sparse.WireTopK(cluster.wire_topk, self.wire), self.residuals)
        """Top-K: each slice's Update is the top-K of (its update + its residual), as (index, value) pairs."""
        self._pack = SendBuckets(self._hold_bucket)
        self._send = SendBuckets(self._send_bucket)
        # Nothing is all-reduced among the workers: the reducer only packs (and maybe sends) buckets.
        self.reducer = GradReducer(self.params, alone or world, bucket_size, hook_for_step=self._open_step,
                                   describe_step=lambda: self.name, agreement=False)
        self._sends: list[tuple[int, Handle]] = []  # (server, its send)
        self._outbox: dict[int, list[tuple[Header, Tensor | None]]] = defaultdict(list)
        """Per server: the messages posted since the last flush, to leave as one frame."""
        self._max_frame = 4 * sum(HEADER_BYTES + 8 * s.numel for s in self.mine)
        """The largest frame of replies a server may send (a frame holds at most a few steps' replies)."""
        self._inbox_of = Inbox(world, self._max_frame,
                               lambda h, server: self._slice_of(h, server).numel if h.op is Op.REPLY else 0)
        """The servers' replies, lone or in frames (a frame's further replies may belong to a later step)."""
        self._expected: Counter[int] = Counter()
        self.staleness: list[int] = []
        """Per step: the most versions any slice moved beyond this worker's own update (0 when synchronous)."""
        self.closed = False
        self.steps = 0
        self._op = Op.UPDATE
        self.optimizer = optimizer
        """The wrapped optimizer: only its learning rates are used (a scheduler's changes go to the servers)."""
        self._sent_lrs: list[float] | None = None  # the first step always sends (a resumed server may differ)
        self.overlap = False
        """This step's Updates leave during backward (else in step())."""
        self.may_overlap = cluster.send_updates == "auto" and nan_policy != "skip" and \
            (agree is None or nan_policy == "ignore")
        """False once a step's gradients changed between backward and step (or never allowed: a
        partitioned group's nan verdict comes before any of its Updates)."""
        self._sealed: dict[int, int] = {}  # bucket index -> its buffer's version counter when sealed
        self._in_flight = False  # this step's Updates have left, their replies are not collected yet
        self._finite = True  # every bucket sent so far this step was finite
        self._prepared: bool | None = None  # this step's gradients changed after backward (None: not looked yet)
        self.background = cluster.fetch in ("background", "predict")
        """The replies are received by a thread while the next step computes (`ClusterConfig.fetch`)."""
        self.predict = cluster.fetch == "predict"
        """Background fetch that adds this worker's own update, taken by the wrapped optimizer on its own
        gradient, to the values it computes on until the servers' values with that update arrive."""
        self.lr_scale = 1.0 / (cluster.nworker_groups // cluster.nserver_groups) \
            if cluster.group_merge == "mean" else 1.0
        """What the servers scale the learning rate by (`group_merge`); the local step does the same."""
        self._inbox: Future | None = None  # the thread's work for the replies of the last step
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="troupe-fetch") if self.background else None
        self._landing = {s.id: torch.empty(s.numel, dtype=self.wire or self.local[s.param].dtype)
                         for s in self.mine} if self.background else {}
        """Background fetch: where the thread receives each slice's fresh values until step() copies them in."""

    def start(self) -> None:
        """The first worker group Puts the initial parameters (shared out among its workers); everyone Gets
        (a restarted worker only Gets: it takes the servers' values now)."""
        group, index = self.role.worker
        if group == 0 and not self.rejoined:
            for s in self.mine:
                owner = self.owners[s.param] if self.owners else None
                if (s.id % self.cluster.nworkers_per_group if owner is None else owner) == index:
                    for server in set(self._replicas(s)) - self.gone:
                        self._post(Op.PUT, s, server, self._flat(s))
        for s in self.mine:
            self._post(Op.GET, s, self.server_of[s.id])
        self._flush()
        self._collect(count_staleness=False)

    # --- the UpdateStrategy surface ------------------------------------------------------

    def clip_refusal(self) -> str | None:
        """Why clipping this worker's gradient (between synchronize() and step()) is not clipping its group's, or
        None: under `troupe run --elastic` a group of several workers does not average (a restarted worker
        rejoins alone), so each would clip its own gradient, and the servers average what each clipped."""
        from troupe.runtime import settings

        env = settings.current()  # troupe run --elastic: TROUPE_REJOIN for a parameter-server job
        if self.cluster.nworkers_per_group < 2 or not (env.elastic or env.rejoin) or self.average is not None:
            return None
        name = "Sandblaster" if self.cluster.nworker_groups == 1 else "a parameter-server job"
        return (f"clip_grad_norm_ under troupe run --elastic: {name}'s workers of a group of "
                f"{self.cluster.nworkers_per_group} each hold their own gradient (a restarted worker rejoins alone), "
                "not the group's mean, so each would clip its own: run without --elastic, or with "
                "--nworkers-per-group 1")

    def describe(self) -> str:
        return self.name

    def reduce_hook(self) -> SendBuckets:
        return self._send if self.overlap else self._pack

    def synchronize(self) -> None:
        """Gradients that arrived without a backward (accumulated under no_sync, written by hand): pack them."""
        self.reducer.reduce_now(self._open_step())

    def all_finite(self) -> bool:
        """This worker's verdict, before its gradients reach a server; a non-finite step is Skipped there."""
        changed = self._prepare()
        ok = self._finite if self.overlap else finite([b.data for b in self.reducer.buckets])
        if self.agree is not None:  # one verdict for the group: its slices make one model
            verdict = torch.tensor([0.0 if ok else 1.0])
            self.agree.all_reduce(verdict, "max")
            ok = verdict.item() == 0.0
        if ok:
            return True
        if not self.overlap:
            self._begin()
            for s in self.mine:
                self._post(Op.SKIP, s, self.server_of[s.id])
        self._end_step(changed, skipped=True)
        return False

    def step(self) -> dict:
        """Send the Updates (unless backward did), then collect the fresh slices."""
        changed, sent = self._prepare(), self.overlap
        if not sent:
            self._begin()
            for bucket in self.reducer.buckets:
                self._post_bucket(bucket, self._op)
        self._end_step(changed)
        if changed and sent:
            raise RuntimeError(
                f"worker {self.rank}: the gradients changed between backward and step() at step {self.steps}, "
                "after they had left for the servers (earlier steps left them alone, so they were sent during "
                "backward): with a loop that changes gradients only in some steps (clipping from step N on), "
                "set send_updates: step in the cluster"
            )
        stats = {"staleness": self.staleness[-1] if self.staleness else 0}  # background: none landed at step 1
        if self.feedback is not None:
            stats["residual_norm"] = residual_norm(self.residuals)
        return stats

    def per_rank_state(self) -> list[str]:
        residuals = ["top-K/threshold error-feedback residuals (what each rank has not sent yet)"]
        return [PS_WORKER_STATE, *(residuals if self.residuals else [])]

    def state_dict(self) -> dict:
        """Top-K's residuals (what this worker has not sent yet); the rest of the state is on the servers."""
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}} if self.feedback else {}

    def load_state_dict(self, state: dict) -> None:
        residuals = state.get("residuals") or {}
        if residuals and self.feedback is None:
            raise ValueError(f"the checkpoint holds top-K residuals of {len(residuals)} slice(s), but this "
                             "cluster's wire_topk is unset: resume with the wire_topk it was saved with")
        unknown = sorted(set(residuals) - {f"slice{s.id}" for s in self.mine})
        if unknown:
            raise ValueError(f"the checkpoint holds residuals of {unknown[:3]}, which this worker does not send "
                             "(another model, or another nservers_per_group?)")
        self.residuals.clear()
        self.residuals.update({k: v.clone() for k, v in residuals.items()})

    def close(self) -> None:
        """Take in the last replies, tell every server this worker has finished (called at exit if not before)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._land()
        finally:
            if self._fetcher is not None:
                self._fetcher.shutdown(wait=False)
        for server in self.all_servers:
            if server in self.gone:
                continue
            try:
                self.world.send(Header(Op.STOP, -1, 0, self.rank, 0).encode(), server, tag=HEADER_TAG)
            except Exception as e:  # at interpreter exit the process group may be gone already
                # (with fail_over: a server this worker never talked to since it died)
                log.log(logging.INFO if self.fail_over else logging.WARNING,
                        "troupe worker %d: could not say stop to server %d: %s", self.rank, server, reason(e))

    # --- one step ---------------------------------------------------------------------------

    def _open_step(self) -> SendBuckets:
        """A backward (or synchronize) packs this step's gradients; under overlap they leave as it goes."""
        if self._in_flight:
            raise RuntimeError(
                f"worker {self.rank}: a backward started while the previous step's Updates were on their way; "
                "call step() after each backward (accumulate gradients under no_sync())"
            )
        self._sealed.clear()
        self._prepared = None
        if self.overlap:
            self._begin()
        return self.reduce_hook()

    def _begin(self) -> None:
        """The step's first message: say the learning rates if they changed, pick Update or Push."""
        self.steps += 1
        self._finite = True
        self._in_flight = True
        # Downpour's n_fetch: between fetches the servers only acknowledge and the worker keeps its values.
        self._op = Op.UPDATE if self.steps % self.cluster.fetch_freq == 0 else Op.PUSH
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if lrs != self._sent_lrs:
            self._sent_lrs = lrs
            for server in self._my_servers():
                self._outbox[server].append((Header(Op.LR, -1, 0, self.rank, len(lrs)),
                                             torch.tensor(lrs, dtype=torch.float64)))

    def _end_step(self, changed: bool, skipped: bool = False) -> None:
        """Collect the replies (background fetch: the previous step's, and leave this step's to the thread);
        the next step overlaps its Updates with backward only if this one's gradients were left alone."""
        self._flush()
        if self.background:
            own = self._own_step() if self.predict and not skipped else None
            self._land(own)
            expected, sends = self._expected, self._sends
            self._expected, self._sends = Counter(), []
            self._inbox = self._fetcher.submit(self._receive, expected, sends, self._landing)
        else:
            self._collect(count_staleness=True)
        self._in_flight = False
        self._prepared = None
        self.may_overlap = self.may_overlap and not changed
        self.overlap = self.may_overlap

    def _hold_bucket(self, bucket: Bucket) -> Handle:
        if self.average is None:
            self._seal(bucket)
            return Handle(None)
        inner = self.average.all_reduce(bucket.data, "mean", async_op=True)

        def then() -> None:
            inner.wait()
            self._seal(bucket)  # the group's mean is what backward left, not a change of the loop's

        return Handle(None, then, label=bucket.label)

    def _send_bucket(self, bucket: Bucket) -> Handle:
        self._seal(bucket)
        if self.nan_policy != "ignore" and self._finite:
            self._finite = finite([bucket.data])
        # After a non-finite bucket every later one is Skipped too: the step is not applied from there on.
        self._post_bucket(bucket, self._op if self._finite else Op.SKIP)
        self._flush()  # this bucket leaves now, while backward fills the next
        return Handle(None)  # replies are collected in step()

    def _seal(self, bucket: Bucket) -> None:
        """Note the version counter of the bucket's buffer as backward left it. Buckets carved from one
        storage share one counter, so packing this bucket moved those sealed before: note them again
        (else every step with two buckets or more looked changed after backward, and never overlapped)."""
        self._sealed[bucket.index] = bucket.buffer._version
        storage = bucket.buffer.untyped_storage().data_ptr()
        for b in self.reducer.buckets:
            if b.index in self._sealed and b.buffer.untyped_storage().data_ptr() == storage:
                self._sealed[b.index] = b.buffer._version

    def _post_bucket(self, bucket: Bucket, op: Op) -> None:
        for k, p in enumerate(bucket.params):
            flat = bucket.view(k).reshape(-1)
            for s in self.by_param[self.index[id(p)]]:
                self._post(op, s, self.server_of[s.id], None if op is Op.SKIP else flat[s.start : s.stop])

    def _prepare(self) -> bool:
        """Once per step, after backward: did the loop change the gradients? If so, and the Updates
        have not left yet, take into the buckets what ``p.grad`` holds now."""
        if self._prepared is None:
            self._prepared = self._changed()
            if self._prepared and not self.overlap:
                self._refresh()
        return self._prepared

    def _changed(self) -> bool:
        """Did the loop change the gradients after backward packed them (in place, or by replacing ``p.grad``)?"""
        for b in self.reducer.buckets:
            if b.buffer._version != self._sealed.get(b.index):  # views share their base's version counter
                return True
            for k, p in enumerate(b.params):
                g = p.grad
                if (g is not None) != b.used[k] or (g is not None and g.data_ptr() != b.view(k).data_ptr()):
                    return True
        return False

    @torch.no_grad()
    def _refresh(self) -> None:
        """Copy into the buckets what ``p.grad`` holds now where the loop replaced it (None: a zero)."""
        for b in self.reducer.buckets:
            for k, p in enumerate(b.params):
                view, g = b.view(k), p.grad
                if g is None:
                    if b.used[k]:  # removed by the loop (an unused parameter's slot is zero already)
                        view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)

    # --- messages -----------------------------------------------------------------------------

    def _my_servers(self) -> list[int]:
        return sorted(set(self.server_of.values()))

    def _route(self, index: int) -> int:
        """The server that holds this worker's slices of server index `index`: its own server group's, or
        (that one gone) the same server of the next live server group."""
        n, groups = self.cluster.nservers_per_group, self.cluster.nserver_groups
        for k in range(groups):
            rank = self.all_servers[(self.server_group + k) % groups * n + index]
            if rank not in self.gone:
                return rank
        raise RuntimeError(f"worker {self.rank}: server {index} of every server group is gone (ranks "
                           f"{sorted(self.gone)}): no copy of its slices is left")

    @torch.no_grad()
    def _fail_over(self, lost: set[int]) -> None:
        """Servers whose links failed (`fail_over`) are gone: send their slices to the same server of the next
        live server group from now on, and Get that server's values of them (what this worker's update in
        flight to a dead server did died with it). Runs in the training thread, between two steps."""
        lost = lost - self.gone
        while lost:
            self.gone |= lost
            moved = [s for s in self.mine if self.server_of[s.id] in lost]
            for s in self.slices:
                if self.server_of[s.id] in lost:
                    self.server_of[s.id] = self._route(s.server)
            to = sorted({self.server_of[s.id] for s in moved})
            self.failovers.append({"step": self.steps, "gone": sorted(lost), "to": to})
            print(f"troupe worker rank {self.rank}: server rank(s) {sorted(lost)} gone at step {self.steps}; their "
                  f"slices go to server rank(s) {to} of the next server group from now on", file=sys.stderr,
                  flush=True)
            self._sent_lrs = None  # the next step tells the learning rates to every server it talks to
            pending = self._expected, self._sends  # this step's, under background fetch: the thread's
            self._expected, self._sends = Counter(), []
            for s in moved:
                self._post(Op.GET, s, self.server_of[s.id])
            self._flush()
            replies, lost = self._receive(self._expected, self._sends)
            self._expected, self._sends = pending
            self._take(replies, count_staleness=False)
            lost -= self.gone

    def _replicas(self, s) -> list[int]:
        """The server of slice s in every server group (all need initial values)."""
        n = self.cluster.nservers_per_group
        return [self.all_servers[g * n + s.server] for g in range(self.cluster.nserver_groups)]

    def _flat(self, s) -> Tensor:
        return self.local[s.param].detach().reshape(-1)[s.start : s.stop]

    def _post(self, op: Op, s, server: int, payload: Tensor | None = None) -> None:
        length = 0 if payload is None else payload.numel()
        if payload is not None and self.feedback is not None and op in (Op.UPDATE, Op.PUSH):
            (index, values), _ = self.feedback.compress(payload, f"slice{s.id}")
            op, length, payload = SPARSE_OF[op], index.numel(), sparse.encode(index, values)
        elif payload is not None and self.wire is not None and op is not Op.PUT:  # first values travel in full
            payload = payload.to(self.wire)
        self._outbox[server].append((Header(op, s.id, self.version[s.id], self.rank, length), payload))
        if op in (Op.GET, Op.UPDATE, Op.PUSH, Op.SKIP, *SPARSE):
            self._expected[server] += 1

    def _flush(self) -> None:
        """Send what was posted: one frame (or a lone message) per server."""
        for server, messages in self._outbox.items():
            if self.background and len(messages) == 1 and messages[0][1] is not None:
                # A frame's body is a copy; a lone payload may be a view of the gradient buckets, still on
                # its way while the next backward writes them: send a copy.
                header, payload = messages[0]
                messages = [(header, payload.clone())]
            try:
                for tensor, tag in pack(messages):
                    self._sends.append((server, self.world.isend(tensor, server, tag=tag)))
            except RuntimeError as e:  # its link failed: the replies' receive finds it gone
                if not self.fail_over:
                    raise
                log.info("troupe worker %d: a send to server %d failed: %s", self.rank, server, reason(e))
        self._outbox.clear()

    @torch.no_grad()
    def _collect(self, count_staleness: bool) -> None:
        """Receive every reply owed to this worker and copy the fresh slices into the parameters."""
        replies, lost = self._receive(self._expected, self._sends)
        self._expected, self._sends = Counter(), []
        self._take(replies, count_staleness)
        self._fail_over(lost)

    def _receive(self, expected: Counter[int], sends: list[tuple[int, Handle]],
                 into: dict[int, Tensor] | None = None) -> tuple[list[tuple[int, int, Tensor | None]], set[int]]:
        """Receive the replies `expected` of each server: (slice, version, fresh values or None for an Ack).
        Then wait for this step's sends. Runs in the fetch thread under background fetch. Also returns the
        servers whose links failed (`fail_over`; else their error is raised)."""
        replies, lost = [], set()
        for server in sorted(expected):
            if server in self.gone:
                continue
            try:
                self._replies_of(server, expected[server], into, replies)
            except RuntimeError as e:  # Gloo: its process died
                if not self.fail_over:
                    raise
                log.info("troupe worker %d: receiving from server %d failed: %s", self.rank, server, reason(e))
                lost.add(server)
        for server, h in sends:
            if server in self.gone or server in lost:
                continue  # a send to a dead server may never complete
            try:
                h.wait()
            except RuntimeError:
                if not self.fail_over:
                    raise
                lost.add(server)
        return replies, lost - self.gone

    def _replies_of(self, server: int, count: int, into: dict[int, Tensor] | None,
                    replies: list[tuple[int, int, Tensor | None]]) -> None:
        """Receive `count` replies of `server` into `replies`."""
        for header, frame in self._inbox_of.messages(server, count):
            if header.op is Op.EVICTED and header.sender == server:
                _leave_evicted(self.rank, server)
            s = self._slice_of(header, server)
            check(header, src=server, expected_length=s.numel, allowed={Op.REPLY, Op.ACK})
            value = None
            if header.op is Op.REPLY:
                dtype = self.wire or self.local[s.param].dtype
                if frame is not None:
                    value = frame.take(header.length, dtype)
                    value = into[s.id].copy_(value) if into is not None else value
                else:
                    value = into[s.id] if into is not None else torch.empty(header.length, dtype=dtype)
                    self.world.recv(value, server, tag=PAYLOAD_TAG)
            replies.append((s.id, header.version, value))

    def _slice_of(self, header: Header, server: int):
        """The slice a reply is about, if this worker holds it and `server` serves it."""
        s = self.slices[header.slice_id] if 0 <= header.slice_id < len(self.slices) else None
        if s is None or s.param not in self.local or self.server_of[s.id] != server:
            raise MessageError(f"reply from server {server} for slice {header.slice_id} it does not hold")
        return s

    @torch.no_grad()
    def _take(self, replies: list[tuple[int, int, Tensor | None]], count_staleness: bool,
              own: dict[int, Tensor] | None = None) -> None:
        """Copy the fresh slices into the parameters (plus `own`: the worker's update they do not hold
        yet); the staleness is how many versions a slice moved beyond this worker's own update."""
        worst = 0
        for slice_id, version, value in replies:
            if value is not None:
                s = self.slices[slice_id]
                self._flat(s).copy_(value)
                if own is not None:
                    self._flat(s).add_(own[s.param][s.start : s.stop])
            worst = max(worst, version - self.version[slice_id] - 1)
            self.version[slice_id] = version
        if count_staleness:
            self.staleness.append(worst)

    def _land(self, own: dict[int, Tensor] | None = None) -> None:
        """Background fetch: wait for the thread's replies of the last step and copy them in (plus `own`,
        this step's own update per parameter, under "predict")."""
        inbox, self._inbox = self._inbox, None
        if inbox is not None:
            replies, lost = inbox.result()
            self._take(replies, count_staleness=True, own=own)
            self._fail_over(lost)

    @torch.no_grad()
    def _own_step(self) -> dict[int, Tensor]:
        """fetch "predict": step the wrapped optimizer on this worker's gradient, as the servers will
        (its learning rate times their scale), and return what it changed per parameter. With one
        worker the optimizer sees what the servers see and the prediction is exact."""
        before = {i: p.detach().clone() for i, p in self.local.items()}
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] *= self.lr_scale
        try:
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        return {i: (p.detach() - before[i]).reshape(-1) for i, p in self.local.items()}
