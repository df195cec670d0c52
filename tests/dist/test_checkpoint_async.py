"""Asynchronous checkpoints and the sampler's position across world sizes, in real worlds.

An async save writes what a blocking save writes (while training goes on, from a copy), waits
its turn, reports a failure at the next checkpoint call, and a job killed during one resumes
from the previous complete checkpoint. A run checkpointed mid-epoch on 4 ranks, resumed on
2, checkpointed again and resumed on 3 sees every sample of the epoch exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist.world import RankFailed, run_world

N, BATCH, EPOCH = 101, 3, 1  # tail="uneven": 101 samples, 3 per rank per step


def _data():
    return torch.randn(N, 8, generator=torch.Generator().manual_seed(7))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _setup():
    import troupe

    model = _model()
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train = troupe.data.loader(torch.arange(N), BATCH, tail="uneven", seed=5)  # a dataset of sample ids
    return model, sgd, train


def _train(model, sgd, batches, steps, seen):
    x = _data()
    for _ in range(steps):
        (ids,) = next(batches)
        seen += ids.tolist()
        sgd(model(x[ids]).square().mean())


def _state(model, sgd):
    return [t.detach().clone() for t in model.parameters()] + \
        [sgd.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]


def _held(checkpoint):
    """Hold this rank's background writing until the returned event is set."""
    import threading

    release, write = threading.Event(), checkpoint._write

    def held(*args):
        release.wait(60)
        write(*args)

    checkpoint._write = held
    return release, lambda: setattr(checkpoint, "_write", write)


def _four(rank, world_size, directory):
    """4 steps of epoch 1, then the same state saved blocking and asynchronously; training goes on meanwhile."""
    from troupe.reliability import checkpoint

    d = Path(directory)
    model, sgd, train = _setup()
    train.sampler.set_epoch(EPOCH)
    batches, seen = iter(train), []
    _train(model, sgd, batches, 4, seen)
    extra = {"epoch": EPOCH, "sampler": train.sampler.state_dict()}
    checkpoint.save(d / "sync", 4, model, sgd, extra)
    saved = _state(model, sgd)
    release, restore = _held(checkpoint)
    checkpoint.save(d / "async", 4, model, sgd, extra, async_save=True)
    restore()
    _train(model, sgd, batches, 2, [])  # changes every parameter in place while the save is held
    incomplete = not (d / "async" / "step-00000004" / "MANIFEST.json").exists()
    release.set()
    done = checkpoint.wait()
    return {"seen": seen, "saved": saved, "incomplete": incomplete, "done": done.name,
            "latest": checkpoint.latest(d / "async").name}


def _two(rank, world_size, directory):
    """Resume the 4-rank async checkpoint, 3 steps, then: saves wait their turn, a failure surfaces."""
    from troupe.reliability import checkpoint

    d = Path(directory) / "async"
    model, sgd, train = _setup()
    extra = checkpoint.load(checkpoint.latest(d), model, sgd)
    loaded = _state(model, sgd)
    train.sampler.load_state_dict(extra["sampler"])
    train.sampler.set_epoch(extra["epoch"])
    batches, seen = iter(train), []
    _train(model, sgd, batches, 3, seen)

    import time

    write = checkpoint._write
    checkpoint._write = lambda *a: (time.sleep(0.5), write(*a))  # a slow disk
    checkpoint.save(d, 7, model, sgd, {"epoch": EPOCH, "sampler": train.sampler.state_dict()}, async_save=True)
    checkpoint._write = write
    real = checkpoint._atomic_write
    if rank == 1:  # the next save fails on rank 1's disk
        def full(path, data):
            if path.parent.name == "step-00000008":
                raise OSError(28, "No space left on device", str(path))
            real(path, data)

        checkpoint._atomic_write = full
    checkpoint.save(d, 8, model, sgd, {}, async_save=True)
    waited = (d / "step-00000007" / "MANIFEST.json").exists()  # save 8 began after save 7 was complete
    with pytest.raises(checkpoint.CheckpointError, match="rank 1: .*No space left on device") as failed:
        checkpoint.wait()
    checkpoint._atomic_write = real
    assert checkpoint.wait() is None  # reported once
    return {"seen": seen, "loaded": loaded, "waited": waited, "error": str(failed.value),
            "latest": checkpoint.latest(d).name}


def _three(rank, world_size, directory):
    """Resume the 2-rank checkpoint on 3 ranks and finish the epoch."""
    from troupe.reliability import checkpoint

    model, sgd, train = _setup()
    extra = checkpoint.load(checkpoint.latest(Path(directory) / "async"), model, sgd)
    train.sampler.load_state_dict(extra["sampler"])
    train.sampler.set_epoch(extra["epoch"])
    seen = []
    x = _data()
    with sgd.join():  # "uneven": a rank may have one batch more
        for (ids,) in train:
            seen += ids.tolist()
            sgd(model(x[ids]).square().mean())
    return {"seen": seen, "step": extra["step"]}


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    # .metadata names its checkpoint's path and a random save id; the probe holds a random token
    for name in names:
        if name not in (".metadata", ".shared-disk-probe", "MANIFEST.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((p / "MANIFEST.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        del m["sha256"][".metadata"]
    assert ma == mb


def test_async_save_equals_sync_and_the_sampler_reshards_4_2_3(tmp_path):
    four = run_world(_four, 4, str(tmp_path), timeout=120)
    for out in four:
        assert out["incomplete"] and out["done"] == out["latest"] == "step-00000004"
        assert all(torch.equal(a, b) for a, b in zip(out["saved"], four[0]["saved"]))
    _same_files(tmp_path / "sync" / "step-00000004", tmp_path / "async" / "step-00000004")

    two = run_world(_two, 2, str(tmp_path), timeout=120)
    for out in two:
        assert all(torch.equal(a, b) for a, b in zip(out["loaded"], four[0]["saved"]))  # the copy, not the later state
        assert out["waited"] and out["latest"] == "step-00000007"
        assert "step-00000008" in out["error"]
    assert not (tmp_path / "async" / "step-00000008" / "MANIFEST.json").exists()

    three = run_world(_three, 3, str(tmp_path), timeout=120)
    assert {out["step"] for out in three} == {7}
    # The epoch's permutation, computed here as torch's DistributedSampler defines it (seed + epoch)
    permutation = torch.randperm(N, generator=torch.Generator().manual_seed(5 + EPOCH)).tolist()
    start = 0
    for world in (four, two, three):
        part = [i for out in world for i in out["seen"]]
        assert sorted(part) == sorted(permutation[start:start + len(part)])  # the next stretch of the epoch
        start += len(part)
    seen = [i for world in (four, two, three) for out in world for i in out["seen"]]
    assert sorted(seen) == list(range(N))  # every sample exactly once across the three worlds


def _killed(rank, world_size, directory):
    """A complete async save, then rank 1 is killed (SIGKILL) while the next one is being written."""
    import os
    import signal

    from troupe.reliability import checkpoint

    d = Path(directory)
    model, sgd, train = _setup()
    batches = iter(train)
    _train(model, sgd, batches, 2, [])
    checkpoint.save(d, 2, model, sgd, async_save=True)
    if rank == 0:
        torch.save(_state(model, sgd), d / "expected.pt")
    _train(model, sgd, batches, 2, [])
    if rank == 1:
        real = checkpoint._atomic_write

        def die(path, data):
            if path.parent.name == "step-00000004":  # its DCP data is written, its checksums not yet sent
                (d / "killed").write_text(str(path))
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)

        checkpoint._atomic_write = die
    checkpoint.save(d, 4, model, sgd, async_save=True)  # waits for save 2: it is complete
    for _ in range(2000):  # training goes on until the peer's death stops it
        _train(model, sgd, iter(train), 1, [])
    checkpoint.wait()


def _resume(rank, world_size, directory):
    from troupe.reliability import checkpoint

    model, sgd, _ = _setup()
    found = checkpoint.latest(directory)
    extra = checkpoint.load(found, model, sgd)
    return found.name, extra["step"], _state(model, sgd)


def test_a_job_killed_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path):
    with pytest.raises((RankFailed, TimeoutError)):
        run_world(_killed, 2, str(tmp_path), timeout=60)
    assert (tmp_path / "killed").exists()  # rank 1 died in the middle of writing step 4
    assert (tmp_path / "step-00000004" / "__1_0.distcp").exists()
    assert not (tmp_path / "step-00000004" / "MANIFEST.json").exists()
    assert (tmp_path / "step-00000002" / "MANIFEST.json").exists()
    expected = torch.load(tmp_path / "expected.pt")
    for name, step, state in run_world(_resume, 1, str(tmp_path)):  # on 1 rank: resharded too
        assert name == "step-00000002" and step == 2
        assert all(torch.equal(a, b) for a, b in zip(state, expected))
