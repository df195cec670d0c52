"""The A/B engine: contestants take turns step by step inside the same processes.

Every contestant lives in the same processes on the same process group and trains (or
moves) the same thing. A burn-in stage runs each contestant `burnin` steps, untimed;
then each repetition runs `steps` measured steps of every contestant, taking turns
step by step. The order is reversed every other step and every other repetition
(rep 0: A B, B A, A B, ...; rep 1: B A, A B, ...), so slow drift of the machine's
load falls on all contestants equally. Each step is timed alone (wall clock and this
process's CPU time); as ranks step in lockstep, the slowest rank's time is kept. A
repetition's value is the median over its steps; counters a step returns (bytes sent)
are averaged over the steps and over the ranks.

>>> schedule = Schedule(reps=11, steps=20, burnin=5)
>>> results = run_ab([Contestant("A", step_a), Contestant("B", step_b)], schedule, comm)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Step = Callable[[int], "dict[str, float] | None"]
"""One step of a contestant: gets the step's index (which batch), may return counters."""


@dataclass
class Contestant:
    """A named way to do one step, with the facts a record should carry about it."""

    name: str
    step: Step
    params: dict[str, Any] = field(default_factory=dict)
    """Facts about this contestant for the records (bucket size, number of buckets, ...)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How long to run: burn-in steps once, then `reps` repetitions of `steps` measured steps."""

    reps: int = 11
    """Repetitions; tables report the median over them (11 or more for a result worth writing down)."""
    steps: int = 20
    """Measured steps per repetition and contestant."""
    burnin: int = 5
    """Untimed steps per contestant before the first repetition (caches, allocator, Gloo's buffers)."""
    align: bool = False
    """An untimed barrier before every timed step, so every step starts with the ranks together.
    Without it a contestant whose ranks never wait for each other (a local step) lets them drift
    apart by the scheduler's unfairness, and the next contestant that synchronises pays the whole
    drift at its first collective: on 4 processes sharing 2 cores that was 6-18 ms per step,
    charged to whichever contestant came next."""

    def __post_init__(self) -> None:
        for name in ("reps", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.burnin, bool) or not isinstance(self.burnin, int) or self.burnin < 0:
            raise ValueError(f"burnin must be an int >= 0, got {self.burnin!r}")


def order(n: int, rep: int, step: int) -> list[int]:
    """Which contestant goes when in step `step` of repetition `rep`: forward or reversed, alternating."""
    forward = list(range(n))
    return forward if (rep + step) % 2 == 0 else forward[::-1]


@dataclass(frozen=True)
class Measurement:
    """One repetition's value of one metric for one contestant (before it becomes a `Record`)."""

    contestant: int
    """Index into the contestant list."""
    rep: int
    metric: str
    value: float


class Reducer:
    """Combines per-rank numbers across ranks (the slowest rank's time, the mean of counters)."""

    def __init__(self, comm: Any | None):
        self.comm = comm if comm is not None and comm.world_size > 1 else None

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if self.comm is not None:
            self.comm.all_reduce(t, "max")
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.comm is not None:
            self.comm.all_reduce(t, "mean")
        return t

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.barrier()


def run_ab(contestants: list[Contestant], schedule: Schedule, comm: Any | None = None,
           clock: Callable[[], float] = time.perf_counter,
           cpu_clock: Callable[[], float] = time.process_time) -> list[Measurement]:
    """Burn in, then alternate the contestants step by step; per repetition and metric, one Measurement.

    Metrics: "step_time" (median wall seconds per step, slowest rank), "cpu_time" (median CPU
    seconds of this process per step, slowest rank), and for every counter a step returns
    its mean per step and rank. `comm` (a troupe Communicator) reduces across ranks; None
    on one process. Every rank must call this with the same contestants and schedule.
    """
    if not contestants:
        raise ValueError("run_ab needs at least one contestant")
    names = [c.name for c in contestants]
    if len(set(names)) != len(names):
        raise ValueError(f"contestant names must be unique, got {names}")
    reduce = Reducer(comm)
    n = len(contestants)
    for i in range(schedule.burnin):
        for k in order(n, 0, i):
            contestants[k].step(i)
    out: list[Measurement] = []
    for rep in range(schedule.reps):
        times = torch.zeros(n, schedule.steps, 2, dtype=torch.float64)
        counters: list[dict[str, float]] = [{} for _ in range(n)]
        reduce.barrier()
        for i in range(schedule.steps):
            batch = schedule.burnin + rep * schedule.steps + i
            for k in order(n, rep, i):
                if schedule.align:
                    reduce.barrier()
                wall, cpu = clock(), cpu_clock()
                counted = contestants[k].step(batch)
                times[k, i, 0], times[k, i, 1] = clock() - wall, cpu_clock() - cpu
                for key, v in (counted or {}).items():
                    counters[k][key] = counters[k].get(key, 0.0) + v
        reduce.max(times)  # steps run in lockstep: the slowest rank sets the pace
        out += _measurements(rep, times, counters, schedule.steps, reduce)
    return out


def _measurements(rep: int, times: torch.Tensor, counters: list[dict[str, float]], steps: int,
                  reduce: Reducer) -> list[Measurement]:
    out = []
    keys = sorted({key for c in counters for key in c})
    means = None
    if keys:  # every rank holds the same keys (same contestants): one mean per (contestant, key)
        means = reduce.mean(torch.tensor([[c.get(key, 0.0) / steps for key in keys] for c in counters],
                                         dtype=torch.float64))
    for k in range(times.shape[0]):
        out.append(Measurement(k, rep, "step_time", statistics.median(times[k, :, 0].tolist())))
        out.append(Measurement(k, rep, "cpu_time", statistics.median(times[k, :, 1].tolist())))
        for j, key in enumerate(keys):
            if key in counters[k]:  # a contestant that counts nothing (DDP's bytes) gets no record
                out.append(Measurement(k, rep, key, float(means[k, j])))
    return out
