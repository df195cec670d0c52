"""Slice planning and ParamShard update semantics vs a single-process torch optimizer."""

from __future__ import annotations

import pytest
import torch

from troupe.cluster.serving import mastercopies as groupsync
from troupe.cluster.wire.messages import Header, MessageError, Op, check
from troupe.cluster.serving.shard import ParamShard, plan_slices


def test_slices_balanced_cover_everything_and_split_large_params():
    numels = [1000, 10, 7, 3000, 1]
    for nservers in (1, 2, 3, 7):
        slices = plan_slices(numels, nservers)
        assert plan_slices(numels, nservers) == slices  # deterministic
        per_server = [sum(s.numel for s in slices if s.server == j) for j in range(nservers)]
        assert max(per_server) - min(per_server) <= 1
        for p, n in enumerate(numels):  # each parameter covered exactly once, in order
            mine = [s for s in slices if s.param == p]
            assert mine[0].start == 0 and mine[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        assert [s.id for s in slices] == list(range(len(slices)))
    assert len({s.server for s in plan_slices(numels, 3) if s.param == 3}) == 3  # the big one is split


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=g), torch.randn(4, generator=g), torch.randn(30, generator=g)]


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.SGD([{"params": ps[:1], "lr": 0.5}, {"params": ps[1:]}], lr=0.1, momentum=0.5),
    ],
)
def test_sync_group_equals_optimizer_on_the_mean_gradient(make_opt):
    params = make_params()
    reference = [p.clone().requires_grad_() for p in params]
    ref_opt = make_opt(reference)
    template = make_opt([p.clone().requires_grad_() for p in params])
    group_of = [next(i for i, g in enumerate(template.param_groups) if any(q is t for q in g["params"]))
                for t in [q for g in template.param_groups for q in g["params"]]]
    slices = plan_slices([p.numel() for p in params], 2)
    shards = [ParamShard([s for s in slices if s.server == j], template, group_of, {0: {10, 11}}) for j in range(2)]
    for s in slices:
        shards[s.server].put(s.id, params[s.param].reshape(-1)[s.start : s.stop])
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
        for p, a, b in zip(reference, *grads):
            p.grad = (a + b) / 2
        ref_opt.step()
        for s in slices:
            shard = shards[s.server]
            assert shard.update(s.id, 10, grads[0][s.param].reshape(-1)[s.start : s.stop], step) == []
            assert shard.update(s.id, 11, grads[1][s.param].reshape(-1)[s.start : s.stop], step) == [10, 11]
    for s in slices:
        version, value = shards[s.server].get(s.id)
        assert version == 4
        torch.testing.assert_close(value, reference[s.param].detach().reshape(-1)[s.start : s.stop])
    assert shards[0].staleness == [0] * len(shards[0].staleness)


def test_async_groups_apply_separately_and_dead_worker_completes_its_group():
    params = make_params()
    template = torch.optim.SGD([p.clone() for p in params], lr=1.0)
    slices = plan_slices([p.numel() for p in params], 1)
    shard = ParamShard(slices, template, [0, 0, 0], {0: {0, 1}, 1: {2, 3}})
    s = slices[0]
    shard.put(s.id, params[0].reshape(-1))
    one = torch.ones(s.numel)
    assert shard.update(s.id, 2, one) == []
    assert shard.update(s.id, 3, 3 * one) == [2, 3]  # group 1 applies without waiting for group 0
    torch.testing.assert_close(shard.get(s.id)[1], params[0].reshape(-1) - 2)
    assert shard.update(s.id, 0, one) == []
    assert shard.missing() == {(0, s.id): {1}}
    assert shard.remove_worker(1) == [(s.id, [0])]  # worker 1 died: group 0 goes on alone
    torch.testing.assert_close(shard.get(s.id)[1], params[0].reshape(-1) - 3)
    assert shard.get(s.id)[0] == 2
    with pytest.raises(ValueError, match="two updates"):
        shard.update(s.id, 2, one)
        shard.update(s.id, 2, one)


def test_learning_rates_follow_the_workers_param_groups():
    a, b, c = torch.zeros(3), torch.zeros(2), torch.zeros(4)
    template = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}, {"params": [c]}], lr=0.1)
    slices = plan_slices([3, 2, 4], 2)
    shard = ParamShard([s for s in slices if s.server == 1], template, [0, 1, 2], {0: {0}})
    shard.set_lr([0.01, 0.02, 0.03])  # this shard holds no slice of parameter 0: its group is left out
    assert [g["lr"] for g in shard.optimizer.param_groups] == [0.02, 0.03]
    with pytest.raises(ValueError, match="expected 3 learning rates"):
        shard.set_lr([0.1])


def test_asynchronous_groups_share_the_learning_rate():
    # group_merge "mean": a server fed by 2 asynchronous groups steps with lr / 2 for each group's update,
    # from the start and after a scheduler changes the workers' lr
    w = torch.zeros(4)
    template = torch.optim.SGD([w], lr=0.1)
    shard = ParamShard(plan_slices([4], 1), template, [0], {0: {0}, 1: {1}}, lr_scale=0.5)
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    shard.put(0, torch.zeros(4))
    shard.update(0, 1, torch.ones(4))
    torch.testing.assert_close(shard.values[0], torch.full((4,), -0.05))
    shard.set_lr([0.2])
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_a_server_that_takes_over_a_group_waits_for_its_workers_and_shares_the_rate_among_all_groups():
    # `troupe run --elastic`: group 1's server died; its workers 1 and 2 fail over to this server, which served
    # group 0 alone at the full rate ("mean" over 1 group); from then on each of the 2 groups counts 1/2.
    w = torch.zeros(4)
    shard = ParamShard(plan_slices([4], 1), torch.optim.SGD([w], lr=0.1), [0], {0: {0}}, lr_scale=1.0, group_size=2)
    shard.put(0, torch.zeros(4))
    with pytest.raises(KeyError):
        shard.update(0, 1, torch.ones(4))  # not served here yet
    shard.set_lr([0.2])
    shard.serve_group(1, {1, 2}, {1, 2}, lr_scale=0.5)
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the workers' last lr, 0.2, times 1/2
    assert shard.update(0, 1, torch.ones(4)) == []  # the group's update waits for its other worker
    assert shard.update(0, 2, 3 * torch.ones(4)) == [1, 2]
    torch.testing.assert_close(shard.values[0], torch.full((4,), -0.2))  # their mean, 2, at lr 0.1
    shard.remove_worker(2)
    shard.add_worker(2)  # restarted: its group waits for it again
    assert shard.update(0, 1, torch.ones(4)) == []


def test_group_sync_parts_cover_every_slice_once_balanced():
    slices = plan_slices([1000, 10, 7, 3000, 1, 2], 2)
    for ngroups in (1, 2, 3, 5):
        parts = groupsync.parts(slices, ngroups)
        for s in slices:  # each slice is cut into consecutive ranges, one per group (empty ones left out)
            ranges = sorted((lo, hi) for p in parts for t, lo, hi in p if t == s)
            assert ranges[0][0] == 0 and ranges[-1][1] == s.numel
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [sum(hi - lo for _, lo, hi in p) for p in parts]
        assert max(sizes) - min(sizes) <= len(slices)  # within one element per slice


def test_checkpoint_round_trip():
    params = make_params()
    template = torch.optim.SGD([p.clone() for p in params], lr=0.1, momentum=0.9)
    slices = plan_slices([p.numel() for p in params], 1)
    a = ParamShard(slices, template, [0, 0, 0], {0: {0}})
    for s in slices:
        a.put(s.id, params[s.param].reshape(-1))
        a.update(s.id, 0, torch.ones(s.numel))
    b = ParamShard(slices, template, [0, 0, 0], {0: {0}})
    b.load_state_dict(a.state_dict())
    for s in slices:
        a.update(s.id, 0, torch.ones(s.numel))
        b.update(s.id, 0, torch.ones(s.numel))
        assert torch.equal(a.get(s.id)[1], b.get(s.id)[1]) and b.get(s.id)[0] == 2


def test_headers_round_trip_and_reject_malformed():
    h = Header(Op.UPDATE, 3, 7, 2, 40)
    assert Header.decode(h.encode()) == h
    for ok in (Header(Op.PUSH, 3, 7, 2, 40), Header(Op.ACK, 3, 8, 5, 0), Header(Op.STOP, -1, 0, 2, 0)):
        assert Header.decode(ok.encode()) == ok
    with pytest.raises(MessageError, match="ACK message with payload length 4"):
        Header.decode(Header(Op.ACK, 3, 8, 5, 4).encode())
    bad = h.encode()
    bad[0] = 123
    with pytest.raises(MessageError, match="bad magic"):
        Header.decode(bad)
    bad = h.encode()
    bad[1] = 99
    with pytest.raises(MessageError, match="unknown op 99"):
        Header.decode(bad)
    with pytest.raises(MessageError, match="GET message with payload length 5"):
        Header.decode(Header(Op.GET, 1, 0, 0, 5).encode())
    with pytest.raises(MessageError, match="claims sender 2 but came from rank 1"):
        check(h, src=1, expected_length=40, allowed={Op.UPDATE})
    with pytest.raises(MessageError, match="carries 40 elements, the slice has 39"):
        check(h, src=2, expected_length=39, allowed={Op.UPDATE})
    with pytest.raises(MessageError, match="unexpected REPLY"):
        check(Header(Op.REPLY, 3, 0, 2, 40), src=2, expected_length=40, allowed={Op.UPDATE})


def test_staleness_bound_holds_the_fast_group_until_the_slow_one_catches_up():
    template = torch.optim.SGD([torch.zeros(4)], lr=1.0)
    slices = plan_slices([4], 1)
    shard = ParamShard(slices, template, [0], {0: {0}, 1: {1}}, staleness_bound=1)
    shard.put(0, torch.zeros(4))
    g = torch.ones(4)
    assert shard.update(0, 0, g) == [0]  # 1 ahead: within the bound
    assert shard.update(0, 0, g) == []  # 2 ahead: held
    assert shard.released() == []
    assert shard.update(0, 1, g) == [1]
    assert shard.released() == [(0, [0])]  # the slow group caught up: the fast one goes on
    assert shard.update(0, 0, g) == []  # 3 vs 1: held again
    shard.remove_worker(1)  # the slow group is gone: nobody to wait for
    assert shard.released() == [(0, [0])]


def test_inverse_staleness_divides_the_learning_rate_of_a_stale_update():
    # Two asynchronous groups of one worker each. staleness_lr "inverse": an update computed on
    # values tau versions old steps with lr / max(1, tau) (momentum and weight decay as usual).
    params = make_params()
    template = torch.optim.SGD([p.clone().requires_grad_() for p in params], lr=0.1, momentum=0.9, weight_decay=1e-2)
    slices = plan_slices([p.numel() for p in params], 1)
    shard = ParamShard(slices, template, [0, 0, 0], {0: {10}, 1: {11}}, staleness_lr="inverse")
    for s in slices:
        shard.put(s.id, params[s.param].reshape(-1))
    reference = [p.clone().requires_grad_() for p in params]
    ref_opt = torch.optim.SGD(reference, lr=0.1, momentum=0.9, weight_decay=1e-2)
    g = torch.Generator().manual_seed(3)
    # (sender, the version its values had): fresh, fresh, 2 behind, 3 behind, 1 behind
    for sender, behind in ((10, 0), (11, 0), (10, 2), (11, 3), (10, 1)):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for s in slices:
            version = shard.version[s.id] - behind
            assert shard.update(s.id, sender, grads[s.param].reshape(-1), version) == [sender]
        for p, grad in zip(reference, grads):
            p.grad = grad
        for group in ref_opt.param_groups:
            group["lr"] = 0.1 / max(1, behind)
        ref_opt.step()
    for s in slices:
        torch.testing.assert_close(shard.values[s.id], reference[s.param].detach().reshape(-1), rtol=0, atol=1e-6)
    assert shard.staleness == [tau for tau in (0, 0, 2, 3, 1) for _ in slices]
    assert [g["lr"] for g in shard.optimizer.param_groups] == [0.1]  # restored after every stale update


def test_background_fetch_lets_a_worker_send_one_step_ahead_of_its_group():
    # steps_ahead=1 (fetch: background): worker 0 sends steps 1 and 2 before its partner's step 1;
    # each step of the group is applied once, in order, when complete. A third is a protocol error.
    params = make_params()
    template = torch.optim.SGD([p.clone() for p in params], lr=1.0)
    slices = plan_slices([p.numel() for p in params], 1)
    shard = ParamShard(slices, template, [0, 0, 0], {0: {0, 1}}, steps_ahead=1)
    s = slices[0]
    start = params[0].reshape(-1)
    shard.put(s.id, start)
    one = torch.ones(s.numel)
    assert shard.update(s.id, 0, one, 0) == []
    assert shard.update(s.id, 0, 3 * one, 0) == []  # step 2, queued behind step 1
    with pytest.raises(ValueError, match="for 3 steps before its group completed the first"):
        shard.update(s.id, 0, one, 0)
    assert shard.missing() == {(0, s.id): {1}}
    assert shard.update(s.id, 1, 5 * one, 0) == [0, 1]  # step 1: mean of 1 and 5
    torch.testing.assert_close(shard.get(s.id)[1], start - 3)
    assert shard.get(s.id)[0] == 1
    assert shard.remove_worker(1) == [(s.id, [0])]  # step 2 completes without the partner: 3
    torch.testing.assert_close(shard.get(s.id)[1], start - 6)
    assert shard.missing() == {}


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD([{"params": ps[:2], "lr": 0.3, "nesterov": True}, {"params": ps[2:]}], lr=0.1,
                               momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
])
def test_a_fused_step_moves_every_slice_exactly_as_one_step_per_slice(make_opt):
    # Two asynchronous groups, staleness_lr "inverse" (several lr scales in one fused step), a random
    # subset of slices per update (the rest keep grad None), some slices updated twice in one block.
    numels = [60, 6, 7, 45, 1, 11]
    params = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in numels]
    slices = [s for s in plan_slices(numels, 2) if s.server == 0]
    template = make_opt([p.clone() for p in params])
    shards = [ParamShard(slices, template, [0, 0, 1, 1, 1, 1] if len(template.param_groups) == 2 else [0] * 6,
                         {0: {10}, 1: {11}}, staleness_lr="inverse") for _ in range(2)]
    for shard in shards:
        for s in slices:
            shard.put(s.id, params[s.param][s.start : s.stop])
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        sends = [(sender, s.id, torch.randn(s.numel, generator=g), int(torch.randint(0, 3, (1,), generator=g)))
                 for sender in (10, 11) for s in slices if torch.rand(1, generator=g) < 0.7]
        per_slice, fused = shards
        for sender, k, grad, behind in sends:
            per_slice.update(k, sender, grad, per_slice.version[k] - behind)
        with fused.fused():
            for sender, k, grad, behind in sends:
                fused.update(k, sender, grad, fused.version[k] - behind)
        for k in per_slice.values:
            assert torch.equal(per_slice.values[k], fused.values[k]) and per_slice.version[k] == fused.version[k]
    assert per_slice.staleness == fused.staleness and max(per_slice.staleness) > 1
    a, b = per_slice.state_dict()["optimizer"], fused.state_dict()["optimizer"]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert all(torch.equal(a["state"][i][key], b["state"][i][key]) for key in a["state"][i])
