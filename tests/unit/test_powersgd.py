"""PowerSGD's arithmetic without processes (troupe.compress.powersgd); two ranks simulated by hand."""

from __future__ import annotations

import pytest
import torch

from troupe.compress.powersgd import BucketLayout, LowRankState, PowerSGDConfig, orthogonalize
from troupe.strategies import registry


def exchange(states, grads, key="b0"):
    """One PowerSGD reduction of one bucket of matrices on len(states) simulated ranks, as the hook does it:
    P summed, then Q averaged. Returns what every rank ends up holding, per tensor."""
    shapes = [tuple(g.shape) for g in grads[0]]
    layout = states[0].layout(key, shapes)
    flats = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
    befores = [s.feed_back(key, f) for s, f in zip(states, flats)]
    offsets = [sum(g.numel() for g in grads[0][:k]) for k in range(len(shapes))]

    def matrices(f):
        return [f[offsets[m.slot]: offsets[m.slot] + m.rows * m.cols].view(m.rows, m.cols) for m in layout.compressed]

    ps = [torch.empty(layout.p_size) for _ in states]
    for s, f, p in zip(states, flats, ps):
        s.project(key, layout, matrices(f), p)
    summed = [torch.stack(ps).sum(0) for _ in states]  # every rank's copy of the all-reduced P
    qs = [s.back_project(key, layout, matrices(f), p) for s, f, p in zip(states, flats, summed)]
    q_mean = torch.stack(qs).mean(0)
    for s, f, p in zip(states, flats, summed):
        s.q[key].copy_(q_mean)
        s.expand(layout, matrices(f), p, s.q[key])
    for k in layout.dense:  # the uncompressed tensors: the plain mean
        mean = torch.stack([f[offsets[k]: offsets[k] + grads[0][k].numel()] for f in flats]).mean(0)
        for f in flats:
            f[offsets[k]: offsets[k] + grads[0][k].numel()] = mean
    for s, f, before in zip(states, flats, befores):
        s.keep_residual(key, before, f)
    return layout, flats, befores


def test_orthogonalize_gives_orthonormal_columns_as_torchs_hook_does():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    for rank in (1, 2, 3):  # Gram-Schmidt up to 2, QR above
        m = torch.randn(1, 20, rank, generator=torch.Generator().manual_seed(rank))
        ours, theirs = m.clone(), m.clone()
        orthogonalize(ours)
        _orthogonalize(theirs)
        assert torch.equal(ours, theirs)
        assert torch.allclose(ours[0].T @ ours[0], torch.eye(rank), atol=1e-6)


def test_layout_compresses_matrices_that_shrink_and_sends_the_rest_whole():
    shapes = [(8, 2, 3, 3), (8,), (16, 128), (4, 16), (16, 128), (3, 3)]
    layout = BucketLayout.plan(shapes, PowerSGDConfig(rank=2))
    # vectors, a 4 x 16 matrix ((4 + 16) * 2 * 2 > 64) and a 3 x 3 one travel whole
    assert layout.dense == (1, 3, 5)
    # a conv weight is its first dimension by the rest; same-shaped tensors sit together (torch's order)
    assert [(m.slot, m.rows, m.cols, m.rank) for m in layout.compressed] == \
        [(0, 8, 18, 2), (2, 16, 128, 2), (4, 16, 128, 2)]
    assert (layout.p_size, layout.q_size) == (2 * (8 + 16 + 16), 2 * (18 + 128 + 128))
    # at rank 5 the conv weight no longer shrinks enough
    assert [m.slot for m in BucketLayout.plan(shapes, PowerSGDConfig(rank=5)).compressed] == [2, 4]
    # a rank above the smaller side is clamped to it (torch's rule); at the default rate that never compresses
    assert BucketLayout.plan([(8, 18)], PowerSGDConfig(rank=9)).compressed == ()
    assert BucketLayout.plan([(8, 18)], PowerSGDConfig(rank=9, min_compression_rate=0)).compressed[0].rank == 8
    # below CompressionConfig.min_compress_size: whole
    assert [m.slot for m in BucketLayout.plan(shapes, PowerSGDConfig(rank=2), min_size=1000).compressed] == [2, 4]


def test_a_matrix_of_the_chosen_rank_arrives_exactly_and_leaves_no_residual():
    g = torch.Generator().manual_seed(0)
    low = torch.randn(30, 2, generator=g) @ torch.randn(2, 40, generator=g)  # rank 2
    bias = torch.randn(30, generator=g)
    states = [LowRankState(PowerSGDConfig(rank=2)) for _ in range(2)]
    _, flats, _ = exchange(states, [[low.clone(), bias * (r + 1)] for r in range(2)])
    for s, f in zip(states, flats):
        assert torch.allclose(f[: low.numel()].view(30, 40), low, atol=1e-4)
        assert torch.allclose(f[low.numel():], bias * 1.5)  # the vector: the plain mean
        # the matrix's residual is ~0; the vector's is this rank's own minus the mean, as torch keeps it
        assert s.residuals["b0"][: low.numel()].abs().max() < 1e-4


def test_error_feedback_carries_what_the_approximation_missed_into_the_next_step():
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(20, 30, generator=g)] for _ in range(2)]
    states = [LowRankState(PowerSGDConfig(rank=1)) for _ in range(2)]
    originals = [gs[0].clone() for gs in grads]
    _, flats, _ = exchange(states, grads)
    # residual = (own gradient + old residual, zero at first) - what every rank holds now
    for s, f, own in zip(states, flats, originals):
        assert torch.allclose(s.residuals["b0"], own.reshape(-1) - f)
        assert s.residuals["b0"].norm() > 0.1 * own.norm()  # rank 1 of a random 20 x 30 misses a lot
    # the next step sends gradient + residual: its residual is that minus what arrived
    nxt = [torch.randn(20, 30, generator=g) for _ in range(2)]
    wanted = [n.reshape(-1) + s.residuals["b0"] for n, s in zip(nxt, states)]
    first = flats[0].clone()
    _, flats, _ = exchange(states, [[n.clone()] for n in nxt])
    for w, s, f in zip(wanted, states, flats):
        assert torch.allclose(s.residuals["b0"], w - f, atol=1e-6)
    # nothing is lost: what was applied plus the ranks' mean residual is the mean of all gradients
    total = sum(o.reshape(-1) + n.reshape(-1) for o, n in zip(originals, nxt)) / 2
    assert torch.allclose(first + flats[0] + (states[0].residuals["b0"] + states[1].residuals["b0"]) / 2, total,
                          atol=1e-5)
    # warm start: Q is kept, identical on both ranks
    assert torch.equal(states[0].q["b0"], states[1].q["b0"]) and states[0].draws == 1


def test_q_is_seeded_as_torchs_hook_seeds_it_and_the_callers_generator_is_untouched():
    import numpy as np

    layout = BucketLayout.plan([(10, 12), (6, 20)], PowerSGDConfig(rank=2))
    state = LowRankState(PowerSGDConfig(rank=2, random_seed=7))
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    state.project("b0", layout, [torch.ones(10, 12), torch.ones(6, 20)], torch.empty(layout.p_size))
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(int(np.random.RandomState(7).randint(1_000_000_000)))
    first = torch.randn(1, 12, 2)
    orthogonalize(first)
    assert torch.equal(state.q["b0"][:24].view(1, 12, 2), first)
    # a restored state continues the seed draws where it was
    again = LowRankState(PowerSGDConfig(rank=2, random_seed=7))
    again.load_state_dict(state.state_dict())
    assert again.draws == 1 and torch.equal(again.q["b0"], state.q["b0"])


@pytest.mark.parametrize("rank", [0, -1, 1.5, "2", True, None])
def test_bad_rank_is_one_clear_error(rank):
    with pytest.raises(ValueError, match=f"powersgd_rank must be an integer >= 1, got {rank!r}"):
        PowerSGDConfig(rank=rank)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="min_compression_rate must be a finite number >= 0, got -1"):
        PowerSGDConfig(min_compression_rate=-1)
    with pytest.raises(ValueError, match="random_seed must be an integer >= 0, got 0.5"):
        PowerSGDConfig(random_seed=0.5)


def test_the_regime_is_registered_and_declares_what_it_can_do():
    regime = registry.lookup("powerSGD")
    assert regime.method == "backward_and_powerSGD_update"
    # elastic: tests/dist/test_elastic.py heals a joiner's Q and residuals; graph mode: not its shape
    assert regime.supports.graph_mode is False and regime.supports.elastic is True
    assert "powerSGD" not in registry.graph_options()
    assert regime.method_args(spars=0.1, powersgd_rank=2) == {"powersgd_rank": 2}


def test_distopt_rejects_bad_powersgd_arguments_and_warns_when_nothing_would_compress():
    import troupe

    model = torch.nn.Linear(4, 3)
    make = lambda **kw: troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), dist_option="powerSGD", **kw)
    with pytest.raises(ValueError, match="powersgd_rank must be an integer >= 1, got 0"):
        make(powersgd_rank=0)
    with pytest.raises(ValueError, match="powersgd_rank must be an integer >= 1, got 2.0"):
        make(powersgd_rank=2.0)
    with pytest.raises(ValueError, match="powersgd_start must be an integer >= 0, got -1"):
        make(powersgd_start=-1)
    with pytest.raises(ValueError, match="powersgd_rank must be an integer >= 1, got 0"):
        troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), powersgd_rank=0)  # checked whatever the option
    with pytest.warns(UserWarning, match=r"powersgd_rank=1 compresses no gradient \(the largest matrix, shape \(3, 4\)"):
        sgd = make(powersgd_rank=1)
    assert sgd.strategy.describe() == "powerSGD(rank=1, start=0)"
