"""PowerSGD's arithmetic (Vogels et al. 2019), as torch's ``powerSGD_hook`` does it, without any collective.

A gradient with two or more dimensions is viewed as a matrix M (first dimension x the rest)
and sent as two thin factors: P = M Q (rows x r), summed over ranks and orthonormalised, then
Q = M^T P (cols x r), averaged over ranks; every rank rebuilds P Q^T. Q is kept between steps
(warm start: one power-iteration step per training step) and what a rank's P Q^T misses of its
own gradient is added to its next one (error feedback). Tensors that would not shrink enough
(vectors, or ``(rows + cols) * r * min_compression_rate >= rows * cols``) travel uncompressed.

PowerSGD does not fit the one-shot `Compressor` protocol (its second message depends on the
sum of the first), so this module holds the pure state a two-round reduce hook drives
(`troupe.sync.hooks.powersgd`): per bucket a `BucketLayout`, the Q memory and the residuals.

    >>> state = LowRankState(PowerSGDConfig(rank=2))
    >>> layout = state.layout("bucket0", [(500, 800), (500,)])
    >>> before = state.feed_back("bucket0", flat_grads)         # + residual; the uncompensated copy
    >>> state.project("bucket0", layout, matrices, p)           # P = M Q         (then sum P over ranks)
    >>> q = state.back_project("bucket0", layout, matrices, p)  # Q = M^T P       (then average Q)
    >>> state.expand(layout, matrices, p, q)                    # M = P Q^T
    >>> state.keep_residual("bucket0", before, flat_grads)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from troupe.util import check_int


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """PowerSGD's knobs, named and defaulted as torch's ``PowerSGDState`` (whose start step is the regime's)."""

    rank: int = 1
    """torch's matrix_approximation_rank: columns of P and Q. A matrix whose smaller side is below it
    is approximated at that side's rank (torch's clamp), which never compresses, so it travels whole."""
    min_compression_rate: float = 2.0
    """Compress a rows x cols matrix only if ``(rows + cols) * rank * min_compression_rate < rows * cols``."""
    orthogonalization_epsilon: float = 0.0
    """Added to each column's norm in Gram-Schmidt (a small value avoids 0/0 for an all-zero column)."""
    use_error_feedback: bool = True
    """Add what this rank's approximation missed to its next gradient."""
    warm_start: bool = True
    """Keep Q between steps; False draws a fresh random Q every step."""
    random_seed: int = 0
    """Seeds Q's first draw exactly as torch does (``np.random.RandomState(random_seed)``)."""

    def __post_init__(self) -> None:
        check_int("powersgd_rank", self.rank)
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                      and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        check_int("random_seed", self.random_seed, minimum=0)


@dataclass(frozen=True)
class Member:
    """One compressed tensor of a bucket: its slot, its matrix shape, its rank and its slices of P and Q."""

    slot: int
    rows: int
    cols: int
    rank: int
    p: slice
    q: slice


@dataclass(frozen=True)
class BucketLayout:
    """Which tensors of a bucket are compressed (in torch's order: grouped by shape) and which travel whole."""

    compressed: tuple[Member, ...]
    dense: tuple[int, ...]
    """Slots of the tensors all-reduced uncompressed (vectors, and matrices not worth compressing)."""
    p_size: int
    q_size: int

    @classmethod
    def plan(cls, shapes: Sequence[Sequence[int]], config: PowerSGDConfig, min_size: int = 0) -> BucketLayout:
        """The layout of a bucket whose tensors have `shapes`; tensors below `min_size` elements stay whole."""
        groups: dict[tuple[int, int], list[int]] = {}
        dense = []
        for slot, shape in enumerate(shapes):
            rows, cols = matrix_shape(shape)
            rank = min(rows, cols, config.rank)
            if len(shape) >= 2 and rows * cols >= min_size and should_compress(rows, cols, rank,
                                                                                 config.min_compression_rate):
                groups.setdefault((rows, cols), []).append(slot)
            else:
                dense.append(slot)
        members, p_at, q_at = [], 0, 0
        # torch draws the first Q tensor by tensor in this order: same-shaped tensors together
        for (rows, cols), slots in groups.items():
            rank = min(rows, cols, config.rank)
            for slot in slots:
                members.append(Member(slot, rows, cols, rank, slice(p_at, p_at + rows * rank),
                                      slice(q_at, q_at + cols * rank)))
                p_at, q_at = p_at + rows * rank, q_at + cols * rank
        return cls(tuple(members), tuple(dense), p_at, q_at)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix PowerSGD sees: the first dimension by the product of the others (a vector: n x 1)."""
    rows = int(shape[0]) if len(shape) else 1
    return rows, math.prod(int(s) for s in shape[1:])


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's test: do the factors, `min_compression_rate` times over, take fewer elements than the matrix?"""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each (batch, n, r) matrix orthonormal, in place, as torch's hook does:
    Gram-Schmidt up to rank 2 (or in half precision), a QR factorisation above."""
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        gram_schmidt(matrices, epsilon)
    else:
        r = matrices.new_empty(matrices.shape[0], matrices.shape[2], matrices.shape[2])
        torch.linalg.qr(matrices, out=(matrices, r))


def gram_schmidt(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of each (batch, n, r) matrix, in place (torch's arithmetic, op for op).

    With epsilon 0 an all-zero column divides 0 by 0 (NaN), as in torch; a small epsilon avoids it.
    """
    cols = matrices.shape[2]
    for i in range(cols):
        col = matrices[:, :, i : i + 1]
        if epsilon == 0:
            col /= torch.norm(col, dim=1, keepdim=True)
        else:
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


@dataclass
class LowRankState:
    """What PowerSGD keeps between steps: per bucket key, Q (shared by every rank) and this rank's residual."""

    config: PowerSGDConfig
    residuals: dict[str, Tensor] = field(default_factory=dict)
    """Error feedback per bucket key (the DistOpt's shared residuals, so checkpoints carry them)."""
    q: dict[str, Tensor] = field(default_factory=dict)
    """Warm-start Q per bucket key: every compressed tensor's Q back to back (the same on every rank)."""
    draws: int = 0
    """Seeds drawn so far from ``RandomState(random_seed)`` (one per bucket whose Q was drawn)."""
    _layouts: dict[str, BucketLayout] = field(default_factory=dict)

    def layout(self, key: str, shapes: Sequence[Sequence[int]], min_size: int = 0) -> BucketLayout:
        """The bucket's layout, planned once."""
        if key not in self._layouts:
            self._layouts[key] = BucketLayout.plan(shapes, self.config, min_size)
        return self._layouts[key]

    def feed_back(self, key: str, flat: Tensor) -> Tensor | None:
        """Add the bucket's residual to its gradients (in place); return the sum, to compute the next
        residual from (None without error feedback)."""
        if not self.config.use_error_feedback:
            return None
        old = self.residuals.get(key)
        if old is not None:
            if old.shape != flat.shape:
                raise ValueError(f"residual of {key} has shape {tuple(old.shape)} but the bucket has "
                                 f"{tuple(flat.shape)}; was it loaded from a run with another model or bucket size?")
            flat.add_(old)
        return flat.clone()

    def keep_residual(self, key: str, before: Tensor | None, sent: Tensor) -> None:
        """The residual: what this rank wanted to send (`before`) minus what every rank now holds."""
        if before is not None:
            self.residuals[key] = before.sub_(sent)

    def project(self, key: str, layout: BucketLayout, matrices: Sequence[Tensor], p: Tensor) -> None:
        """P = M Q for every compressed matrix, into `p` (flat); Q orthonormalised first (warm) or drawn."""
        q = self.q.get(key)
        fresh = q is None or not self.config.warm_start
        if q is not None and q.numel() != layout.q_size:
            raise ValueError(f"PowerSGD's Q of {key} has {q.numel()} elements but the bucket needs {layout.q_size}; "
                             "was it loaded from a run with another model, bucket size or powersgd_rank?")
        if fresh:
            q = self.q[key] = self._draw(layout, p.dtype, p.device)
        for m, matrix in zip(layout.compressed, matrices):
            qm = q[m.q].view(1, m.cols, m.rank)
            if not fresh:
                orthogonalize(qm, self.config.orthogonalization_epsilon)
            torch.bmm(matrix.unsqueeze(0), qm, out=p[m.p].view(1, m.rows, m.rank))

    def back_project(self, key: str, layout: BucketLayout, matrices: Sequence[Tensor], p: Tensor) -> Tensor:
        """Given P summed over ranks: orthonormalise it, then Q = M^T P (this rank's; to be averaged)."""
        q = self.q[key]
        for m, matrix in zip(layout.compressed, matrices):
            pm = p[m.p].view(1, m.rows, m.rank)
            orthogonalize(pm, self.config.orthogonalization_epsilon)
            torch.bmm(matrix.unsqueeze(0).transpose(1, 2), pm, out=q[m.q].view(1, m.cols, m.rank))
        return q

    @staticmethod
    def expand(layout: BucketLayout, matrices: Sequence[Tensor], p: Tensor, q: Tensor) -> None:
        """Overwrite every compressed matrix with P Q^T (Q already the mean over ranks)."""
        for m, matrix in zip(layout.compressed, matrices):
            pm, qm = p[m.p].view(1, m.rows, m.rank), q[m.q].view(1, m.cols, m.rank)
            torch.bmm(pm, qm.transpose(1, 2), out=matrix.unsqueeze(0))

    def _draw(self, layout: BucketLayout, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A fresh orthonormalised Q, seeded as torch's hook seeds it (one draw from the seed's
        RandomState per bucket, then a standard normal tensor by tensor) and leaving the
        caller's random generator alone."""
        import numpy as np  # only when a Q is drawn: numpy stays out of `import troupe`

        rng = np.random.RandomState(self.config.random_seed)
        for _ in range(self.draws):
            rng.randint(1_000_000_000)
        seed = int(rng.randint(1_000_000_000))
        self.draws += 1
        q = torch.empty(layout.q_size, dtype=dtype, device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in layout.compressed:
                qm = q[m.q].view(1, m.cols, m.rank)
                qm.copy_(torch.randn(1, m.cols, m.rank, dtype=dtype))
                orthogonalize(qm, self.config.orthogonalization_epsilon)
        return q

    def state_dict(self) -> dict[str, object]:
        return {"q": {k: v.clone() for k, v in self.q.items()}, "draws": self.draws}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.q = {k: v.clone() for k, v in dict(state.get("q", {})).items()}  # type: ignore[call-overload]
        self.draws = int(state.get("draws", 0))  # type: ignore[call-overload]
