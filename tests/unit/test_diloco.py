"""DiLoCo without processes: its cluster fields and their errors, its layout from -n and --nworker-groups,
and the outer step's arithmetic (`OuterStep`)."""

from __future__ import annotations

import pytest
import torch

from troupe.cli import build_parser
from troupe.cluster.configuration.config import ClusterConfig
from troupe.cluster.configuration.flags import given
from troupe.cluster.configuration.roles import expendable_ranks, roles
from troupe.cluster.configuration.sources import parse_cluster_text, resolve
from troupe.strategies.diloco import OuterStep, fragment_bounds, outer_optimizer, sync_offset
from troupe.strategies.pseudograd import CHUNK, decode, encode, wire_size


def diloco(**fields) -> ClusterConfig:
    return ClusterConfig.from_dict({"framework": "diloco", "nworker_groups": 2, **fields})


@pytest.mark.parametrize("fields, message", [
    ({"sync_freq": 0}, "sync_freq must be an integer >= 1, got 0"),
    ({"outer_optimizer": "lion"}, r"outer_optimizer must be 'nesterov' or a torch.optim optimizer \(.*AdamW.*\), "
                                  r"got 'lion'"),
    ({"nworker_groups": 1}, "framework diloco averages worker groups and needs nworker_groups >= 2, got 1"),
    ({"outer_lr": 0}, "outer_lr must be a number > 0, got 0"),
    ({"outer_lr": -0.5}, "outer_lr must be a number > 0, got -0.5"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\), got 1.0"),
    ({"server_worker_separate": True}, "framework diloco runs one worker per process without separate servers"),
    ({"nserver_groups": 1}, "framework diloco has no servers of its own"),
])
def test_bad_diloco_fields_are_one_line_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message) as e:
        diloco(**fields)
    assert "\n" not in str(e.value)


def test_outer_fields_need_framework_diloco():
    with pytest.raises(ValueError, match="outer_lr 0.5: only framework diloco has an outer optimizer"):
        ClusterConfig(nworker_groups=3, nserver_groups=3, outer_lr=0.5)
    with pytest.raises(ValueError, match="outer_lr 0.5: only framework diloco"):
        resolve("hogwild", None, None, outer_lr=0.5)


def test_the_servers_follow_the_workers_and_no_diloco_worker_is_expendable():
    c = diloco(nworkers_per_group=2, sync_freq=50)
    assert (c.nserver_groups, c.nservers_per_group, c.nprocs, c.worker_regime) == (2, 2, 4, "diloco")
    assert [r.worker for r in roles(c)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert expendable_ranks(c) == set()  # a group lost would leave the others waiting at the outer step
    assert (c.outer_optimizer, c.outer_lr, c.outer_momentum) == ("nesterov", 0.7, 0.9)


def test_troupe_run_flags_lay_out_the_groups_from_n():
    args = build_parser().parse_args(["run", "-n", "4", "--framework", "diloco", "--nworker-groups", "2",
                                      "--sync-freq", "20", "--outer-optimizer", "adamw", "--outer-lr", "0.5",
                                      "x.py"])
    c = resolve(args.framework, args.cluster, args.nproc, **given(args))
    assert (c.framework, c.nworker_groups, c.nworkers_per_group, c.sync_freq) == ("diloco", 2, 2, 20)
    assert (c.outer_optimizer, c.outer_lr, c.nprocs) == ("adamw", 0.5, 4)
    assert resolve("diloco", None, 6).nworker_groups == 2 and resolve("diloco", None, 6).nworkers_per_group == 3
    assert resolve("diloco", None, None, nworker_groups=4).nprocs == 4
    with pytest.raises(ValueError, match=r"-n 5 processes do not divide into 2 worker groups"):
        resolve("diloco", None, 5, nworker_groups=2)


def test_the_cluster_block_and_toml_name_the_framework():
    block = parse_cluster_text("cluster {\n  framework: diloco\n  nworker_groups: 4\n  sync_freq: 50\n"
                               "  outer_optimizer: \"SGD\"\n  outer_lr: 1\n  outer_momentum: 0\n}\n")
    assert (block.framework, block.nworker_groups, block.nserver_groups, block.sync_freq) == ("diloco", 4, 4, 50)
    assert (block.outer_optimizer, block.outer_lr, block.outer_momentum) == ("SGD", 1.0, 0.0)
    toml = parse_cluster_text('[cluster]\nframework = "diloco"\nnworker_groups = 2\nnworkers_per_group = 2\n')
    assert (toml.nprocs, toml.nservers_per_group) == (4, 2)
    assert ClusterConfig.from_json(toml.to_json()) == toml


def test_the_outer_optimizer_is_nesterov_sgd_or_any_torch_optim_name():
    p = [torch.zeros(3, requires_grad=True)]
    default = outer_optimizer(diloco(), p)
    assert type(default) is torch.optim.SGD
    assert default.defaults["nesterov"] and default.defaults["momentum"] == 0.9 and default.defaults["lr"] == 0.7
    adamw = outer_optimizer(diloco(outer_optimizer="adamw", outer_lr=0.01), p)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["lr"] == 0.01
    plain = outer_optimizer(diloco(outer_optimizer="sgd", outer_momentum=0.5), p)
    assert not plain.defaults["nesterov"] and plain.defaults["momentum"] == 0.5
    with pytest.warns(UserWarning, match="outer_momentum 0.5 has no effect: torch.optim.Adam takes no momentum"):
        outer_optimizer(diloco(outer_optimizer="Adam", outer_momentum=0.5), p)


def test_outer_sgd_at_lr_1_without_momentum_is_the_groups_average():
    """Distributed Hogwild's master-copy rule (group_merge mean) as DiLoCo's special case."""
    start = torch.tensor([1.0, 2.0, 3.0])
    groups = [torch.tensor([0.0, 2.0, 5.0]), torch.tensor([2.0, 4.0, 1.0])]
    step = OuterStep(diloco(outer_optimizer="sgd", outer_lr=1, outer_momentum=0), [start])
    mine = [groups[0].clone()]
    deltas = [step.pseudo_gradient([g])[0] for g in groups]
    step.step([(deltas[0] + deltas[1]) / 2], mine)
    assert torch.equal(mine[0], (groups[0] + groups[1]) / 2) and torch.equal(step.outer[0], mine[0])


def test_the_nesterov_outer_step_by_hand_and_its_state_round_trips():
    theta0 = torch.tensor([1.0, -1.0])
    step = OuterStep(diloco(), [theta0])
    params = [theta0.clone()]
    lr, mu, buf = 0.7, 0.9, torch.zeros(2)
    expected = theta0.clone()
    for delta in (torch.tensor([0.5, 0.25]), torch.tensor([-0.125, 1.0])):
        step.step([delta.clone()], params)
        buf = mu * buf + delta if step.steps > 1 else delta.clone()
        expected = expected - lr * (delta + mu * buf)  # torch's Nesterov SGD
        torch.testing.assert_close(params[0], expected)
    saved = step.state_dict()
    again = OuterStep(diloco(), [torch.zeros(2)])
    again.load_state_dict(saved)
    assert again.steps == 2 and torch.equal(again.outer[0], step.outer[0])
    torch.testing.assert_close(again.optimizer.state_dict()["state"][0]["momentum_buffer"], buf)


@pytest.mark.parametrize("dtype, levels", [("int8", 127), ("int4", 7)])
def test_integer_pseudo_gradients_round_trip_within_half_a_step_of_their_chunks_absmax(dtype, levels):
    torch.manual_seed(0)
    n = 3 * CHUNK + 17  # a partial last chunk
    x = torch.randn(n) * torch.linspace(1e-3, 10, n)  # chunks of very different scales
    payload = encode(x, dtype)
    assert payload.dtype == torch.uint8 and payload.numel() == wire_size(n, dtype)
    y = decode(payload, n, dtype)
    padded = torch.nn.functional.pad(x, (0, -n % CHUNK)).view(-1, CHUNK)
    bound = (padded.abs().amax(dim=1, keepdim=True) / levels).expand(-1, CHUNK).reshape(-1)[:n]
    assert ((y - x).abs() <= bound / 2 * (1 + 1e-6)).all()
    assert torch.equal(decode(encode(torch.zeros(5), dtype), 5, dtype), torch.zeros(5))


def test_fp8_pseudo_gradients_round_trip_within_a_sixteenth_of_each_value_or_a_subnormal_step():
    torch.manual_seed(0)
    n = 3 * CHUNK + 17
    x = torch.randn(n) * torch.linspace(1e-3, 10, n)
    x[5] = 0.0
    payload = encode(x, "fp8")
    assert payload.dtype == torch.uint8 and payload.numel() == wire_size(n, "fp8") == wire_size(n, "int8")
    y = decode(payload, n, "fp8")
    padded = torch.nn.functional.pad(x, (0, -n % CHUNK)).view(-1, CHUNK)
    scale = (padded.abs().amax(dim=1, keepdim=True) / 448).expand(-1, CHUNK).reshape(-1)[:n]
    # e4m3: 3 mantissa bits (half an ulp: 1/16 of the value), subnormals below 2**-6 spaced 2**-9
    assert ((y - x).abs() <= torch.maximum(x.abs() / 16, scale / 1024) * (1 + 1e-6)).all()
    assert y[5] == 0 and torch.equal(y.abs().argmax(), x.abs().argmax())  # a chunk's largest stays exact-ish
    assert (y - x).abs().max() > 0  # lossy: the bound above is not vacuous
    assert torch.equal(decode(encode(torch.zeros(5), "fp8"), 5, "fp8"), torch.zeros(5))


def test_fp32_and_bf16_pseudo_gradients_round_trip_exactly_and_to_bf16():
    x = torch.randn(1000)
    assert torch.equal(decode(encode(x, "fp32"), 1000, "fp32"), x)
    assert torch.equal(decode(encode(x, "bf16"), 1000, "bf16"), x.to(torch.bfloat16).float())
    assert [wire_size(4096, d) for d in ("fp32", "bf16", "int8", "int4")] == [16384, 8192, 4096 + 16, 2048 + 16]


def test_pseudo_grad_dtype_is_a_flag_a_field_and_one_clear_line_when_unknown():
    args = build_parser().parse_args(["run", "-n", "4", "--framework", "diloco", "--nworker-groups", "2",
                                      "--pseudo-grad-dtype", "int4", "x.py"])
    assert resolve(args.framework, args.cluster, args.nproc, **given(args)).pseudo_grad_dtype == "int4"
    block = parse_cluster_text("cluster {\n  framework: diloco\n  nworker_groups: 2\n  pseudo_grad_dtype: bf16\n}\n")
    assert block.pseudo_grad_dtype == "bf16" and diloco().pseudo_grad_dtype == "fp32"
    with pytest.raises(ValueError, match="pseudo_grad_dtype must be one of fp32, bf16, fp8, int8, int4, got 'fp4'") as e:
        diloco(pseudo_grad_dtype="fp4")
    assert diloco(pseudo_grad_dtype="fp8").pseudo_grad_dtype == "fp8"
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="pseudo_grad_dtype 'int8': only framework diloco"):
        ClusterConfig(nworker_groups=3, nserver_groups=3, pseudo_grad_dtype="int8")


def test_fragments_are_contiguous_runs_of_tensors_balanced_by_elements():
    assert fragment_bounds([30, 5, 15, 3], 1) == [(0, 4)]
    assert fragment_bounds([30, 5, 15, 3], 3) == [(0, 1), (1, 2), (2, 4)]
    assert fragment_bounds([10] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert fragment_bounds([1000, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # none empty
    for k, message in ((5, "got 5"), (0, "got 0")):
        with pytest.raises(ValueError, match=f"fragments must be an integer from 1 to the model's 4 parameter "
                                             f"tensors, {message}"):
            fragment_bounds([30, 5, 15, 3], k)


@pytest.mark.parametrize("h, k", [(12, 4), (10, 3), (3, 3), (2, 3), (50, 1)])
def test_each_fragment_syncs_once_per_period_at_offsets_spread_over_it(h, k):
    offsets = [sync_offset(j, k, h) for j in range(k)]
    assert offsets[0] == 0 and all(0 <= o < h for o in offsets)  # fragment 0 syncs with plain DiLoCo
    assert offsets == sorted(offsets) and offsets[-1] - offsets[0] <= h - h // k
    if k <= h:
        assert len(set(offsets)) == k  # no two fragments share a step


def test_fragments_is_a_flag_and_a_field_and_at_least_1():
    args = build_parser().parse_args(["run", "-n", "2", "--framework", "diloco", "--fragments", "4", "x.py"])
    assert resolve(args.framework, args.cluster, args.nproc, **given(args)).fragments == 4
    assert parse_cluster_text("cluster {\n  framework: diloco\n  nworker_groups: 2\n  fragments: 3\n}\n").fragments == 3
    with pytest.raises(ValueError, match="fragments must be an integer >= 1, got 0"):
        diloco(fragments=0)
    with pytest.raises(ValueError, match="fragments 2: only framework diloco"):
        ClusterConfig(nworker_groups=3, nserver_groups=3, fragments=2)


def test_delay_and_merge_alpha_are_flags_and_fields_with_one_line_errors():
    args = build_parser().parse_args(["run", "-n", "2", "--framework", "diloco", "--sync-freq", "10", "--fragments",
                                      "2", "--delay", "3", "--merge-alpha", "0.5", "x.py"])
    c = resolve(args.framework, args.cluster, args.nproc, **given(args))
    assert (c.delay, c.merge_alpha, c.fragments) == (3, 0.5, 2)
    block = parse_cluster_text("cluster {\n  framework: diloco\n  nworker_groups: 2\n  sync_freq: 5\n  delay: 2\n"
                               "  merge_alpha: 0.25\n}\n")
    assert (block.delay, block.merge_alpha) == (2, 0.25)
    for fields, message in (({"delay": 5, "sync_freq": 5}, "delay 5 must be < sync_freq 5"),
                            ({"delay": -1}, "delay must be an integer >= 0, got -1"),
                            ({"merge_alpha": 1}, r"merge_alpha must be a number in \[0, 1\), got 1")):
        with pytest.raises(ValueError, match=message) as e:
            diloco(**fields)
        assert "\n" not in str(e.value)


def test_a_merge_with_alpha_mixes_the_groups_parameters_with_the_outer_ones():
    step = OuterStep(diloco(outer_optimizer="sgd", outer_lr=1, outer_momentum=0), [torch.tensor([1.0, 1.0])])
    mine = [torch.tensor([3.0, -1.0])]
    step.step([torch.tensor([0.5, 0.5])], mine, alpha=0.25)  # theta_outer -> [0.5, 0.5]
    torch.testing.assert_close(mine[0], 0.25 * torch.tensor([3.0, -1.0]) + 0.75 * torch.tensor([0.5, 0.5]))


def test_each_fragment_keeps_its_own_outer_state_in_the_checkpoint():
    from types import SimpleNamespace

    from troupe.strategies.diloco import DiLoCo

    params = [torch.zeros(4), torch.zeros(2), torch.zeros(3)]
    worker = DiLoCo(diloco(fragments=2), SimpleNamespace(reducer=None), None, params, lambda: 0)
    assert worker.bounds == [(0, 1), (1, 3)] and [len(o.outer) for o in worker.outers] == [1, 2]
    worker.outers[1].steps = 5
    saved = worker.state_dict()
    assert isinstance(saved["diloco"], list) and len(saved["diloco"]) == 2
    again = DiLoCo(diloco(fragments=2), SimpleNamespace(reducer=None), None, params, lambda: 0)
    again.load_state_dict(saved)
    assert [o.steps for o in again.outers] == [0, 5]
    one = DiLoCo(diloco(), SimpleNamespace(reducer=None), None, params, lambda: 0)
    with pytest.raises(ValueError, match="the checkpoint's DiLoCo state holds 2 fragments, this worker 1"):
        one.load_state_dict(saved)
    with pytest.raises(ValueError, match="fragments must be an integer from 1 to the model's 3 parameter tensors, "
                                         "got 4"):
        DiLoCo(diloco(fragments=4), SimpleNamespace(reducer=None), None, params, lambda: 0)


def test_troupe_run_takes_delay_0_and_says_why_a_negative_one_is_refused():
    for value, expect in (("0", 0), ("-1", "delay must be an integer >= 0, got -1")):
        args = build_parser().parse_args(["run", "-n", "2", "--framework", "diloco", "--delay", value, "x.py"])
        if isinstance(expect, int):
            assert resolve(args.framework, args.cluster, args.nproc, **given(args)).delay == expect
        else:
            with pytest.raises(ValueError, match=expect):
                resolve(args.framework, args.cluster, args.nproc, **given(args))


class _FailingPlace:
    """A quorum of one whose exchanges succeed (a no-op sum) or fail as a lost peer's would."""

    world_size = 1

    def __init__(self):
        self.fail = False

    def fused_all_reduce(self, tensors, op, async_op=True):
        fail = self.fail

        class Done:
            def wait(self):
                if fail:
                    raise RuntimeError("Connection closed by peer")

        return Done()

    def bytes_sent(self):
        return 0


def test_elastic_diloco_takes_a_syncing_step_ahead_of_the_vote_and_undoes_it_when_left_out():
    """ElasticDiLoCo: at a step that syncs, ahead_of_vote() takes the inner step and the exchange; step()
    then only takes the outer step; left_out() restores the parameters and inner optimizer state (the
    same step syncs again); a failed exchange raises out of ahead_of_vote (DistOpt votes it out)."""
    from troupe.strategies.diloco_elastic import ElasticDiLoCo
    from troupe.strategies.allreduce import AllReduce

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    place, count = _FailingPlace(), [1]  # the step taken now makes the count 2 = H: it syncs
    inner = AllReduce(name="plain", comm=place, reducer=None, optimizer=sgd, params=params)
    cfg = ClusterConfig(framework="diloco", nworker_groups=2, nserver_groups=2, sync_freq=2, outer_lr=1.0,
                        outer_momentum=0.0, outer_optimizer="sgd", elastic=True)
    strategy = ElasticDiLoCo(cfg, inner, place, params, lambda: count[0])
    strategy.start()
    before = [p.detach().clone() for p in params]

    def backward():
        sgd.zero_grad()
        model(torch.ones(4, 3)).square().sum().backward()

    backward()
    strategy.synchronize()
    strategy.ahead_of_vote()
    assert any(not torch.equal(p, b) for p, b in zip(params, before)), "the inner step was not taken ahead"
    strategy.left_out()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not sgd.state, "left_out did not undo it"
    strategy.ahead_of_vote()  # the same step again: committed this time
    stats = strategy.step()
    assert stats["fragments_synced"] == [0] and strategy.outers[0].steps == 1
    # outer SGD at lr 1 over a quorum of one: theta_outer - (theta_outer - theta) = theta, adopted
    assert all(torch.equal(p, o) for p, o in zip(params, strategy.outers[0].outer))
    count[0] = 3  # the next period's last step
    backward()
    place.fail = True
    with pytest.raises(RuntimeError, match="Connection closed"):
        strategy.ahead_of_vote()
    strategy.left_out()
    assert all(torch.equal(p, o) for p, o in zip(params, strategy.outers[0].outer))


class _PeerPlace:
    """A quorum of two: this group and a peer whose side of each sum is given (its pseudo-gradient, or
    none: a group that joined after the exchange was taken)."""

    world_size = 2

    def __init__(self, peer_delta):
        self.peer_delta = peer_delta

    def all_reduce(self, tensor, op):
        tensor += 0.0 if self.peer_delta is None else 1.0

    def fused_all_reduce(self, tensors, op, async_op=True):
        for t, d in zip(tensors, self.peer_delta or [torch.zeros_like(t) for t in tensors]):
            t += d

        class Done:
            def wait(self):
                pass

        return Done()

    def bytes_sent(self):
        return 0


def test_elastic_streaming_diloco_redoes_an_exchange_in_flight_over_a_new_quorum():
    """With delay 1 the exchange taken at count 2 merges at count 3. Over the same quorum it is the plain
    mean; after `reconfigured()` (a group lost or joined meanwhile) it is redone over the groups that took
    it: the peer's pseudo-gradient counted when it has one, left out (and not counted) when it joined
    after; the list in flight goes to a joiner through state_dict, without a pseudo-gradient."""
    from troupe.strategies.diloco_elastic import ElasticDiLoCo
    from troupe.strategies.allreduce import AllReduce

    cfg = ClusterConfig(framework="diloco", nworker_groups=2, nserver_groups=2, sync_freq=2, delay=1, outer_lr=1.0,
                        outer_momentum=0.0, outer_optimizer="sgd", elastic=True)

    def run(peer_delta, reconfigure):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        params = list(model.parameters())
        sgd = torch.optim.SGD(params, lr=0.1)
        place, count = _PeerPlace(peer_delta), [1]
        inner = AllReduce(name="plain", comm=place, reducer=None, optimizer=sgd, params=params)
        strategy = ElasticDiLoCo(cfg, inner, place, params, lambda: count[0])
        strategy.start()
        outer = [p.detach().clone() for p in params]
        for _ in range(2):  # count 1 -> 2 (takes the exchange), 2 -> 3 (merges it)
            sgd.zero_grad()
            model(torch.ones(4, 3)).square().sum().backward()
            strategy.ahead_of_vote()
            if count[0] == 1:
                assert strategy.holds_work() and strategy.state_dict()["in_flight"] == [[3, 0]]
                taken = [o - p.detach() for o, p in zip(outer, params)]
            strategy.step()
            if count[0] == 1 and reconfigure:
                strategy.reconfigured()
                assert not strategy.holds_work(), "an exchange on a group left behind still counted as held"
            count[0] += 1
        assert not strategy.flights and strategy.outers[0].steps == 1
        return params, outer, taken, strategy

    peer = [torch.full((2, 3), 0.5), torch.full((2,), -0.25)]
    for reconfigure in (False, True):  # the peer took it: the mean of both, either way
        params, outer, mine, _ = run(peer, reconfigure)
        for p, o, d, q in zip(params, outer, mine, peer):
            torch.testing.assert_close(p, o - (d + q) / 2, rtol=0, atol=1e-7)
    # the peer joined after it was taken (redone without it): this group's pseudo-gradient alone
    params, outer, mine, strategy = run(None, True)
    for p, o, d in zip(params, outer, mine):
        torch.testing.assert_close(p, o - d, rtol=0, atol=1e-7)
    joiner = ElasticDiLoCo(cfg, strategy.inner, strategy.place, params, lambda: 2)
    joiner.load_state_dict({**strategy.state_dict(), "in_flight": [[3, 0]]})
    assert [(f.merge_at, f.fragment, f.kept) for f in joiner.flights] == [(3, 0, None)]


@pytest.mark.parametrize("fields, message", [
    ({"shard": "gradients", "nworkers_per_group": 2}, r"shard gradients under framework diloco: only shard optimizer "
                                                      r"\(DiLoCo's outer parameters and outer optimizer state"),
    ({"shard": "optimizer"}, "shard optimizer under framework diloco cuts the outer state over each group's "
                             "processes and needs nworkers_per_group >= 2, got 1"),
    ({"shard": "optimizer", "nworkers_per_group": 2, "partition_dim": 1},
     "shard optimizer under framework diloco needs the whole model in each process of a group"),
    ({"shard": "gradients", "nworkers_per_group": 2, "elastic": True}, "shard gradients under framework diloco"),
])
def test_bad_sharded_diloco_fields_are_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as e:
        diloco(**fields)
    assert "\n" not in str(e.value)


def test_an_outer_optimizer_that_looks_beyond_each_element_cannot_be_sharded():
    assert diloco(shard="optimizer", nworkers_per_group=2, outer_optimizer="adamw").shard == "optimizer"
    with pytest.raises(ValueError, match=r"torch.optim.LBFGS \(outer_optimizer 'lbfgs'\) cannot .* use one of "
                                         r"ASGD, .*SGD, or leave out shard") as e:
        diloco(shard="optimizer", nworkers_per_group=2, outer_optimizer="lbfgs")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("elastic", [[], ["--elastic"]])
def test_troupe_run_shard_optimizer_with_framework_diloco_shards_the_outer_state(elastic):
    from troupe.launcher.flags import Flags
    from troupe.launcher.resolve import cluster_for

    args = build_parser().parse_args(["run", "-n", "4", "--framework", "diloco", "--nworker-groups", "2",
                                      "--shard", "optimizer", *elastic, "x.py"])
    c = cluster_for(Flags.from_args(args))
    assert (c.framework, c.shard, c.nworkers_per_group, c.elastic) == ("diloco", "optimizer", 2, bool(elastic))
    assert c.worker_regime == ("elastic-diloco" if elastic else "diloco")


class _Group:
    """The communicator of one worker group's k processes, run as threads: an all-gather meets at a barrier."""

    def __init__(self, k: int):
        import threading

        self.world_size, self.barrier, self.slots = k, threading.Barrier(k), [None] * k

    def as_rank(self, rank: int) -> "_Group":
        import copy

        me = copy.copy(self)
        me.rank = rank
        return me

    def all_gather_into(self, output, input):
        self.slots[self.rank] = input.clone()
        self.barrier.wait()
        output.copy_(torch.cat(self.slots))
        self.barrier.wait()


@pytest.mark.parametrize("groups, k", [(4, 2), (2, 3)])
def test_outer_state_sharded_over_a_group_steps_as_the_whole_and_holds_its_chunk(groups, k):
    """G groups of k processes (threads) with Nesterov outer SGD over 3 fragments, 3 outer steps: each process's
    chunk steps as the whole outer state does; the group's chunks add up to it, in bytes too."""
    from concurrent.futures import ThreadPoolExecutor

    from troupe.strategies.diloco_shard import GroupCut, ShardedOuterStep

    cluster = diloco(nworker_groups=groups, nworkers_per_group=k, shard="optimizer")
    torch.manual_seed(0)
    init = [torch.randn(n) for n in (30, 5, 15, 3)]
    bounds = fragment_bounds([p.numel() for p in init], 3)
    whole = [[p.clone() for p in init] for _ in range(groups)]  # each group's parameters, unsharded DiLoCo
    cut = [[[p.clone() for p in init] for _ in range(k)] for _ in range(groups)]  # ... and each process's, sharded
    outers = [OuterStep(cluster, init[a:b]) for a, b in bounds]
    comms = [_Group(k) for _ in range(groups)]
    shards = [[[ShardedOuterStep(cluster, init[a:b], GroupCut(comms[g].as_rank(j), j, k)) for a, b in bounds] for j in range(k)]
              for g in range(groups)]
    for g, j, f in ((g, j, f) for g in range(groups) for j in range(k) for f in range(len(bounds))):
        shards[g][j][f].reset(init[slice(*bounds[f])])
    for outer_step in range(3):
        for g in range(groups):  # the groups' inner steps: each group moves its own way
            drift = [torch.randn(p.shape) * 0.1 for p in init]
            for params in [whole[g], *cut[g]]:
                for p, d in zip(params, drift):
                    p.add_(d)
        for f, (a, b) in enumerate(bounds):
            deltas = [outers[f].pseudo_gradient(whole[g][a:b]) for g in range(groups)]
            outers[f].step([sum(d[i] for d in deltas) / groups for i in range(b - a)], whole[0][a:b])
            for g in range(1, groups):
                for p, q in zip(whole[g][a:b], whole[0][a:b]):
                    p.copy_(q)
            chunks = [[shards[g][j][f].pseudo_gradient(cut[g][j][a:b])[0] for j in range(k)] for g in range(groups)]
            means = [sum(chunks[g][j] for g in range(groups)) / groups for j in range(k)]
            with ThreadPoolExecutor(groups * k) as pool:
                list(pool.map(lambda gj: shards[gj[0]][gj[1]][f].step([means[gj[1]]], cut[gj[0]][gj[1]][a:b]),
                              [(g, j) for g in range(groups) for j in range(k)]))
        for g in range(groups):
            for j in range(k):
                torch.testing.assert_close(torch.cat(cut[g][j]), torch.cat(whole[g]), rtol=0, atol=1e-6)
    for f in range(len(bounds)):
        for g in range(groups):
            assert sum(shards[g][j][f].held_bytes() for j in range(k)) == outers[f].held_bytes()
        assert max(shards[0][j][f].held_bytes() for j in range(k)) <= -(-outers[f].held_bytes() // (8 * k)) * 8
    state = shards[0][1][0].state_dict()
    shards[1][1][0].load_state_dict(state)  # the same place in another group: its chunk
    with pytest.raises(ValueError, match=r"the checkpoint's DiLoCo state holds elements \[\d+, \d+\) of 30, this "
                                         r"process elements \[0, \d+\) of 30") as e:
        shards[1][0][0].load_state_dict(state)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="holds a chunk of the outer parameters"):
        outers[0].load_state_dict(state)


def test_the_old_import_paths_re_export_diloco():
    import troupe.cluster.workers.diloco as old
    import troupe.cluster.workers.diloco_shard as old_shard
    import troupe.cluster.workers.pseudograd as old_wire
    import troupe.strategies.diloco as new
    import troupe.strategies.diloco_elastic as new_elastic
    import troupe.strategies.diloco_shard as new_shard
    import troupe.strategies.pseudograd as new_wire

    assert (old.DiLoCo, old.ElasticDiLoCo, old.OuterStep, old.outer_optimizer) == \
        (new.DiLoCo, new_elastic.ElasticDiLoCo, new.OuterStep, new.outer_optimizer)
    assert (old_shard.ShardedOuterStep, old_wire.encode, old_wire.wire_size) == \
        (new_shard.ShardedOuterStep, new_wire.encode, new_wire.wire_size)
