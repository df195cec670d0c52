"""Layer profiles: what the cost model needs to know about a model, measured on this machine.

For every nn.Linear / nn.Conv2d the forward reaches (in the order it reaches them): its
parameter count, activation elements per sample in and out, and forward+backward seconds
on n samples with all or 1/k of its outputs; for everything else (ReLU, pooling, norms,
...) one replicated compute time and parameter count. `profile_model` measures them
(median of repetitions after a warm-up, one torch thread by default) on copies, so the
model, its gradients and the RNG are left as they were; tests build `ModelProfile`s by hand.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from troupe.partition.plan import _check_layer, is_partitionable, out_size
from troupe.util import check_int


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One partitionable layer (nn.Linear or nn.Conv2d) as forward uses it."""

    name: str
    kind: str
    """'Linear' or 'Conv2d'."""
    params: int
    in_elems: int
    """Input activation elements per sample (A_in)."""
    out_elems: int
    """Output activation elements per sample (A_out)."""
    out_size: int
    """out_features or out_channels: what dim 1 splits."""
    times: Mapping[tuple[int, int], float]
    """(samples, parts) -> forward+backward seconds with out_size / parts outputs."""
    splittable: bool = True
    """False for a grouped Conv2d (resolve_plan refuses dim 1 for it)."""
    input_grad: bool = True
    """Does backward need the gradient of this layer's input (False for the model's first layer)?"""
    calls: int = 1
    """Times one forward calls the layer (each call pays its compute and exchanges)."""
    shapes: tuple[tuple[int, ...], ...] | None = None
    """Its parameters' shapes, for options that treat each tensor by its shape (powerSGD compresses
    matrices, sends vectors whole); None when not known (hand-built profiles)."""

    def __post_init__(self) -> None:
        _check_shapes(self.name, self.shapes, self.params)

    def compute(self, samples: int, parts: int = 1) -> float:
        """Forward+backward seconds of one call on `samples` rows with 1/`parts` of the outputs."""
        try:
            return self.times[(samples, parts)]
        except KeyError:
            raise ValueError(f"{self.name}: no time profiled for {samples} samples with 1/{parts} of its outputs "
                             f"(profiled (samples, parts): {sorted(self.times)})") from None

    def allows_dim1(self, workers_per_group: int) -> bool:
        """Can dim 1 split this layer over `workers_per_group` workers (the runtime's rule)?"""
        return workers_per_group > 1 and self.splittable and self.out_size % workers_per_group == 0

    def dims(self, workers_per_group: int) -> tuple[int, ...]:
        """The partition_dims worth searching for group size k (k = 1: only 0; they all compute alike)."""
        if workers_per_group == 1:
            return (0,)
        return (0, 1, -1) if self.allows_dim1(workers_per_group) else (0, -1)


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A model's partitionable layers in forward order, plus everything replicated."""

    batch: int
    """b: samples per worker (the group batch is k * b)."""
    layers: tuple[LayerProfile, ...]
    replicated_params: int = 0
    """Parameters outside the partitionable layers (norms, embeddings): always data parallel."""
    replicated_seconds: float = 0.0
    """Forward+backward seconds of everything but the partitionable layers, on b samples."""
    replicated_shapes: tuple[tuple[int, ...], ...] | None = None
    """Shapes of the replicated parameters (see `LayerProfile.shapes`); None when not known."""
    unused: tuple[str, ...] = ()
    """Partitionable layers forward never called (they cost nothing; planned as dim 0)."""
    bytes_per_element: int = 4
    model: str = ""

    def __post_init__(self) -> None:
        check_int("batch", self.batch)
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names repeat: {names}")
        _check_shapes("replicated parameters", self.replicated_shapes, self.replicated_params)

    @property
    def shapes_known(self) -> bool:
        """Are every parameter's shapes recorded (as `profile_model` does)?"""
        return self.replicated_shapes is not None and all(layer.shapes is not None for layer in self.layers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)


def _check_shapes(what: str, shapes: Sequence[Sequence[int]] | None, params: int) -> None:
    if shapes is not None and sum(math.prod(shape) for shape in shapes) != params:
        raise ValueError(f"{what}: shapes {list(shapes)} hold {sum(math.prod(s) for s in shapes)} elements, "
                         f"not the {params} parameters given")


def proportional_times(seconds_per_sample: float, batch: int, ks: Sequence[int]) -> dict[tuple[int, int], float]:
    """Times of a layer whose cost is linear in samples and outputs (for tests and what-if plans)."""
    times = {(batch, 1): seconds_per_sample * batch}
    for k in ks:
        times[(k * batch, 1)] = seconds_per_sample * k * batch
        times[(k * batch, k)] = seconds_per_sample * batch
    return times


@dataclass
class _Seen:
    """What the recording forward saw of one layer."""

    module: nn.Module
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: torch.dtype
    input_grad: bool
    calls: int = 0


@dataclass
class _Timer:
    reps: int
    warmup: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def median(self, fn: Callable[[], None]) -> float:
        """Median seconds of `fn` over `reps` runs after `warmup` untimed ones."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _tensors(obj: object) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _backward_all(out: object) -> None:
    """Backward from every floating output that needs a gradient (as a loss on them would)."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward([t.float().sum() for t in outs])


def _record(model: nn.Module, sample: Tensor) -> dict[str, _Seen]:
    """Run forward+backward once with hooks on every partitionable layer: shapes, order, calls."""
    seen: dict[str, _Seen] = {}
    handles = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if name not in seen:
                x = args[0]
                seen[name] = _Seen(module, tuple(x.shape), tuple(output.shape), x.dtype, x.requires_grad)
            seen[name].calls += 1

        return hook

    for name, module in model.named_modules():
        if name and is_partitionable(module):
            handles.append(module.register_forward_hook(hook_for(name)))
    try:
        _backward_all(model(sample))
    except Exception as e:
        raise ValueError(f"profiling {type(model).__name__}'s forward on input of shape {tuple(sample.shape)} "
                         f"failed: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    return seen


def _sliced(layer: nn.Module, parts: int) -> nn.Module:
    """A fresh layer like `layer` with 1/`parts` of its outputs (a copy when parts == 1)."""
    if parts == 1:
        return copy.deepcopy(layer)
    p = layer.weight
    bias = layer.bias is not None
    if isinstance(layer, nn.Linear):
        return nn.Linear(layer.in_features, layer.out_features // parts, bias, device=p.device, dtype=p.dtype)
    return nn.Conv2d(layer.in_channels, layer.out_channels // parts, layer.kernel_size, layer.stride,
                     layer.padding, layer.dilation, layer.groups, bias, layer.padding_mode,
                     device=p.device, dtype=p.dtype)


def _time_layer(seen: _Seen, samples: int, parts: int, timer: _Timer) -> float:
    layer = _sliced(seen.module, parts)
    x = torch.randn((samples, *seen.in_shape[1:]), dtype=seen.dtype, device=timer.device,
                    requires_grad=seen.input_grad)
    grad = torch.ones_like(layer(x))

    def step() -> None:
        layer(x).backward(grad)

    return timer.median(step)


def _layer_profile(name: str, seen: _Seen, batch: int, ks: Sequence[int], timer: _Timer) -> LayerProfile:
    module = seen.module
    try:
        _check_layer(name, module, 1, 1)  # the runtime's own rule (grouped Conv2d) with a k that divides
        splittable = True
    except ValueError:
        splittable = False
    size = out_size(module)
    shapes = {(batch, 1)}
    for k in ks:
        if k > 1:
            shapes.add((k * batch, 1))
            if splittable and size % k == 0:
                shapes.add((k * batch, k))
    times = {shape: _time_layer(seen, *shape, timer) for shape in sorted(shapes)}
    return LayerProfile(
        name=name, kind=type(module).__name__, params=sum(p.numel() for p in module.parameters()),
        in_elems=math.prod(seen.in_shape[1:]), out_elems=math.prod(seen.out_shape[1:]), out_size=size,
        times=times, splittable=splittable, input_grad=seen.input_grad, calls=seen.calls,
        shapes=tuple(tuple(p.shape) for p in module.parameters()))


def profile_model(
    model: nn.Module,
    sample: Tensor,
    workers_per_group: Sequence[int],
    *,
    reps: int = 5,
    warmup: int = 1,
    threads: int | None = 1,
) -> ModelProfile:
    """Measure `model`'s layers on this machine for each group size in `workers_per_group`.

    `sample` is one worker's batch (b = sample.shape[0]). Works on a deep copy, inside a
    forked RNG, with `threads` torch threads (None: leave the setting), so the caller's
    model, gradients and random state are untouched.
    """
    check_int("reps", reps)
    check_int("warmup", warmup, minimum=0)
    ks = sorted({check_int("workers_per_group", k) for k in workers_per_group})
    batch = check_int("batch (sample.shape[0])", sample.shape[0] if sample.dim() else 0)
    old_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(check_int("threads", threads))
        with torch.random.fork_rng(devices=[]):
            return _profile(copy.deepcopy(model), sample, batch, ks, _Timer(reps, warmup, sample.device))
    finally:
        torch.set_num_threads(old_threads)


def _profile(model: nn.Module, sample: Tensor, batch: int, ks: list[int], timer: _Timer) -> ModelProfile:
    seen = _record(model, sample)
    layers = tuple(_layer_profile(name, s, batch, ks, timer) for name, s in seen.items())

    def whole() -> None:
        _backward_all(model(sample))

    total = timer.median(whole)
    own = sum(layer.compute(batch) * layer.calls for layer in layers)
    unused = tuple(n for n, m in model.named_modules() if n and is_partitionable(m) and n not in seen)
    params = list(model.parameters())
    owned = {id(p) for s in seen.values() for p in s.module.parameters()}
    replicated = sum(p.numel() for p in params) - sum(layer.params for layer in layers)
    shapes = tuple(tuple(p.shape) for p in params if id(p) not in owned)
    if sum(math.prod(shape) for shape in shapes) != replicated:  # weights shared between layers: counts disagree
        shapes = None
    return ModelProfile(
        batch=batch, layers=layers,
        # unused layers stay dim 0: their parameters join the data-parallel reduction
        replicated_params=replicated,
        replicated_seconds=max(total - own, 0.0),
        replicated_shapes=shapes,
        unused=unused,
        bytes_per_element=params[0].element_size() if params else 4,
        model=type(model).__name__)
