"""The partition planner: a cost model of troupe's partition runtime and an exact search over it.

    profile.py  what each layer costs on this machine (measured once, or built by hand)
    link.py     the link's alpha (seconds per message) and beta (seconds per byte)
    instep.py   the link as a step in this job sees it (sync, reductions, exchanges), measured
    cost.py     predicted step time and bytes per step of a plan (and of DiLoCo, and of the shard modes)
    memory.py   model-state bytes per worker of a plan, unsharded or with a shard mode
    search.py   the exact dynamic programme over the layer chain (also within a memory budget), the
                candidate list (plans, options, powerSGD ranks, DiLoCo's H, the shard modes), each
                marked against synchronous SGD, the pick
    auto.py     ``troupe.partition(model, "auto", ...)``: rank 0 plans, every rank gets the plan
    command.py  ``troupe plan SCRIPT.py -n W --link 1gbit``

It decides plans; it never partitions a model or reduces a gradient.

>>> profile = profile_model(CNN(), torch.randn(64, 1, 28, 28), workers_per_group=[1, 2, 4])
>>> cands = candidates(profile, world_size=4, link=parse_link("1gbit"))
>>> pick(cands).plan      # on a 1 Gbit/s link, for example: linear1 split over groups of 2
{'conv1': 0, 'conv2': 0, 'linear1': 1, 'linear2': 0}
>>> model = troupe.partition(CNN(), "auto", workers_per_group=2, sample=x_own, link="1gbit")
"""

from __future__ import annotations

from troupe.partition.planner.auto import auto_plan
from troupe.partition.planner.instep import InStep, calibrate
from troupe.partition.planner.cost import (
    OPTIONS,
    Cost,
    Setup,
    diloco_cost,
    layer_cost,
    param_bytes,
    plan_cost,
    transition_cost,
)
from troupe.partition.planner.link import Link, link_from_text, measure_link, parse_link
from troupe.partition.planner.profile import LayerProfile, ModelProfile, profile_model, proportional_times
from troupe.partition.planner.memory import state_bytes
from troupe.partition.planner.search import (Candidate, best_chain, best_dims, best_dims_within, candidates, pick,
                                             plan_for)

__all__ = [
    "OPTIONS",
    "Candidate",
    "Cost",
    "InStep",
    "LayerProfile",
    "Link",
    "ModelProfile",
    "Setup",
    "auto_plan",
    "best_chain",
    "best_dims",
    "best_dims_within",
    "calibrate",
    "candidates",
    "diloco_cost",
    "layer_cost",
    "link_from_text",
    "measure_link",
    "param_bytes",
    "parse_link",
    "pick",
    "plan_cost",
    "plan_for",
    "profile_model",
    "proportional_times",
    "state_bytes",
    "transition_cost",
]
