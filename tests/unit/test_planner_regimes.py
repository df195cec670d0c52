"""The planner's pricing of powerSGD and DiLoCo, by hand: bytes and seconds per step of a tiny
profile with known shapes (synthetic alpha, beta and layer times), how each candidate is marked
against synchronous SGD, and what a slow link lists and picks. No processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from troupe.partition.planner import LayerProfile, Link, ModelProfile, Setup, candidates, parse_link, pick, plan_cost
from troupe.partition.planner.command import render_table
from troupe.partition.planner.cost import compresses, diloco_cost, dp_reduction, lowrank_elements
from troupe.partition.planner.profile import profile_model
from troupe.partition.planner.search import PICK_FROM

ALPHA, BETA = 1e-3, 1e-6
LINK = Link(ALPHA, BETA)
PLAIN_ELEMS = 76 + 410 + 12


def tiny() -> ModelProfile:
    """A conv 4x2x3x3 (+bias, 25 output positions, first layer), a linear 10x40 (+bias), a norm of
    12 replicated parameters; b = 2, s = 4."""
    conv = LayerProfile(name="conv", kind="Conv2d", params=76, in_elems=50, out_elems=100, out_size=4,
                        input_grad=False, times={(2, 1): 0.010}, shapes=((4, 2, 3, 3), (4,)))
    fc = LayerProfile(name="fc", kind="Linear", params=410, in_elems=40, out_elems=10, out_size=10,
                      times={(2, 1): 0.004}, shapes=((10, 40), (10,)))
    return ModelProfile(batch=2, layers=(conv, fc), replicated_params=12, replicated_seconds=0.003,
                        replicated_shapes=((6,), (6,)))


def dp(option: str = "plain", **kw) -> Setup:
    return Setup(world_size=4, link=LINK, option=option, **kw)


def test_which_matrices_powersgd_compresses():
    # conv as 4 x 18: r=1 (4+18)*2 = 44 < 72; r=2 88 >= 72 travels whole. fc 10 x 40: r=2 200 < 400, r=4 400 not.
    assert [compresses((4, 2, 3, 3), r) for r in (1, 2)] == [1, 0]
    assert [compresses((10, 40), r) for r in (1, 2, 4)] == [1, 2, 0]
    assert compresses((10,), 1) == 0 and compresses((3, 100), 5) == 0  # a vector; a rank clamped to 3 fails
    # r=1, round one: P 4 + bias 4, P 10 + bias 10, the norm's 12; round two: Q 18, Q 40
    assert lowrank_elements([s for layer in tiny().layers for s in layer.shapes] + [(6,), (6,)], 1) == (40, 58)


@pytest.mark.parametrize("rank,sent", [
    (1, 1.5 * 4 * (40 + 58)),             # 2(W-1)/W of (round one + round two) elements x 4 bytes
    (2, 1.5 * 4 * (76 + 12 + 30 + 80)),   # conv and norm whole; fc: P 20 + bias 10, Q 80
    (4, 1.5 * 4 * PLAIN_ELEMS),           # nothing compresses at r=4: plain's bytes
])
def test_powersgd_bytes_per_step_by_hand(rank, sent):
    cost = plan_cost(tiny(), (0, 0), dp("powerSGD", powersgd_rank=rank))
    assert cost.bytes == pytest.approx(sent, rel=1e-12)
    assert plan_cost(tiny(), (0, 0), dp()).bytes == pytest.approx(1.5 * 4 * PLAIN_ELEMS, rel=1e-12)


def test_powersgd_seconds_by_hand():
    cost = plan_cost(tiny(), (0, 0), dp("powerSGD", powersgd_rank=1))
    # matrix products 6*r*n*m, scaled from the layer's (4 + 2g)*b*positions*n*m flops:
    # conv 0.010 * 6 / (4 * 2 * 25), fc 0.004 * 6 / (6 * 2 * 1)
    assert cost.compute == pytest.approx(0.017 + 0.0003 + 0.002, rel=1e-12)
    # two rounds for conv and fc, one for the norm (it has no Q): 5 messages, then the bytes
    assert cost.reduce == pytest.approx(5 * ALPHA + 1.5 * 4 * 98 * BETA, rel=1e-12)


def test_powersgd_needs_shapes_and_a_valid_rank():
    with pytest.raises(ValueError, match="option 'powerSGD' needs the shapes of the 410 parameters"):
        dp_reduction(410, dp("powerSGD"), 4)
    with pytest.raises(ValueError, match="powersgd_rank must be an integer >= 1, got 0"):
        dp("powerSGD", powersgd_rank=0)
    with pytest.raises(ValueError, match=r"fc: shapes \[\(10, 40\)\] hold 400 elements, not the 410 parameters"):
        LayerProfile(name="fc", kind="Linear", params=410, in_elems=40, out_elems=10, out_size=10, times={},
                     shapes=((10, 40),))


@pytest.mark.parametrize("groups,seconds,nbytes", [
    # G=2 groups of 2: the inner step all-reduces over 2 (3 messages, 1.0 x 1992 bytes); every 10
    # steps the outer all-reduce over the 2 groups (1 message, 1992 bytes), a tenth per step
    (2, 0.017 + 3 * ALPHA + 1992 * BETA + (ALPHA + 1992 * BETA) / 10, 1992 + 1992 / 10),
    # G=4 groups of 1: no inner reduction; the outer one over 4 sends 1.5 x 1992
    (4, 0.017 + (ALPHA + 1.5 * 1992 * BETA) / 10, 1.5 * 1992 / 10),
])
def test_diloco_cost_by_hand(groups, seconds, nbytes):
    cost = diloco_cost(tiny(), dp(), groups, 10)
    assert cost.seconds == pytest.approx(seconds, rel=1e-12)
    assert cost.bytes == pytest.approx(nbytes, rel=1e-12)


@pytest.mark.parametrize("groups,dtype,fragments,delay,seconds,nbytes", [
    # the pseudo-gradient all-gathered as each group's encoded bytes, (G-1) pieces per worker: int8 one
    # chunk of 1024 codes + a 4-byte scale for the 498 elements, int4 512 + 4, bf16 2 x 498
    (4, "int8", 1, 0, 0.017 + (ALPHA + 3 * 1028 * BETA) / 10, 3 * 1028 / 10),
    (4, "int4", 1, 0, 0.017 + (ALPHA + 3 * 516 * BETA) / 10, 3 * 516 / 10),
    (4, "bf16", 1, 0, 0.017 + (ALPHA + 3 * 996 * BETA) / 10, 3 * 996 / 10),
    (2, "int4", 1, 0, 0.017 + 3 * ALPHA + 1992 * BETA + (ALPHA + 516 * BETA) / 10, 1992 + 516 / 10),
    # Streaming, 2 fragments of 249 elements: fp32 two all-reduces of 996 bytes (1.5 x 996 sent each)
    # per H, the same bytes as DiLoCo; overlapped with one inner step (17 ms) nothing is left exposed
    (4, "fp32", 2, 0, 0.017 + 2 * (ALPHA + 1.5 * 996 * BETA) / 10, 2 * 1.5 * 996 / 10),
    (4, "fp32", 2, 1, 0.017, 2 * 1.5 * 996 / 10),
    # int4 fragments are padded to whole chunks each: 2 x 516 bytes where DiLoCo sends one 516
    (4, "int4", 2, 0, 0.017 + 2 * (ALPHA + 3 * 516 * BETA) / 10, 2 * 3 * 516 / 10),
])
def test_diloco_wire_dtype_and_streaming_by_hand(groups, dtype, fragments, delay, seconds, nbytes):
    cost = diloco_cost(tiny(), dp(), groups, 10, dtype, fragments, delay)
    assert cost.seconds == pytest.approx(seconds, rel=1e-12)
    assert cost.bytes == pytest.approx(nbytes, rel=1e-12)


def test_plan_prices_the_chosen_pseudo_gradient_dtype_and_says_how_to_run_it():
    from troupe.partition.planner.command import describe_pick

    cands = candidates(tiny(), 4, parse_link("100mbit"), workers_per_group=[1], pseudo_grad_dtype="int4",
                       fragments=2, delay=1)
    streaming = next(c for c in cands if c.option == "diloco:50:int4:K2:d1" and c.worker_groups == 4)
    slow = Setup(world_size=4, link=parse_link("100mbit"))
    assert streaming.cost.bytes == pytest.approx(diloco_cost(tiny(), slow, 4, 50, "int4", 2, 1).bytes)
    assert ("--framework diloco --nworker-groups 4 --sync-freq 50 --pseudo-grad-dtype int4 --fragments 2 --delay 1"
            in describe_pick(streaming))


def test_diloco_bad_input():
    with pytest.raises(ValueError, match="sync_freq must be an integer >= 1, got 0"):
        diloco_cost(tiny(), dp(), 2, 0)
    with pytest.raises(ValueError, match=r"2 or more worker groups dividing the world size \(4\), got 3"):
        diloco_cost(tiny(), dp(), 3, 10)
    with pytest.raises(ValueError, match=r"pseudo_grad_dtype must be one of .*, got 'fp4'"):
        diloco_cost(tiny(), dp(), 2, 10, "fp4")
    assert diloco_cost(tiny(), dp(), 2, 10, "fp8").bytes == diloco_cost(tiny(), dp(), 2, 10, "int8").bytes  # a byte each
    with pytest.raises(ValueError, match=r"delay \(10\) must be smaller than sync_freq \(10\)"):
        diloco_cost(tiny(), dp(), 2, 10, "fp32", 2, 10)


def test_slow_link_lists_diloco_and_powersgd_below_plain_and_picks_exact_sync_sgd():
    cands = candidates(tiny(), 4, parse_link("100mbit"), workers_per_group=[1])
    plain = next(c for c in cands if c.name == "data parallel" and c.option == "plain")
    by_option = {(c.name, c.option): c for c in cands}
    for r in (1, 2):
        assert by_option[("data parallel", f"powerSGD:{r}")].cost.bytes < plain.cost.bytes
    for g in (2, 4):
        for h in (20, 50, 100):
            assert by_option[(f"DiLoCo {g} groups x {4 // g}", f"diloco:{h}")].sync_sgd == "no"
    diloco = by_option[("DiLoCo 4 groups x 1", "diloco:100")]
    assert diloco.cost.bytes == pytest.approx(1.5 * 4 * PLAIN_ELEMS / 100) and diloco.cost.bytes < plain.cost.bytes
    assert diloco.param_bytes == 3 * 4 * PLAIN_ELEMS  # the model, the outer parameters, the outer momentum
    assert {c.sync_sgd for c in cands if c.regime == "powerSGD"} == {"approx"}
    assert pick(cands).sync_sgd == "exact"
    assert pick(cands, PICK_FROM["approx"]).sync_sgd in ("exact", "approx")
    assert pick(cands, PICK_FROM["any"]) == cands[0]
    table = render_table(tiny(), 4, parse_link("100mbit"), cands, pick(cands))
    row = next(line for line in table.splitlines() if line.startswith("DiLoCo 4 groups x 1") and "diloco:100" in line)
    assert row.split()[-6:-4] == ["diloco:100", "no"] and "no = not equivalent to synchronous SGD" in table
    assert ("faster with an option that changes the update (diloco:100, sync SGD no): DiLoCo 4 groups x 1 "
            "(--framework diloco --nworker-groups 4 --sync-freq 100): ") in table


def test_hand_built_profiles_without_shapes_skip_powersgd():
    bare = ModelProfile(batch=2, layers=tuple(LayerProfile(**{**vars(layer), "shapes": None})
                                              for layer in tiny().layers), replicated_params=12)
    assert not any(c.regime == "powerSGD" for c in candidates(bare, 4, LINK, workers_per_group=[1]))


def test_profile_records_parameter_shapes():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 3))
    profile = profile_model(model, torch.randn(2, 1, 4, 4), [1], reps=1, warmup=0)
    assert [layer.shapes for layer in profile.layers] == [((2, 1, 3, 3), (2,)), ((3, 8), (3,))]
    assert profile.replicated_shapes == ((8,), (8,)) and profile.shapes_known
