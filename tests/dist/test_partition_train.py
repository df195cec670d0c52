"""Partitioned models trained by DistOpt (20 steps of SGD with momentum) equal one process on
the combined batch: each parameter reduced over its holders only, every loop and option."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from tests.dist.test_partition import MODELS
from tests.dist.world import run_world

STEPS = 20
B_OWN = 3
TOL = 1e-5
CLIP = 0.3
"""Below the gradient norm of many of the clip case's steps (the test checks that it binds)."""

CASES = {
    2: [  # label, workers per group, model, plan, loop
        ("mlp all dim 1, torch loop", 2, "mlp", 1, "torch"),
        ("cnn hybrid + dim -1, SINGA sgd(loss)", 2, "cnn", {"conv*": 0, "fc1": 1, "fc2": -1}, "singa"),
        ("mlp hybrid, accumulate 2 under no_sync + clip", 2, "mlp", {"fc1": 0, "fc2": 1, "fc3": -1}, "accumulate"),
        # rank 1 holds no partitioned parameter at all: it must still take part in the holder groups
        ("mlp with only one layer on worker 0", 2, "mlp", {"fc2": -1}, "singa"),
    ],
    4: [
        ("cnn two groups x two workers, torch loop", 2, "cnn", {"conv1": 0, "conv2": 1, "fc1": -1, "fc2": 1},
         "torch"),
        ("mlp two groups, SINGA fp16", 2, "mlp", {"fc1": 1, "fc2": 0, "fc3": 1}, "fp16"),
        ("cnn two groups, clipped to a binding norm", 2, "cnn", {"conv*": 0, "fc1": 1, "fc2": -1}, "clip"),
    ],
}


def data(world_size: int, step: int, shape):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn((world_size * B_OWN, *shape), generator=gen)
    return x, torch.randint(0, 4, (world_size * B_OWN,), generator=gen)


def micro_rows(world_size: int, micro: int) -> list[int]:
    """Micro-batch `micro` when accumulating: each rank's first two samples, then its third."""
    part = range(0, 2) if micro == 0 else range(2, 3)
    return [r * B_OWN + i for r in range(world_size) for i in part]


def reference(world_size: int, model_name: str, loop: str) -> dict[str, torch.Tensor]:
    """One process, the combined batch, the same steps (the same two micro-batches when accumulating)."""
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = data(world_size, step, shape)
        opt.zero_grad()
        if loop == "accumulate":
            for micro in range(2):
                rows = micro_rows(world_size, micro)
                (F.cross_entropy(model(x[rows]), y[rows]) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        else:
            F.cross_entropy(model(x), y).backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(rank: int, world_size: int, k: int, model_name: str, plan, loop: str) -> dict[str, torch.Tensor]:
    """Partition, then train with this rank's own samples under `loop`; the whole model at the end."""
    import troupe

    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = troupe.partition(make(), plan, workers_per_group=k)
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    own = slice(rank * B_OWN, (rank + 1) * B_OWN)
    norms: list[float] = []
    for step in range(STEPS):
        x, y = data(world_size, step, shape)
        if loop in ("singa", "fp16"):
            sgd.update(F.cross_entropy(model(x[own]), y[own]), "plain" if loop == "singa" else "fp16")
        elif loop == "accumulate":
            sgd.zero_grad()
            for micro in range(2):
                rows = [i for i in micro_rows(world_size, micro) if own.start <= i < own.stop]
                with sgd.no_sync() if micro == 0 else nullcontext():
                    (F.cross_entropy(model(x[rows]), y[rows]) / 2).backward()
            sgd.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # a no-op bound: clipping runs between
            sgd.step()
        else:
            sgd.zero_grad()
            F.cross_entropy(model(x[own]), y[own]).backward()
            if loop == "clip":
                sgd.synchronize()
                norms.append(float(troupe.clip_grad_norm_(model.parameters(), CLIP)))
            sgd.step()
    return {"state": troupe.full_state_dict(model), "norms": norms}


def _world(rank, world_size, directory):
    out = {label: train(rank, world_size, k, model_name, plan, loop)
           for label, k, model_name, plan, loop in CASES[world_size]}
    out["checkpoint"] = checkpoint_round_trip(rank, world_size, directory)
    return out


def checkpoint_round_trip(rank: int, world_size: int, directory: str) -> float:
    """troupe.checkpoint saves each rank's slices; a new partitioned model resumes and trains on identically."""
    import troupe
    from troupe.reliability import checkpoint

    def make():
        torch.manual_seed(0)
        model = troupe.partition(MODELS["cnn"][0](), {"conv*": 0, "fc1": 1, "fc2": -1}, workers_per_group=2)
        return model, troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    own = slice(rank * B_OWN, (rank + 1) * B_OWN)

    def step(model, sgd, i):
        x, y = data(world_size, i, MODELS["cnn"][1])
        sgd.update(F.cross_entropy(model(x[own]), y[own]), "plain")

    first, sgd = make()
    for i in range(3):
        step(first, sgd, i)
    checkpoint.save(directory, 3, first, sgd)
    step(first, sgd, 3)
    second, sgd2 = make()
    checkpoint.load(checkpoint.latest(directory), second, sgd2)
    step(second, sgd2, 3)
    a, b = troupe.full_state_dict(first), troupe.full_state_dict(second)
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("world_size", [2, 4])
def test_partitioned_training_equals_one_process(world_size, tmp_path):
    results = run_world(_world, world_size, str(tmp_path), timeout=150)
    assert all(r["checkpoint"] == 0.0 for r in results), [r["checkpoint"] for r in results]
    for label, _, model_name, _, loop in CASES[world_size]:
        ref = reference(world_size, model_name, loop)
        tol = 2e-3 if loop == "fp16" else TOL
        for rank, by_case in enumerate(results):
            got = by_case[label]["state"]
            assert list(got) == list(ref), (label, rank)
            err = max((got[n] - ref[n]).abs().max().item() for n in ref)
            assert err < tol, f"rank {rank}, {label}: differs from one process by {err:.3g}"
            if loop == "clip":  # every rank clipped by the same (whole model's) norm, and it bound
                norms = by_case[label]["norms"]
                assert norms == results[0][label]["norms"] and sum(n > CLIP for n in norms) >= STEPS // 4, norms


def _refused(rank, world_size):
    import troupe

    model = troupe.partition(MODELS["mlp"][0](), {"fc2": 1}, workers_per_group=2)
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(B_OWN, 8)
    messages = []
    # nan_policy: a non-finite gradient in one rank's slice makes every rank skip the step
    other = troupe.partition(MODELS["mlp"][0](), {"fc2": 1}, workers_per_group=2)
    skipping = troupe.DistOpt(torch.optim.SGD(other.parameters(), lr=0.1), nan_policy="skip")
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    skipping.zero_grad()
    other(x).sum().backward()
    skipping.synchronize()
    if rank == 1:
        other.fc2.weight.grad[0, 0] = float("nan")  # fc2 is split: only rank 1 holds this slice
    with pytest.warns(UserWarning, match="skipped step"):
        skipping.step()
    unchanged = all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    messages.append(f"skipped={skipping.skipped_steps} unchanged={unchanged}")
    try:
        sgd.update(model(x).sum(), "partialUpdate")
    except ValueError as e:
        messages.append(str(e))
    try:
        with sgd.join():
            pass
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_nan_skip_partial_update_and_join_on_a_partitioned_model():
    for messages in run_world(_refused, 2, timeout=60):
        assert len(messages) == 3, messages
        assert messages[0] == "skipped=1 unchanged=True", messages[0]  # both ranks, though one saw the NaN
        assert "cannot average a partitioned model's slices" in messages[1]
        assert "join() cannot shadow a partitioned model" in messages[2]

