"""Every cluster framework under the PyTorch loop: backward, synchronize, clip, step, zero_grad, no_sync.

The loop of every test: each step accumulates MICRO micro-batches (all but the last
backward under ``no_sync()``), optionally clips between ``synchronize()`` and ``step()``,
and may inject a non-finite gradient on worker 1 (nan_policy). Synchronous clusters are
compared with one process on the combined batch; asynchronous ones must train (finite
parameters, lower loss). Server ranks enter through DistOpt here, as under torchrun: their
DistOpt serves and ends the process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.world import run_world
from tests.dist.test_cluster import MLP  # the same model as the SINGA-loop cluster tests
from troupe.cluster.configuration.config import ClusterConfig

STEPS = 8
MICRO = 2
BATCH = 8
LR = 0.1
CLIP = 0.05
"""Small enough that clipping acts in every step (the gradient norms here are 0.2-1)."""
TIMEOUT = 120



def data(nworkers: int, steps: int = STEPS):
    """A teacher's labels (learnable): xs[step, micro, worker * BATCH + i]."""
    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(12, 5, generator=g)
    xs = torch.randn(steps, MICRO, nworkers * BATCH, 12, generator=g)
    return xs, (xs @ teacher).argmax(-1)


def eval_loss(model) -> float:
    g = torch.Generator().manual_seed(99)
    teacher = torch.randn(12, 5, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(256, 12, generator=g)
    with torch.no_grad():
        return F.cross_entropy(model(x), (x @ teacher).argmax(-1)).item()


def clips(loop: dict, step: int) -> bool:
    return loop.get("clip_from") is not None and step >= loop["clip_from"]


def train_loop(rank, world_size, loop):
    """The PyTorch loop on one rank; returns parameters and what the strategy saw ("server" on servers)."""
    import troupe

    torch.manual_seed(100 + rank)  # different init per rank: worker 0's must win
    model = MLP()
    try:
        opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=LR), nan_policy=loop.get("nan_policy", "raise"),
                             **({"bucket_size": loop["bucket_size"]} if "bucket_size" in loop else {}))
    except SystemExit as e:  # a server rank serves inside DistOpt, then exits
        assert e.code == 0
        return "server"
    opt.sync_parameters(model)
    before = eval_loss(model)
    steps = loop.get("steps", STEPS)
    xs, ys = data(opt.world_size, steps)
    r = opt.global_rank
    for step in range(steps):
        for m in range(MICRO):
            x, y = xs[step, m, r * BATCH : (r + 1) * BATCH], ys[step, m, r * BATCH : (r + 1) * BATCH]
            loss = F.cross_entropy(model(x), y)
            if step == loop.get("nan_at") and r == 1 and m == MICRO - 1:
                loss = loss * float("nan")
            if m < MICRO - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clips(loop, step):
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.get("max_norm", CLIP))
        opt.step()
        opt.zero_grad()
    out = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "loss": (before, eval_loss(model)),
        "skipped": opt.skipped_steps,
        "overlap": getattr(opt.strategy, "overlap", None),
        "buckets": len(opt.strategy.reducer.buckets) if "bucket_size" in loop else None,
        "staleness": list(opt.strategy.staleness),
    }
    if loop.get("clip_after"):  # one step clipped after the Updates left during backward: an error
        loss = F.cross_entropy(model(xs[0, 0, r * BATCH : (r + 1) * BATCH]), ys[0, 0, r * BATCH : (r + 1) * BATCH])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with pytest.raises(RuntimeError, match="send_updates: step") as e:
            opt.step()
        out["error"] = str(e.value)
        opt.zero_grad()
        opt(F.cross_entropy(model(xs[1, 0, :BATCH]), ys[1, 0, :BATCH]))  # the protocol is still in step
        out["after"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    opt.close()
    return out


def reference(nworkers: int, loop: dict, clip: str) -> dict[str, torch.Tensor]:
    """One process on the combined batch: each worker's accumulated gradient, clipped per worker
    (``clip="worker"``: a Downpour group of one worker clips its own before the servers average) or
    after the mean (``clip="mean"``: ``p.grad`` holds the group's mean, co-located or Sandblaster), averaged."""
    torch.manual_seed(100)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = data(nworkers)
    params = list(model.parameters())
    for step in range(STEPS):
        if step == loop.get("nan_at"):
            continue  # nan_policy "skip": the step is skipped everywhere
        total = [torch.zeros_like(p) for p in params]
        for w in range(nworkers):
            model.zero_grad()
            for m in range(MICRO):
                F.cross_entropy(model(xs[step, m, w * BATCH : (w + 1) * BATCH]),
                                ys[step, m, w * BATCH : (w + 1) * BATCH]).backward()
            if clips(loop, step) and clip == "worker":
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            for t, p in zip(total, params):
                t += p.grad / nworkers
        for t, p in zip(total, params):
            p.grad = t
        if clips(loop, step) and clip == "mean":
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(cluster: ClusterConfig, loop: dict) -> list:
    return run_world(train_loop, cluster.nprocs, loop, timeout=TIMEOUT, env={"TROUPE_CLUSTER": cluster.to_json()})


def assert_equal_to(expected, params):
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")


SANDBLASTER = ClusterConfig(nworkers_per_group=2, nservers_per_group=1, server_worker_separate=True)


def test_sandblaster_loop_with_accumulation_sends_during_backward_from_the_second_step():
    # then one step clipped after its Updates left: a clear error, and the protocol stays in step
    results = run(SANDBLASTER, {"clip_after": True})
    assert results[2] == "server"
    expected = reference(2, {}, clip="worker")
    for out in results[:2]:
        assert_equal_to(expected, out["params"])
        assert out["overlap"] is True and out["staleness"] == [0] * STEPS
        assert "changed between backward and step()" in out["error"] and out["after"]


def test_sandblaster_sends_during_backward_with_several_buckets_in_one_storage():
    # buckets carved from one storage share a version counter: packing a later one must not look like
    # the loop changing an earlier one (it did, and a model of two buckets or more never overlapped)
    results = run(SANDBLASTER, {"bucket_size": 64})
    expected = reference(2, {}, clip="worker")
    for out in results[:2]:
        assert out["buckets"] >= 2
        assert_equal_to(expected, out["params"])
        assert out["overlap"] is True and out["staleness"] == [0] * STEPS


def test_sandblaster_loop_clipping_every_step_sends_in_step():
    # backward leaves the group's mean in p.grad: clipping clips what one process on the combined batch does
    results = run(SANDBLASTER, {"clip_from": 0})
    expected = reference(2, {"clip_from": 0}, clip="mean")
    for out in results[:2]:
        assert_equal_to(expected, out["params"])
        assert out["overlap"] is False  # the loop changes gradients: they leave in step(), after clipping


def test_sandblaster_send_at_step_clipping_from_a_later_step_and_nan_skip():
    cluster = ClusterConfig(nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True,
                            send_updates="step")
    loop = {"clip_from": 3, "nan_at": 5, "nan_policy": "skip"}
    results = run(cluster, loop)
    assert results[2:] == ["server", "server"]
    expected = reference(2, loop, clip="mean")
    for out in results[:2]:
        assert_equal_to(expected, out["params"])
    # worker 1 had the non-finite gradient: the group's mean is non-finite, so both workers skip the step
    assert [out["skipped"] for out in results[:2]] == [1, 1]


def test_allreduce_loop_clips_the_group_mean_and_skips_together():
    cluster = ClusterConfig(nworkers_per_group=2, nservers_per_group=2)
    loop = {"clip_from": 0, "nan_at": 5, "nan_policy": "skip"}
    results = run(cluster, loop)
    expected = reference(2, loop, clip="mean")
    for out in results:
        assert_equal_to(expected, out["params"])
        assert out["skipped"] == 1  # the non-finite mean is the same verdict on both workers


ASYNC = {
    "downpour": ClusterConfig(nworker_groups=2, nservers_per_group=1, server_worker_separate=True),
    "hogwild": ClusterConfig(nworker_groups=2, nserver_groups=2, sync_freq=3),
    "in-memory hogwild": ClusterConfig(nworker_groups=2, nworkers_per_procs=2, share_memory=True),
}


@pytest.mark.parametrize("framework", sorted(ASYNC))
def test_async_frameworks_train_with_the_loop_and_skip_a_non_finite_step(framework):
    loop = {"clip_from": 0, "max_norm": 1.0, "nan_at": 5, "nan_policy": "skip", "steps": 30}
    results = [r for r in run(ASYNC[framework], loop) if r != "server"]
    assert len(results) == 2
    for r, out in enumerate(results):
        assert all(bool(torch.isfinite(p).all()) for p in out["params"].values()), framework
        before, after = out["loss"]
        assert after < before - 0.05, (framework, before, after)
        assert out["skipped"] == (1 if r == 1 else 0)


def test_shard_skips_a_group_update_that_a_worker_skipped():
    from troupe.cluster.serving.shard import ParamShard, plan_slices

    w = torch.zeros(4)
    shard = ParamShard(plan_slices([4], 1), torch.optim.SGD([w], lr=1.0, momentum=0.9), [0], {0: {0, 1}})
    shard.put(0, torch.ones(4))
    assert shard.update(0, 0, torch.ones(4)) == []
    assert shard.update(0, 1, None) == [0, 1]  # worker 1's gradient was not finite
    assert shard.get(0)[0] == 0 and torch.equal(shard.get(0)[1], torch.ones(4)) and shard.skipped == 1
    assert shard.update(0, 0, torch.ones(4)) == [] and shard.update(0, 1, torch.ones(4)) == [0, 1]
    assert shard.get(0)[0] == 1 and torch.equal(shard.get(0)[1], torch.zeros(4))  # momentum saw one step


def test_training_spec_is_plain_json_and_rebuilds_the_optimizer():
    from troupe.cluster.configuration.spec import TrainingSpec

    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.5, "betas": (0.8, 0.9)}], lr=0.01)
    spec = TrainingSpec.from_optimizer(opt, [a, b], [0, 1])
    back = TrainingSpec.from_json(spec.to_json())
    assert back.numels == (3, 4) and back.dtype == torch.float32 and back.param_group_of == (0, 1)
    built = back.optimizer.build([[torch.zeros(3)], [torch.zeros(4)]])
    assert type(built) is torch.optim.Adam
    assert [g["lr"] for g in built.param_groups] == [0.01, 0.5]
    assert built.param_groups[1]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="lr.* is a Tensor"):
        TrainingSpec.from_optimizer(torch.optim.SGD([a], lr=torch.tensor(0.1)), [a], [0]).to_json()
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer subclass"):
        TrainingSpec.from_json(spec.to_json().replace("torch.optim.adam.Adam", "torch.nn.Linear"))


CUSTOM_OPTIMIZER = """
import torch, troupe
class MyOpt(torch.optim.SGD):
    pass
m = torch.nn.Linear(4, 2)
opt = troupe.DistOpt(MyOpt(m.parameters(), lr=0.1))
print("unreachable", flush=True)
"""

LOOP_SCRIPT = """
import torch, troupe
torch.set_num_threads(1)
torch.manual_seed(0)
m = torch.nn.Linear(4, 2)
opt = troupe.DistOpt(torch.optim.SGD(m.parameters(), lr=0.1))
for _ in range(4):
    m(torch.randn(8, 4)).square().mean().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    opt.step()
    opt.zero_grad()
print("worker", opt.global_rank, "done", flush=True)
"""


def troupe_run(tmp_path, script: str, *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "s.py"
    path.write_text(script)
    return subprocess.run([sys.executable, "-m", "troupe.cli", "run", *flags, str(path)], capture_output=True,
                          text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_troupe_run_starts_servers_without_the_script(tmp_path):
    done = troupe_run(tmp_path, LOOP_SCRIPT, "-n", "3", "--framework", "sandblaster")  # 1 worker, 2 servers
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["worker", "0", "done"]
    for rank in (1, 2):  # each server's stats and traffic as it leaves
        assert done.stderr.count(f"troupe server rank {rank}: ") == 2, done.stderr[-2000:]
        assert done.stderr.count(f"troupe server rank {rank}: traffic ") == 1
    # the script never ran on the server rank: an optimizer it defines cannot reach a server
    done = troupe_run(tmp_path, CUSTOM_OPTIMIZER, "-n", "3", "--framework", "sandblaster")
    assert done.returncode != 0
    assert "cannot import the optimizer class '__main__.MyOpt'" in done.stderr
    assert "define the optimizer in a module on the PYTHONPATH" in done.stderr
    assert "unreachable" not in done.stdout


def test_a_compressed_dist_option_under_a_cluster_is_refused_at_construction(monkeypatch):
    """Checked before the job is joined (no process group is made here)."""
    import pytest
    import torch

    import troupe

    monkeypatch.setenv("TROUPE_CLUSTER", "sandblaster")
    with pytest.raises(ValueError, match="dist_option 'fp16' is not available under a parameter-server cluster"):
        troupe.DistOpt(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), dist_option="fp16")
