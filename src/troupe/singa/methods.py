"""SINGA's DistOpt methods, kept word for word for scripts written against SINGA.

`DistOpt` inherits them; each update method is one `_singa_step(loss, option, **args)`
of the front (zero the gradients, backward under that option's strategy, step). Nothing
here holds state of its own.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from troupe.strategies import registry
from troupe.strategies.fsdp import SHARDED_BY
from troupe.strategies.partitioned import split_by_holders


class SingaMethods:
    """SINGA's names: rank_in_local/global, the backward_and_* updates, update(loss, dist_option),
    all_reduce/wait, sync_parameters."""

    @property
    def rank_in_local(self) -> int:
        return self.local_rank

    @property
    def rank_in_global(self) -> int:
        return self.global_rank

    # --- updates ---------------------------------------------------------------------------

    def backward_and_update(self, loss: Tensor) -> None:
        """Backward, average gradients across ranks (overlapped with backward), optimizer step."""
        self._singa_step(loss, "plain")

    def __call__(self, loss: Tensor) -> None:
        self.backward_and_update(loss)

    def backward_and_update_half(
        self, loss: Tensor, clipping: bool = False, clip_value: float = 100, dtype: str = "fp16"
    ) -> None:
        """Like `backward_and_update`, but gradients travel as fp16 (or ``dtype="bf16"``).

        Each rank divides by the world size before the cast, so the sum cannot overflow;
        `clipping` first clips every gradient element to [-clip_value, clip_value] (SINGA).
        """
        self._singa_step(loss, "bf16" if dtype == "bf16" else "fp16", clipping=clipping, clip_value=clip_value,
                         dtype=dtype)

    def backward_and_partial_update(self, loss: Tensor) -> None:
        """Local update on every rank, then one chunk of the parameters averaged, rotating.

        Chunk size, periodic full averaging and warm-up come from `CompressionConfig`.
        """
        self._singa_step(loss, "partialUpdate")

    def backward_and_sparse_update(
        self, loss: Tensor, spars: float = 0.05, topK: bool = False, corr: bool = True
    ) -> None:
        """Send only part of each bucket's gradient as (index, value) pairs, sum, average, step.

        `topK=True`: the ceil(spars * n) largest magnitudes (spars in (0, 1]);
        `topK=False`: every element with ``|g| >= spars``. `corr` adds back what was not
        sent in earlier steps (error feedback).
        """
        self._singa_step(loss, "sparseTopK" if topK else "sparseThreshold", spars=spars, topK=topK, corr=corr)

    def backward_and_powerSGD_update(self, loss: Tensor, powersgd_rank: int | None = None,
                                     powersgd_start: int | None = None) -> None:
        """troupe's addition (SINGA has no PowerSGD): matrix gradients travel as rank-`powersgd_rank`
        factors after `powersgd_start` plain steps; both default to the DistOpt's own (its constructor's
        arguments), see `troupe.strategies.powersgd`."""
        given = {"powersgd_rank": powersgd_rank, "powersgd_start": powersgd_start}
        self._singa_step(loss, "powerSGD", **{**self._option_args, **{k: v for k, v in given.items() if v is not None}})

    def update(self, loss: Tensor, dist_option: str = "plain", spars: float | None = None) -> None:
        """Run the update that `dist_option` names (SINGA's names, see `DIST_OPTIONS`); `spars` reaches
        the options that take it, and the DistOpt's own option arguments (``powersgd_rank``) theirs."""
        regime = registry.lookup(dist_option)
        getattr(self, regime.method)(loss, **regime.method_args(spars=spars, **self._option_args))

    def _singa_step(self, loss: Tensor, option: str, **args: Any) -> None:
        """One of SINGA's methods: zero the gradients, backward under `option`'s strategy, step (DistOpt's)."""
        rec = self.world.recorder
        if rec is not None:
            rec.note_loss(loss)
        strategy = self._choice.select(option, **args)
        self.zero_grad()
        if self.reducer is not None and self._choice.owns_reducer:
            hook = strategy.reduce_hook()
            if hook is not None:  # start the step's agreement now: it overlaps backward
                # plain's steps all have one shape; a compressed option's warm-up steps are plain's, its later ones not
                self.reducer.open_step(hook, per_call=True, steady=strategy.name == "plain")
            else:  # gradients stay local: the strategy agrees on its own, after what the reducer needs
                self.reducer.local_step()
        try:
            loss.backward()
        except BaseException:
            self._abandon_open_step()
            raise
        self.step()

    # --- collectives ----------------------------------------------------------------------

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
        self._names.update({id(p): n for n, p in model.named_parameters()})
        # A partitioned model's slices and a sharded model's shards differ by rank by design (troupe.partition
        # and troupe.shard broadcast them whole).
        shared = {id(p) for p in split_by_holders([p for _, p in model.named_parameters()], self.world_size)[0]
                  if not hasattr(p, SHARDED_BY)}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in shared] + list(model.named_buffers())
        if self.world.membership.builds_together:  # else troupe.track gives an elastic joiner the quorum's values
            self.communicator.check_same([(n, tuple(t.shape), str(t.dtype)) for n, t in named], "the model")
            self.communicator.broadcast_tensors([t for _, t in named])
        if self.reducer is not None:
            self.reducer.label_buckets(self.param_name)
