"""DiLoCo's worker (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): synchronous inside a
group, an outer optimizer step over the groups every `sync_freq` inner steps.

Inside a group the workers are SINGA's synchronous workers: the plain mean all-reduce of the
gradients over the group's communicator, then the wrapped (inner) optimizer's step on every
worker, so the group's workers hold the same parameters. Every H = `sync_freq` steps of the
DistOpt's step counter, each worker takes the outer step with the workers holding the same place
in the other groups (its *place* communicator; with one worker per group, every worker)::

    delta = theta_outer - theta                 # this group's pseudo-gradient
    delta = sum over the groups of delta / G    # over the place communicator, in pseudo_grad_dtype
    outer_optimizer.step()  with grad delta     # steps theta_outer
    theta = theta_outer                         # every group adopts it

`theta_outer` (the parameters after the last outer step) and the outer optimizer live on every
worker: they see the same all-reduced gradient, so their state is the same everywhere and
every group holds the same parameters, bit for bit, after each outer step. The inner
optimizer's state is never averaged. Distributed Hogwild's master copies
(`troupe.cluster.serving.mastercopies`) are the asynchronous special case of outer SGD at lr 1
without momentum; DiLoCo's groups wait for each other at the outer step, so a synchronous
all-reduce serves it and no master copy, thread or channel is needed.

The pseudo-gradients travel in `pseudo_grad_dtype` (`troupe.strategies.pseudograd`). With the
cluster's ``shard: optimizer`` the outer state is cut over each group's processes instead, each
exchanging only its chunk of the pseudo-gradient (`troupe.strategies.diloco_shard`).

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): with
`fragments` K > 1 the parameter tensors, in order, are cut into K contiguous fragments balanced
by element count (`fragment_bounds`), each with its own `OuterStep` (its theta_outer and its
slice of the outer optimizer state). Fragment j takes its outer step, as above but over its own
tensors only, after each inner step that brings the step count c to c % H == floor(j * H / K)
(`sync_offset`): once per H steps, the K exchanges spread over the period, so the peak traffic
of one sync is about 1/K of DiLoCo's. Fragment 0 syncs with plain DiLoCo (c % H == 0); fragment
j's first period is floor(j * H / K) steps long.

With `delay` tau > 0 a fragment's exchange overlaps the next tau inner steps: at its sync step
the worker takes delta = theta_outer - theta and starts the mean in the background (an async
all-reduce, or all-gather for a quantised dtype); after the tau-th inner step that follows it
waits for the mean, steps theta_outer, and merges with the paper's mixing rule,
theta = alpha * theta + (1 - alpha) * theta_outer, alpha = `merge_alpha` (0: adopt theta_outer,
the groups are bit for bit equal in that fragment again; the tau inner updates made meanwhile to
the fragment are then dropped, as in torchft's implementation). tau < H, so a fragment's
exchange lands before its next starts.

`OuterStep` is the pure state (no communication), unit-tested without processes; `DiLoCo`
is the UpdateStrategy around the inner `AllReduce`; `troupe.strategies.diloco_elastic.ElasticDiLoCo`
runs it over elastic worker groups.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies.allreduce import AllReduce
from troupe.strategies.base import BaseStrategy, StepStats
from troupe.strategies.diloco_shard import GroupCut, OuterConfig, ShardedOuterStep, state_bytes
from troupe.strategies.partitioned import HolderGroups, Partitioned, split_by_holders
from troupe.strategies.pseudograd import PendingMean, start_mean
from troupe.sync.reducer import GradReducer


DILOCO_STATE = "DiLoCo worker (between outer steps each worker group's parameters and inner optimizer state are its own)"
"""Why a DiLoCo worker's checkpoint cannot move to another number of ranks (`per_rank_state`)."""


def outer_optimizer(cluster: OuterConfig, params: Sequence[Tensor]) -> torch.optim.Optimizer:
    """The cluster's outer optimizer over `params`: SGD with Nesterov momentum by default, or the named torch.optim one."""
    return cluster.make_outer_optimizer(params)


def fragment_bounds(sizes: Sequence[int], k: int) -> list[tuple[int, int]]:
    """Streaming DiLoCo's fragments: `k` contiguous runs [a, b) of the parameter tensors (of `sizes`
    elements), none empty, each cut placed where the elements before it come closest to j/k of all."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(sizes):
        raise ValueError(f"fragments must be an integer from 1 to the model's {len(sizes)} parameter tensors, "
                         f"got {k!r}")
    before = [0]
    for n in sizes:
        before.append(before[-1] + n)
    cuts = [0]
    for j in range(1, k):
        # leave at least one tensor for each fragment still to come
        room = range(cuts[-1] + 1, len(sizes) - (k - j) + 1)
        cuts.append(min(room, key=lambda c: abs(before[c] - j * before[-1] / k)))
    cuts.append(len(sizes))
    return list(zip(cuts[:-1], cuts[1:]))


def sync_offset(fragment: int, k: int, h: int) -> int:
    """Fragment `fragment` of `k` syncs after each inner step that makes the step count = this (mod `h`):
    floor(fragment * h / k), so the k exchanges spread evenly over the period and each comes once in it."""
    return fragment * h // k


class OuterStep:
    """The outer parameters and their optimizer, pure state: pseudo-gradients in, parameters to adopt out."""

    def __init__(self, cluster: OuterConfig, params: Sequence[Tensor]):
        # Their own tensors, shaped as the parameters, so that an outer optimizer that looks at
        # shapes sees the model's.
        self.outer = [p.detach().clone() for p in params]
        self.optimizer = outer_optimizer(cluster, self.outer)
        self.steps = 0
        """Outer steps taken."""

    @torch.no_grad()
    def reset(self, params: Sequence[Tensor]) -> None:
        """theta_outer = `params` (the job's initial values, the same on every worker)."""
        for o, p in zip(self.outer, params):
            o.copy_(p)

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[Tensor]) -> list[Tensor]:
        """theta_outer - theta for each parameter (new tensors)."""
        return [o - p.detach() for o, p in zip(self.outer, params)]

    def blank(self) -> list[Tensor]:
        """A zero pseudo-gradient (a group that has none still joins the sum)."""
        return [torch.zeros_like(o) for o in self.outer]

    def held_bytes(self) -> int:
        """Bytes of outer state this process holds: theta_outer and the outer optimizer's state."""
        return state_bytes(self.outer, self.optimizer)

    @torch.no_grad()
    def step(self, mean_delta: Sequence[Tensor], params: Sequence[Tensor], alpha: float = 0.0) -> None:
        """Step theta_outer with the groups' mean pseudo-gradient, then merge it into `params`:
        params = alpha * params + (1 - alpha) * theta_outer (alpha 0: a copy, exactly)."""
        for o, d in zip(self.outer, mean_delta):
            o.grad = d
        try:
            self.optimizer.step()
        finally:
            for o in self.outer:
                o.grad = None
        for o, p in zip(self.outer, params):
            if alpha == 0:
                p.copy_(o)
            else:
                p.mul_(alpha).add_(o, alpha=1 - alpha)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"outer": [o.clone() for o in self.outer], "optimizer": self.optimizer.state_dict(),
                "steps": self.steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "chunk" in state:
            raise ValueError(f"the checkpoint's DiLoCo state holds a chunk of the outer parameters (shard "
                             f"optimizer), this process them whole: resume with the same shard")
        if len(state["outer"]) != len(self.outer):
            raise ValueError(f"the checkpoint's DiLoCo state holds {len(state['outer'])} outer parameters, "
                             f"this worker {len(self.outer)}")
        for o, saved in zip(self.outer, state["outer"]):
            o.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


def group_step(params: Sequence[Tensor], group: Communicator, optimizer: torch.optim.Optimizer, bucket_size: int,
               *, workers: int, partitioned_model: bool, elastic: bool = False, **reducer_args: Any
               ) -> AllReduce | Partitioned:
    """A worker group's synchronous inner step: the mean of its processes' gradients, then the inner optimizer.

    A model partitioned inside the group (`troupe.partition`; `workers`: the job's workers, whom a
    replicated parameter's holders name) has slices held by one process of the group, whose gradient
    already sums the whole group's samples (the connection layers' backward adds them): divided by
    the group's size, it is the group's mean too. The outer step then treats every parameter alike:
    process j of every group holds the same tensors, and the place communicator averages them.
    `partitioned_model` must be the same on every process of the group (one may hold no slice: the
    others' verdict on theirs still needs it); `elastic`: the group communicator follows the quorum
    (its size is 1 until the group joins)."""
    everyone, partitioned = split_by_holders(params, workers)
    reducer = GradReducer(everyone, group, bucket_size, **reducer_args) \
        if everyone and (elastic or group.world_size > 1) else None
    inner = AllReduce(name="plain", comm=group, reducer=reducer, optimizer=optimizer, params=everyone)
    if not partitioned_model:
        return inner
    holders = HolderGroups(group, partitioned, made={h: None for h in partitioned})  # nothing to sum over
    if reducer is not None:  # the slices are divided whenever the buckets are reduced, in the same place
        reducer.also_reduce = holders.reduce
    return Partitioned(inner, holders, group, reducer)


class DiLoCo(BaseStrategy):
    """A DiLoCo worker: the group's plain all-reduce step, and every sync_freq steps each fragment's outer step."""

    name = "diloco"

    def __init__(self, cluster: OuterConfig, inner: AllReduce, place: Communicator, params: Sequence[Tensor],
                 step_count: Callable[[], int], shard: GroupCut | None = None):
        self.cluster, self.inner, self.place = cluster, inner, place
        self.reducer = inner.reducer
        self.params = list(params)
        self.step_count = step_count
        self.bounds = fragment_bounds([p.numel() for p in self.params], cluster.fragments)
        self.outers: list[OuterStep | ShardedOuterStep] = \
            [OuterStep(cluster, self.params[a:b]) if shard is None else
             ShardedOuterStep(cluster, self.params[a:b], shard) for a, b in self.bounds]
        """One outer step per fragment: its own theta_outer and outer optimizer state (with `shard`: this
        process's chunk of them, `troupe.strategies.diloco_shard`)."""
        self.in_flight: list[tuple[int, int, PendingMean]] = []
        """(step count to merge at, fragment, exchange) in the order started: the same on every worker."""

    def start(self) -> None:
        """Every worker now holds rank 0's parameters: they are theta_outer."""
        for outer, (a, b) in zip(self.outers, self.bounds):
            outer.reset(self.params[a:b])

    def _syncing(self) -> list[int]:
        """The fragments whose outer step follows the step being taken (DistOpt counts it after `step`)."""
        now = (self.step_count() + 1) % self.cluster.sync_freq
        return [j for j in range(len(self.bounds)) if sync_offset(j, len(self.bounds), self.cluster.sync_freq) == now]

    def describe(self) -> str:
        return self.inner.describe()

    def reduce_hook(self):
        return self.inner.reduce_hook()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def all_finite(self) -> bool:
        """The group's verdict; at an outer step, the groups' verdicts combined, so that all of them
        skip it together (one group skipping it alone would leave the others waiting in it)."""
        ok = self.inner.all_finite()
        if self._syncing():
            flag = torch.tensor([1.0 if ok else 0.0])
            self.place.all_reduce(flag, "min")
            ok = bool(flag.item() == 1.0)
        return ok

    def step(self) -> StepStats:
        stats = self.inner.step()
        count = self.step_count() + 1
        # Merges due first (started `delay` steps ago; later if this group skipped that step), then
        # the exchanges this step starts: the same fragments in the same order on every worker.
        merged = []
        while self.in_flight and self.in_flight[0][0] <= count:
            merged.append(self._merge(self.in_flight.pop(0)))
        for j in self._syncing():
            self.in_flight.append((count + self.cluster.delay, j, self._start(j)))
            if self.cluster.delay == 0:
                merged.append(self._merge(self.in_flight.pop()))
        if merged:
            stats = {**stats, "outer_step": self.outers[merged[-1]].steps, "fragments_synced": merged}
        return stats

    def _start(self, fragment: int) -> PendingMean:
        """Start the groups' mean of the fragment's pseudo-gradient, theta_outer - theta, taken now."""
        a, b = self.bounds[fragment]
        deltas = self.outers[fragment].pseudo_gradient(self.params[a:b])
        return start_mean(self.place, deltas, self.cluster.pseudo_grad_dtype)

    def _merge(self, flight: tuple[int, int, PendingMean]) -> int:
        """Wait for a fragment's exchange, take its outer step, merge theta_outer into the parameters."""
        _, fragment, pending = flight
        a, b = self.bounds[fragment]
        self.outers[fragment].step(pending.wait(), self.params[a:b], self.cluster.merge_alpha)
        return fragment

    def per_rank_state(self) -> list[str]:
        return [DILOCO_STATE]

    def outer_bytes(self) -> int:
        """Bytes of outer state (theta_outer and the outer optimizer's) this process holds, over all fragments."""
        return sum(outer.held_bytes() for outer in self.outers)

    def state_dict(self) -> dict[str, Any]:
        if self.in_flight:
            warnings.warn(f"a DiLoCo checkpoint at step {self.step_count()} leaves out the exchanges of fragments "
                          f"{[j for _, j, _ in self.in_flight]} still in flight (delay {self.cluster.delay}): "
                          f"a resume from it does not apply them")
        states = [outer.state_dict() for outer in self.outers]
        return {"diloco": states[0] if len(states) == 1 else states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "diloco" not in state:
            return
        saved = state["diloco"] if isinstance(state["diloco"], list) else [state["diloco"]]
        if len(saved) != len(self.outers):
            raise ValueError(f"the checkpoint's DiLoCo state holds {len(saved)} fragments, this worker "
                             f"{len(self.outers)} (cluster field fragments)")
        for outer, one in zip(self.outers, saved):
            outer.load_state_dict(one)

    def close(self) -> None:
        """Complete the exchanges still in flight (no collective left half done), without merging them."""
        for _, _, pending in self.in_flight:
            pending.wait()
        self.in_flight = []
