"""troupe.partition on real Gloo worlds, against one process training on the combined batch.

Every rank builds the reference (seed 0: rank 0's initial model) and a model seeded by its
own rank, which partition() must overwrite with rank 0's. Each rank feeds its own b rows of
one combined batch; the reference sees all of them. The test reduces gradients the way
DistOpt will: sum over the parameter's `_troupe_holders`, divide by the world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world

B_OWN = 3  # samples per worker
TOL = 1e-5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 4)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    """examples/mnist_cnn.py's shape, smaller: conv -> pool -> conv -> pool -> fc -> relu -> fc."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.fc1, self.fc2 = nn.Linear(8 * 2 * 2, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.conv1(x)), 2)
        y = F.max_pool2d(F.relu(self.conv2(y)), 2)
        return self.fc2(F.relu(self.fc1(y.flatten(1))))


MODELS = {"mlp": (MLP, (8,)), "cnn": (CNN, (1, 16, 16))}


def _holder_comms(job, world_size, k):
    """A communicator for every set of holders there can be (every rank makes them, same order)."""
    sets = {tuple(range(j, world_size, k)) for j in range(k)}
    comms = {tuple(range(world_size)): job}
    for ranks in sorted(s for s in sets if 1 < len(s) < world_size):
        comms[ranks] = job.new_group(list(ranks))
    return comms


def _reduce_over_holders(model, comms, world_size):
    for p in model.parameters():
        holders = p._troupe_holders
        if len(holders) > 1:
            comms[holders].all_reduce(p.grad, "sum")
        p.grad.div_(world_size)


def _expected_holders(dim, rank, world_size, k):
    """Everyone (dim 0); this worker index in every group (dim 1); every group's worker 0 (dim -1)."""
    start, step = {0: (0, 1), 1: (rank % k, k), -1: (0, k)}[dim]
    return tuple(range(start, world_size, step))


def _whole_part(model, name, whole, k):
    """The piece of the reference tensor `whole` that the partitioned parameter `name` holds."""
    from troupe.partition import FeatureSplit, slice_rows

    layer = model.get_submodule(name.rpartition(".")[0])
    if isinstance(layer, FeatureSplit):
        return whole[slice_rows(whole.shape[0], k, layer.group.index)]
    return whole


def _layout(model, ref, dims, rank, world_size, k):
    """Parameter names, holders and sizes against the plan's dims (names are the reference's)."""
    facts = {"names": sorted(n for n, _ in model.named_parameters()), "bad_holders": [], "bad_sizes": []}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dim = dims.get(name.rpartition(".")[0], 0)
        if p._troupe_holders != _expected_holders(dim, rank, world_size, k):
            facts["bad_holders"].append((name, p._troupe_holders))
        if p.numel() * (k if dim == 1 else 1) != ref_params[name].numel():
            facts["bad_sizes"].append((name, p.numel(), ref_params[name].numel()))
    return facts


def _case(job, rank, world_size, k, model_name, plan, dims, steps=3):
    """Partition, train `steps` SGD-with-momentum steps beside the reference; the largest errors."""
    import troupe.partition as tp

    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(rank)  # rank 0 builds the reference's model, the others not: partition() must broadcast it
    model = tp.partition(make(), plan, k, comm=job)
    comms = _holder_comms(job, world_size, k)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((world_size * B_OWN, *shape), generator=gen)
    y = torch.randint(0, 4, (world_size * B_OWN,), generator=gen)
    own = slice(rank * B_OWN, (rank + 1) * B_OWN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out = {"layout": _layout(model, ref, dims, rank, world_size, k), "grad": 0.0}
    for step in range(steps):
        pred, ref_pred = model(x[own]), ref(x)
        if step == 0:
            out["forward"] = (pred - ref_pred[own]).abs().max().item()
        opt.zero_grad()
        ref_opt.zero_grad()
        F.cross_entropy(pred, y[own]).backward()  # the mean over this rank's own samples
        F.cross_entropy(ref_pred, y).backward()  # the mean over the combined batch
        _reduce_over_holders(model, comms, world_size)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            err = (p.grad - _whole_part(model, name, ref_grads[name], k)).abs().max().item()
            out["grad"] = max(out["grad"], err)
        opt.step()
        ref_opt.step()
    full, ref_state = tp.full_state_dict(model), ref.state_dict()
    out["keys_match"] = list(full) == list(ref_state)
    out["state"] = max((full[n] - ref_state[n]).abs().max().item() for n in ref_state)
    plain = make()
    plain.load_state_dict(full, strict=True)
    out["loaded"] = (plain(x) - ref(x)).abs().max().item()
    out["describe"] = [tuple(row) for row in tp.describe(model)]
    return out


CASES = {
    2: [  # one group of two
        ("mlp all dim 1", 2, "mlp", 1, {"fc1": 1, "fc2": 1, "fc3": 1}),
        ("cnn hybrid", 2, "cnn", {"conv*": 0, "fc1": 1, "fc2": -1}, {"fc1": 1, "fc2": -1}),
        # dim -1 on the input (no gradient flows into the data) and every dim in one model
        ("mlp input on one worker", 2, "mlp", {"fc1": -1, "fc2": 0, "fc3": 1}, {"fc1": -1, "fc3": 1}),
    ],
    4: [  # two groups of two, then one group of four
        ("cnn two groups", 2, "cnn", {"conv1": 0, "conv2": 1, "fc1": -1, "fc2": 1},
         {"conv2": 1, "fc1": -1, "fc2": 1}),
        ("mlp one group of four", 4, "mlp", {"*": 1, "fc2": -1}, {"fc1": 1, "fc2": -1, "fc3": 1}),
    ],
}


def _world(rank, world_size):
    import troupe

    job = troupe.init().comm
    return {label: _case(job, rank, world_size, k, model, plan, dims)
            for label, k, model, plan, dims in CASES[world_size]}


def _check(results, world_size):
    for rank, by_case in enumerate(results):
        for label, k, model_name, _, dims in CASES[world_size]:
            r, where = by_case[label], f"rank {rank}, {label}"
            for what in ("forward", "grad", "state", "loaded"):
                assert r[what] < TOL, f"{where}: {what} differs from the reference by {r[what]:.3g}"
            assert r["keys_match"], where
            layout = r["layout"]
            assert not layout["bad_holders"] and not layout["bad_sizes"], (where, layout)
            make = MODELS[model_name][0]
            on_one = {f"{layer}.{p}" for layer, d in dims.items() if d == -1 for p in ("weight", "bias")}
            expected = {n for n, _ in make().named_parameters()} - (on_one if rank % k else set())
            assert set(layout["names"]) == expected, where  # dim -1: worker 0 alone holds the layer
            described = {name: (dim, count) for name, _, dim, count in r["describe"]}
            for layer, dim in dims.items():
                whole = sum(p.numel() for p in make().get_submodule(layer).parameters())
                held = {1: whole // k, -1: whole if rank % k == 0 else 0}[dim]
                assert described[layer] == (dim, held), (where, layer, described[layer])


def test_one_group_of_two_matches_one_process():
    _check(run_world(_world, 2, timeout=60), 2)


def test_four_ranks_two_groups_and_one_group_of_four():
    _check(run_world(_world, 4, timeout=90), 4)
