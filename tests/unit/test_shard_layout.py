"""Sharded data parallelism without processes: how buckets are cut over ranks, and the refusals."""

from __future__ import annotations

import pytest
import torch

from troupe.strategies import registry
from troupe.strategies.sharded import chunk_range, own_parts
from troupe.sync.bucket import Bucket


@pytest.mark.parametrize("numels", [[1000, 10, 7, 3000, 1], [1], [5, 5], [1, 1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_parts_cover_every_element_once_balanced_by_elements(numels, k):
    total = sum(numels)
    covered = [[0] * n for n in numels]
    held = []
    for rank in range(k):
        chunk, lo, hi = chunk_range(total, rank, k)
        assert chunk * k >= total > chunk * (k - 1) - k  # padded to k equal chunks, at most k - 1 elements
        parts = own_parts(numels, rank, k)
        assert [s for s, _, _ in parts] == sorted({s for s, _, _ in parts})  # one part per tensor, in order
        for slot, start, stop in parts:
            for i in range(start, stop):
                covered[slot][i] += 1
        held.append(sum(stop - start for _, start, stop in parts))
        assert held[-1] == hi - lo
    assert all(c == 1 for row in covered for c in row)
    assert max(held) - min(held) <= -(-total // k)  # whole tensors never decide the balance
    assert max(held) <= -(-total // k)


def test_a_padded_bucket_keeps_its_flags_after_the_padding():
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    bucket = Bucket(0, params, pad_to=4)
    assert bucket.padded == 8 and bucket.padded_data.numel() == 8
    assert bucket.flags.numel() == len(params) + 1 + 2
    assert bucket.buffer.numel() == 8 + 5
    bucket.bind(None)
    assert bucket.buffer is None


@pytest.mark.parametrize("kwargs,message", [
    ({"shard": "bogus"}, "unknown shard mode 'bogus'; choose one of ['gradients', 'optimizer']"),
    ({"shard": "optimizer", "dist_option": "fp16"}, "dist_option 'fp16' cannot run with shard='optimizer'"),
    ({"shard": "gradients", "dist_option": "sparseTopK"}, "dist_option 'sparseTopK' cannot run with shard="),
])
def test_a_shard_mode_that_cannot_run_is_refused_before_joining(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        registry.resolve(kwargs.get("dist_option", "plain"), None, kwargs["shard"])


def test_a_shard_mode_under_a_cluster_framework_is_refused():
    class Cluster:
        worker_regime = "ps-client"

    with pytest.raises(ValueError, match="shard='optimizer' cannot run under a cluster framework"):
        registry.resolve("plain", Cluster(), "optimizer")


@pytest.mark.process
def test_troupe_run_refuses_shard_with_a_framework_or_elastic_groups_of_one(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "x.py"
    script.write_text("")
    for extra, said in ((["--framework", "downpour"], "--shard optimizer runs with plain data parallelism only for "
                                                      "now: drop the cluster framework"),
                        (["--elastic"], "--shard optimizer under --elastic cuts the state inside each worker group, "
                                        "and these groups are of one process: give --nworker-groups G")):
        out = subprocess.run([sys.executable, "-m", "troupe.cli", "run", "-n", "4", "--shard", "optimizer", *extra,
                              str(script)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert said in out.stderr
        assert "Traceback" not in out.stderr
