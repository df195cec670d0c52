"""Contrastive Divergence without a process group: CD-k against a hand computation, the surrogate loss,
Gaussian hidden units, the unrolled autoencoder, bad input."""

from __future__ import annotations

import pytest
import torch

from troupe.algorithms.cd import RBM, DeepAutoencoder, squared_error


def _rbm(n_visible=6, n_hidden=4, hidden="bernoulli", seed=0):
    torch.manual_seed(seed)
    rbm = RBM(n_visible, n_hidden, hidden=hidden)
    with torch.no_grad():  # non-zero biases, so a sign or transpose slip shows
        rbm.h_bias.normal_(0, 0.3)
        rbm.v_bias.normal_(0, 0.3)
    return rbm


def _batch(n=5, d=6, seed=1):
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed)).round()


def _reference(W, bh, bv, v, k, hidden, noise):
    """CD-k by hand, from explicit noise: one hidden-shaped draw per Gibbs step."""
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    mean_h = (lambda x: x) if hidden == "gaussian" else sig
    h_pos = mean_h(v @ W.T + bh)
    h_neg = h_pos
    for step in range(k):
        if hidden == "gaussian":
            h = h_neg + noise[step]
        else:
            h = (noise[step] < h_neg).double()
        v_neg = sig(h @ W + bv)
        if step == 0:
            first = v_neg
        h_neg = mean_h(v_neg @ W.T + bh)
    B = v.shape[0]
    dW = (h_neg.T @ v_neg - h_pos.T @ v) / B
    dbh = (h_neg - h_pos).sum(0) / B
    dbv = (v_neg - v).sum(0) / B
    err = ((v - first) ** 2).sum() / B
    return dW, dbh, dbv, err


@pytest.mark.parametrize("hidden", ["bernoulli", "gaussian"])
@pytest.mark.parametrize("k", [1, 3])
def test_cd_k_equals_the_hand_computation_with_the_same_hidden_draws(hidden, k):
    rbm, v = _rbm(hidden=hidden), _batch()
    stats = rbm.cd_step(v, k, generator=torch.Generator().manual_seed(7))
    # the documented draws: one torch.rand (Bernoulli) or torch.randn (Gaussian) of h's shape per step
    g = torch.Generator().manual_seed(7)
    draw = torch.randn if hidden == "gaussian" else torch.rand
    noise = [draw(5, 4, generator=g).double() for _ in range(k)]
    W, bh, bv = (t.detach().double() for t in (rbm.weight, rbm.h_bias, rbm.v_bias))
    dW, dbh, dbv, err = _reference(W, bh, bv, v.double(), k, hidden, noise)
    torch.testing.assert_close(rbm.weight.grad.double(), dW, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rbm.h_bias.grad.double(), dbh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rbm.v_bias.grad.double(), dbv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.error.double(), err, rtol=1e-5, atol=1e-6)


def test_samples_really_differ_from_mean_field():
    rbm, v = _rbm(), _batch()
    rbm.cd_step(v, generator=torch.Generator().manual_seed(0))
    sampled = rbm.weight.grad.clone()
    rbm.zero_grad()
    rbm.cd_step(v, mean_field=True)
    assert not torch.allclose(sampled, rbm.weight.grad)


def test_cd_step_accumulates_like_autograd():
    rbm, v = _rbm(), _batch()
    rbm.cd_step(v, mean_field=True)
    once = [p.grad.clone() for p in rbm.parameters()]
    rbm.cd_step(v, mean_field=True)
    for p, g in zip(rbm.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


@pytest.mark.parametrize("hidden", ["bernoulli", "gaussian"])
def test_the_free_energy_surrogate_has_exactly_the_cd_gradient(hidden):
    rbm, v = _rbm(hidden=hidden), _batch()
    rbm.cd_step(v, 2, generator=torch.Generator().manual_seed(3))
    direct = [p.grad.clone() for p in rbm.parameters()]
    rbm.zero_grad()
    loss, _ = rbm.cd_loss(v, 2, generator=torch.Generator().manual_seed(3))
    loss.backward()
    for p, g in zip(rbm.parameters(), direct):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_free_energy_matches_the_sum_over_hidden_states():
    """F(v) = -log sum_h exp(-E(v, h)) for Bernoulli units, by enumerating all 2^4 hidden states."""
    rbm, v = _rbm(), _batch()
    W, bh, bv = (t.detach().double() for t in (rbm.weight, rbm.h_bias, rbm.v_bias))
    states = torch.tensor([[(i >> j) & 1 for j in range(4)] for i in range(16)], dtype=torch.float64)
    vd = v.double()
    neg_energy = vd @ bv[:, None] + states @ bh + (vd @ W.T) @ states.T  # (B, 16)
    torch.testing.assert_close(rbm.free_energy(v).double(), -torch.logsumexp(neg_energy, dim=1),
                               rtol=1e-5, atol=1e-5)


def test_training_an_rbm_lowers_its_reconstruction_error():
    g = torch.Generator().manual_seed(0)
    protos = (torch.rand(4, 20, generator=g) > 0.5).float()
    data = protos[torch.randint(0, 4, (400,), generator=g)]
    rbm = RBM(20, 8, generator=g)
    opt = torch.optim.SGD(rbm.parameters(), lr=0.1, momentum=0.8)
    first = rbm.cd_step(data[:100], generator=g).error.item()
    for epoch in range(30):
        for b in range(4):
            opt.zero_grad()
            last = rbm.cd_step(data[b * 100 : (b + 1) * 100], generator=g).error.item()
            opt.step()
    assert last < 0.3 * first, (first, last)


def test_the_unrolled_autoencoder_shares_the_rbms_parameters():
    torch.manual_seed(0)
    rbms = [RBM(12, 8), RBM(8, 5), RBM(5, 2, hidden="gaussian")]
    ae = DeepAutoencoder(rbms)
    assert {id(p) for p in ae.parameters()} == {id(p) for r in rbms for p in r.parameters()}
    v = _batch(3, 12)
    code = rbms[2].hidden_mean(rbms[1].hidden_mean(rbms[0].hidden_mean(v)))
    torch.testing.assert_close(ae.encode(v), code)
    h = rbms[0].visible_mean(rbms[1].visible_mean(rbms[2].visible_mean(code)))
    torch.testing.assert_close(ae.reconstruct(v), h)
    assert squared_error(v, ae.reconstruct(v)).shape == (3,)


def test_bad_input_is_rejected_with_the_value():
    with pytest.raises(ValueError, match="hidden must be one of"):
        RBM(4, 3, hidden="softmax")
    with pytest.raises(ValueError, match="n_hidden must be a positive int, got 0"):
        RBM(4, 0)
    rbm = RBM(4, 3)
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        rbm.cd_step(torch.rand(2, 4), 0)
    with pytest.raises(ValueError, match=r"v must be \(batch, 4\), got \(2, 5\)"):
        rbm.cd_step(torch.rand(2, 5))
    with pytest.raises(ValueError, match="do not chain"):
        DeepAutoencoder([RBM(4, 3), RBM(5, 2)])
