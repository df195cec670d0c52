"""The planner's memory budget without other processes: the model-state terms of a partition plan with a
sharded DistOpt by hand arithmetic, the constrained search against brute force, its error naming the
smallest need, plan "auto"'s budget on one process, and the partition + shard candidates."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from troupe.partition.planner import LayerProfile, Link, ModelProfile, Setup, candidates, pick, plan_cost
from troupe.partition.planner.auto import check_budget, plan_here
from troupe.partition.planner.cost import shard_cost
from troupe.partition.planner.memory import param_bytes, state_bytes
from troupe.partition.planner.profile import proportional_times
from troupe.partition.planner.search import best_dims, best_dims_within

from tests.unit.test_planner import ALPHA, BETA, LINK, chain, setup  # the same hand-written chain and link


def test_partition_plus_shard_state_by_hand():
    """W = 4, k = 2, G = 2, Adam (2 slots), 4 bytes: plan (0, 1, 0) holds 10 + 100 + 50 = 160 elements on all
    4 ranks and fc1's slice of 1500 on its 2 holders; -1 puts all of fc2 on worker 0, shared by G = 2."""
    profile, s = chain(), setup(optimizer_slots=2)
    assert state_bytes(profile, (0, 1, 0), s) == (160 + 1500) * 4 * (2 + 2)
    assert state_bytes(profile, (0, 1, 0), s, "optimizer") == 160 * 4 * (2 + 2 / 4) + 1500 * 4 * (2 + 2 / 2)
    assert state_bytes(profile, (0, 1, 0), s, "gradients") == 160 * 4 * (1 + 3 / 4) + 1500 * 4 * (1 + 3 / 2)
    assert state_bytes(profile, (1, 1, -1), s, "optimizer") == (
        10 * 4 * (2 + 2 / 4) + (50 + 1500 + 50) * 4 * (2 + 2 / 2))
    assert param_bytes(profile, (0, 1, 0), s, "optimizer") == 160 * 4 * (1 + 2 / 4) + 1500 * 4 * (1 + 2 / 2)
    assert param_bytes(profile, (0, 1, 0), s, "gradients") == param_bytes(profile, (0, 1, 0), s, "optimizer")
    one_group = Setup(world_size=2, workers_per_group=2, link=LINK, optimizer_slots=2)  # G = 1: slices stay whole
    assert state_bytes(profile, (0, 1, 0), one_group, "optimizer") == 160 * 4 * (2 + 1) + 1500 * 4 * 4


def test_partition_plus_shard_step_by_hand():
    """The plan's step, plus the all-gathers after the update: the 160 replicated elements over W = 4 (one
    bucket) and worker 0's 1500 slice elements over G = 2 (one message)."""
    profile, s = chain(), setup(optimizer_slots=2)
    plain = plan_cost(profile, (0, 1, 0), s)
    sharded = shard_cost(profile, s, "optimizer", (0, 1, 0))
    assert sharded.seconds == pytest.approx(plain.seconds + (ALPHA + 0.75 * 160 * 4 * BETA)
                                            + (ALPHA + 0.5 * 1500 * 4 * BETA), rel=1e-12)
    assert sharded.bytes == plain.bytes
    with pytest.raises(ValueError, match=r"shard 'parameters' \(troupe.shard\) cannot shard a partitioned model"):
        shard_cost(profile, s, "parameters", (0, 1, 0))


def random_profile(rng: random.Random) -> ModelProfile:
    layers = [LayerProfile(name=f"l{i}", kind="Linear", params=rng.randint(1, 10**6), in_elems=rng.randint(1, 10**4),
                           out_elems=rng.randint(1, 10**4), out_size=rng.choice([4, 6, 12]),
                           times=proportional_times(rng.random() * 1e-3, 8, [2]), input_grad=i > 0)
              for i in range(rng.randint(2, 7))]
    return ModelProfile(batch=8, layers=tuple(layers), replicated_params=rng.randint(0, 1000),
                        replicated_seconds=rng.random() * 1e-3)


@pytest.mark.parametrize("seed", range(12))
def test_search_within_a_budget_equals_brute_force(seed):
    """The fastest plan whose state fits, among every assignment of dims, for budgets between the
    smallest need and the fastest plan's need (where the budget binds)."""
    rng = random.Random(seed)
    profile = random_profile(rng)
    s = Setup(world_size=8, workers_per_group=2, link=Link(rng.random() * 1e-4, rng.random() * 1e-8),
              optimizer_slots=rng.choice([0, 1, 2]))
    shard = rng.choice([None, "optimizer", "gradients"])
    plans = list(itertools.product(*(layer.dims(2) for layer in profile.layers)))
    needs = sorted({state_bytes(profile, dims, s, shard) for dims in plans})
    for budget in rng.sample(needs, min(4, len(needs))):
        dims = best_dims_within(profile, s, budget, shard)
        assert state_bytes(profile, dims, s, shard) <= budget
        brute = min(plan_cost(profile, d, s).seconds for d in plans if state_bytes(profile, d, s, shard) <= budget)
        assert plan_cost(profile, dims, s).seconds == pytest.approx(brute, rel=1e-9)
    assert best_dims_within(profile, s, needs[-1] * 2, shard) == best_dims(profile, s)  # no binding budget


def test_a_budget_no_plan_fits_names_the_smallest_need():
    # (10 + 100 + 50) * 4 * 4 + 1500 * 4 * 4 = 26,560 bytes: every layer that splits over k = 2 split
    # (conv's 4 filters and fc1's 8 outputs; fc2's 5 outputs cannot), Adam.
    profile, s = chain(), setup(optimizer_slots=2)
    smallest = state_bytes(profile, (1, 1, 0), s)
    assert smallest == (10 + 50 + 50 + 1500) * 4 * 4
    assert best_dims_within(profile, s, smallest) == (1, 1, 0)
    with pytest.raises(ValueError, match=r"no partition plan for workers_per_group 2 fits 0.0 MiB of model state per "
                                         r"worker: the smallest needs 0.0 MiB \(dims \{'conv': 1, 'fc1': 1, 'fc2': 0\}\)"):
        best_dims_within(profile, s, smallest - 1)
    with pytest.raises(ValueError, match="composes with the shard modes"):
        best_dims_within(profile, s, smallest, "parameters")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_auto_plan_takes_the_budget():
    """plan "auto"'s planning (rank 0's part, in this process) under a budget, on a real profile."""
    model, sample = MLP(), torch.randn(8, 16)
    from troupe.partition.planner.link import parse_link

    status, plan = plan_here(model, 2, 4, sample, parse_link("100mbit"), None, None, 1)
    assert status == "ok"
    elems = {"fc1": 16 * 512 + 512, "fc2": 512 * 512 + 512, "fc3": 512 * 4 + 4}
    held = sum(n / 2 if plan[name] == 1 else n for name, n in elems.items())
    budget = (held - 1) * 4 * 3  # SGD with momentum: 3 tensors a parameter; one element less than the free pick
    status, tight = plan_here(model, 2, 4, sample, parse_link("100mbit"), None, budget, 1)
    assert status == "ok", tight
    assert sum(n / 2 if tight[name] == 1 else n for name, n in elems.items()) * 12 <= budget
    status, why = plan_here(model, 2, 4, sample, parse_link("100mbit"), None, 1000.0, 1)
    assert status == "error" and "the smallest needs" in why and "\n" not in why


@pytest.mark.parametrize("plan,budget,slots,message", [
    ({"fc*": 1}, "2GiB", 0, "memory_per_rank is for plan 'auto'"),
    ("auto", "two gigs", 0, "memory_per_rank must be a positive size"),
    ("auto", -5, 0, "memory_per_rank must be a positive number of bytes"),
    ("auto", True, 0, "memory_per_rank must be a positive number of bytes"),
    ("auto", "2GiB", -1, "optimizer_slots must be an integer >= 0"),
])
def test_bad_budgets(plan, budget, slots, message):
    with pytest.raises(ValueError, match=message):
        check_budget(plan, budget, slots)
    with pytest.raises(ValueError, match=message):  # before any process group: one line on every rank alike
        from troupe.partition import partition

        partition(MLP(), plan, 2, memory_per_rank=budget, optimizer_slots=slots, sample=torch.randn(2, 16))
    assert check_budget("auto", "1.5KiB", 2) == 1536.0


def test_candidates_list_partition_plus_shard_and_the_plan_within_budget():
    cands = candidates(chain(), 4, LINK, workers_per_group=[1, 2], optimizer_slots=2, options=("plain", "shard"),
                       memory=26000)
    by = {(c.dims, c.option): c for c in cands}
    assert by[((0, 1, 0), "shard:optimizer")].state_bytes == state_bytes(chain(), (0, 1, 0), setup(optimizer_slots=2),
                                                                         "optimizer")
    assert not any(c.option == "shard:parameters" and any(c.dims) for c in cands)
    within = next(c for c in cands if c.name.startswith("best for k=2 within budget") and c.option == "plain")
    assert within.dims == (1, 1, 0) and within.state_bytes <= 26000  # best for k=2 (0, 1, 0) needs 26,560
    chosen = pick(cands, memory=26000)
    assert chosen.seconds == min(c.seconds for c in cands if c.state_bytes <= 26000)
