"""DistOpt: wraps any torch optimizer for synchronous data-parallel training."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from troupe.runtime import comm as comm_mod
from troupe.reliability import nonfinite as nonfinite_mod
from troupe.observe import trace
from troupe.reliability import watchdog
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE, FIRST_BUCKET_SIZE
from troupe.cluster.config import from_env as cluster_from_env
from troupe.runtime.comm import Handle
from troupe.runtime.launch import Ticket, init
from troupe.reliability.nonfinite import NAN_POLICIES, NanPolicy
from troupe.sync.reducer import GradReducer, ReduceFn
from troupe.strategies.compressed import CompressionConfig, Strategies

DIST_OPTIONS = {
    "plain": "backward_and_update",
    "fp32": "backward_and_update",
    "fp16": "backward_and_update_half",
    "bf16": "backward_and_update_half",
    "partialUpdate": "backward_and_partial_update",
    "sparseTopK": "backward_and_sparse_update",
    "sparseThreshold": "backward_and_sparse_update",
}
"""`dist_option` names (SINGA's) and the DistOpt method each one calls."""

DIST_OPTION_ARGS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bf16"},
    "sparseTopK": {"topK": True},
    "sparseThreshold": {"topK": False},
}
"""Fixed keyword arguments a `dist_option` passes to its method."""


class DistOpt:
    """Averages gradients across ranks, overlapped with backward, then steps the wrapped optimizer.

    Gradients are summed across ranks and divided by the world size before the wrapped
    optimizer runs, so momentum and weight decay see the averaged gradient. At
    construction rank 0's parameters are broadcast, so every rank starts equal.

    >>> sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9))
    >>> model.to(sgd.device)
    >>> loss = F.cross_entropy(model(x), y)
    >>> sgd(loss)                      # backward, all-reduce, step
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        ticket: Ticket | str | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        backend: str | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        first_bucket_size: int = FIRST_BUCKET_SIZE,
        timeout: float | None = None,
        join_timeout: float | None = None,
        compression: CompressionConfig | None = None,
        nan_policy: NanPolicy = "raise",
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistOpt wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, size in (("bucket_size", bucket_size), ("first_bucket_size", first_bucket_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive number of elements, got {size!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise TypeError(f"compression must be a troupe.CompressionConfig, got {type(compression).__name__}")
        self.info = init(
            ticket, local_rank, world_size, rank=rank, backend=backend, timeout=timeout, join_timeout=join_timeout
        )
        self.optimizer = optimizer
        # Under a cluster (`troupe run --framework ...`) a server rank serves inside join_cluster and
        # exits; a worker sees only the workers: global_rank/world_size/default() count workers.
        self.ps: Any = None
        cluster = cluster_from_env()
        if cluster is not None:
            from troupe.cluster.worker import join_cluster

            self.info, self.ps = join_cluster(cluster, optimizer, self.info, bucket_size)
        self.communicator = comm_mod.default()
        self.bucket_size = bucket_size
        self.nan_policy = nan_policy
        self.skipped_steps = 0
        self.step_count = 0
        self._names: dict[int, str] = {}
        self._pending: list[Handle] = []
        params = self._params()
        self._check_same_everywhere([(tuple(p.shape), str(p.dtype)) for p in params], "the optimizer's parameters")
        self._broadcast(params)
        plain = self.world_size > 1 and self.ps is None
        self.reducer = GradReducer(params, self.communicator, bucket_size, first_bucket_size) if plain else None
        if self.reducer is not None:
            self.reducer.label_buckets(self.param_name)  # by position; by name once a model is attached
        self.strategies = Strategies(self, compression or CompressionConfig())
        if self.ps is not None:
            self.ps.start()  # Put/Get the initial parameters

    # --- where this process is -------------------------------------------------------

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def global_rank(self) -> int:
        return self.info.global_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> torch.device:
        """``cuda:local_rank`` under NCCL, else the CPU."""
        return self.info.device

    # SINGA's older names
    rank_in_local = local_rank
    rank_in_global = global_rank

    # --- the update ------------------------------------------------------------------

    def backward_and_update(self, loss: Tensor) -> None:
        """Backward, average gradients across ranks (overlapped with backward), optimizer step."""
        self._note_loss(loss)
        if self.ps is not None:  # the cluster's servers run the optimizer
            self.ps.backward_and_update(loss)
            self.step_count += 1
            return
        self._backward(loss)
        self._apply_update()

    def _apply_update(self) -> None:
        """Step the wrapped optimizer on the averaged gradients, unless one is NaN/Inf (see `nan_policy`).

        Averaged gradients are identical on every rank, so every rank makes the same choice.
        """
        if self.nan_policy != "ignore":
            flats = [b.data for b in self.reducer.buckets] if self.reducer else [
                p.grad for p in self._params() if p.grad is not None]
            bad = [] if nonfinite_mod.all_finite(flats) else nonfinite_mod.nonfinite(self._params())
            if bad:
                names = ", ".join(self.param_name(p) for p in bad[:5])
                if self.nan_policy == "raise":
                    raise FloatingPointError(
                        f"rank {self.global_rank}: non-finite gradient at step {self.step_count} in {names} "
                        "(DistOpt(nan_policy='skip') skips such steps instead)"
                    )
                warnings.warn(f"troupe: skipped step {self.step_count}: non-finite gradient in {names}")
                self.skipped_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
                self.step_count += 1
                return
        self.optimizer.step()
        self.step_count += 1

    @property
    def step_count(self) -> int:
        """Updates made so far (the watchdog reports it in stall and failure messages)."""
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        finished_a_step = hasattr(self, "_step_count") and value == self._step_count + 1
        self._step_count = value
        watchdog.set_step(value)
        rec = trace._recorder
        if rec is not None and finished_a_step:
            rec.end_step(value, self.communicator.bytes_sent(), self._step_extra())

    def _step_extra(self) -> dict[str, Any]:
        """What per-step stats add to timings: compression ratio, residual norm, staleness."""
        extra: dict[str, Any] = {}
        stats = getattr(self, "strategies", None) and self.strategies.last_step_stats
        if stats and stats.get("step") == self._step_count - 1:
            extra.update({k: v for k, v in stats.items() if k in ("option", "ratio", "residual_norm")})
        if self.ps is not None and getattr(self.ps, "staleness", None):
            extra["staleness"] = self.ps.staleness[-1]
        return extra

    @staticmethod
    def _note_loss(loss: Tensor) -> None:
        """Per-step stats carry the loss (only when stats, a timeline or TensorBoard are on)."""
        rec = trace._recorder
        if rec is not None:
            rec.note_loss(loss)

    def _backward(self, loss: Tensor, reduce_fn: ReduceFn | None = None) -> None:
        """Backward with each bucket reduced by `reduce_fn` (default: the plain mean all-reduce)."""
        rec = trace._recorder
        if rec is not None:
            rec.mark("backward")
        if self.reducer is None:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            self.reducer.backward(loss, reduce_fn)
        if rec is not None:
            rec.mark("reduced")

    __call__ = backward_and_update

    def backward_and_update_half(
        self, loss: Tensor, clipping: bool = False, clip_value: float = 100, dtype: str = "fp16"
    ) -> None:
        """Like `backward_and_update`, but gradients travel as fp16 (or ``dtype="bf16"``).

        Each rank divides by the world size before the cast, so the sum cannot overflow;
        `clipping` first clips every gradient element to [-clip_value, clip_value] (SINGA).
        """
        self._note_loss(loss)
        self.strategies.half(loss, clipping, clip_value, dtype)

    def backward_and_partial_update(self, loss: Tensor) -> None:
        """Local update on every rank, then one chunk of the parameters averaged, rotating.

        Chunk size, periodic full averaging and warm-up come from `CompressionConfig`.
        """
        self._note_loss(loss)
        self.strategies.partial_update(loss)

    def backward_and_sparse_update(
        self, loss: Tensor, spars: float = 0.05, topK: bool = False, corr: bool = True
    ) -> None:
        """Send only part of each bucket's gradient as (index, value) pairs, sum, average, step.

        `topK=True`: the ceil(spars * n) largest magnitudes (spars in (0, 1]);
        `topK=False`: every element with ``|g| >= spars``. `corr` adds back what was not
        sent in earlier steps (error feedback).
        """
        self._note_loss(loss)
        self.strategies.sparse(loss, spars, topK, corr)

    @property
    def last_step_stats(self) -> dict[str, Any]:
        """Traffic of the last half/partial/sparse step: bytes_sent, dense_bytes, ratio, residual_norm."""
        return self.strategies.last_step_stats

    def update(self, loss: Tensor, dist_option: str = "plain", spars: float | None = None) -> None:
        """Run the update that `dist_option` names (SINGA's names, see `DIST_OPTIONS`)."""
        try:
            method = DIST_OPTIONS[dist_option]
        except KeyError:
            raise ValueError(f"unknown dist_option {dist_option!r}; choose one of {sorted(DIST_OPTIONS)}") from None
        if self.ps is not None and method != "backward_and_update":
            raise ValueError(
                f"dist_option {dist_option!r} is not available under a parameter-server cluster: use 'plain'"
            )
        kwargs = dict(DIST_OPTION_ARGS.get(dist_option, {}))
        if spars is not None and method == "backward_and_sparse_update":
            kwargs["spars"] = spars
        getattr(self, method)(loss, **kwargs)

    @contextmanager
    def join(self):
        """Let ranks with fewer batches finish an epoch without hanging (PyTorch's `Join`, for DistOpt).

        Every rank wraps its loop in ``with sgd.join():``. A rank that leaves the block
        keeps taking part in the others' gradient reductions with zero gradients, marked
        inactive, and applies the same averaged update (so parameters stay equal), until
        every rank has left. Gradients are averaged over the ranks that still had data.
        Other collectives inside the loop (metrics every step) cannot be shadowed: reduce
        them after the block.
        """
        yield self
        if self.reducer is None:
            return
        while self.reducer.shadow() > 0:
            self._apply_update()

    # --- SINGA's collective helpers ---------------------------------------------------

    def all_reduce(self, tensor: Tensor) -> None:
        """Start summing `tensor` in place across ranks; `wait()` completes it."""
        self._pending.append(self.communicator.all_reduce(tensor, "sum", async_op=True))

    def wait(self) -> None:
        """Complete every `all_reduce` started so far."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    def sync_parameters(self, model: nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank (call on all ranks)."""
        named = list(model.named_parameters()) + list(model.named_buffers())
        self._names.update({id(p): n for n, p in model.named_parameters()})
        self._check_same_everywhere([(n, tuple(t.shape), str(t.dtype)) for n, t in named], "the model")
        self._broadcast([t for _, t in named])
        if self.reducer is not None:
            self.reducer.label_buckets(self.param_name)

    def param_name(self, param: Tensor) -> str:
        """The parameter's name in the attached model, or its position in the optimizer."""
        if id(param) in self._names:
            return self._names[id(param)]
        return f"param[{[id(p) for p in self._params()].index(id(param))}]"

    # --- torch.optim.Optimizer surface --------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Step the wrapped optimizer on gradients already averaged (advanced use)."""
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "step_count": self.step_count,
            "strategies": self.strategies.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        self.strategies.load_state_dict(state.get("strategies", {}))

    def close(self) -> None:
        """Under a parameter-server cluster: tell the servers this worker has finished (also done at exit)."""
        if self.ps is not None:
            self.ps.close()

    def __repr__(self) -> str:
        return (
            f"DistOpt({type(self.optimizer).__name__}, rank {self.global_rank}/{self.world_size}, "
            f"{self.info.backend}, bucket_size={self.bucket_size})"
        )

    # --- internals ----------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        seen: dict[int, Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _check_same_everywhere(self, signature: list, what: str) -> None:
        if self.world_size == 1:
            return
        everyone = self.communicator.all_gather_object(signature)
        for r, theirs in enumerate(everyone):
            if theirs != signature:
                diff = next((i for i, (a, b) in enumerate(zip(signature, theirs)) if a != b), None)
                where = (
                    f"first difference at entry {diff}: {signature[diff]} here vs {theirs[diff]} on rank {r}"
                    if diff is not None
                    else f"{len(signature)} entries here vs {len(theirs)} on rank {r}"
                )
                raise ValueError(
                    f"rank {self.global_rank}: {what} differs across ranks ({where}); "
                    "every rank must build the same model"
                )

    @torch.no_grad()
    def _broadcast(self, tensors: Iterable[Tensor]) -> None:
        """Broadcast rank 0's values, one fused message per dtype and device."""
        if self.world_size == 1:
            return
        groups: dict[tuple, list[Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for key in sorted(groups, key=str):
            members = groups[key]
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            self.communicator.broadcast(flat, src=0)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
