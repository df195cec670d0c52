"""DiLoCo over elastic worker groups (`troupe run --elastic --framework diloco`): `ElasticDiLoCo`, the
exchanges taken ahead of the members' vote, undone when it leaves a step out, redone over a new quorum.
The algorithm itself is `troupe.strategies.diloco`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator
from troupe.strategies.allreduce import AllReduce
from troupe.strategies.base import StepStats, StepUndo
from troupe.strategies.diloco import DiLoCo
from troupe.strategies.diloco_shard import GroupCut, OuterConfig
from troupe.strategies.pseudograd import PendingMean, start_mean



@dataclass
class Flight:
    """One fragment's exchange under elastic DiLoCo, from the step that takes its pseudo-gradient to the
    step that merges it (`delay` steps later; the same step when 0)."""

    merge_at: int
    """The step count after whose step it merges."""
    fragment: int
    kept: list[Tensor] | None
    """This group's pseudo-gradient, kept to average again over a quorum that changed meanwhile (None: a
    group that joined after it was taken has none, and is not counted in the mean)."""
    pending: PendingMean | None
    generation: int
    """The quorum group it runs on (`ElasticDiLoCo.generation`): an exchange on another is redone."""


class ElasticDiLoCo(DiLoCo):
    """DiLoCo over elastic worker groups (`troupe run --elastic --framework diloco`), of one process or
    several (the regime hands it communicators that follow the quorum: troupe.cluster.regimes).

    An elastic job votes on every step after its reduction (runtime/elastic.py); DiLoCo's exchanges
    are collectives over the groups, so each runs before the vote of the step it belongs to, in
    `ahead_of_vote` (DistOpt calls it after `synchronize`): at a step that syncs a fragment, the inner
    step (its values kept first: `StepUndo`), then the pseudo-gradient's exchange started; at the
    step that merges it (the same step with `delay` 0, `delay` steps later otherwise), the wait for
    its mean. `step` then takes the outer steps (and, at a step that only merges, the inner step
    first). A group lost in any of it fails the vote: every member undoes its inner step (`left_out`)
    and drops the exchanges that step started, and the next step, the same step again for the
    counter, starts them again with the groups present then.

    An exchange still in flight when the quorum changes (`reconfigured`: a group lost or joined
    between its start and its merge) is redone at its merge, synchronously, over the new quorum:
    each group that took it contributes the pseudo-gradient it kept, a group that joined meanwhile
    contributes nothing and is not counted, so the mean is over the groups that both took it and are
    present. Every member decides this alike (the quorum's decisions are the same everywhere), and
    the old group is set aside rather than shut down while an exchange may run on it
    (`holds_work`). A restarted group copies a live one's parameters, inner optimizer state, outer
    state (theta_outer and the outer optimizer's state) and the list of exchanges in flight through
    `troupe.track`. nan_policy "skip" is refused (a group skipping a step would leave the others
    waiting in its exchange); "raise" ends the group, which restarts.
    """

    def __init__(self, cluster: OuterConfig, inner: AllReduce, place: Communicator, params: Sequence[Tensor],
                 step_count: Callable[[], int], shard: GroupCut | None = None):
        super().__init__(cluster, inner, place, params, step_count, shard)
        self.flights: list[Flight] = []
        """Exchanges started and not merged, in the order started: the same on every member."""
        self.generation = 0
        """Quorum groups this worker has been in (`reconfigured`)."""
        self._ready: list[tuple[Flight, list[Tensor] | None]] | None = None
        """This step's merges and their mean pseudo-gradients, awaiting the vote."""
        self._started: list[Flight] = []
        self._saved: StepUndo | None = None
        self._inner_stats: StepStats = {}

    def reconfigured(self) -> None:
        """The quorum's group was made anew (Elastic.on_reconfigure): exchanges in flight are redone."""
        self.generation += 1

    def holds_work(self) -> bool:
        """Whether an exchange may still run on the current quorum's group (Elastic.holds_work)."""
        return any(f.pending is not None and f.generation == self.generation for f in self.flights)

    def ahead_of_vote(self) -> None:
        """After `synchronize` (the group's reduction), before the vote: at a step that syncs, keep the
        parameters and inner optimizer state, take the inner step and start the exchanges; at a step
        that merges, wait for (or redo) the exchanges due."""
        count = self.step_count() + 1
        syncing = self._syncing()
        if not (syncing or any(f.merge_at <= count for f in self.flights)):
            return
        if not self.inner.all_finite():  # nan_policy "raise" decides a non-finite step
            return
        if syncing:
            self._saved = StepUndo(self.params, self.inner.optimizer)
            self._inner_stats = self.inner.step()
            self._started = [self._launch(j, count) for j in syncing]
            self.flights += self._started
        self._ready = [(f, self._mean(f)) for f in self.flights if f.merge_at <= count]

    def _launch(self, fragment: int, count: int) -> Flight:
        a, b = self.bounds[fragment]
        deltas = self.outers[fragment].pseudo_gradient(self.params[a:b])
        kept = [d.clone() for d in deltas] if self.cluster.delay else None  # delay 0: merged before any change
        return Flight(count + self.cluster.delay, fragment, kept, start_mean(self.place, deltas,
                      self.cluster.pseudo_grad_dtype), self.generation)

    def _mean(self, flight: Flight) -> list[Tensor] | None:
        """The flight's mean pseudo-gradient over the groups that took it and are present (None: none is)."""
        if flight.generation == self.generation:
            return flight.pending.wait()
        have = torch.tensor([0.0 if flight.kept is None else 1.0])
        self.place.all_reduce(have, "sum")
        groups = int(have.item())
        if groups == 0:
            return None
        deltas = [d.clone() for d in flight.kept] if flight.kept is not None else \
            self.outers[flight.fragment].blank()
        pending = start_mean(self.place, deltas, self.cluster.pseudo_grad_dtype)
        pending.groups = groups  # the sum over those who took it, divided by their number
        return pending.wait()

    def all_finite(self) -> bool:
        """This group's verdict alone: the exchange already told the others (a non-finite group never joined it)."""
        return self.inner.all_finite()

    def step(self) -> StepStats:
        if self._ready is None:
            return self.inner.step()
        stats = self._inner_stats if self._saved is not None else self.inner.step()
        ready, self._ready, self._saved, self._started = self._ready, None, None, []
        merged = []
        for flight, mean in ready:
            self.flights.remove(flight)
            if mean is not None:
                a, b = self.bounds[flight.fragment]
                self.outers[flight.fragment].step(mean, self.params[a:b], self.cluster.merge_alpha)
                merged.append(flight.fragment)
        if merged:
            stats = {**stats, "outer_step": self.outers[merged[-1]].steps, "fragments_synced": merged}
        return stats

    def left_out(self) -> None:
        """The vote left this step out: undo the inner step `ahead_of_vote` took and drop the exchanges it
        started (the step, taken again, starts them anew); the merges wait for the step again."""
        if self._saved is not None:
            self._saved.undo()
        for flight in self._started:
            self.flights.remove(flight)
        self._ready = self._saved = None
        self._started = []

    def state_dict(self) -> dict[str, Any]:
        """The outer state and the exchanges in flight (a group healed from it joins their redo without a
        pseudo-gradient of its own; a resume from a checkpoint skips their outer steps)."""
        return {**super().state_dict(), "in_flight": [[f.merge_at, f.fragment] for f in self.flights]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.flights = [Flight(int(m), int(j), None, None, -1) for m, j in state.get("in_flight", [])]

    def close(self) -> None:
        """Complete the exchanges in flight on the current group (no collective left half done), without
        merging them; a lost peer only ends the wait."""
        for flight in self.flights:
            if flight.pending is not None and flight.generation == self.generation:
                try:
                    flight.pending.wait()
                except RuntimeError:
                    break
        self.flights = []
