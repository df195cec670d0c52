"""ParamShard: the pure state of one server (its slices, server-side optimizer, versions). No I/O.

Parameters are laid end to end and the resulting flat vector is cut into
``nservers`` contiguous ranges of equal size (within one element); where a range
boundary falls inside a parameter, that parameter is split across servers. The plan
depends only on the parameters' sizes, so every rank computes the same one.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from troupe.cluster.configuration.spec import OptimizerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of the flattened parameter `param`, held by server `server` of a group."""

    id: int
    param: int
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_slices(numels: Sequence[int], nservers: int) -> list[Slice]:
    """Cut parameters of sizes `numels` into slices balanced across `nservers` servers."""
    if nservers < 1:
        raise ValueError(f"nservers must be >= 1, got {nservers}")
    total = sum(numels)
    bounds = [total * s // nservers for s in range(nservers + 1)]
    slices: list[Slice] = []
    offset, server = 0, 0
    for p, n in enumerate(numels):
        start = 0
        while start < n:
            while bounds[server + 1] <= offset + start:
                server += 1
            stop = min(n, bounds[server + 1] - offset)
            slices.append(Slice(len(slices), p, start, stop, server))
            start = stop
        offset += n
    return slices


@dataclass
class _Pending:
    total: Tensor | None = None
    """The sum of the group's gradients so far (None before the first)."""
    senders: set[int] = field(default_factory=set)
    base_version: int = 0
    skipped: bool = False
    """A sender had a non-finite gradient (nan_policy): the group's update of the slice is skipped."""


class ParamShard:
    """The slices one server holds, their server-side optimizer and a version per slice.

    Within a worker group updates are synchronous: a slice's gradients from the group's
    workers are summed, averaged and applied once. Updates of different groups are
    applied as they complete (asynchronous). `template` is the optimizer to run server-side
    (its class and hyper-parameters; an `OptimizerSpec` when it came from another process).
    """

    def __init__(
        self,
        slices: Iterable[Slice],
        template: torch.optim.Optimizer | OptimizerSpec,
        param_group_of: Sequence[int],
        members: dict[int, set[int]],
        dtype: torch.dtype = torch.float32,
        staleness_bound: int | None = None,
        lr_scale: float = 1.0,
        *,
        owners: dict[int, int | None] | None = None,
        position: dict[int, int] | None = None,
        group_size: int = 1,
        staleness_lr: str = "constant",
        steps_ahead: int = 0,
    ):
        self.slices = {s.id: s for s in slices}
        self.owners = {k: (owners or {}).get(k) for k in self.slices}
        """Per slice of a partitioned model (`troupe.cluster.workers.layout`): the index in each group of the one
        worker holding it, or None when every worker of a group holds it."""
        self.position = dict(position or {})
        """Each worker's index inside its group."""
        self.group_size = group_size
        self.dtype = dtype
        self._deferred: dict[int, tuple[Tensor, float]] | None = None
        """Inside `fused()`: per slice, the gradient and lr scale of its update not stepped yet (None: step at once)."""
        self.values = {k: torch.zeros(s.numel, dtype=dtype) for k, s in self.slices.items()}
        self.version = {k: 0 for k in self.slices}
        self.initialised: set[int] = set()
        self.members = {g: set(m) for g, m in members.items()}
        """Live workers of each worker group this shard serves."""
        self.group_of = {w: g for g, m in members.items() for w in m}
        spec = OptimizerSpec.of(template)
        groups: list[list[Tensor]] = [[] for _ in spec.groups]
        for k in sorted(self.slices):
            groups[param_group_of[self.slices[k].param]].append(self.values[k])
        self.optimizer = spec.build(groups)
        self.ngroups = len(spec.groups)
        self._group_of_server_group = [i for i, g in enumerate(groups) if g]  # empty groups are left out
        self.lr_scale = lr_scale
        self.staleness_lr = staleness_lr
        """"inverse": an update computed on values tau versions old steps with lr / max(1, tau)."""
        """The server steps with the workers' learning rate times this (1/G: G asynchronous groups, "mean")."""
        self._lrs = list(spec.lrs)
        self.set_lr(spec.lrs)
        self.steps_ahead = steps_ahead
        """How many steps a worker may send beyond its group's oldest incomplete update of a slice
        (1 under background fetch: a worker sends step t+1 before its partners' step t arrived)."""
        self._pending: dict[tuple[int, int], list[_Pending]] = {}
        """Per (group, slice): the group's incomplete updates, oldest first (one unless `steps_ahead`)."""
        self.updates = 0
        self.skipped = 0
        """Group updates of a slice not applied because a worker's gradient was not finite."""
        self.staleness: list[int] = []
        self.last_sync = {k: torch.zeros(s.numel, dtype=dtype) for k, s in self.slices.items()}
        self.staleness_bound = staleness_bound
        """Stale-synchronous: a group more than this many updates of a slice ahead of the slowest
        live group gets its reply only when the slowest catches up (None: no bound)."""
        self.clock: dict[tuple[int, int], int] = defaultdict(int)
        self._held: list[tuple[int, int, list[int]]] = []

    def put(self, slice_id: int, values: Tensor) -> None:
        """Set a slice's initial value (the first worker group's Put)."""
        self.flush()
        self.values[slice_id].copy_(values.reshape(-1))
        self.last_sync[slice_id].copy_(self.values[slice_id])
        self.initialised.add(slice_id)

    def get(self, slice_id: int) -> tuple[int, Tensor]:
        """(version, value) of a slice."""
        return self.version[slice_id], self.values[slice_id]

    def update(self, slice_id: int, sender: int, grad: Tensor | None, version: int = 0) -> list[int]:
        """Add `sender`'s gradient; when its group is complete apply once. Returns the workers to reply to.

        ``grad=None``: the sender takes part in this step without a gradient (its own was not
        finite): the group's update of the slice is skipped, as one process skips the step.
        """
        group = self.group_of[sender]
        queue = self._pending.setdefault((group, slice_id), [])
        pending = next((p for p in queue if sender not in p.senders), None)
        if pending is None:
            if len(queue) > self.steps_ahead:
                if not self.steps_ahead:
                    raise ValueError(f"worker {sender} sent two updates for slice {slice_id} in one step")
                raise ValueError(f"worker {sender} sent updates of slice {slice_id} for {len(queue) + 1} steps before "
                                 f"its group completed the first (at most {self.steps_ahead + 1})")
            pending = _Pending(base_version=version)
            queue.append(pending)
        if grad is None:
            pending.skipped = True
        elif pending.total is None:  # a copy, not a sum with zeros: one pass less on the server's critical path
            pending.total = grad.reshape(-1).to(self.dtype, copy=True)
        else:
            pending.total.add_(grad.reshape(-1))
        pending.senders.add(sender)
        return self._maybe_apply(group, slice_id)

    def remove_worker(self, worker: int) -> list[tuple[int, list[int]]]:
        """Forget a dead or finished worker; returns (slice, workers to reply to) for updates it completes."""
        group = self.group_of.get(worker)
        if group is None or worker not in self.members[group]:
            return []
        self.members[group].discard(worker)
        done = []
        for g, k in sorted(self._pending):
            if g == group:
                done.append((k, self._maybe_apply(g, k)))
        return [(k, r) for k, r in done if r]

    def add_worker(self, worker: int) -> None:
        """Take back a worker that restarted (`troupe run --elastic`): its group waits for it again (a worker
        of another server group's groups only says Stop here)."""
        if worker in self.group_of:
            self.members[self.group_of[worker]].add(worker)

    def serve_group(self, group: int, workers: set[int], live: set[int], lr_scale: float | None = None) -> None:
        """Serve worker group `group` too (`troupe run --elastic`: its own server group's server is gone and
        its workers fail over here): `workers` are all of its workers, `live` those that count now. With
        `lr_scale` every group's updates step at the workers' learning rate times it from now on
        (group_merge "mean": 1/G for the G groups served)."""
        for worker in workers:
            self.group_of[worker] = group
        self.members[group] = set(live)
        if lr_scale is not None and lr_scale != self.lr_scale:
            self.lr_scale = lr_scale
            self.set_lr(self._lrs)

    def missing(self) -> dict[tuple[int, int], set[int]]:
        """For each incomplete (group, slice): the live workers its oldest incomplete update still waits for."""
        return {key: self.holders(*key) - queue[0].senders for key, queue in self._pending.items()}

    def holders(self, group: int, slice_id: int) -> set[int]:
        """The live workers of `group` that hold slice `slice_id` (all of them, unless it is partitioned)."""
        owner = self.owners[slice_id]
        live = self.members[group]
        return live if owner is None else {w for w in live if self.position.get(w) == owner}

    def holds(self, worker: int, slice_id: int) -> bool:
        """May `worker` send this slice? Every worker may, unless the slice is partitioned."""
        owner = self.owners.get(slice_id)
        return owner is None or self.position.get(worker) == owner

    def _maybe_apply(self, group: int, slice_id: int) -> list[int]:
        """Apply the group's oldest updates of the slice that are complete; the workers to reply to (one
        entry per update applied: a worker that sent two completed ones gets two replies)."""
        queue, replies = self._pending[(group, slice_id)], []
        while queue and queue[0].senders and self.holders(group, slice_id) <= queue[0].senders:
            replies += self._apply_complete(group, slice_id, queue.pop(0))
        if not queue:
            del self._pending[(group, slice_id)]
        return replies

    def _apply_complete(self, group: int, slice_id: int, pending: _Pending) -> list[int]:
        live = self.holders(group, slice_id)
        if pending.skipped:  # nothing applied, the version stays: everyone gets the unchanged value
            self.skipped += 1
            return sorted(pending.senders & live)
        # A partitioned slice's one sender already summed its group's k workers' contributions.
        senders = len(pending.senders) * (1 if self.owners[slice_id] is None else self.group_size)
        tau = self.version[slice_id] - pending.base_version  # updates applied since the values it was computed on
        scale = 1.0 / max(1, tau) if self.staleness_lr == "inverse" else 1.0
        self.apply(slice_id, pending.total if senders == 1 else pending.total / senders, lr_scale=scale)
        self.clock[(group, slice_id)] += 1
        self.staleness.append(tau)
        if self._ahead(group, slice_id):
            self._held.append((group, slice_id, sorted(pending.senders)))
            return []
        return sorted(pending.senders & live)

    def _ahead(self, group: int, slice_id: int) -> bool:
        if self.staleness_bound is None:
            return False
        live = [g for g, m in self.members.items() if m]
        slowest = min(self.clock[(g, slice_id)] for g in live) if live else 0
        return self.clock[(group, slice_id)] - slowest > self.staleness_bound

    def released(self) -> list[tuple[int, list[int]]]:
        """Replies held back by the staleness bound that may go now: (slice, workers)."""
        out, keep = [], []
        for group, slice_id, workers in self._held:
            if self._ahead(group, slice_id):
                keep.append((group, slice_id, workers))
            else:
                live = [w for w in workers if w in self.members[group]]
                if live:
                    out.append((slice_id, live))
        self._held = keep
        return out

    def apply(self, slice_id: int, grad: Tensor, lr_scale: float = 1.0) -> None:
        """One optimizer step on one slice with `grad` (the group's averaged gradient), at lr * lr_scale.

        Inside `fused()` the step waits for `flush`, which steps every waiting slice at once; the
        version counts the update now, so the staleness of the updates that follow is the same.
        """
        if self._deferred is None:
            self._step({slice_id: (grad, lr_scale)})
        else:
            if slice_id in self._deferred:  # a second update of the slice steps from the first's result
                self.flush()
            self._deferred[slice_id] = (grad, lr_scale)
        self.version[slice_id] += 1
        self.updates += 1

    @contextmanager
    def fused(self) -> Iterator[None]:
        """Updates completed inside are applied in one optimizer step per lr scale (at `flush` or on leaving).

        One step over all of a worker's slices instead of one per slice: each step of a torch
        optimizer walks every parameter it holds, so stepping the slices one by one costs the
        square of their number. A slice's values are stale inside until `flush`.
        """
        if self._deferred is not None:
            raise RuntimeError("ParamShard.fused() is not reentrant")
        self._deferred = {}
        try:
            yield
        finally:
            try:
                self.flush()
            finally:
                self._deferred = None

    def waiting(self, slice_id: int) -> bool:
        """Inside `fused()`: whether the slice has an update not stepped yet (its values are stale)."""
        return self._deferred is not None and slice_id in self._deferred

    def flush(self) -> None:
        """Step every update waiting inside `fused()` (nothing outside it)."""
        if self._deferred:
            waiting, self._deferred = self._deferred, {}
            self._step(waiting)

    @torch.no_grad()
    def _step(self, updates: dict[int, tuple[Tensor, float]]) -> None:
        """One optimizer step per distinct lr scale over the slices of `updates`; the others keep grad None,
        which torch's optimizers skip, so each slice moves exactly as if it had been stepped alone."""
        by_scale: dict[float, list[tuple[Tensor, Tensor]]] = {}  # disjoint slices: the order does not matter
        for k, (grad, scale) in updates.items():
            by_scale.setdefault(scale, []).append((self.values[k], grad))
        for scale, stepped in by_scale.items():
            for value, grad in stepped:
                value.grad = grad.reshape(-1).to(self.dtype)
            try:
                if scale == 1.0:  # the common case, without the context manager's cost per lone update
                    self.optimizer.step()
                else:
                    with self._lr_scaled(scale):
                        self.optimizer.step()
            finally:
                for value, _ in stepped:
                    value.grad = None

    @contextmanager
    def _lr_scaled(self, scale: float) -> Iterator[None]:
        """Every param group's lr times `scale` inside (staleness_lr "inverse"), restored on leaving."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] *= scale
        try:
            yield
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr

    def set_lr(self, lrs: Sequence[float]) -> None:
        """Follow the workers' learning rates (one per param group of the wrapped optimizer)."""
        if len(lrs) != self.ngroups:
            raise ValueError(f"expected {self.ngroups} learning rates (one per param group), got {len(lrs)}")
        self.flush()  # the updates completed so far step at the learning rate they were sent with
        self._lrs = list(lrs)
        if self.optimizer is not None:
            for group, i in zip(self.optimizer.param_groups, self._group_of_server_group):
                group["lr"] = float(lrs[i]) * self.lr_scale

    def state_dict(self) -> dict[str, Any]:
        """Slices, versions and server-side optimizer state (a server checkpoint)."""
        self.flush()
        return {
            "values": {k: v.clone() for k, v in self.values.items()},
            "version": dict(self.version),
            "optimizer": None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["values"]) != set(self.values):
            raise ValueError(f"checkpoint holds slices {sorted(state['values'])}, this shard {sorted(self.values)}")
        for k, v in state["values"].items():
            self.put(k, v)
        self.version.update(state["version"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
