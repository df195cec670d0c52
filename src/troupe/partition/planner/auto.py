"""`troupe.partition(model, "auto", ...)`: rank 0 profiles and plans, every rank gets its plan.

The one piece of the planner that talks to other processes: rank 0 profiles the model on
the sample batch, runs the exact search for the given group size with the plain option,
and the job communicator hands the resulting {layer name: dim} to every rank, so all
ranks partition alike. A failure on rank 0 is raised, with its message, on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from troupe.partition.plan import check_world
from troupe.partition.planner.cost import Setup
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
) -> dict[str, int]:
    """{layer name: partition_dim} for `model`, the same on every rank (a collective).

    Args:
        sample: one batch of this worker's input (b = sample.shape[0]); only rank 0 uses it.
        link: a `Link` or a `troupe plan --link` spelling (not 'measure'); the default
            "loopback" constants suit one machine: pass the real link for several.
    """
    if sample is None:
        raise ValueError("plan 'auto' needs sample=: one batch of this worker's input, for profiling")
    if not isinstance(sample, Tensor):
        raise TypeError(f"sample must be a Tensor (one batch of this worker's input), got {type(sample).__name__}")
    link = link if isinstance(link, Link) else parse_link(link)
    check_world(job.world_size, workers_per_group)
    result: tuple[str, object] | None = None
    if job.rank == 0:
        try:
            profile = profile_model(model, sample, [workers_per_group], reps=AUTO_REPS)
            setup = Setup(world_size=job.world_size, workers_per_group=workers_per_group, link=link)
            result = ("ok", plan_for(profile, setup))
        except Exception as e:  # raised below on every rank, not only here (the others would wait)
            result = ("error", f"{type(e).__name__}: {e}")
    if job.world_size > 1:
        result = job.all_gather_object(result)[0]
    status, value = result
    if status != "ok":
        raise ValueError(f"plan 'auto' failed on rank 0: {value}")
    return value
