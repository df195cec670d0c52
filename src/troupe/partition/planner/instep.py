"""The link as a training step sees it: sync, exchange and reduction costs measured inside the job.

A link measured between idle processes (`link.measure_link`, or the named constants)
predicts a step well when the transfer dominates (100 Mbit/s), and badly when the
processes share oversubscribed cores (four workers on two cores: docs/planner.md). There a
collective's cost is mostly scheduling: the first one after compute waits for the rank the
scheduler served last, once per step however often the step syncs, and each one costs by its
kind (all-gather and reduce-scatter more than all-to-all and a tiny all-reduce).
So `calibrate` times what the runtime does, the way a step does it: every calibration
contestant is the model's local step (compute only) followed by one kind of
communication, taking turns with the local step in aligned steps (`troupe.observe.turns`
with ``Schedule(align=True)``: a barrier before every step).
With e the extra seconds over the local step and S the sync:

    local + 1 tiny all-reduce           e = S + a_ar
    local + 5 tiny all-reduces          e = S + 5 a_ar                      -> S, a_ar
    local + 5 tiny K                    e = S + 5 a_K                       -> a_K
    local + 5 K of E per rank           e = S + 5 (a_K + beta_K * wire_K)   -> beta_K
        for K in all_gather, all_to_all, reduce_scatter (`cost.EXCHANGES`; send: all_to_all's)
    local + reduced step of M1          e = S + alpha_r * m1 + beta_r * wire1
    local + reduced step of M2          e = S + alpha_r * m2 + beta_r * wire2  -> the reduction link

A reduced step is DistOpt's plain step: its `GradReducer` reduces M parameters during
backward, then an optimizer step. m counts messages as the cost model does with
`Setup.fused_reductions` (one per step plus M / bucket_size), so alpha_r carries the
reducer's fixed cost per message (the ranks' agreement, the hand-off to Gloo's threads)
and beta_r its copies as well as the wire. The probes run
over the whole job; a group of fewer workers is priced with the same numbers. Every rank
must call these functions alike (they communicate).

>>> cal = calibrate(world.comm, local_step)          # 11 x 3 turns of 12 contestants
>>> plan_cost(profile, dims, cal.apply(Setup(world_size=4, workers_per_group=2, link=parse_link("1gbit"))))
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from troupe.observe.turns import Contestant, Schedule, run_ab
from troupe.partition.planner.cost import Setup, plan_cost
from troupe.partition.planner.link import Link
from troupe.partition.planner.profile import ModelProfile
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE
from troupe.sync.reducer import GradReducer

if TYPE_CHECKING:
    from troupe.runtime.comm import Communicator

LOCAL = "local"
SYNC, SYNC5 = "cal: all_reduce x1", "cal: all_reduce x5"
KINDS = ("all_gather", "all_to_all", "reduce_scatter")
"""The collective kinds probed (the cost model's `EXCHANGES` but send, priced as all_to_all)."""
REDUCE1, REDUCE2 = "cal: reduce 1", "cal: reduce 2"
REPEATS = 5
"""Collectives in a row in each probe."""
EXCHANGE_ELEMS = 2**16
"""Elements per rank and destination in the large exchange probes (256 KiB of fp32)."""
REDUCE_TENSORS = 4
"""Bucket-sized tensors in the large reduction probe (each travels as a bucket of its own)."""


def _tiny(kind: str) -> str:
    return f"cal: {kind} x{REPEATS}"


def _large(kind: str) -> str:
    return f"cal: {kind} x{REPEATS} of {EXCHANGE_ELEMS * 4 // 1024} KiB"


NAMES = (SYNC, SYNC5, *(_tiny(k) for k in KINDS), *(_large(k) for k in KINDS), REDUCE1, REDUCE2)
"""Every calibration contestant's name (`contestants` makes them in this order)."""


@dataclass(frozen=True)
class InStep:
    """What a step pays for communication on this job's ranks, as `calibrate` measured it."""

    sync: float
    """Seconds once per step (`Setup.sync`)."""
    reduce: Link
    """The DistOpt reduction: alpha per message, beta per wire byte (copies included)."""
    exchanges: dict[str, Link]
    """Each exchange kind inside a group (`Setup.exchange_links`)."""
    local: float = 0.0
    """Seconds of the local step as the probes measured it (0: not given), for `scaled`."""

    def setup_args(self) -> dict:
        """The `Setup` fields this calibration sets (for `candidates(profile, W, **args)`)."""
        return {"link": self.reduce, "exchange_links": self.exchanges, "sync": self.sync, "fused_reductions": True}

    def apply(self, setup: Setup) -> Setup:
        """`setup` with this job's measured sync and links, reductions counted as the runtime fuses them."""
        return dataclasses.replace(setup, **self.setup_args())

    def scaled(self, profile: ModelProfile) -> ModelProfile:
        """`profile` with its compute scaled so a whole local step takes what it took here: a
        profile is timed on one process, the job's ranks share the cores (x1.0-1.6 measured)."""
        if self.local <= 0:
            raise ValueError("this InStep holds no local step time: solve() was given none")
        zeros = [0] * len(profile.layers)
        factor = self.local / plan_cost(profile, zeros, Setup(world_size=1, link=self.reduce)).seconds
        return dataclasses.replace(
            profile, replicated_seconds=profile.replicated_seconds * factor,
            layers=tuple(dataclasses.replace(layer, times={key: t * factor for key, t in layer.times.items()})
                         for layer in profile.layers))

    def to_json(self) -> dict:
        return {"local_s": self.local, "sync_s": self.sync, "reduce": [self.reduce.alpha, self.reduce.beta],
                "exchanges": {kind: [link.alpha, link.beta] for kind, link in self.exchanges.items()}}


def _reduce_sizes(bucket_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Tensor sizes of the two reduction probes: one small bucket, and REDUCE_TENSORS full ones."""
    return (max(1, bucket_size // 8),), (bucket_size,) * REDUCE_TENSORS


def _wire(kind: str, n: int, elems: int) -> float:
    """Bytes a rank sends in one probe collective (as the cost model counts them)."""
    if kind == "reduce_scatter":  # Gloo: an all-reduce of the n * elems input
        return 2 * (n - 1) / n * n * elems * 4
    return (n - 1) * elems * 4


def _collective(comm: Communicator, kind: str, elems: int) -> Callable[[], object]:
    n = comm.world_size
    small, full, other = torch.zeros(elems), torch.zeros(n * elems), torch.zeros(n * elems)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(small)
    if kind == "all_gather":
        return lambda: comm.all_gather_into(full, small)
    if kind == "all_to_all":
        return lambda: comm.all_to_all(other, full)
    return lambda: comm.reduce_scatter(small, full)


def probes(comm: Communicator, local_step: Callable[[int], object], *,
           bucket_size: int = DEFAULT_BUCKET_SIZE, update: bool = True) -> list[Contestant]:
    """The calibration probes as A/B contestants, named `NAMES` (the local step is not among
    them: the caller adds it, named `LOCAL` for `solve`). The reduction probes reduce over
    `comm` with a DistOpt's plain machinery (its `GradReducer`: buckets, the ranks' agreement,
    the hand-off to the backend's threads); `update`: each step opens as SINGA's
    ``DistOpt.update(loss, "plain")`` does (a step chosen per call: bucket 0 goes alone, carrying
    the agreement, after the first step's exchange), instead of as ``backward(); step()`` does."""

    def after_local(name: str, collective: Callable[[], object], repeats: int) -> Contestant:
        def step(i: int) -> None:
            local_step(i)
            for _ in range(repeats):
                collective()

        return Contestant(name, step)

    def reducer(name: str, sizes: tuple[int, ...]) -> Contestant:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        weights = [torch.ones(n) for n in sizes]
        sgd = torch.optim.SGD(params, lr=0.0)
        reduce = GradReducer(params, comm, bucket_size)  # backward leaves the mean over ranks in p.grad

        def step(i: int) -> None:
            local_step(i)
            loss = sum((p * w).sum() for p, w in zip(params, weights))
            sgd.zero_grad()
            if update:
                reduce.open_step(per_call=True)
            loss.backward()
            sgd.step()

        return Contestant(name, step)

    tiny = _collective(comm, "all_reduce", 1)
    made = [after_local(SYNC, tiny, 1), after_local(SYNC5, tiny, REPEATS)]
    made += [after_local(_tiny(kind), _collective(comm, kind, 1), REPEATS) for kind in KINDS]
    made += [after_local(_large(kind), _collective(comm, kind, EXCHANGE_ELEMS), REPEATS) for kind in KINDS]
    small, large = _reduce_sizes(bucket_size)
    return made + [reducer(REDUCE1, small), reducer(REDUCE2, large)]


def solve(times: dict[str, float], world_size: int, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> InStep:
    """The InStep from the median step seconds of `LOCAL` and every calibration contestant
    (negative estimates, which only noise makes, are clamped at 0)."""
    missing = [name for name in (LOCAL, *NAMES) if name not in times]
    if missing:
        raise ValueError(f"calibration needs the step times of {missing}")
    if world_size < 2:
        raise ValueError(f"calibration needs a job of 2 or more ranks, got world_size {world_size}")
    n = world_size
    extra = {name: times[name] - times[LOCAL] for name in NAMES}
    a_ar = max((extra[SYNC5] - extra[SYNC]) / (REPEATS - 1), 0.0)
    sync = max(extra[SYNC] - a_ar, 0.0)
    exchanges = {}
    for kind in KINDS:
        alpha = max((extra[_tiny(kind)] - sync) / REPEATS, 0.0)
        beta = (extra[_large(kind)] - extra[_tiny(kind)]) / (REPEATS * _wire(kind, n, EXCHANGE_ELEMS))
        exchanges[kind] = Link(alpha, max(beta, 0.0), name=f"{kind} in the job")
    exchanges["send"] = dataclasses.replace(exchanges["all_to_all"], name="send (as all_to_all) in the job")
    rows = []
    for name, sizes in zip((REDUCE1, REDUCE2), _reduce_sizes(bucket_size)):
        rows.append((1 + sum(sizes) / bucket_size, 2 * (n - 1) / n * sum(sizes) * 4, extra[name] - sync))
    (m1, w1, e1), (m2, w2, e2) = rows
    alpha_r = (e1 * w2 - e2 * w1) / (m1 * w2 - m2 * w1)
    beta_r = (e1 - alpha_r * m1) / w1
    if alpha_r < 0:  # the line through the two points would start below zero: all of it per byte
        alpha_r, beta_r = 0.0, (e1 * w1 + e2 * w2) / (w1 * w1 + w2 * w2)
    elif beta_r < 0:  # or fall: all of it per message
        alpha_r, beta_r = (e1 * m1 + e2 * m2) / (m1 * m1 + m2 * m2), 0.0
    reduce = Link(max(alpha_r, 0.0), max(beta_r, 0.0), name="reductions in the job")
    return InStep(sync, reduce, exchanges, local=times[LOCAL])


def calibrate(comm: Communicator, local_step: Callable[[int], object], *, reps: int = 11, steps: int = 3,
              burnin: int = 2, bucket_size: int = DEFAULT_BUCKET_SIZE, update: bool = True) -> InStep:
    """Time the probes with the local step in aligned turns (`troupe.observe.turns.run_ab`: a
    barrier before every step, the slowest rank, medians per repetition and over them) and `solve`."""
    made = [Contestant(LOCAL, local_step), *probes(comm, local_step, bucket_size=bucket_size, update=update)]
    measured = run_ab(made, Schedule(reps=reps, steps=steps, burnin=burnin, align=True), comm)
    times = {c.name: statistics.median(m.value for m in measured if m.contestant == k and m.metric == "step_time")
             for k, c in enumerate(made)}
    return solve(times, comm.world_size, bucket_size=bucket_size)
