"""troupe.partition without other processes: plan resolution and its errors, slicing
arithmetic, the layer spec against torch's layers, and a world of one end to end."""

from __future__ import annotations

import warnings

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import troupe
import troupe.partition as tp
from troupe.partition import check_world, resolve_plan, slice_rows
from troupe.util import Refusal


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect")
        self.fc1, self.fc2 = nn.Linear(8 * 3 * 3, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.conv1(x)), 2)
        y = F.max_pool2d(F.relu(self.conv2(y)), 2)
        return self.fc2(F.relu(self.fc1(y.flatten(1))))


class Net(nn.Module):
    """A container with a norm layer inside, for inheritance and the non-splittable errors."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2))
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))


# --- plan resolution ----------------------------------------------------------------------


def test_an_int_plan_is_every_linear_and_conv():
    dims = resolve_plan(CNN(), -1, 2)
    assert dims == {"conv1": -1, "conv2": -1, "fc1": -1, "fc2": -1}
    assert list(dims) == ["conv1", "conv2", "fc1", "fc2"]  # module order


def test_globs_default_star_and_exact_names():
    assert resolve_plan(CNN(), {"conv*": 0, "fc*": 1}, 2) == {"conv1": 0, "conv2": 0, "fc1": 1, "fc2": 1}
    assert resolve_plan(CNN(), {"fc1": 1}, 2) == {"conv1": 0, "conv2": 0, "fc1": 1, "fc2": 0}  # default 0
    assert resolve_plan(CNN(), {"*": 1, "conv1": 0}, 2) == {"conv1": 0, "conv2": 1, "fc1": 1, "fc2": 1}
    assert resolve_plan(CNN(), {"conv1": 0}, 2, default=-1) == {"conv1": 0, "conv2": -1, "fc1": -1, "fc2": -1}
    # an exact name wins over a glob that also matches it
    assert resolve_plan(CNN(), {"fc*": 1, "fc2": -1}, 2)["fc2"] == -1


def test_a_container_key_reaches_the_layers_under_it():
    dims = resolve_plan(Net(), {"classifier": 1, "features.0": -1}, 2)
    assert dims == {"features.0": -1, "features.3": 0, "classifier.0": 1, "classifier.2": 1}
    # a key on a parameterless module (ReLU) is allowed: it works on any layout
    assert resolve_plan(Net(), {"classifier.1": 1}, 2)["classifier.2"] == 0


def test_subclasses_of_linear_are_left_alone():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 4))
    assert resolve_plan(model, 1, 2) == {"1": 1}  # not the attention's out_proj


@pytest.mark.parametrize(
    "model, plan, k, kwargs, error, words",
    [
        (CNN, {"fc*": 1, "nope*": 0}, 2, {}, ValueError, ["'nope*'", "matches no module", "conv1"]),
        (CNN, {"fc1": 2}, 2, {}, ValueError, ["plan['fc1']", "(0, 1, -1)", "got 2"]),
        (CNN, {"fc1": True}, 2, {}, ValueError, ["got True"]),
        (CNN, 3, 2, {}, ValueError, ["plan", "got 3"]),
        (CNN, {"conv1": 0}, 2, {"default": 5}, ValueError, ["default", "got 5"]),
        (CNN, {"*": 1}, 2, {"default": 0}, ValueError, ["plan['*'] (1)", "default (0)"]),
        (CNN, 1, 2, {"default": 0}, ValueError, ["int plan (1)", "default=0"]),
        (CNN, "fc1", 2, {}, TypeError, ["plan must be an int or a dict", "str"]),
        (CNN, {"fc*": 1, "*2": -1}, 2, {}, ValueError, ["'fc2'", "'fc*': 1", "'*2': -1"]),
        (Net, {"features.1": 1}, 2, {}, ValueError, ["features.1", "BatchNorm2d", "partition_dim 1"]),
        (Net, {"features.1": -1}, 2, {}, ValueError, ["BatchNorm2d", "partition_dim -1"]),
        (Net, {"features.3": 1}, 2, {}, ValueError, ["features.3", "groups=2"]),
        (CNN, {"fc2": 1}, 3, {}, ValueError, ["fc2", "workers_per_group (3)", "out_features (4)"]),
        (CNN, {"conv2": 1}, 3, {}, ValueError, ["conv2", "out_channels (8)"]),
        (CNN, 0, 0, {}, ValueError, ["workers_per_group", "got 0"]),
    ],
)
def test_bad_plans_name_the_values(model, plan, k, kwargs, error, words):
    with pytest.raises(error) as info:
        resolve_plan(model(), plan, k, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_batch_norm_may_keep_dim_0_and_a_grouped_conv_may_go_to_one_worker():
    assert resolve_plan(Net(), {"features.1": 0, "features.3": -1}, 2)["features.3"] == -1


def test_world_size_must_be_a_multiple_of_the_group():
    assert check_world(6, 3) == 2 and check_world(1, 1) == 1
    with pytest.raises(ValueError, match=r"workers_per_group \(4\) must divide the world size \(6\)"):
        check_world(6, 4)
    with pytest.raises(ValueError, match="workers_per_group must be an integer >= 1, got -2"):
        check_world(4, -2)


# --- slicing arithmetic and the layer spec ----------------------------------------------------


def test_slices_cover_the_rows_once_in_order():
    whole = torch.arange(12.0).reshape(6, 2)
    pieces = [whole[slice_rows(6, 3, j)] for j in range(3)]
    assert [p.shape[0] for p in pieces] == [2, 2, 2]
    assert torch.equal(torch.cat(pieces), whole)
    with pytest.raises(ValueError, match="6 rows do not split into 4"):
        slice_rows(6, 4, 0)
    with pytest.raises(ValueError, match="index 3 is out of range for 3"):
        slice_rows(6, 3, 3)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Linear(5, 3), (4, 5)),
        (nn.Linear(5, 3, bias=False), (4, 2, 5)),  # features are the last dim
        (nn.Conv2d(2, 6, 3, stride=2, padding=1, dilation=1), (3, 2, 9, 9)),
        (nn.Conv2d(2, 6, 3, padding=2, dilation=2, padding_mode="reflect"), (3, 2, 8, 8)),
        (nn.Conv2d(2, 6, (3, 1), padding="same", padding_mode="circular"), (3, 2, 7, 5)),
        (nn.Conv2d(4, 6, 3, groups=2, bias=False), (2, 4, 6, 6)),
    ],
)
def test_layer_spec_computes_what_the_layer_does(layer, shape):
    x = torch.randn(shape)
    spec = tp.LayerSpec.of(layer)
    torch.testing.assert_close(spec.apply(x, layer.weight, layer.bias), layer(x))
    assert spec.out_size == (layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels)


def test_layer_spec_refuses_unbatched_input():
    with pytest.raises(ValueError, match=r"batched input.*\(2, 5, 5\)"):
        tp.LayerSpec.of(nn.Conv2d(2, 2, 1)).apply(torch.randn(2, 5, 5), torch.randn(2, 2, 1, 1), None)


# --- a world of one ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    w = troupe.init()
    yield w
    troupe.shutdown()


def test_world_of_one_runs_every_dim_and_round_trips(world):
    torch.manual_seed(0)
    plain = CNN()
    model = tp.partition(copy.deepcopy(plain), {"conv1": 1, "conv2": -1, "fc1": 1}, 1)
    assert isinstance(model.conv1, tp.FeatureSplit) and isinstance(model.conv2, tp.OnOneWorker)
    assert isinstance(model.fc2, nn.Linear)  # dim 0: untouched
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(p._troupe_holders == (0,) for p in model.parameters())
    assert (model.fc1.partition_dim, model.fc1.workers_per_group, model.conv2.partition_dim) == (1, 1, -1)
    assert "partition_dim=1" in repr(model.fc1) and "Linear(72, 16)" in repr(model.fc1)

    x = torch.randn(5, 1, 16, 16)
    out, ref = model(x), plain(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

    full = tp.full_state_dict(model)
    assert list(full) == list(plain.state_dict())
    fresh = CNN()
    fresh.load_state_dict(full, strict=True)
    torch.testing.assert_close(fresh(x), ref)

    rows = tp.describe(model)
    assert [(r.name, r.type, r.partition_dim) for r in rows] == [
        ("conv1", "Conv2d", 1), ("conv2", "Conv2d", -1), ("fc1", "Linear", 1), ("fc2", "Linear", 0)]
    assert [r.local_params for r in rows] == [sum(p.numel() for p in m.parameters()) for m in plain.children()]


def test_a_shared_layer_is_replaced_under_both_names(world):
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    tp.partition(model, {"0": 1}, 1)
    assert isinstance(model[0], tp.FeatureSplit) and model[2] is model[0]
    assert list(tp.full_state_dict(model)) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_tied_parameter_cannot_be_partitioned(world):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(Refusal, match=r"1 shares a parameter .*'0.weight', '1.weight'.*leave 1 out of the plan"):
        tp.partition(model, {"1": 1}, 1)  # a Refusal (a ValueError) reads as one line when uncaught
    with pytest.raises(ValueError, match=r"workers_per_group \(2\) must divide the world size \(1\)"):
        tp.partition(model, {"1": 1}, 2)


class _One:
    """A communicator of one rank: clip_grad_norm_ reduces nothing over it."""

    world_size = 1


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_equals_torchs_on_the_gradients_device(device, norm_type):
    torch.manual_seed(0)
    ours, theirs = CNN().to(device), CNN().to(device)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 1, 14, 14, device=device)
    for m in (ours, theirs):
        m(x).square().sum().backward()
    got = troupe.clip_grad_norm_(ours.parameters(), 0.5, norm_type, comm=_One())
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type)
    assert got.device.type == device  # a CUDA rank's norm stays on its GPU (it once mixed in a CPU tensor)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


# --- under troupe run --elastic (the processes stand by alone when they partition) ------------


class _Link:
    """A group communicator of one process whose exchanges fail, as when a partner died."""

    world_size, rank = 2, 0

    def all_gather_into(self, out, x):
        raise RuntimeError("Connection reset by peer")


def _elastic_world(monkeypatch, group_size=2, place=1, group=1):
    from types import SimpleNamespace

    from troupe.partition import partitioner

    lost = []
    membership = SimpleNamespace(elastic=True, options=SimpleNamespace(group_size=group_size, groups=3), place=place,
                                 group=group, partner_lost=lost.append, joined=False, incarnation=0)
    fake = SimpleNamespace(membership=membership, partitioned=False, comm=None, rank=group * group_size + place,
                           world_size=3 * group_size, replica_comms=lambda escape: (_Link(), None))
    monkeypatch.setattr(partitioner.world, "init", lambda: fake)
    monkeypatch.delenv("TROUPE_CLUSTER", raising=False)
    return fake, lost


def test_elastic_partition_slices_by_the_groups_place_and_labels_the_job_s_ranks(monkeypatch):
    fake, lost = _elastic_world(monkeypatch)
    model = tp.partition(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), {"0": 1, "2": -1})
    assert fake.partitioned
    assert tuple(model[0].weight.shape) == (8, 8) and model[2].weight is None  # slice 1 of 2; worker 0's layer
    assert getattr(model[0].weight, tp.HOLDERS) == (1, 3, 5)  # place 1 of each of the 3 groups of 2
    with pytest.raises(RuntimeError, match=r"call troupe.track\(model=..., optimizer=...\) before the first forward"):
        model(torch.randn(2, 8))  # standing by: the group forms when it joins the job
    assert not lost
    fake.membership.joined = True
    with pytest.raises(RuntimeError, match="Connection reset"):
        model(torch.randn(2, 8))
    assert len(lost) == 1 and "Connection reset" in str(lost[0])  # the membership decides what a lost partner means


def test_elastic_partition_refuses_another_group_size_and_an_auto_plan_without_a_sample(monkeypatch):
    _elastic_world(monkeypatch)
    with pytest.raises(Refusal, match="workers_per_group 3 differs from the elastic job's worker groups of 2"):
        tp.partition(nn.Sequential(nn.Linear(8, 16)), 1, workers_per_group=3)
    with pytest.raises(ValueError, match="plan 'auto' needs sample="):
        tp.partition(nn.Sequential(nn.Linear(8, 16)), "auto")


class _Store:
    """The launcher's store, as a dict; `get` of a missing key is a bug here (it would wait)."""

    def __init__(self):
        self.data = {}

    def check(self, keys):
        return all(k in self.data for k in keys)

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def compare_set(self, key, expected, desired):
        if self.data.get(key, b"") == expected.encode():
            self.set(key, desired)


def test_elastic_auto_plan_is_rank_0_s_for_every_process_and_every_restart(monkeypatch):
    from troupe.partition import partitioner
    from troupe.partition.planner import auto

    store, made = _Store(), []
    real = auto.plan_here
    monkeypatch.setattr(auto, "plan_here", lambda *a, **kw: made.append(a[2]) or real(*a, **kw))
    model = lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))  # noqa: E731
    plans = []
    for group, place in ((1, 1), (0, 0), (2, 1), (0, 0)):  # rank 3 waits for rank 0's; rank 0 again: a restart
        fake, _ = _elastic_world(monkeypatch, place=place, group=group)
        fake.membership.store = store
        if (group, place) == (1, 1):
            with pytest.raises(KeyError):  # nothing posted yet: a real store would wait for rank 0
                tp.partition(model(), "auto", sample=torch.zeros(4, 8), link="1gbit")
            continue
        m = tp.partition(model(), "auto", sample=torch.zeros(4, 8), link="1gbit")
        plans.append([r.partition_dim for r in tp.describe(m) if r.type == "Linear"])
    assert made == [6]  # rank 0 planned once, for the job's 6 processes; nobody else planned
    assert plans[0] == plans[1] == plans[2] and partitioner.AUTO_PLAN_KEY in store.data


def test_elastic_auto_plan_timed_in_the_job_is_the_first_lives_for_everyone_or_rank_0_s_on_loopback(monkeypatch):
    """link "job" under --elastic: the first lives time the job together (`first_lives`) and the first plan
    offered to the store stays, for every process and every restart; a process lost while they time it
    makes rank 0 plan with the loopback link's constants (a warning says so), which everyone takes."""
    from contextlib import contextmanager

    from troupe.partition import partitioner
    from troupe.partition.planner import auto
    from troupe.runtime import comm

    model = lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))  # noqa: E731
    monkeypatch.setattr(comm, "Communicator", lambda: "the first lives' group")
    for lost in (False, True):
        store, met, made = _Store(), [], []

        @contextmanager
        def first_lives(name, size, lost=lost, met=met):
            met.append((name, size))
            if lost:
                raise RuntimeError("Connection closed by peer")
            yield

        def timed(m, k, job, *, sample, link, memory=None, optimizer_slots=2, made=made):
            made.append((job, link))
            return {"0": 1, "2": -1}

        monkeypatch.setattr(auto, "auto_plan", timed)
        plans = []
        for group, place, incarnation in ((1, 1, 0), (0, 0, 0), (2, 1, 1)):  # the last: a restart
            fake, _ = _elastic_world(monkeypatch, place=place, group=group)
            fake.membership.store, fake.membership.first_lives = store, first_lives
            fake.membership.incarnation = incarnation
            if lost and (group, place) == (1, 1):
                with pytest.raises(KeyError):  # nothing posted yet: a real store would wait for rank 0
                    tp.partition(model(), "auto", sample=torch.zeros(4, 8), link="job")
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m = tp.partition(model(), "auto", sample=torch.zeros(4, 8), link="job")
            plans.append([r.partition_dim for r in tp.describe(m) if r.type == "Linear"])
            said = [str(w.message) for w in caught]
            assert any("planned with the loopback link's constants" in s for s in said) == (lost and group == 0)
        assert met == [(partitioner.AUTO_PLAN_KEY, 6)] * (2 if lost else 1), "a restart or a late process timed"
        assert len(set(map(tuple, plans))) == 1, plans
        if not lost:
            assert made == [("the first lives' group", "job")] and plans[0] == [1, -1]


def test_elastic_groups_of_one_leave_the_model_whole(monkeypatch):
    fake, _ = _elastic_world(monkeypatch, group_size=1, place=0, group=2)
    model = tp.partition(nn.Sequential(nn.Linear(8, 16)), 1)
    assert not fake.partitioned and tuple(model[0].weight.shape) == (16, 8)
    assert getattr(model[0].weight, tp.HOLDERS) == (0, 1, 2)


def test_holders_by_place_weigh_sum_over_the_place_and_divide_by_the_processes_present():
    from types import SimpleNamespace

    from troupe.strategies.partitioned import HolderGroups

    class Place:
        def all_reduce(self, t, op):
            t.mul_(2)  # two holders at this place with the same gradient

    job = SimpleNamespace(world_size=4)
    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([1.0, 2.0, 3.0])
    holders = HolderGroups.by_place(job, Place(), {(1, 3, 5): [w]})
    holders.weight = lambda: 1.5
    holders.reduce()
    torch.testing.assert_close(w.grad, torch.tensor([1.0, 2.0, 3.0]) * 1.5 * 2 / 4, rtol=0, atol=0)
    job.world_size = 6  # another quorum: the divisor follows it
    w.grad = torch.ones(3)
    holders.weight = None
    holders.reduce()
    torch.testing.assert_close(w.grad, torch.full((3,), 2 / 6), rtol=0, atol=0)
    with pytest.raises(ValueError, match="found 2 sets of holders"):
        HolderGroups.by_place(job, Place(), {(0, 2): [w], (1, 3): [w]})
