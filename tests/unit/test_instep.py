"""The in-step calibration (troupe.partition.planner.instep) and the cost model's terms it feeds:
solve() recovers known costs from step times made by the model's own formulas, the sync is
charged once per step, each exchange kind uses its own link, fused reductions count messages
as the runtime sends them, and the A/B engine's aligned turns put a barrier before every step."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_planner import ALPHA, BETA, LINK, chain, setup
from troupe.observe.turns import Contestant, Schedule, run_ab
from troupe.partition.planner import Link, Setup, layer_cost, plan_cost
from troupe.partition.planner import instep

N, LOCAL_S, SYNC = 4, 0.030, 0.004
A_AR = 0.001
KIND_COSTS = {"all_gather": (0.002, 1e-9), "all_to_all": (0.0015, 2e-9), "reduce_scatter": (0.003, 3e-9)}
ALPHA_R, BETA_R = 0.005, 1.5e-9
BUCKET = 2**19
E = instep.EXCHANGE_ELEMS


def synthetic_times() -> dict[str, float]:
    """Step times the model says the probes take, written out here (not with instep's helpers)."""
    wire = {"all_gather": (N - 1) * E * 4, "all_to_all": (N - 1) * E * 4, "reduce_scatter": 2 * (N - 1) * E * 4}
    times = {instep.LOCAL: LOCAL_S, instep.SYNC: LOCAL_S + SYNC + A_AR, instep.SYNC5: LOCAL_S + SYNC + 5 * A_AR}
    for kind, (a, b) in KIND_COSTS.items():
        times[f"cal: {kind} x5"] = LOCAL_S + SYNC + 5 * a
        times[f"cal: {kind} x5 of 256 KiB"] = LOCAL_S + SYNC + 5 * (a + b * wire[kind])
    # one bucket of 1/8 of the bucket size; four full buckets (plus the step's one message each)
    for name, elems, messages in ((instep.REDUCE1, BUCKET // 8, 1 + 1 / 8), (instep.REDUCE2, 4 * BUCKET, 1 + 4)):
        times[name] = LOCAL_S + SYNC + ALPHA_R * messages + BETA_R * 1.5 * elems * 4
    return times


def test_solve_recovers_the_costs_that_made_the_times():
    cal = instep.solve(synthetic_times(), N, bucket_size=BUCKET)
    assert set(synthetic_times()) == {instep.LOCAL, *instep.NAMES}
    assert cal.sync == pytest.approx(SYNC, rel=1e-9)
    assert cal.reduce.alpha == pytest.approx(ALPHA_R, rel=1e-6)
    assert cal.reduce.beta == pytest.approx(BETA_R, rel=1e-6)
    for kind, (a, b) in KIND_COSTS.items():
        assert cal.exchanges[kind].alpha == pytest.approx(a, rel=1e-9)
        assert cal.exchanges[kind].beta == pytest.approx(b, rel=1e-9)
    assert (cal.exchanges["send"].alpha, cal.exchanges["send"].beta) == (cal.exchanges["all_to_all"].alpha,
                                                                         cal.exchanges["all_to_all"].beta)


def test_solve_clamps_noise_and_refuses_missing_probes():
    times = synthetic_times()
    times[instep.SYNC5] = times[instep.SYNC] - 0.002  # five in a row measured faster than one: noise
    times[instep.REDUCE1] = times[instep.REDUCE2] + 0.01
    cal = instep.solve(times, N, bucket_size=BUCKET)
    assert cal.sync >= 0 and cal.reduce.alpha >= 0 and cal.reduce.beta >= 0
    assert all(link.alpha >= 0 and link.beta >= 0 for link in cal.exchanges.values())
    del times[instep.REDUCE2]
    with pytest.raises(ValueError, match=r"calibration needs the step times of \['cal: reduce 2'\]"):
        instep.solve(times, N)
    with pytest.raises(ValueError, match="2 or more ranks"):
        instep.solve(synthetic_times(), 1)


def test_apply_prices_a_plan_with_the_measured_terms():
    cal = instep.solve(synthetic_times(), N, bucket_size=BUCKET)
    s = cal.apply(setup())
    assert s.link == cal.reduce and s.sync == cal.sync and s.fused_reductions
    assert s.exchange("all_gather") == cal.exchanges["all_gather"]
    assert instep.InStep(**{"sync": 0.0, "reduce": LINK, "exchanges": {}}).apply(setup()).exchange("send") == LINK


def test_sync_is_charged_once_per_step_and_only_with_several_ranks():
    profile = chain()
    plain = plan_cost(profile, (0, 1, -1), setup())
    synced = plan_cost(profile, (0, 1, -1), setup(sync=0.007))
    assert synced.sync == 0.007 and synced.seconds - plain.seconds == pytest.approx(0.007, rel=1e-12)
    alone = Setup(world_size=1, link=LINK, sync=0.007)
    assert plan_cost(profile, (0, 0, 0), alone).sync == 0.0
    with pytest.raises(ValueError, match="sync must be a finite number"):
        setup(sync=-1.0)
    with pytest.raises(ValueError, match=r"exchange_links: unknown kinds \['broadcast'\]"):
        setup(exchange_links={"broadcast": LINK})


def test_each_exchange_kind_uses_its_own_link():
    # fc1 with dim 1, W = 4, k = 2, b = 2, s = 4: gather 160 B, two all-to-alls of 32 B, reduce-scatter 320 B
    profile = chain()
    fc1 = profile.layers[1]
    base = layer_cost(fc1, 1, setup(), profile.batch)
    slow_gather = Link(10 * ALPHA, 10 * BETA)
    cost = layer_cost(fc1, 1, setup(exchange_links={"all_gather": slow_gather}), profile.batch)
    assert cost.intra - base.intra == pytest.approx(9 * ALPHA + 9 * 160 * BETA, rel=1e-12)
    cost = layer_cost(fc1, 1, setup(exchange_links={"all_to_all": slow_gather}), profile.batch)
    assert cost.intra - base.intra == pytest.approx(2 * (9 * ALPHA + 9 * 32 * BETA), rel=1e-12)
    cost = layer_cost(fc1, 1, setup(exchange_links={"reduce_scatter": slow_gather}), profile.batch)
    assert cost.intra - base.intra == pytest.approx(9 * ALPHA + 9 * 320 * BETA, rel=1e-12)
    assert cost.reduce == base.reduce  # the slice's reduction keeps `link`
    root = layer_cost(fc1, -1, setup(exchange_links={"send": slow_gather}), profile.batch)
    assert root.intra == pytest.approx(10 * layer_cost(fc1, -1, setup(), profile.batch).intra, rel=1e-12)


def test_fused_reductions_count_messages_as_the_runtime_sends_them():
    # data parallel over W = 4, bucket 1000 elements: 3160 parameters are 3.16 messages plus the step's one,
    # instead of each of the 4 parts (replicated, conv, fc1, fc2) paying ceil(P / 1000) = 1, 1, 3, 1
    profile = chain()
    per_layer = plan_cost(profile, (0, 0, 0), setup(1, bucket_size=1000))
    fused = plan_cost(profile, (0, 0, 0), setup(1, bucket_size=1000, fused_reductions=True))
    assert per_layer.reduce - fused.reduce == pytest.approx((6 - (1 + 3.16)) * ALPHA, rel=1e-9)
    assert per_layer.bytes == fused.bytes
    # a dim-1 slice (fc1: 1500 of its 3000 parameters per worker) reduced over G = 2: 1.5 messages, not 1
    hybrid = plan_cost(profile, (0, 1, 0), setup(bucket_size=1000, fused_reductions=True))
    dims0 = 10 + 100 + 50
    expected = (1 + dims0 / 1000 + 1500 / 1000) * ALPHA + (1.5 * dims0 * 4 + 1 * 1500 * 4) * BETA
    assert hybrid.reduce == pytest.approx(expected, rel=1e-9)


class CountingComm:
    """Enough of a Communicator for run_ab: counts barriers, reduces nothing (one rank's numbers)."""

    world_size = 2

    def __init__(self):
        self.barriers = 0

    def barrier(self):
        self.barriers += 1

    def all_reduce(self, t, op="sum"):
        return t


@pytest.mark.parametrize("align,expected", [(False, 3), (True, 3 + 3 * 2 * 2)])
def test_aligned_turns_put_a_barrier_before_every_timed_step(align, expected):
    comm = CountingComm()
    made = [Contestant("A", lambda i: None), Contestant("B", lambda i: None)]
    measured = run_ab(made, Schedule(reps=3, steps=2, burnin=1, align=align), comm)
    assert comm.barriers == expected  # one per repetition, and with align one per contestant and step
    assert all(math.isfinite(m.value) for m in measured)

