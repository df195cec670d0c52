"""Sharded checkpoints: written once (not once per rank), resumed on another world size, refused where
state belongs to one rank, and usable without a shared disk (each rank's files on its own node)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist.world import run_world

BATCH = 12  # the global batch: 3, 4, 6 or 12 rows per rank on 4, 3, 2 or 1 ranks
STEPS = 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _big():
    torch.manual_seed(1)
    return nn.Linear(256, 256)


def _bn():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))


def _sgd(model, **kw):
    import troupe

    return troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)


def _loss(model, rank, world_size, step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, generator=gen)
    own = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return model(x[own]).square().mean()


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [opt.optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()])


def _write(rank, world_size, directory):
    """4 ranks: a plain checkpoint (and the step after it), a large one (bytes), and three that
    hold per-rank state."""
    import troupe
    from troupe.reliability import checkpoint

    d = Path(directory)
    model = _model()
    opt = _sgd(model)
    for step in range(STEPS):
        opt(_loss(model, rank, world_size, step))
    checkpoint.save(d / "plain", STEPS, model, opt, {"rank": rank})
    saved = _state(model, opt)
    opt(_loss(model, rank, world_size, STEPS))
    after = _state(model, opt)

    big = _big()
    big_opt = _sgd(big)
    big_opt(big(torch.ones(2, 256)).square().mean())
    checkpoint.save(d / "big", 1, big, big_opt)

    topk = _model()
    topk_opt = _sgd(topk)
    topk_opt.backward_and_sparse_update(_loss(topk, rank, world_size, 0), spars=0.25, topK=True)
    checkpoint.save(d / "topk", 1, topk, topk_opt)

    partial = _model()
    partial_opt = _sgd(partial)
    partial_opt.backward_and_partial_update(_loss(partial, rank, world_size, 0))
    checkpoint.save(d / "partial", 1, partial, partial_opt)

    parted = troupe.partition(_model(), {"2": 1}, workers_per_group=2)
    parted_opt = _sgd(parted)
    checkpoint.save(d / "partitioned", 1, parted, parted_opt)

    bn = _bn()  # BatchNorm statistics: each rank's own batch (troupe does not average buffers)
    bn_opt = _sgd(bn)
    bn_opt(_loss(bn, rank, world_size, 0))
    checkpoint.save(d / "bn", 1, bn, bn_opt)
    return saved, after, {k: v.clone() for k, v in bn.state_dict().items()}


def _ps_write(rank, world_size, directory):
    """A parameter-server job (2 workers + 1 server): the workers checkpoint their DistOpt."""
    from troupe.reliability import checkpoint

    model = _model()
    try:
        opt = _sgd(model)
    except SystemExit:  # a server rank serves inside DistOpt, then exits
        return "server"
    opt(_loss(model, rank, 2, 0))
    checkpoint.save(Path(directory) / "ps", 1, model, opt)
    opt.close()
    return "worker"


def _resume_plain(rank, world_size, directory):
    """Load the 4-rank plain checkpoint, then take the step after it on this world's split of the batch."""
    from troupe.reliability import checkpoint

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # other initial values
    opt = _sgd(model)
    extra = checkpoint.load(checkpoint.latest(Path(directory) / "plain"), model, opt)
    loaded = _state(model, opt)
    count = opt.step_count
    opt(_loss(model, rank, world_size, STEPS))
    return {"extra": extra, "loaded": loaded, "step_count": count, "after": _state(model, opt)}


def _refusals(rank, world_size, directory):
    """Each 4-rank checkpoint with per-rank state: its CheckpointError on this world size."""
    import troupe
    from troupe.reliability import checkpoint

    out = {}
    for name in ("topk", "partial", "partitioned"):
        model = troupe.partition(_model(), {"2": 1}, workers_per_group=2) if name == "partitioned" else _model()
        try:
            checkpoint.load(checkpoint.latest(Path(directory) / name), model, _sgd(model))
            out[name] = "loaded"
        except checkpoint.CheckpointError as e:
            out[name] = str(e)
    return out


def _two_nodes(rank, world_size, directory):
    """Two ranks that do not share a disk (each its own directory): each writes and reads only its own files."""
    import pytest

    from troupe.reliability import checkpoint

    node = Path(directory) / f"node{rank}"
    model = _model()
    opt = _sgd(model)
    for step in (1, 2):
        opt(_loss(model, rank, world_size, step))
        checkpoint.save(node, step, model, opt)
    saved = _state(model, opt)
    manifest = json.loads((node / "step-00000002" / "MANIFEST.json").read_text())
    files = sorted(p.relative_to(node / "step-00000002").as_posix()
                   for p in (node / "step-00000002").rglob("*") if p.is_file())
    found = checkpoint.latest(node)
    fresh = _model()
    fresh_opt = _sgd(fresh)
    checkpoint.load(found, fresh, fresh_opt)
    loaded = _state(fresh, fresh_opt)

    opt.communicator.barrier()
    if rank == 1:  # a corrupted file on node 1 only: node 1 falls back, and load notices the ranks disagree
        path = node / "step-00000002" / "rank1" / "__0_0.distcp"
        path.write_bytes(path.read_bytes()[:-8] + b"corrupt!")
    fallback = checkpoint.latest(node).name
    with pytest.raises(checkpoint.CheckpointError, match="ranks resolved different checkpoints"):
        checkpoint.load(checkpoint.latest(node), fresh, fresh_opt)
    return {"layout": manifest["layout"], "files": files, "found": found.name, "saved": saved,
            "loaded": loaded, "fallback": fallback}


def _first_format(rank, world_size, directory):
    """A checkpoint of troupe's first format (a full rank{r}.pt per rank) still loads on the same world size."""
    import hashlib
    import io

    from troupe.reliability import checkpoint

    target = Path(directory) / "first" / "step-00000007"
    target.mkdir(parents=True, exist_ok=True)
    model = _model()
    opt = _sgd(model)
    opt(_loss(model, rank, world_size, 0))
    buf = io.BytesIO()
    torch.save({"step": 7, "rank": rank, "world_size": world_size, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "rng": checkpoint.rng_state(), "extra": {"epoch": 1}}, buf)
    (target / f"rank{rank}.pt").write_bytes(buf.getvalue())
    digests = opt.communicator.all_gather_object(hashlib.sha256(buf.getvalue()).hexdigest())
    if rank == 0:
        manifest = {"step": 7, "world_size": world_size, "sha256": {f"rank{r}.pt": d for r, d in enumerate(digests)}}
        (target / "MANIFEST.json").write_text(json.dumps(manifest))
    opt.communicator.barrier()
    fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fresh_opt = _sgd(fresh)
    extra = checkpoint.load(checkpoint.latest(target.parent), fresh, fresh_opt)
    return {"extra": extra, "same": _same(_state(model, opt), _state(fresh, fresh_opt))}


def _world_of_2(rank, world_size, directory):
    from troupe.reliability import checkpoint

    bn = _bn()
    checkpoint.load(checkpoint.latest(Path(directory) / "bn"), bn, _sgd(bn))
    return {"plain": _resume_plain(rank, world_size, directory), "refused": _refusals(rank, world_size, directory),
            "nodes": _two_nodes(rank, world_size, Path(directory) / "nodes"), "bn": bn.state_dict(),
            "first": _first_format(rank, world_size, directory)}


def _world_of_3(rank, world_size, directory):
    from troupe.reliability import checkpoint

    model = _model()
    try:  # the two-node checkpoint (2 ranks, no shared disk) on 3 ranks
        checkpoint.load(Path(directory) / "nodes" / f"node{rank % 2}" / "step-00000001", model, _sgd(model))
        local = "loaded"
    except checkpoint.CheckpointError as e:
        local = str(e)
    try:  # the parameter-server workers' checkpoint (2 workers) on 3 ranks without a cluster
        checkpoint.load(Path(directory) / "ps" / "step-00000001", model, _sgd(model))
        ps = "loaded"
    except checkpoint.CheckpointError as e:
        ps = str(e)
    return {"plain": _resume_plain(rank, world_size, directory), "local": local, "ps": ps}


def _world_of_1(rank, world_size, directory):
    from troupe.reliability import checkpoint

    d = Path(directory) / "one"
    big = _big()
    big_opt = _sgd(big)
    big_opt(big(torch.ones(2, 256)).square().mean())
    checkpoint.save(d / "big", 1, big, big_opt)

    model = _model()  # a corrupted DCP data file: latest() falls back to the previous checkpoint
    opt = _sgd(model)
    for step in (1, 2):
        opt(_loss(model, rank, world_size, step))
        checkpoint.save(d / "corrupt", step, model, opt)
    path = d / "corrupt" / "step-00000002" / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-8] + b"corrupt!")
    try:  # the first format's 2-rank checkpoint on 1 rank
        checkpoint.load(Path(directory) / "first" / "step-00000007", model, opt)
        first = "loaded"
    except checkpoint.CheckpointError as e:
        first = str(e)
    return {"plain": _resume_plain(rank, world_size, directory), "fallback": checkpoint.latest(d / "corrupt").name,
            "first": first}


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _same(a, b):
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _close(a, b):
    return all(torch.allclose(a[0][k], b[0][k], atol=1e-6) for k in a[0]) and \
        all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a[1], b[1]))


@pytest.mark.slow
def test_four_ranks_write_once_and_resume_on_three_two_and_one(tmp_path):
    written = run_world(_write, 4, str(tmp_path), timeout=240)
    saved, after, bn = written[0]
    assert all(_same(saved, s) for s, _, _ in written)  # data parallel: every rank held the same state
    assert not torch.equal(written[1][2]["1.running_mean"], bn["1.running_mean"])  # BatchNorm's differ

    from troupe.cluster.configuration.config import ClusterConfig

    cluster = ClusterConfig(nworkers_per_group=2, nservers_per_group=1, server_worker_separate=True)
    assert run_world(_ps_write, 3, str(tmp_path), timeout=240, env={"TROUPE_CLUSTER": cluster.to_json()}) == \
        ["worker", "worker", "server"]

    manifest = json.loads((tmp_path / "plain" / "step-00000003" / "MANIFEST.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["per_rank_keys"] == [] and manifest["not_reshardable"] == []
    for world_size, fn in ((2, _world_of_2), (3, _world_of_3), (1, _world_of_1)):
        results = run_world(fn, world_size, str(tmp_path), timeout=240)
        for rank, out in enumerate(results):
            plain = out["plain"]
            assert _same(plain["loaded"], saved), (world_size, rank)  # exactly the saved tensors
            assert plain["step_count"] == STEPS and plain["extra"] == {"step": STEPS, "rank": rank}
            # and the step after it equals the 4-rank run's (the same global batch, split differently)
            assert _close(plain["after"], after), (world_size, rank)
        if world_size == 2:
            _check_refusals_and_nodes(results)
            bn_manifest = json.loads((tmp_path / "bn" / "step-00000001" / "MANIFEST.json").read_text())
            assert "model.1.running_mean" in bn_manifest["per_rank_keys"] and bn_manifest["not_reshardable"] == []
            for out in results:  # resharded: rank 0's statistics on every rank, the (equal) weights
                assert all(torch.equal(out["bn"][k], bn[k]) for k in bn), out["bn"]
        if world_size == 3:
            for out in results:
                assert "written by 2 ranks, this job has 3" in out["local"]
                assert "without a shared filesystem" in out["local"]
                assert "written by 2 ranks, this job has 3" in out["ps"] and "parameter-server worker" in out["ps"]
        if world_size == 1:
            assert results[0]["fallback"] == "step-00000001"
            assert "written by 2 ranks, this job has 1" in results[0]["first"] and "first format" in results[0]["first"]
            one, four = _bytes(tmp_path / "one" / "big"), _bytes(tmp_path / "big")
            assert one > 2 * 256 * 257 * 4  # parameters and momentum
            assert four < 1.1 * one, (one, four)  # each replicated tensor written once, not once per rank


def _check_refusals_and_nodes(results):
    for out in results:
        refused = out["refused"]
        for name, why in (("topk", "error-feedback residuals"), ("partial", "partial update"),
                          ("partitioned", "partitioned model")):
            assert "written by 4 ranks, this job has 2" in refused[name] and why in refused[name], refused[name]
    for rank, out in enumerate(results):
        assert out["first"] == {"extra": {"step": 7, "epoch": 1}, "same": True}
        nodes = out["nodes"]
        assert nodes["layout"] == "local" and nodes["found"] == "step-00000002"
        # node r holds rank r's files only (and the manifest)
        assert all(f in ("MANIFEST.json", f"rank{rank}.pt", ".shared-disk-probe") or f.startswith(f"rank{rank}/")
                   for f in nodes["files"]), nodes["files"]
        assert _same(nodes["loaded"], nodes["saved"])
        assert nodes["fallback"] == ("step-00000001" if rank == 1 else "step-00000002")


def test_metadata_that_would_run_code_is_refused(tmp_path):
    import os
    import pickle

    import pytest

    from troupe.reliability.dcp_files import SafeReader

    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned > " + str(tmp_path / "ran"),)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeReader(tmp_path).read_metadata()
    assert not (tmp_path / "ran").exists()
