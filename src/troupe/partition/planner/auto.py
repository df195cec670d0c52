"""`troupe.partition(model, "auto", ...)`: rank 0 profiles and plans, every rank gets its plan.

The one piece of the planner that talks to other processes: rank 0 profiles the model on
the sample batch, runs the exact search for the given group size with the plain option,
and the job communicator hands the resulting {layer name: dim} to every rank, so all
ranks partition alike. A failure on rank 0 is raised, with its message, on every rank.
With ``link="job"`` every rank first times the model's local step and the collectives a
step makes, as the step makes them (`instep.calibrate`, a few seconds), and rank 0 prices
the plans with those numbers instead of a named link's constants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from troupe.partition.plan import check_world
from troupe.partition.planner.cost import Setup
from troupe.partition.planner.instep import InStep, calibrate
from troupe.partition.planner.link import Link, parse_link
from troupe.partition.planner.profile import profile_model
from troupe.partition.planner.search import plan_for

if TYPE_CHECKING:
    from troupe.runtime.comm import Communicator

AUTO_REPS = 3
"""Timed repetitions per layer shape in the auto plan (it runs at every job start)."""


def auto_plan(
    model: nn.Module,
    workers_per_group: int,
    job: Communicator,
    *,
    sample: Tensor | None,
    link: str | Link = "loopback",
    memory: float | None = None,
    optimizer_slots: int = 0,
) -> dict[str, int]:
    """{layer name: partition_dim} for `model`, the same on every rank (a collective).

    Args:
        sample: one batch of this worker's input (b = sample.shape[0]); only rank 0 uses it.
        link: a `Link` or a `troupe plan --link` spelling (not 'measure'); the default
            "loopback" constants suit one machine: pass the real link for several. "job":
            measure this job's costs in the step (`instep`); every rank runs the model's
            forward and backward on its `sample` (a copy of the model; the model is untouched).
        memory: bytes of model state (parameters, gradients, `optimizer_slots` optimizer states) each
            worker may hold: the fastest plan that fits (`search.best_dims_within`), or an error naming
            the smallest need on every rank.
    """
    check_sample(sample)
    in_job = isinstance(link, str) and link.strip().lower() == "job"
    link = link if isinstance(link, Link) or in_job else parse_link(link)
    check_world(job.world_size, workers_per_group)
    measured = _calibrate(model, sample, job) if in_job else None
    result: tuple[str, object] | None = None
    if job.rank == 0:
        result = plan_here(model, workers_per_group, job.world_size, sample, link, measured, memory, optimizer_slots)
    if job.world_size > 1:
        result = job.all_gather_object(result)[0]
    return plan_of(result)


def check_budget(plan: object, memory_per_rank: float | str | None, optimizer_slots: int) -> float | None:
    """`memory_per_rank` in bytes (a number, or a size such as "2GiB"), checked before any collective;
    only plan "auto" takes a budget."""
    from troupe.util import check_int

    check_int("optimizer_slots", optimizer_slots, minimum=0)
    if memory_per_rank is None:
        return None
    if not (isinstance(plan, str) and plan == "auto"):
        raise ValueError(f"memory_per_rank is for plan 'auto' (the planner picks the fastest plan that fits), "
                         f"got plan {plan!r}")
    if isinstance(memory_per_rank, str):
        from troupe.partition.planner.command import parse_bytes

        return parse_bytes(memory_per_rank, "memory_per_rank")
    if isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, (int, float)) or \
            not 0 < memory_per_rank < float("inf"):
        raise ValueError(f"memory_per_rank must be a positive number of bytes or a size such as '2GiB', "
                         f"got {memory_per_rank!r}")
    return float(memory_per_rank)


def check_sample(sample: object) -> None:
    """Plan "auto" profiles one batch: a clear error without one."""
    if sample is None:
        raise ValueError("plan 'auto' needs sample=: one batch of this worker's input, for profiling")
    if not isinstance(sample, Tensor):
        raise TypeError(f"sample must be a Tensor (one batch of this worker's input), got {type(sample).__name__}")


def plan_of(result: tuple[str, object]) -> dict[str, int]:
    """The plan in `plan_here`'s result, as every process reads it; its error raised where it failed."""
    status, value = result
    if status != "ok":
        raise ValueError(f"plan 'auto' failed on rank 0: {value}")
    return value  # type: ignore[return-value]


def plan_here(model: nn.Module, workers_per_group: int, world_size: int, sample: Tensor, link: Link,
              measured: InStep | None = None, memory: float | None = None,
              optimizer_slots: int = 0) -> tuple[str, object]:
    """("ok", {layer name: dim}) planned in this process for a job of `world_size`, or ("error", why): the
    caller hands either to the other processes (which would otherwise wait for a plan that never comes)."""
    try:
        profile = profile_model(model, sample, [workers_per_group], reps=AUTO_REPS)
        if measured is not None:
            profile = measured.scaled(profile)
            setup = measured.apply(Setup(world_size=world_size, workers_per_group=workers_per_group,
                                         link=measured.reduce, optimizer_slots=optimizer_slots))
        else:
            setup = Setup(world_size=world_size, workers_per_group=workers_per_group, link=link,
                          optimizer_slots=optimizer_slots)
        return ("ok", plan_for(profile, setup, memory))
    except Exception as e:  # noqa: BLE001  (raised on every process by the caller)
        return ("error", f"{type(e).__name__}: {e}")


def _calibrate(model: nn.Module, sample: Tensor, job: Communicator) -> InStep | None:
    """Every rank: the in-step costs with the model's forward and backward on `sample` as the
    local step (a copy, so the model's gradients stay as they were). None on one process."""
    if job.world_size == 1:
        return None
    import copy

    twin = copy.deepcopy(model)

    def local_step(i: int) -> None:
        twin.zero_grad(set_to_none=True)
        out = twin(sample)
        (out if isinstance(out, Tensor) else out[0]).float().sum().backward()

    try:  # one step first, everywhere: a rank whose step fails must not leave the others in a collective
        local_step(0)
        status = None
    except Exception as e:
        status = f"rank {job.rank}: {type(e).__name__}: {e}"
    failed = [s for s in job.all_gather_object(status) if s is not None]
    if failed:
        raise ValueError(f"plan 'auto' with link 'job': the model's step failed ({failed[0]})")
    return calibrate(job, local_step, reps=5, steps=2, burnin=1)
