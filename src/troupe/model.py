"""troupe.Model: a torch.nn.Module with SINGA's training-facing methods."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from troupe.distopt import DistOpt


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
        self.optimizer: DistOpt | torch.optim.Optimizer | None = None
        self._train_arity: int | None = None  # set by compile(is_train=True): forward's input count

    def __call__(self, *args, **kwargs):
        """SINGA's rule: after ``compile(inputs, is_train=True)``, a call with more positional
        arguments than `inputs` (``model(x, y)``, ``model(x, y, dist_option, spars)``) runs
        `train_one_batch`; any other call is `forward`, as in torch."""
        if self._train_arity is not None and len(args) > self._train_arity:
            return self.train_one_batch(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def set_optimizer(self, optimizer: DistOpt | torch.optim.Optimizer) -> None:
        """Attach the optimizer; a DistOpt also copies rank 0's parameters and buffers to every rank."""
        if not isinstance(optimizer, (DistOpt, torch.optim.Optimizer)):
            raise TypeError(f"set_optimizer takes a DistOpt or torch optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        if isinstance(optimizer, DistOpt):
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
    ) -> None:
        """Run one forward on `inputs` to initialise the model, set train/eval mode, optionally build a graph.

        With `is_train`, ``model(x, y[, dist_option, spars])`` then runs `train_one_batch`
        (SINGA's Model), while ``model(x)`` stays `forward`.

        `use_graph=True` runs the forward through `torch.compile` (SINGA's graph mode);
        where the platform cannot compile, it warns and stays eager. `sequential` is
        accepted for SINGA compatibility (PyTorch always runs ops in program order).
        """
        self.train(is_train)
        self._train_arity = len(inputs) if is_train else None
        self.__dict__.pop("forward", None)  # undo an earlier graph
        with torch.no_grad():
            self.forward(*inputs)
        if use_graph:
            try:
                compiled = torch.compile(self.forward)
                with torch.no_grad():
                    compiled(*inputs)
            except Exception as e:  # inductor needs a working compiler toolchain
                warnings.warn(f"use_graph=True: torch.compile failed ({type(e).__name__}: {e}); running eagerly")
            else:
                # An instance attribute shadows the method, so self.forward(x) and self(x) both use the graph.
                self.forward = compiled
