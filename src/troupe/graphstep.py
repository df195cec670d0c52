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

Graph mode must pay: a small model's compiled step can be slower than the eager one (the MNIST
CNN's was 1.23x on this CPU). So with inductor, after `WARMUP_STEPS` compiled steps (they
compile), the next 2 x `trial` steps alternate compiled and eager steps, timed (the two give
the same update: tests/dist/test_graph_mode.py); the slowest rank's median of each decides, the
same on every rank, and a step that is not faster compiled runs eagerly from then on, with
a one-line `GraphSlowerWarning` saying the two times. ``trial=0`` keeps the compiled step.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from troupe.strategies import registry
from troupe.sync.compiled import unsplit
from troupe.sync.ingraph import Codec, InGraphReduce, gate

BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends graph mode accepts (aot_eager: traced graphs run op by op, fast to build)."""


def check_backend(backend: object) -> None:
    """A ValueError unless `backend` is one of `BACKENDS` or a backend function."""
    if not callable(backend) and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or a torch.compile backend function, got {backend!r}")


class GraphCompileWarning(UserWarning):
    """Graph mode could not compile on this platform and runs eagerly."""


class GraphSlowerWarning(UserWarning):
    """Graph mode's compiled step was not faster than the eager one here: it runs eagerly."""


WARMUP_STEPS = 2
"""Compiled steps before the trial: the first compiles (forward, compiled autograd, update)."""
TRIAL_STEPS = 5
"""Default steps of each kind (compiled, eager) the trial times, with inductor."""


@dataclass(frozen=True)
class GraphPlan:
    """What a step is compiled over: the trainable parameters in their buckets, and where they are reduced."""

    params: list[Tensor]
    buckets: list[list[Tensor]]
    """The parameters in reduction buckets (each bucket's gradients are reduced together in the graph)."""
    world_size: int
    group: Any
    """The process group the gradients are reduced over (None in a world of one: the WORLD)."""
    name_of: Callable[[Tensor], str]
    optimizer_step: Callable[[], Any]
    """The wrapped optimizer's step (compiled as the update)."""


class GraphHost(Protocol):
    """All graph mode needs of the optimizer it compiles a step for (`troupe.DistOpt` is one)."""

    def graph_plan(self) -> GraphPlan:
        """The step's parameters and buckets; raises ValueError where graph mode cannot run."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A block whose backward leaves gradients to the graph (no eager reduction)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def update(self, loss: Tensor, dist_option: str = "plain") -> None:
        """SINGA's eager update (the step without graph mode, after a failed compile)."""

    def step(self) -> Any:
        """The PyTorch loop's update, after ``loss.backward()``, with the optimizer's own dist_option."""

    @property
    def strategy(self) -> Any:
        """The update strategy the PyTorch loop steps with (its ``name``: the dist_option)."""

    def apply_reduced(self, update: Callable[[], Any]) -> None:
        """The update after the graph's reduction: nan_policy, then `update`, then count the step."""


def compile_step(host: GraphHost, model: nn.Module, loss_fn: Callable[..., Tensor], *, dist_option: str = "plain",
                 sequential: bool = False, backend: str | Callable[..., Any] = "inductor",
                 trial: int | None = None) -> GraphStep:
    """Graph mode for a plain module and a loss function (`troupe.DistOpt.compile_step`)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")

    own = registry.lookup(dist_option).name == host.strategy.name

    def eager(*batch: Any) -> Tensor:
        loss = loss_fn(*batch)
        if own:  # the PyTorch loop: the step's agreement rides in the buckets, no exchange of its own
            host.zero_grad()  # a compiled step leaves its gradients
            loss.backward()
            host.step()
        else:  # another dist_option than the optimizer's, chosen for this call (SINGA's update)
            host.update(loss, dist_option)
        return loss.detach()

    return GraphStep(host, model, loss_fn, eager, returns_loss=True, dist_option=dist_option,
                     sequential=sequential, backend=backend, trial=trial)


class UpdateCall:
    """Stands in for the DistOpt while the compiled forward runs: SINGA's update methods only note
    the loss and the dist_option (the backward and the update follow outside the forward's graph)."""

    def __init__(self) -> None:
        self.loss: Tensor | None = None
        self.codec = Codec()

    def update(self, loss: Tensor, dist_option: str = "plain", spars: float | None = None) -> None:
        regime = registry.lookup(dist_option)
        if not regime.supports.graph_mode:
            raise ValueError(f"graph mode reduces with one of {registry.graph_options()}, not dist_option "
                             f"{dist_option!r}; compile with use_graph=False for the other options")
        getattr(self, regime.method)(loss, **regime.fixed_args)

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

    def backward_and_powerSGD_update(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        raise ValueError("graph mode does not run backward_and_powerSGD_update; compile with use_graph=False")


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
        trial: steps of each kind timed to choose between the compiled and the eager step (default
            `TRIAL_STEPS` with inductor, 0 with another backend; 0 keeps the compiled step).
        clock: seconds, for the trial (a test's, to decide the trial).
    """

    def __init__(self, sgd: GraphHost, model: nn.Module, forward: Callable[..., Any], eager: Callable[..., Any], *,
                 returns_loss: bool, dist_option: str = "plain", sequential: bool = False,
                 backend: str | Callable[..., Any] = "inductor", trial: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        check_backend(backend)
        if trial is None:
            trial = TRIAL_STEPS if backend == "inductor" else 0
        if isinstance(trial, bool) or not isinstance(trial, int) or trial < 0:
            raise ValueError(f"trial must be an integer >= 0 (steps of each kind), got {trial!r}")
        plan = sgd.graph_plan()
        if returns_loss and dist_option not in registry.graph_options():
            raise ValueError(f"graph mode reduces with {', '.join(registry.graph_options())}, not dist_option "
                             f"{dist_option!r}")
        if not isinstance(sequential, bool):
            raise TypeError(f"sequential must be a bool, got {sequential!r}")
        self.sgd, self.model, self.eager = sgd, model, eager
        self.returns_loss, self.sequential, self.backend = returns_loss, sequential, backend
        self.codec = Codec(registry.lookup(dist_option).name)
        self.failed: BaseException | None = None
        """Why graph mode fell back to eager (None while it runs compiled)."""
        self.trial, self.clock = trial, clock
        self.chosen: str | None = None if trial else "compiled"
        """"compiled" or "eager": what the trial chose (None until it has)."""
        self.timings: dict[str, list[float]] = {"compiled": [], "eager": []}
        """The trial's step times, seconds, this rank's."""
        self.calls = 0
        self.steps = 0
        owned = {id(p) for p in model.parameters()}
        strangers = [plan.name_of(p) for p in plan.params if id(p) not in owned]
        if strangers:
            raise ValueError(f"graph mode needs every parameter of the optimizer in the model; not in it: "
                             f"{strangers[:5]}")
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._buckets = plan.buckets
        self._reduce: InGraphReduce | None = None
        if plan.world_size > 1:
            group = plan.group or torch.distributed.group.WORLD
            self._reduce = InGraphReduce(group.group_name, plan.world_size, self.codec)
        self._call = UpdateCall()
        self._forward = torch.compile(forward, **self._compile_args())
        self._update = torch.compile(plan.optimizer_step, **self._compile_args())
        self._group = (plan.group or torch.distributed.group.WORLD) if plan.world_size > 1 else None

    def _compile_args(self) -> dict[str, Any]:
        if callable(self.backend) or self.backend != "inductor":
            return {"backend": self.backend}
        passes = [] if self.sequential else ["sink_waits", "raise_comms"]
        return {"backend": "inductor", "options": {"reorder_for_compute_comm_overlap": not self.sequential,
                                                   "reorder_for_compute_comm_overlap_passes": passes,
                                                   "reorder_for_peak_memory": not self.sequential}}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kind = self._kind()
        self.calls += 1
        start = self.clock()
        if kind == "compiled":
            try:
                with unsplit():  # this graph reduces inside itself: no DDPOptimizer pieces
                    result = self._step(*args, **kwargs)
            except Exception as e:
                if not _is_compile_failure(e) or self.steps > 0:
                    raise
                self.failed = e
                warnings.warn(f"graph mode: torch.compile failed on this platform ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); running eagerly",
                              GraphCompileWarning, stacklevel=2)
                self.sgd.zero_grad()
                return self.eager(*args, **kwargs)
        else:
            result = self.eager(*args, **kwargs)
        if self.chosen is None and self.failed is None and self.calls > WARMUP_STEPS:
            self.timings[kind].append(self.clock() - start)
            if len(self.timings["eager"]) == len(self.timings["compiled"]) == self.trial:
                self._decide()
        return result

    def _kind(self) -> str:
        """This call's step: compiled, but eager after a failed compile or a trial that chose it, and
        every other step of the trial (the order of each pair swapped every pair)."""
        if self.failed is not None or self.chosen == "eager":
            return "eager"
        done = self.calls - WARMUP_STEPS
        if self.chosen is not None or done < 0:
            return "compiled"
        return ("compiled", "eager")[(done // 2 + done % 2) % 2]

    def _decide(self) -> None:
        """Keep the compiled step only if the slowest rank's median compiled step beats its median eager one."""
        medians = [statistics.median(self.timings[k]) for k in ("compiled", "eager")]
        if self._group is not None:  # every rank must take the same step: the slowest counts
            both = torch.tensor(medians, dtype=torch.float64)
            torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MAX, group=self._group)
            medians = both.tolist()
        compiled, eager = medians
        self.chosen = "compiled" if compiled < eager else "eager"
        if self.chosen == "eager":
            warnings.warn(f"graph mode: the compiled step took {compiled * 1e3:.1f} ms, the eager one "
                          f"{eager * 1e3:.1f} ms (median of {self.trial} steps each, slowest rank): running eagerly",
                          GraphSlowerWarning, stacklevel=3)

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
