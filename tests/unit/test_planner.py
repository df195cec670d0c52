"""The partition planner without other processes: the cost arithmetic against hand-computed
numbers (synthetic alpha, beta and layer times), the exact search against brute force, the
candidate list and its pick, link spellings, profiling on copies, and `troupe plan`'s errors."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from troupe.cli import main as cli_main
from troupe.partition.planner import (
    LayerProfile,
    Link,
    ModelProfile,
    Setup,
    best_chain,
    best_dims,
    candidates,
    layer_cost,
    param_bytes,
    parse_link,
    pick,
    plan_cost,
    profile_model,
    proportional_times,
)
from troupe.partition.planner.command import find_model, input_shape, load_script, print_json, render_table
from troupe.partition.planner.cost import DEFAULT_CHUNK_SIZE
from troupe.partition.planner.link import fit_alpha_beta
from troupe.partition.planner.search import hand_plans

ALPHA, BETA = 1e-3, 1e-6  # round numbers: every hand-computed cost below is exact to the microsecond
LINK = Link(ALPHA, BETA)


def chain() -> ModelProfile:
    """Three layers, b = 2, s = 4, profiled for k = 1 and 2 (hand-written times)."""
    conv = LayerProfile(name="conv", kind="Conv2d", params=100, in_elems=10, out_elems=20, out_size=4,
                        input_grad=False, times={(2, 1): 0.010, (4, 1): 0.020, (4, 2): 0.011})
    fc1 = LayerProfile(name="fc1", kind="Linear", params=3000, in_elems=20, out_elems=8, out_size=8,
                       times={(2, 1): 0.004, (4, 1): 0.008, (4, 2): 0.005})
    fc2 = LayerProfile(name="fc2", kind="Linear", params=50, in_elems=8, out_elems=5, out_size=5,
                       times={(2, 1): 0.001, (4, 1): 0.002})
    return ModelProfile(batch=2, layers=(conv, fc1, fc2), replicated_params=10, replicated_seconds=0.003)


def setup(k: int = 2, **kw) -> Setup:
    return Setup(world_size=4, workers_per_group=k, link=LINK, **kw)


# --- the cost arithmetic, by hand: W = 4, k = 2 (G = 2), b = 2, s = 4 -------------------------
# (seconds, bytes) per layer and dim; the comment is the formula with the numbers put in.
HAND = {
    # dim 0: c(b) + alpha + 2(W-1)/W * P*s * beta
    ("conv", 0): (0.010 + ALPHA + 1.5 * 400 * BETA, 600),
    ("fc1", 0): (0.004 + ALPHA + 1.5 * 12000 * BETA, 18000),
    ("fc2", 0): (0.001 + ALPHA + 1.5 * 200 * BETA, 300),
    # dim 1: c(B,k) + gather (k-1)b*A_in*s + 2 x all-to-all (k-1)/k*b*A_out*s [+ reduce-scatter 2(k-1)b*A_in*s]
    #        + all-reduce over G=2 of P/k*s (2(G-1)/G = 1)
    ("conv", 1): (0.011 + (ALPHA + 80 * BETA) + 2 * (ALPHA + 80 * BETA) + (ALPHA + 200 * BETA), 80 + 160 + 200),
    ("fc1", 1): (0.005 + (ALPHA + 160 * BETA) + 2 * (ALPHA + 32 * BETA) + (ALPHA + 320 * BETA)
                 + (ALPHA + 6000 * BETA), 160 + 64 + 320 + 6000),
    # dim -1: c(B) + forward (k-1)[2 alpha + b(A_in+A_out)s beta] + backward (k-1)[alpha + b*A_out*s beta]
    #         [+ (k-1)(alpha + b*A_in*s beta)] + all-reduce over G=2 of P*s
    ("conv", -1): (0.020 + (2 * ALPHA + 240 * BETA) + (ALPHA + 160 * BETA) + (ALPHA + 400 * BETA), 240 + 160 + 400),
    ("fc1", -1): (0.008 + (2 * ALPHA + 224 * BETA) + (2 * ALPHA + 224 * BETA) + (ALPHA + 12000 * BETA),
                  224 + 224 + 12000),
    ("fc2", -1): (0.002 + (2 * ALPHA + 104 * BETA) + (2 * ALPHA + 104 * BETA) + (ALPHA + 200 * BETA), 104 + 104 + 200),
}
REPLICATED = (0.003 + ALPHA + 1.5 * 40 * BETA, 60)


@pytest.mark.parametrize("name,dim", sorted(HAND))
def test_layer_cost_by_hand(name, dim):
    profile = chain()
    layer = next(layer for layer in profile.layers if layer.name == name)
    cost = layer_cost(layer, dim, setup(), profile.batch)
    seconds, nbytes = HAND[(name, dim)]
    assert cost.seconds == pytest.approx(seconds, rel=1e-12)
    assert cost.bytes == pytest.approx(nbytes, rel=1e-12)


def test_plan_cost_sums_layers_and_replicated_part():
    cost = plan_cost(chain(), (0, 1, -1), setup())
    parts = [REPLICATED, HAND[("conv", 0)], HAND[("fc1", 1)], HAND[("fc2", -1)]]
    assert cost.seconds == pytest.approx(sum(p[0] for p in parts), rel=1e-12)
    assert cost.bytes == pytest.approx(sum(p[1] for p in parts), rel=1e-12)
    assert cost.compute == pytest.approx(0.003 + 0.010 + 0.005 + 0.002, rel=1e-12)


# Pure data parallel (W = 4), each option, by hand: replicated + conv + fc1 + fc2.
COMPUTE = 0.003 + 0.010 + 0.004 + 0.001
OPTION_HAND = {
    "plain": COMPUTE + 4 * ALPHA + 1.5 * 4 * (10 + 100 + 3000 + 50) * BETA,
    "fp16": COMPUTE + 4 * ALPHA + 1.5 * 2 * (10 + 100 + 3000 + 50) * BETA,  # half the bytes
    "bf16": COMPUTE + 4 * ALPHA + 1.5 * 2 * (10 + 100 + 3000 + 50) * BETA,
    # top-K at spars 0.1: ceil(0.1 P) (index, value) pairs of 8 bytes, all-gathered: (W-1) x payload
    "sparseTopK": COMPUTE + 4 * ALPHA + 3 * 8 * (1 + 10 + 300 + 5) * BETA,
    # partial update, chunks of 1000: 3160 parameters -> K = 4 chunks of 790, one all-reduce per step
    "partialUpdate": COMPUTE + ALPHA + 1.5 * 790 * 4 * BETA,
}


@pytest.mark.parametrize("option", sorted(OPTION_HAND))
def test_data_parallel_options_by_hand(option):
    cost = plan_cost(chain(), (0, 0, 0), setup(1, option=option, spars=0.1, chunk_size=1000))
    assert cost.seconds == pytest.approx(OPTION_HAND[option], rel=1e-12)


def test_options_touch_only_the_data_parallel_reduction():
    plain = plan_cost(chain(), (0, 1, -1), setup())
    half = plan_cost(chain(), (0, 1, -1), setup(option="fp16"))
    saved = (1.5 * 20 + 1.5 * 200) * BETA  # half of the replicated part's and conv's dim-0 bytes
    assert plain.seconds - half.seconds == pytest.approx(saved, rel=1e-9)
    assert half.intra == plain.intra and half.compute == plain.compute


def test_overlap_hides_only_the_bucketed_reduction():
    full = plan_cost(chain(), (0, 1, 0), setup())
    half = plan_cost(chain(), (0, 1, 0), setup(overlap=0.5))
    bucketed = (REPLICATED[0] - 0.003) + (HAND[("conv", 0)][0] - 0.010) + (HAND[("fc2", 0)][0] - 0.001)
    assert full.seconds - half.seconds == pytest.approx(bucketed / 2, rel=1e-9)
    assert half.bytes == full.bytes


def test_memory_per_worker():
    profile = chain()
    assert param_bytes(profile, (0, 0, 0), setup(1)) == 4 * 3160
    assert param_bytes(profile, (0, 1, 0), setup()) == 4 * (10 + 100 + 1500 + 50)
    assert param_bytes(profile, (1, 1, -1), setup()) == 4 * (10 + 50 + 1500 + 50)  # worker 0 holds the -1 layer
    assert param_bytes(profile, (0, 1, 0), setup(optimizer_slots=1)) == 2 * 4 * 1660


def test_model_state_per_worker_and_the_shard_modes_by_hand():
    """P = 3160 parameters of 4 bytes, W = 4, Adam's 2 slots: parameters + gradients + state per worker."""
    from troupe.partition.planner.memory import state_bytes
    from troupe.partition.planner.cost import shard_cost

    profile, dp = chain(), setup(1, optimizer_slots=2)
    assert state_bytes(profile, (0, 0, 0), dp) == 3160 * 4 * (2 + 2)                    # 16 bytes a parameter
    assert state_bytes(profile, (0, 1, 0), setup(optimizer_slots=2)) == 1660 * 4 * 4    # fc1 split over k = 2
    assert state_bytes(profile, (0, 0, 0), dp, "optimizer") == 3160 * 4 * (2 + 2 / 4)   # 8 + 8/k
    assert state_bytes(profile, (0, 0, 0), dp, "gradients") == 3160 * 4 * (1 + 3 / 4)   # 4 + 12/k
    assert state_bytes(profile, (0, 0, 0), dp, "parameters") == 3160 * 16 / 4 + 2 * 3000 * 4  # 16/k + fc1 gathered
    assert param_bytes(profile, (0, 0, 0), dp, "optimizer") == 3160 * 4 * (1 + 2 / 4)  # the state column less
    assert param_bytes(profile, (0, 0, 0), dp, "gradients") == 3160 * 4 * (1 + 2 / 4)  # the gradients held
    assert param_bytes(profile, (0, 0, 0), dp, "parameters") == 3160 * 4 * 3 / 4 + 3000 * 4
    with pytest.raises(ValueError, match=r"shard 'parameters' \(troupe.shard\) cannot shard a partitioned model"):
        state_bytes(profile, (0, 1, 0), setup(optimizer_slots=2), "parameters")  # partition + shard: test_planner_memory
    plain = plan_cost(profile, (0, 0, 0), dp)
    gather = ALPHA + 0.75 * 3160 * 4 * BETA  # (W-1)/W of the parameters, one bucket, after the update
    assert shard_cost(profile, dp, "optimizer").seconds == pytest.approx(plain.seconds + gather)
    assert shard_cost(profile, dp, "gradients").bytes == plain.bytes  # reduce-scatter + all-gather = all-reduce
    full = shard_cost(profile, dp, "parameters")  # and every block again for forward, one message a layer
    assert full.seconds == pytest.approx(plain.seconds + gather + 3 * ALPHA + 0.75 * 3160 * 4 * BETA)
    assert full.bytes == pytest.approx(plain.bytes + 0.75 * 3160 * 4)


def test_a_memory_budget_picks_the_fastest_plan_that_fits_or_names_the_smallest_need():
    cands = candidates(chain(), 4, LINK, workers_per_group=[1, 2], optimizer_slots=2)
    assert {c.option for c in cands if c.regime == "shard"} == {"shard:optimizer", "shard:gradients",
                                                                "shard:parameters"}
    fastest = pick(cands)
    assert fastest.regime == "plain"  # a sharded step costs an all-gather more: never picked without a budget
    budget = 30000  # bytes: plain data parallel needs 50,560, fc1 split 26,560, ZeRO-2 22,120
    chosen = pick(cands, memory=budget)
    assert chosen.state_bytes <= budget
    assert chosen.seconds == min(c.seconds for c in cands if c.regime in ("plain", "shard")
                                 and c.state_bytes <= budget)
    with pytest.raises(ValueError, match=r"no plan fits 0.0 MiB of model state per worker: the smallest needs 0.0 MiB "
                                         r"\(all dim 1, shard gradients, option shard:gradients\)"):
        pick(cands, memory=1000)


@pytest.mark.parametrize("text,bytes_", [("2GiB", 2 * 2**30), ("1500MiB", 1500 * 2**20), ("2e9", 2e9),
                                         ("0.5 gb", 5e8), (None, None)])
def test_memory_sizes(text, bytes_):
    from troupe.partition.planner.command import parse_bytes

    assert parse_bytes(text) == bytes_


def test_world_of_one_and_pure_groups_reduce_nothing():
    one = Setup(world_size=1, link=LINK)
    assert plan_cost(chain(), (0, 0, 0), one).reduce == 0
    whole_group = Setup(world_size=2, workers_per_group=2, link=LINK)  # G = 1: slices have no other holder
    fc1 = chain().layers[1]
    assert layer_cost(fc1, 1, whole_group, 2).reduce == 0
    assert layer_cost(fc1, 0, whole_group, 2).reduce > 0


# --- valid dims -----------------------------------------------------------------------------
def test_invalid_dims_are_excluded():
    conv, fc1, fc2 = chain().layers
    assert fc2.dims(2) == (0, -1)  # 2 does not divide 5 outputs
    assert fc1.dims(2) == (0, 1, -1) and fc1.dims(3) == (0, -1) and fc1.dims(1) == (0,)
    with pytest.raises(ValueError, match=r"fc2: partition_dim 1 is not possible with workers_per_group 2"):
        layer_cost(fc2, 1, setup(), 2)
    grouped = LayerProfile(name="g", kind="Conv2d", params=1, in_elems=1, out_elems=1, out_size=8, times={},
                           splittable=False)
    assert grouped.dims(2) == (0, -1)
    assert hand_plans(chain(), 2) == {"one weird trick": (0, 1, 0), "all dim 1": (1, 1, 0)}
    for cand in candidates(chain(), 4, LINK, workers_per_group=[1, 2], spars=0.1):
        assert cand.dims[2] != 1
    with pytest.raises(ValueError, match=r"workers_per_group \(3\) must divide the world size \(4\)"):
        candidates(chain(), 4, LINK, workers_per_group=[3])
    with pytest.raises(ValueError, match=r"option must be one of .* got 'zip'"):
        setup(option="zip")


# --- the search: exact ----------------------------------------------------------------------
def brute_force(allowed, node, edge):
    best = None
    for dims in itertools.product(*allowed):
        total = sum(node(i, d) for i, d in enumerate(dims))
        total += sum(edge(i, dims[i - 1] if i else None, d) for i, d in enumerate(dims))
        best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_chain_search_equals_brute_force_with_transitions(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    allowed = [rng.choice([(0,), (0, -1), (0, 1, -1)]) for _ in range(n)]
    node = {(i, d): rng.random() for i in range(n) for d in (0, 1, -1)}
    edge = {(i, p, d): rng.random() for i in range(n) for p in (None, 0, 1, -1) for d in (0, 1, -1)}
    total, dims = best_chain(allowed, lambda i, d: node[i, d], lambda i, p, d: edge[i, p, d])
    assert total == pytest.approx(brute_force(allowed, lambda i, d: node[i, d], lambda i, p, d: edge[i, p, d]))
    assert all(d in a for d, a in zip(dims, allowed))
    again = sum(node[i, d] for i, d in enumerate(dims)) + sum(
        edge[i, dims[i - 1] if i else None, d] for i, d in enumerate(dims))
    assert total == pytest.approx(again)


def random_profile(rng: random.Random, ks: list[int]) -> ModelProfile:
    layers = []
    for i in range(rng.randint(1, 6)):
        layers.append(LayerProfile(
            name=f"l{i}", kind=rng.choice(["Linear", "Conv2d"]), params=rng.randint(1, 10**6),
            in_elems=rng.randint(1, 10**4), out_elems=rng.randint(1, 10**4), out_size=rng.choice([4, 6, 10, 12]),
            times=proportional_times(rng.random() * 1e-3, 8, ks), input_grad=i > 0, calls=rng.choice([1, 1, 2])))
    return ModelProfile(batch=8, layers=tuple(layers), replicated_params=rng.randint(0, 1000),
                        replicated_seconds=rng.random() * 1e-3)


@pytest.mark.parametrize("seed", range(20))
def test_best_dims_equals_brute_force_over_plans(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, [2, 3, 4])
    for k in (2, 3, 4):
        s = Setup(world_size=12, workers_per_group=k, link=Link(rng.random() * 1e-4, rng.random() * 1e-8),
                  option=rng.choice(["plain", "fp16", "sparseTopK"]))
        found = plan_cost(profile, best_dims(profile, s), s).seconds
        brute = min(plan_cost(profile, dims, s).seconds
                    for dims in itertools.product(*(layer.dims(k) for layer in profile.layers)))
        assert found == pytest.approx(brute, rel=1e-12)


def test_partial_update_is_priced_not_searched():
    with pytest.raises(ValueError, match="partialUpdate"):
        best_dims(chain(), setup(option="partialUpdate"))


# --- candidates and the pick ----------------------------------------------------------------
def test_candidates_sorted_and_pick_is_the_minimum():
    cands = candidates(chain(), 4, LINK, workers_per_group=[1, 2], spars=0.1, chunk_size=1000)
    seconds = [c.seconds for c in cands]
    assert seconds == sorted(seconds)
    plain = [c for c in cands if c.option == "plain"]
    assert pick(cands) == min(plain, key=lambda c: c.seconds)
    assert pick(cands, options=None) == cands[0]
    names = {(c.name, c.option) for c in cands}
    assert {("data parallel", o) for o in ("plain", "fp16", "sparseTopK", "partialUpdate")} <= names
    best2 = next(c for c in cands if c.name.startswith("best for k=2") and c.option == "plain")
    assert best2.dims == (0, 1, 0)  # by hand: conv 0 (11.6 < 15.44 < 24.8 ms), fc1 1, fc2 0
    assert best2.seconds == pytest.approx(REPLICATED[0] + HAND[("conv", 0)][0] + HAND[("fc1", 1)][0]
                                          + HAND[("fc2", 0)][0])
    for c in (c for c in cands if c.regime not in ("diloco", "shard")):  # plan_cost, its own k and option
        s = Setup(world_size=4, workers_per_group=c.workers_per_group, link=LINK, option=c.option, spars=0.1,
                  chunk_size=1000)
        assert c.seconds == pytest.approx(plan_cost(chain(), c.dims, s).seconds)
    table = render_table(chain(), 4, LINK, cands, pick(cands))
    assert "data parallel" in table and f"picked: {pick(cands).name} " in table
    with pytest.raises(ValueError, match="no candidate with an option in"):
        pick(cands, options=("bf16",))


def test_json_lines(capsys):
    cands = candidates(chain(), 4, LINK, workers_per_group=[1, 2])
    print_json(chain(), 4, LINK, cands, pick(cands))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["layers"] == ["conv", "fc1", "fc2"] and lines[0]["link"]["alpha_s"] == ALPHA
    assert [row["predicted_ms"] for row in lines[1:-1]] == [c.seconds * 1e3 for c in cands]
    assert lines[-1]["picked"]["dims"] == {"conv": 0, "fc1": 1, "fc2": 0}


def test_equal_plans_are_listed_once():
    # a free link: only compute counts, and every layer computes least with dim 0
    cands = candidates(chain(), 4, Link(0.0, 0.0), workers_per_group=[1, 2])
    dp = [c for c in cands if not any(c.dims) and c.regime not in ("diloco", "shard")]
    assert sorted((c.name, c.option, c.workers_per_group) for c in dp) == [
        ("data parallel = best for k=2", option, 1) for option in ("fp16", "partialUpdate", "plain", "sparseTopK")]


# --- link spellings -------------------------------------------------------------------------
@pytest.mark.parametrize("text,alpha,beta", [
    ("1gbit", 50e-6, 8e-9), ("100mbit", 100e-6, 8e-8), ("10gbit", 20e-6, 8e-10), ("LoopBack", 20e-6, 1 / 3e9),
    ("alpha=50us,beta=1gbit", 50e-6, 8e-9), ("alpha=1ms, beta=8ns", 1e-3, 8e-9), ("2.5gbit", 50e-6, 8 / 2.5e9),
    ("alpha=0s,beta=400mb/s", 0.0, 1 / 400e6),
])
def test_link_spellings(text, alpha, beta):
    link = parse_link(text)
    assert link.alpha == pytest.approx(alpha) and link.beta == pytest.approx(beta)


@pytest.mark.parametrize("text,match", [
    ("fast", r"unknown link 'fast'"), ("", "link must be"), ("alpha=50us", "give both alpha and beta"),
    ("alpha=5parsecs,beta=1gbit", "alpha: unknown time unit in '5parsecs'"),
    ("alpha=1us,beta=0gbit", "bandwidth must be > 0"), ("alpha=1us,beta=1gbit,gamma=3", "got the part 'gamma=3'"),
    ("measure", "measured, not parsed"), ("alpha=-1us,beta=1gbit", "cannot read '-1us'"),
])
def test_link_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_link(text)


def test_fit_alpha_beta_recovers_a_line():
    sizes = [4096.0, 262144.0, 4194304.0]
    alpha, beta = fit_alpha_beta(sizes, [3e-5 + x * 2e-9 for x in sizes])
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-9)
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_alpha_beta([1.0, 1.0], [1.0, 2.0])


def test_chunk_size_matches_partial_update_default():
    from troupe.strategies.compressed import DEFAULT_CHUNK_SIZE as runtime_chunk

    assert DEFAULT_CHUNK_SIZE == runtime_chunk


# --- profiling (a tiny model: milliseconds) -------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 6)
        self.spare = nn.Linear(3, 3)  # never called

    def forward(self, x):
        y = self.fc(F.relu(self.norm(self.conv(x))).flatten(1))
        return self.fc(y.repeat(1, 11)[:, :64])  # fc twice


def test_profile_measures_layers_on_copies():
    model, sample = Tiny(), torch.randn(3, 1, 6, 6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile = profile_model(model, sample, [1, 2], reps=1, warmup=0)
    assert profile.names == ("conv", "fc") and profile.unused == ("spare",) and profile.batch == 3
    conv, fc = profile.layers
    assert (conv.in_elems, conv.out_elems, conv.params, conv.out_size) == (36, 64, 40, 4)
    assert (fc.in_elems, fc.out_elems, fc.calls, fc.input_grad) == (64, 6, 2, True)
    assert not conv.input_grad  # the model's input needs no gradient
    assert set(conv.times) == {(3, 1), (6, 1), (6, 2)} and set(fc.times) == {(3, 1), (6, 1), (6, 2)}
    assert profile.replicated_params == 8 + 12  # the norm's and the unused layer's
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


# --- `troupe plan` errors: exit 2, one line, no traceback -----------------------------------
SCRIPT = """
import torch
from torch import nn
class A(nn.Module):
    def forward(self, x): return x
class B(nn.Module):
    def __init__(self, width):
        super().__init__()
if __name__ == "__main__":
    raise SystemExit("main ran")
"""


def test_script_loading_and_model_errors(tmp_path):
    path = tmp_path / "two.py"
    path.write_text(SCRIPT)
    module = load_script(str(path))
    with pytest.raises(ValueError, match=r"defines 2 nn.Module classes \(A, B\): choose one with --model"):
        find_model(module, None)
    assert isinstance(find_model(module, "A"), nn.Module)
    with pytest.raises(ValueError, match=r"B\(\) failed: TypeError"):
        find_model(module, "B")
    with pytest.raises(ValueError, match=r"--model 'C': .* has no class or function"):
        find_model(module, "C")
    with pytest.raises(ValueError, match="no input shape: pass --input"):
        input_shape(module, None, str(path))
    assert input_shape(module, "1,28,28", str(path)) == (1, 28, 28)
    with pytest.raises(ValueError, match=r"--input must be positive integers .* got '1,x'"):
        input_shape(module, "1,x", str(path))
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="importing .*bad.py failed: RuntimeError: boom"):
        load_script(str(bad))


def run_plan(argv: list[str]) -> int:
    """`troupe plan ARGV` in this process: its exit code (argparse's own errors exit)."""
    try:
        return cli_main(["plan", *argv])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,match", [
    (["missing.py", "-n", "4"], "script not found: missing.py"),
    (["{script}", "-n", "0"], "-n must be a positive integer, got '0'"),
    (["{script}", "-n", "4", "--workers-per-group", "3"], "--workers-per-group 3 does not divide -n 4"),
    (["{script}", "-n", "4", "--link", "2 pigeons"], "unknown link '2 pigeons'"),
    (["{script}", "-n", "4", "--spars", "lots"], "argument --spars: invalid float value: 'lots'"),
    (["{script}", "-n", "4", "--options", "zip"], r"unknown option\(s\) \['zip'\]"),
    (["{script}", "-n", "4", "--sync-freqs", "0"], "--sync-freqs must be a positive integer, got '0'"),
    (["{script}", "-n", "4", "--powersgd-ranks", "two"], "--powersgd-ranks must be a positive integer, got 'two'"),
    (["{script}", "-n", "4", "--memory-per-rank", "lots"], "--memory-per-rank must be a positive size such as 2GiB"),
])
def test_plan_command_bad_input(tmp_path, capsys, argv, match):
    path = tmp_path / "one.py"
    path.write_text("from torch import nn\nclass M(nn.Module):\n    pass\n")
    code = run_plan([a.format(script=path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("troupe plan: "), err
    assert re.search(match, err), err


def test_step_time_is_finite_for_every_candidate():
    for c in candidates(chain(), 4, LINK, workers_per_group=[1, 2]):
        assert math.isfinite(c.seconds) and c.seconds > 0 and c.param_bytes > 0
