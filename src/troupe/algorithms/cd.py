"""Contrastive Divergence (SINGA 0.x ``alg: kCD``): RBM layers, the CD-k step, the unrolled autoencoder.

CD is not back-propagation, but its update is still a gradient to descend, so it goes
through `troupe.DistOpt` like any other: `RBM.cd_step` writes ``p.grad`` and the user
calls ``sgd.step()``, which averages the gradients over ranks first (every dist_option,
every parameter-server framework). `RBM.cd_loss` is the same update as a surrogate loss
(its gradient equals `cd_step`'s exactly), for loops that want ``loss.backward()``.

>>> rbm = troupe.cd.RBM(784, 1000)
>>> sgd = troupe.DistOpt(torch.optim.SGD(rbm.parameters(), lr=0.1, momentum=0.8))
>>> stats = rbm.cd_step(v)          # p.grad = this rank's CD-1 update
>>> sgd.step(); sgd.zero_grad()     # averaged over ranks, then SGD

The semantics are SINGA's (``RBMVisLayer``/``RBMHidLayer``, ``CDWorker``): hidden units
are sampled to drive the negative phase (Bernoulli; Gaussian: mean + N(0, 1)), visible
units of the negative phase are not sampled (Hinton & Salakhutdinov 2006), and the
update uses the hidden *means*:
dW = (h_negᵀ v_neg − h_posᵀ v_pos)/B, db_v = mean(v_neg − v_pos), db_h = mean(h_neg − h_pos).
This module owns no process state and never communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HIDDEN_UNITS = ("bernoulli", "gaussian")


@dataclass(frozen=True)
class CDStats:
    """What one CD-k step saw (tensors, so reading them is the caller's choice of when to sync)."""

    error: Tensor
    """Squared reconstruction error per sample after the first Gibbs step: sum over units, mean over the batch."""
    v_neg: Tensor
    """The negative phase's visible means after k Gibbs steps."""


class RBM(nn.Module):
    """A restricted Boltzmann machine: Bernoulli visible units, Bernoulli or Gaussian hidden units.

    ``weight`` is (n_hidden, n_visible), SINGA's layout and ``nn.Linear(n_visible, n_hidden)``'s,
    so the RBM is also the encoder layer ``sigmoid(v Wᵀ + h_bias)`` (linear for Gaussian units).
    """

    def __init__(self, n_visible: int, n_hidden: int, *, hidden: Literal["bernoulli", "gaussian"] = "bernoulli",
                 init_std: float = 0.1, generator: torch.Generator | None = None):
        super().__init__()
        for name, value in (("n_visible", n_visible), ("n_hidden", n_hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden not in HIDDEN_UNITS:
            raise ValueError(f"hidden must be one of {HIDDEN_UNITS}, got {hidden!r}")
        if not init_std > 0:
            raise ValueError(f"init_std must be > 0, got {init_std!r}")
        self.hidden = hidden
        # SINGA's rbm*.conf: weights N(0, 0.1), biases 0
        self.weight = nn.Parameter(torch.randn(n_hidden, n_visible, generator=generator) * init_std)
        self.h_bias = nn.Parameter(torch.zeros(n_hidden))
        self.v_bias = nn.Parameter(torch.zeros(n_visible))

    @property
    def gaussian(self) -> bool:
        return self.hidden == "gaussian"

    def extra_repr(self) -> str:
        n_hidden, n_visible = self.weight.shape
        return f"{n_visible} -> {n_hidden}, hidden={self.hidden}"

    # --- the two conditionals -----------------------------------------------------------

    def hidden_mean(self, v: Tensor) -> Tensor:
        """E[h | v]: sigmoid(v Wᵀ + b_h), or v Wᵀ + b_h for Gaussian units."""
        x = F.linear(v, self.weight, self.h_bias)
        return x if self.gaussian else torch.sigmoid(x)

    def visible_mean(self, h: Tensor) -> Tensor:
        """E[v | h] = sigmoid(h W + b_v)."""
        return torch.sigmoid(torch.addmm(self.v_bias, h, self.weight))

    def sample_h(self, v: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(mean, sample) of the hidden units given `v`; see `sample_hidden` for the draw."""
        mean = self.hidden_mean(v)
        return mean, self.sample_hidden(mean, generator)

    def sample_v(self, h: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(mean, Bernoulli sample) of the visible units given `h` (one ``torch.rand`` of v's shape)."""
        mean = self.visible_mean(h)
        noise = torch.rand(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        return mean, (noise < mean).to(mean.dtype)

    def sample_hidden(self, mean: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Bernoulli: ``(torch.rand(shape) < mean)``; Gaussian: ``mean + torch.randn(shape)`` (one draw of h's shape)."""
        if self.gaussian:
            return mean + torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        noise = torch.rand(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        return (noise < mean).to(mean.dtype)

    def forward(self, v: Tensor) -> Tensor:
        """The RBM as an encoder layer: E[h | v]."""
        return self.hidden_mean(v)

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v) per sample: −b_v·v − Σ softplus(v Wᵀ + b_h) (Gaussian units: −b_v·v − Σ (v Wᵀ + b_h)²/2)."""
        x = F.linear(v, self.weight, self.h_bias)
        hidden = 0.5 * x.square() if self.gaussian else F.softplus(x)
        return -(v @ self.v_bias) - hidden.sum(dim=1)

    # --- CD-k ----------------------------------------------------------------------------

    @torch.no_grad()
    def gibbs(self, v: Tensor, k: int = 1, *, mean_field: bool = False,
              generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The chain of CD-k from data `v`: (h_pos, v_neg, h_neg, v_neg after the first step).

        Each of the k steps draws the hidden units once (`sample_hidden`, in order, from
        `generator`); ``mean_field=True`` uses the means instead and draws nothing.
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if v.dim() != 2 or v.shape[1] != self.weight.shape[1]:
            raise ValueError(f"v must be (batch, {self.weight.shape[1]}), got {tuple(v.shape)}")
        h_pos = h_neg = self.hidden_mean(v)
        first = None
        for _ in range(k):
            h = h_neg if mean_field else self.sample_hidden(h_neg, generator)
            v_neg = self.visible_mean(h)  # not sampled (Hinton & Salakhutdinov 2006, as SINGA)
            h_neg = self.hidden_mean(v_neg)
            first = v_neg if first is None else first
        return h_pos, v_neg, h_neg, first

    @torch.no_grad()
    def cd_step(self, v: Tensor, k: int = 1, *, mean_field: bool = False,
                generator: torch.Generator | None = None) -> CDStats:
        """Add this batch's CD-k update to ``p.grad`` (the sign of a gradient to descend); return its stats.

        The update is accumulated like autograd's (a fresh ``p.grad`` if it is None), so
        ``sgd.zero_grad()`` between steps, as with ``backward()``.
        """
        h_pos, v_neg, h_neg, first = self.gibbs(v, k, mean_field=mean_field, generator=generator)
        batch = v.shape[0]
        grads = (
            (h_neg.T @ v_neg - h_pos.T @ v) / batch,
            (h_neg - h_pos).mean(dim=0),
            (v_neg - v).mean(dim=0),
        )
        for p, g in zip((self.weight, self.h_bias, self.v_bias), grads):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        return CDStats(error=(v - first).square().sum(dim=1).mean(), v_neg=v_neg)

    def cd_loss(self, v: Tensor, k: int = 1, *, mean_field: bool = False,
                generator: torch.Generator | None = None) -> tuple[Tensor, CDStats]:
        """The surrogate ``mean F(v) − mean F(v_neg)`` (v_neg held fixed), whose gradient is `cd_step`'s update."""
        _, v_neg, _, first = self.gibbs(v, k, mean_field=mean_field, generator=generator)
        loss = self.free_energy(v).mean() - self.free_energy(v_neg).mean()
        return loss, CDStats(error=(v - first).square().sum(dim=1).mean(), v_neg=v_neg)

    def reconstruct(self, v: Tensor) -> Tensor:
        """One mean-field up-down pass: E[v | h = E[h | v]]."""
        return self.visible_mean(self.hidden_mean(v))


class DeepAutoencoder(nn.Module):
    """A stack of RBMs unrolled into an autoencoder whose decoder shares the encoder's weights.

    Encoder: each RBM's ``hidden_mean``; decoder: the RBMs in reverse, ``h W + b_v``, with a
    sigmoid between layers. The weights are tied, as in SINGA's autoencoder.conf, so the
    autoencoder's parameters are exactly the RBMs' (one DistOpt, and one parameter-server
    layout, serves pre-training and fine-tuning). `forward` returns the output *logits*
    (for ``binary_cross_entropy_with_logits``); `reconstruct` the pixels in [0, 1].
    """

    def __init__(self, rbms: Sequence[RBM]):
        super().__init__()
        if not rbms:
            raise ValueError("DeepAutoencoder needs at least one RBM")
        for below, above in zip(rbms, rbms[1:]):
            if below.weight.shape[0] != above.weight.shape[1]:
                raise ValueError(f"RBM sizes do not chain: {below.extra_repr()} then {above.extra_repr()}")
        self.rbms = nn.ModuleList(rbms)

    def encode(self, v: Tensor) -> Tensor:
        for rbm in self.rbms:
            v = rbm.hidden_mean(v)
        return v

    def decode_logits(self, code: Tensor) -> Tensor:
        h = code
        for i, rbm in enumerate(reversed(self.rbms)):
            x = torch.addmm(rbm.v_bias, h, rbm.weight)
            h = x if i == len(self.rbms) - 1 else torch.sigmoid(x)
        return h

    def forward(self, v: Tensor) -> Tensor:
        return self.decode_logits(self.encode(v))

    def reconstruct(self, v: Tensor) -> Tensor:
        return torch.sigmoid(self.forward(v))


def squared_error(v: Tensor, recon: Tensor) -> Tensor:
    """Sum over pixels of the squared error, per image (Hinton & Salakhutdinov's measure)."""
    return (v - recon).square().sum(dim=1)
