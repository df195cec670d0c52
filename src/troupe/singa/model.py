"""troupe.Model: a torch.nn.Module with SINGA's training-facing methods."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from troupe.singa.methods import SingaMethods


class Model(nn.Module):
    """A `torch.nn.Module` with SINGA's `set_optimizer`, `train_one_batch` and `compile`.

    >>> class CNN(troupe.Model):
    ...     def train_one_batch(self, x, y, dist_option="plain", spars=None):
    ...         out = self.forward(x)
    ...         loss = F.cross_entropy(out, y)
    ...         self.optimizer.update(loss, dist_option, spars)
    ...         return out, loss
    """

    def __init__(self) -> None:
        super().__init__()
        self.optimizer: torch.optim.Optimizer | None = None  # a DistOpt, or any torch optimizer
        self._train_arity: int | None = None  # set by compile(is_train=True): forward's input count

    def __call__(self, *args, **kwargs):
        """SINGA's rule: after ``compile(inputs, is_train=True)``, a call with more positional
        arguments than `inputs` (``model(x, y)``, ``model(x, y, dist_option, spars)``) runs
        `train_one_batch`; any other call is `forward`, as in torch."""
        if self._train_arity is not None and len(args) > self._train_arity:
            own = "forward" in self.__dict__ or "train_one_batch" in self.__dict__  # a graph (compile(use_graph))
            if not own and (self._forward_hooks or self._forward_pre_hooks or _sharded(self)):
                return self._with_hooked_forward(*args, **kwargs)
            return self.train_one_batch(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _with_hooked_forward(self, *args, **kwargs):
        """train_one_batch with its ``self.forward(x)`` run through nn.Module's call, so the module's hooks run:
        a model sharded by troupe.shard gathers its parameters in them (SINGA's idiom would skip them)."""
        nn_call = super().__call__

        def hooked(*a, **k):
            del self.forward  # inside the call, forward is the class's again
            try:
                return nn_call(*a, **k)
            finally:
                self.forward = hooked

        self.forward = hooked
        try:
            return self.train_one_batch(*args, **kwargs)
        finally:
            del self.forward

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Attach the optimizer; a DistOpt also copies rank 0's parameters and buffers to every rank."""
        if not isinstance(optimizer, torch.optim.Optimizer):  # a DistOpt is one
            raise TypeError(f"set_optimizer takes a DistOpt or torch optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        # A DistOpt is known by its SINGA methods: this module sits below troupe.distopt
        # (which inherits them from here) and does not import it.
        if isinstance(optimizer, SingaMethods):
            optimizer.sync_parameters(self)

    def train_one_batch(self, x: Tensor, y: Tensor, dist_option: str = "plain", spars: float | None = None):
        """Forward, loss and update for one batch; subclasses define it (see the class example)."""
        raise NotImplementedError(f"{type(self).__name__} must define train_one_batch(x, y, dist_option, spars)")

    def compile(  # type: ignore[override]  # SINGA's signature, not nn.Module.compile's
        self,
        inputs: Sequence[Tensor],
        is_train: bool = True,
        use_graph: bool = False,
        sequential: bool = False,
        *,
        backend: str | Callable[..., Any] = "inductor",
        trial: int | None = None,
    ) -> None:
        """Run one forward on `inputs` to initialise the model, set train/eval mode, optionally build a graph.

        With `is_train`, ``model(x, y[, dist_option, spars])`` then runs `train_one_batch`
        (SINGA's Model), while ``model(x)`` stays `forward`.

        `use_graph=True` with `is_train` and a DistOpt (`set_optimizer` first) compiles the whole
        `train_one_batch` (SINGA's graph mode, `troupe.graphstep`): the forward, the backward with
        the bucketed all-reduce inside its graph (compiled autograd, functional collectives) and
        the optimizer update; dist_options plain, fp32, fp16 and bf16. `sequential=True` runs the
        ops in program order (SINGA's meaning); False lets the compiler overlap the all-reduce with
        the backward. Without a DistOpt, or with ``is_train=False``, the forward alone is compiled.
        Where the platform cannot compile, one warning and the eager path. `backend`:
        torch.compile's ("inductor"; "aot_eager" compiles quickly and does not fuse). `trial`: with
        inductor, steps of each kind timed to choose the faster (default 5; 0 keeps the graph).
        """
        from troupe.graphstep import GraphStep, check_backend

        check_backend(backend)
        self.train(is_train)
        self._train_arity = len(inputs) if is_train else None
        self.__dict__.pop("forward", None)  # undo an earlier graph
        self.__dict__.pop("train_one_batch", None)
        with torch.no_grad():
            self(*inputs)  # through nn.Module's call: its hooks run (a sharded model gathers in them)
        if not use_graph:
            return
        if is_train and isinstance(self.optimizer, SingaMethods):
            one_batch = type(self).train_one_batch.__get__(self)
            # An instance attribute shadows the method, so model(x, y) runs the graph.
            self.train_one_batch = GraphStep(self.optimizer, self, one_batch, one_batch, returns_loss=False,
                                             sequential=sequential, backend=backend, trial=trial)
            return
        try:
            compiled = torch.compile(self.forward, **({} if backend == "inductor" else {"backend": backend}))
            with torch.no_grad():
                compiled(*inputs)
        except Exception as e:  # inductor needs a working compiler toolchain
            warnings.warn(f"use_graph=True: torch.compile failed ({type(e).__name__}: {e}); running eagerly")
        else:
            # An instance attribute shadows the method, so self.forward(x) and self(x) both use the graph.
            self.forward = compiled


def _sharded(module: nn.Module) -> bool:
    """Sharded by FSDP2 (troupe.shard): its forward must run through the module's call."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing is sharded (and no import here)
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)
