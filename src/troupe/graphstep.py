"""Graph mode: the whole training step compiled, the all-reduce inside the graph (SINGA's use_graph).

A `GraphStep` runs one step as three compiled pieces and nothing eager in between but
bookkeeping:

1. the forward and the loss (``torch.compile`` of the user's `train_one_batch`, or of a
   loss function for a plain module), with every parameter passed through its bucket's
   `BucketGate` (`troupe.sync.ingraph`);
2. the backward, recorded by compiled autograd: the gates' backward puts each bucket's
   reduction, as functional collectives, where autograd finishes the bucket's gradients;
   with ``sequential=False`` inductor may move the waits later (overlap), with
   ``sequential=True`` every op runs in program order (SINGA's meaning);
3. the wrapped optimizer's update (``torch.compile(optimizer.step)``), after DistOpt's
   nan_policy check.

Where the platform cannot compile (no C compiler for inductor, an unsupported Python, a
model dynamo cannot trace), the first step warns once and this and every later step run
eagerly through the DistOpt, exactly as without graph mode.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from troupe.sync.bucket import plan_buckets
from troupe.sync.compiled import unsplit
from troupe.sync.ingraph import CODECS, Codec, InGraphReduce, gate

if TYPE_CHECKING:
    from troupe.distopt import DistOpt

BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends graph mode accepts (aot_eager: traced graphs run op by op, fast to build)."""


def check_backend(backend: object) -> None:
    """A ValueError unless `backend` is one of `BACKENDS` or a backend function."""
    if not callable(backend) and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or a torch.compile backend function, got {backend!r}")


class GraphCompileWarning(UserWarning):
    """Graph mode could not compile on this platform and runs eagerly."""


class UpdateCall:
    """Stands in for the DistOpt while the compiled forward runs: SINGA's update methods only note
    the loss and the dist_option (the backward and the update follow outside the forward's graph)."""

    def __init__(self) -> None:
        self.loss: Tensor | None = None
        self.codec = Codec()

    def update(self, loss: Tensor, dist_option: str = "plain", spars: float | None = None) -> None:
        if dist_option in ("plain", "fp32"):
            self.backward_and_update(loss)
        elif dist_option in ("fp16", "bf16"):
            self.backward_and_update_half(loss, dtype=dist_option)
        else:
            raise ValueError(f"graph mode reduces with one of {CODECS} (and fp32), not dist_option {dist_option!r}; "
                             "compile with use_graph=False for the other options")

    def backward_and_update(self, loss: Tensor) -> None:
        self.loss, self.codec = loss, Codec("plain")

    __call__ = backward_and_update

    def backward_and_update_half(self, loss: Tensor, clipping: bool = False, clip_value: float = 100,
                                 dtype: str = "fp16") -> None:
        self.loss, self.codec = loss, Codec(dtype, clip_value if clipping else None)

    def backward_and_partial_update(self, loss: Tensor) -> None:
        raise ValueError("graph mode does not run backward_and_partial_update; compile with use_graph=False")

    def backward_and_sparse_update(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        raise ValueError("graph mode does not run backward_and_sparse_update; compile with use_graph=False")


class GraphStep:
    """One training step compiled whole: forward, backward with the bucketed all-reduce in its graph, update.

    Built by ``Model.compile(..., use_graph=True)`` (calls run the model's `train_one_batch`)
    and by ``DistOpt.compile_step(model, loss_fn)`` (calls return ``loss_fn(*batch)`` after
    the update).

    Args:
        forward: the step up to the loss. With `returns_loss` it returns the loss; otherwise
            it calls SINGA's update on ``model.optimizer`` (which, while it runs, only notes
            the loss and the dist_option) and its result is returned as it is.
        eager: the same step without graph mode (used after a failed compile).
        dist_option: the codec when `forward` returns the loss ("plain", "fp32", "fp16", "bf16").
        backend: the torch.compile backend: "inductor", "aot_eager" (builds quickly, no fusion), "eager",
            or a backend function (a test's, to look at the graphs).
    """

    def __init__(self, sgd: DistOpt, model: nn.Module, forward: Callable[..., Any], eager: Callable[..., Any], *,
                 returns_loss: bool, dist_option: str = "plain", sequential: bool = False,
                 backend: str | Callable[..., Any] = "inductor"):
        check_backend(backend)
        sgd.check_graph_mode()
        if returns_loss and dist_option not in ("plain", "fp32", "fp16", "bf16"):
            raise ValueError(f"graph mode reduces with plain, fp32, fp16 or bf16, not dist_option {dist_option!r}")
        if not isinstance(sequential, bool):
            raise TypeError(f"sequential must be a bool, got {sequential!r}")
        self.sgd, self.model, self.eager = sgd, model, eager
        self.returns_loss, self.sequential, self.backend = returns_loss, sequential, backend
        self.codec = Codec("plain" if dist_option == "fp32" else dist_option)
        self.failed: BaseException | None = None
        """Why graph mode fell back to eager (None while it runs compiled)."""
        self.steps = 0
        owned = {id(p) for p in model.parameters()}
        params = list({id(p): p for g in sgd.param_groups for p in g["params"] if p.requires_grad}.values())
        strangers = [sgd.param_name(p) for p in params if id(p) not in owned]
        if strangers:
            raise ValueError(f"graph mode needs every parameter of the optimizer in the model; not in it: "
                             f"{strangers[:5]}")
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._buckets = [[params[j] for j in members]
                         for members in plan_buckets(params, sgd.bucket_size, sgd.first_bucket_size)]
        self._reduce: InGraphReduce | None = None
        if sgd.world_size > 1:
            group = sgd.communicator.group or torch.distributed.group.WORLD
            self._reduce = InGraphReduce(group.group_name, sgd.world_size, self.codec)
        self._call = UpdateCall()
        self._forward = torch.compile(forward, **self._compile_args())
        self._update = torch.compile(sgd.optimizer.step, **self._compile_args())

    def _compile_args(self) -> dict[str, Any]:
        if callable(self.backend) or self.backend != "inductor":
            return {"backend": self.backend}
        passes = [] if self.sequential else ["sink_waits", "raise_comms"]
        return {"backend": "inductor", "options": {"reorder_for_compute_comm_overlap": not self.sequential,
                                                   "reorder_for_compute_comm_overlap_passes": passes,
                                                   "reorder_for_peak_memory": not self.sequential}}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            try:
                with unsplit():  # this graph reduces inside itself: no DDPOptimizer pieces
                    return self._step(*args, **kwargs)
            except Exception as e:
                if not _is_compile_failure(e) or self.steps > 0:
                    raise
                self.failed = e
                warnings.warn(f"graph mode: torch.compile failed on this platform ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); running eagerly",
                              GraphCompileWarning, stacklevel=2)
                self.sgd.zero_grad()
        return self.eager(*args, **kwargs)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        sgd = self.sgd
        sgd.zero_grad()
        self._call.loss = None
        compiled_autograd = torch._dynamo.compiled_autograd._enable(
            functools.partial(torch.compile, **self._compile_args()))
        with compiled_autograd, sgd.no_sync():
            with self._gated(), self._standing_in():
                result = self._forward(*args, **kwargs)
            loss, codec = (result, self.codec) if self.returns_loss else (self._call.loss, self._call.codec)
            if loss is None:
                raise RuntimeError(f"graph mode: {type(self.model).__name__}.train_one_batch made no update call "
                                   "(self.optimizer.update(loss, ...) or backward_and_update(loss))")
            if self._reduce is not None:
                self._reduce.codec = codec  # read by the gates' backward
            loss.backward()
        sgd.apply_reduced(self._update)
        self.steps += 1
        return result.detach() if self.returns_loss else result

    @contextmanager
    def _gated(self) -> Iterator[None]:
        """The model's parameters replaced, for the forward, by their gates' outputs."""
        if self._reduce is None:
            yield
            return
        from torch.nn.utils.stateless import _reparametrize_module

        gated = gate(self._buckets, self._reduce)
        with _reparametrize_module(self.model, {self._names[i]: t for i, t in gated.items()}):
            yield

    def _standing_in(self) -> Any:
        """``model.optimizer`` is the `UpdateCall` while a train_one_batch runs."""
        if self.returns_loss:
            return nullcontext()
        return _swapped(self.model, "optimizer", self._call)


@contextmanager
def _swapped(obj: object, name: str, value: object) -> Iterator[None]:
    before = obj.__dict__[name]
    obj.__dict__[name] = value
    try:
        yield
    finally:
        obj.__dict__[name] = before


def _is_compile_failure(e: BaseException) -> bool:
    """Did torch.compile fail to build the step (no C compiler, dynamo cannot trace), rather than the
    model fail to run (a shape error in the forward is the user's, raised again eagerly)?"""
    from torch._dynamo import exc

    if isinstance(e, (exc.TorchRuntimeError, exc.UserError)):
        return False
    return isinstance(e, (exc.BackendCompilerFailed, exc.Unsupported, exc.InternalTorchDynamoError)) or \
        type(e).__module__.startswith("torch._inductor")
