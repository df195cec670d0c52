"""Partitioned models under parameter servers. Synchronous (Sandblaster: each worker Puts, Updates
and Gets only its own slices; AllReduce: the co-located servers reduce only the replicated
parameters in the group, a slice's one holder updates it): 20 steps of SGD with momentum equal
one process on the combined batch. Asynchronous (Downpour, Distributed Hogwild): the groups'
workers agree, hold less than the whole model, and learn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist.test_partition import MODELS
from tests.dist.world import run_world
from troupe.cluster.configuration.config import ClusterConfig

STEPS = 20
B_OWN = 3
TOL = 1e-5
NAN_STEP = 7
"""The step at which one worker's gradient is made non-finite (the nan_policy="skip" case)."""
CLIP = 0.8
"""The "clip" loop's max_norm (troupe.clip_grad_norm_ in the workers, torch's in the reference)."""


def data(nworkers: int, step: int, shape):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn((nworkers * B_OWN, *shape), generator=gen)
    return x, torch.randint(0, 4, (nworkers * B_OWN,), generator=gen)


def reference(nworkers: int, model_name: str, loop: str) -> dict[str, torch.Tensor]:
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        if loop == "nan" and step == NAN_STEP:
            continue  # the skipped step changes nothing, momentum included
        x, y = data(nworkers, step, shape)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if loop == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(rank: int, world_size: int, model_name: str, plan, loop: str):
    """Partition by the cluster (plan None: its partition_dim) or by hand, train this worker's samples."""
    import troupe

    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = troupe.partition(make(), plan)
    try:
        sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                             nan_policy="skip" if loop == "nan" else "raise")
    except SystemExit as e:  # a server rank serves inside DistOpt, then exits
        assert e.code == 0
        return "server"
    r, n = sgd.global_rank, sgd.world_size
    own = slice(r * B_OWN, (r + 1) * B_OWN)
    held = sum(p.numel() for p in model.parameters())
    for step in range(STEPS):
        x, y = data(n, step, shape)
        sgd.zero_grad()
        F.cross_entropy(model(x[own]), y[own]).backward()
        if loop == "clip":  # every p.grad the gradient of the group's mean loss: one norm for the whole model
            sgd.synchronize()
            troupe.clip_grad_norm_(model.parameters(), CLIP)
        if loop == "nan" and step == NAN_STEP and r == 1:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        sgd.step()
    state = troupe.full_state_dict(model)
    sgd.close()
    return {"state": state, "held": held, "skipped": sgd.skipped_steps, "workers": n}


HYBRID = {"conv*": 0, "fc1": 1, "fc2": -1}
CASES = {  # id: cluster, model, plan given to troupe.partition (None: the cluster's), loop
    "Sandblaster: hybrid + dim -1 from the cluster, 2 servers": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True,
                      partition_dim=HYBRID), "cnn", None, "torch"),
    "Sandblaster: all dim 1 by hand, nan skipped": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=1, server_worker_separate=True), "mlp", 1, "nan"),
    "AllReduce: hybrid + dim -1 from the cluster, clipped": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=2, partition_dim=HYBRID), "cnn", None, "clip"),
    "AllReduce: all dim 1 by hand, nan skipped": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=2), "mlp", 1, "nan"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(CASES))
def test_synchronous_cluster_partition_equals_one_process(case):
    cluster, model_name, plan, loop = CASES[case]
    results = run_world(train, cluster.nprocs, model_name, plan, loop, timeout=180,
                        env={"TROUPE_CLUSTER": cluster.to_json()})
    workers = [r for r in results if r != "server"]
    servers = cluster.nprocs - cluster.nworkers  # none when they share the workers' processes (AllReduce)
    assert len(workers) == cluster.nworkers and results[cluster.nworkers:] == ["server"] * servers
    expected = reference(cluster.nworkers, model_name, loop)
    whole = sum(v.numel() for k, v in expected.items())
    for w in workers:
        assert w["workers"] == cluster.nworkers
        assert w["skipped"] == (1 if loop == "nan" else 0)
        assert w["held"] < whole  # a worker holds only its slices of the partitioned layers
        for key, value in expected.items():
            torch.testing.assert_close(w["state"][key], value, atol=TOL, rtol=TOL, msg=key)


def _wrong_k(rank):
    import troupe

    troupe.partition(MODELS["mlp"][0](), 1, workers_per_group=1)


def _plans_differ(rank):
    import troupe

    model = troupe.partition(MODELS["mlp"][0](), {"fc2": 1} if rank == 0 else {"fc1": 1})
    troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05))


def _error_of(rank, world_size, fn):
    """The ValueError this rank gets (None: none)."""
    try:
        fn(rank)
    except ValueError as e:
        return str(e)
    return None


BAD = {  # id: cluster, what every rank runs, what its error says
    "separate servers, workers_per_group 1": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=1, server_worker_separate=True), _wrong_k,
        "nworkers_per_group"),
    "co-located servers, workers_per_group 1": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=2), _wrong_k, "nworkers_per_group"),
    "co-located servers, the workers' plans differ": (
        ClusterConfig(nworkers_per_group=2, nservers_per_group=2), _plans_differ, "differ from worker 0's"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", sorted(BAD))
def test_partition_bad_cluster_fails_on_every_rank(case):
    cluster, fn, message = BAD[case]
    errors = run_world(_error_of, cluster.nprocs, fn, timeout=150, env={"TROUPE_CLUSTER": cluster.to_json()})
    assert all(e is not None and message in e for e in errors), errors


def train_async(rank: int, world_size: int, lr: float, momentum: float, steps: int):
    """Each worker trains its share of a fixed batch; returns its losses, held size and full model."""
    import troupe

    make, shape = MODELS["cnn"]
    torch.manual_seed(0)
    model = troupe.partition(make())  # the cluster's plan
    try:
        sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    except SystemExit as e:
        assert e.code == 0
        return "server"
    r, n = sgd.global_rank, sgd.world_size
    x, y = data(n, 0, shape)
    own = slice(r * B_OWN, (r + 1) * B_OWN)
    losses = []
    for _ in range(steps):
        sgd.zero_grad()
        loss = F.cross_entropy(model(x[own]), y[own])
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    state = troupe.full_state_dict(model)
    groups = getattr(sgd.strategy, "groups", None)  # Distributed Hogwild: this worker's side of the master copies
    synced = sum(groups.sizes) if groups is not None else None
    sgd.close()
    return {"losses": losses, "held": sum(p.numel() for p in model.parameters()), "state": state, "synced": synced}


ASYNC = {  # id: two asynchronous groups of two partitioned workers (ranks 0-1 and 2-3); lr, momentum, steps
    # one separate server: the groups' order at the server is a race
    "Downpour": (ClusterConfig(nworker_groups=2, nworkers_per_group=2, nservers_per_group=1,
                               server_worker_separate=True, partition_dim=HYBRID), 0.05, 0.9, 30),
    # co-located servers, master copies synced every 4 steps by the workers holding each slice. No
    # momentum: each group's server keeps its own, which the master copies' averaging never sees, and
    # on this batch of 12 it made the final loss swing (0.56x to 0.99x the initial over 5 runs of 30
    # steps at lr 0.05; 2x to 4x in 1 run of 4 at 60 steps; unpartitioned, 0.91x in 1 run of 30 steps).
    "Distributed Hogwild": (ClusterConfig(nworker_groups=2, nworkers_per_group=2, nserver_groups=2,
                                          nservers_per_group=2, sync_freq=4, partition_dim=HYBRID), 0.1, 0.0, 60),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(ASYNC))
def test_async_partition_groups_agree_and_learn(case):
    # No exact single-process reference exists (asynchronous groups), so what must hold is
    # checked: both workers of a group end with the same full model to the bit (they share one
    # copy of every replicated layer and hold complementary slices), each holds less than the
    # whole model, and every worker's final model fits the whole batch better than the initial
    # one. (A worker's loss on its own three samples is no such measure: it may rise while the
    # others' fall.)
    cluster, lr, momentum, steps = ASYNC[case]
    results = run_world(train_async, cluster.nprocs, lr, momentum, steps, timeout=200,
                        env={"TROUPE_CLUSTER": cluster.to_json()})
    workers, servers = results[:cluster.nworkers], results[cluster.nworkers:]
    assert servers == ["server"] * (cluster.nprocs - cluster.nworkers) and "server" not in workers
    whole = sum(v.numel() for v in workers[0]["state"].values())
    make, shape = MODELS["cnn"]
    x, y = data(cluster.nworkers, 0, shape)
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        initial = F.cross_entropy(model(x), y).item()
    for w in workers:
        assert w["held"] < whole
        model.load_state_dict(w["state"])
        with torch.no_grad():
            final = F.cross_entropy(model(x), y).item()
        assert final < 0.8 * initial, (initial, final, w["losses"])
    for a, b in ((0, 1), (2, 3)):  # the groups are ranks 0-1 and 2-3
        for key, value in workers[a]["state"].items():
            assert torch.equal(value, workers[b]["state"][key]), (a, b, key)
        if cluster.nserver_groups > 1:  # each element is synced by the one worker of a group holding its slice
            assert workers[a]["synced"] + workers[b]["synced"] == whole, (workers[a]["synced"], workers[b]["synced"])
