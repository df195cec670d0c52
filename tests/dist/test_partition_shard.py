"""A partitioned model under a sharded DistOpt (``troupe.partition`` + ``DistOpt(opt, shard=...)``) on 4 Gloo
ranks in 2 worker groups of 2, against one process training the whole model on the combined batch.

One world runs every case (shard mode x optimizer): a model with a replicated layer norm, dim-0 layers, a
dim-1 layer split over the group and a dim -1 layer on worker 0, with accumulation under no_sync and
`troupe.clip_grad_norm_`; each rank reports the model it ends with (`full_state_dict`) and what it holds
(parameters, gradients, optimizer state), which is checked against the planner's `state_bytes`; one more
case shards the replicated parameters inside each group only (HSDP, ``groups=2``). The same world checks
the refusals: troupe.shard on a partitioned model, a checkpoint of its sharded state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

pytestmark = [pytest.mark.dist]

W, K = 4, 2  # 2 worker groups of 2
STEPS, MICRO, BATCH = 4, 2, 3
PLAN = {"fc0": 0, "fc1": 1, "fc2": -1, "fc3": 0}
CASES = [(mode, opt) for mode in ("optimizer", "gradients") for opt in ("sgd", "adamw")]
HSDP = ("optimizer", "adamw", 2)
"""The replicated parameters sharded inside each of 2 worker groups and replicated across them (``groups=2``)."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(32, 12)
        self.norm, self.fc3 = nn.LayerNorm(12), nn.Linear(12, 5)

    def forward(self, x):
        h = torch.relu(self.fc1(torch.tanh(self.fc0(x))))
        return self.fc3(self.norm(torch.tanh(self.fc2(h))))


def make(opt_name: str, model: nn.Module | None = None):
    if model is None:
        torch.manual_seed(0)
        model = Net()
    if opt_name == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def batches():
    g = torch.Generator().manual_seed(1)
    n = STEPS * MICRO * BATCH * W
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def rows(step: int, micro: int, rank: int) -> slice:
    start = ((step * MICRO + micro) * W + rank) * BATCH
    return slice(start, start + BATCH)


def train_case(rank: int, mode: str, opt_name: str, groups: int | None = None) -> dict:
    import troupe

    torch.manual_seed(0)
    model = troupe.partition(Net(), PLAN, workers_per_group=K)
    model, opt = make(opt_name, model)
    sgd = troupe.DistOpt(opt, shard=mode, bucket_size=100, first_bucket_size=50, groups=groups)
    x, y = batches()
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            loss = F.cross_entropy(model(x[rows(step, micro, rank)]), y[rows(step, micro, rank)]) / MICRO
            if micro < MICRO - 1:
                with sgd.no_sync():
                    loss.backward()
            else:
                loss.backward()
        norms.append(float(troupe.clip_grad_norm_(model.parameters(), 0.5)))
        sgd.step()
    # what the rank holds after a step, before zero_grad: parameters, gradients, optimizer state (each storage once)
    step = sgd.strategy
    grads = [b.buffer for b in sgd.reducer.buckets if b.buffer is not None] if mode == "optimizer" else step.grads
    grads = list(grads) + [s.flat if s.flat is not None else s.grad for s in step.slices.sets]
    held = {"params": sum(p.numel() for p in model.parameters()), "grads": sum(g.numel() for g in grads),
            "state": sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()),
            "parts": sum(p.numel() for g in opt.param_groups for p in g["params"])}
    sgd.zero_grad()
    return {"params": troupe.partition.full_state_dict(model), "norms": norms, "held": held,
            "describe": step.describe()}


def refusals(rank: int) -> list[str]:
    import tempfile

    import troupe

    torch.manual_seed(0)
    model = troupe.partition(Net(), PLAN, workers_per_group=K)
    said = []
    try:
        troupe.shard(model)
    except ValueError as e:
        said.append(str(e))
    _, opt = make("sgd", model)
    sgd = troupe.DistOpt(opt, shard="optimizer")
    F.cross_entropy(model(torch.randn(2, 8)), torch.tensor([0, 1])).backward()
    sgd.step()
    try:
        troupe.checkpoint.save(tempfile.mkdtemp(), 1, model, sgd)
    except ValueError as e:
        said.append(str(e))
    return said


def world(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {case: train_case(rank, *case) for case in [*CASES, HSDP]}
    out["refusals"] = refusals(rank)
    return out


def reference(opt_name: str) -> tuple[dict, list[float]]:
    model, opt = make(opt_name)
    x, y = batches()
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            loss = sum(F.cross_entropy(model(x[rows(step, micro, r)]), y[rows(step, micro, r)]) for r in range(W))
            (loss / (W * MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, norms


@pytest.fixture(scope="module")
def ranks():
    return run_world(world, W, timeout=120)


@pytest.mark.parametrize("case", [*CASES, HSDP], ids=lambda case: "-".join(map(str, case)))
def test_equals_one_process_on_the_combined_batch(ranks, case):
    ref, ref_norms = reference(case[1])
    for r, res in enumerate(ranks):
        got = res[case]
        assert got["describe"] == f"plain, shard={case[0]}, partitioned"
        for name, value in ref.items():
            assert torch.allclose(got["params"][name], value, atol=1e-5, rtol=1e-5), (r, name)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), r


def expected_state(mode: str, opt_name: str) -> float:
    """The planner's model-state bytes of this plan (the worker holding the most), from a hand-built profile."""
    from troupe.partition.planner import LayerProfile, ModelProfile, Setup, parse_link
    from troupe.partition.planner.memory import state_bytes

    net = Net()
    layers = tuple(LayerProfile(name=n, kind="Linear", params=sum(p.numel() for p in net.get_submodule(n).parameters()),
                                in_elems=1, out_elems=1, out_size=net.get_submodule(n).out_features, times={})
                   for n in PLAN)
    profile = ModelProfile(batch=BATCH, layers=layers, replicated_params=sum(p.numel() for p in net.norm.parameters()))
    setup = Setup(world_size=W, workers_per_group=K, link=parse_link("loopback"),
                  optimizer_slots=1 if opt_name == "sgd" else 2)
    return state_bytes(profile, tuple(PLAN.values()), setup, mode)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_each_rank_holds_its_share_as_the_planner_prices_it(ranks, case):
    mode, opt_name = case
    slots = 1 if opt_name == "sgd" else 2
    net = Net()
    replicated = sum(p.numel() for n, p in net.named_parameters() if not n.startswith(("fc1", "fc2")))
    fc1, fc2 = sum(p.numel() for p in net.fc1.parameters()), sum(p.numel() for p in net.fc2.parameters())
    slices = {0: fc1 // K + fc2, 1: fc1 // K}  # worker j's slices; worker 0 also holds the dim -1 layer
    held = [res[case]["held"] for res in ranks]
    parts = [h["parts"] for h in held]
    # the optimizer's parts cover each replicated element once over the job, each slice element once per place
    assert sum(parts) == replicated + sum(slices.values())
    for r, h in enumerate(held):
        place = r % K
        assert h["params"] == replicated + slices[place]
        assert h["state"] == slots * h["parts"]
        # 1/W of the replicated elements (within one bucket's padding) and 1/G of its place's slices
        assert abs(h["parts"] - replicated / W - slices[place] / (W // K)) <= 4 * W
    most = max(4 * (h["params"] + h["grads"] + h["state"]) for h in held)
    # the planner's ideal; the count adds the buckets' padding and flags (a few elements each)
    assert most == pytest.approx(expected_state(mode, opt_name), rel=0.02)
    assert most >= expected_state(mode, opt_name)


def test_what_cannot_compose_is_refused_in_one_line(ranks):
    for res in ranks:
        shard, save = res["refusals"]
        assert "troupe.shard cannot shard a model partitioned by troupe.partition" in shard and "\n" not in shard
        assert "cannot save a partitioned model's sharded optimizer state" in save and "\n" not in save
