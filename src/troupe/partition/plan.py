"""Plan resolution: which `partition_dim` each layer of a model gets, and whether it can.

Pure functions of the model's structure and the plan (no process group, no tensors
moved): the partitioner calls `resolve_plan` before any collective, so every rank
rejects a bad plan the same way instead of hanging.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from troupe.util import check_int

PARTITION_DIMS = (0, 1, -1)
"""0: split the batch (replicated layer); 1: split output features; -1: one worker only."""

Plan = int | Mapping[str, int]


def is_partitionable(module: nn.Module) -> bool:
    """Is `module` a layer `partition` knows how to split or place (exactly nn.Linear or nn.Conv2d)?

    Subclasses are left alone: they may override forward (LoRA) or be read by their owner
    without being called (MultiheadAttention's out_proj).
    """
    return type(module) in (nn.Linear, nn.Conv2d)


def out_size(module: nn.Linear | nn.Conv2d) -> int:
    """The size of the dimension dim 1 splits: out_features or out_channels."""
    return module.out_features if isinstance(module, nn.Linear) else module.out_channels


def slice_rows(total: int, parts: int, index: int) -> slice:
    """The rows of a `total`-row tensor that slice `index` of `parts` equal slices holds."""
    if total % parts:
        raise ValueError(f"{total} rows do not split into {parts} equal slices")
    if not 0 <= index < parts:
        raise ValueError(f"slice index {index} is out of range for {parts} slices")
    size = total // parts
    return slice(index * size, (index + 1) * size)


def check_world(world_size: int, workers_per_group: int) -> int:
    """The number of worker groups, after checking that `workers_per_group` divides `world_size`."""
    check_int("workers_per_group", workers_per_group)
    if world_size % workers_per_group:
        raise ValueError(f"workers_per_group ({workers_per_group}) must divide the world size ({world_size})")
    return world_size // workers_per_group


def _check_dim(where: str, dim: object) -> int:
    if isinstance(dim, bool) or dim not in PARTITION_DIMS:
        raise ValueError(f"{where}: partition_dim must be one of {PARTITION_DIMS}, got {dim!r}")
    return dim  # type: ignore[return-value]


def _normalise(plan: Plan, default: int | None) -> tuple[dict[str, int], int]:
    """(glob -> dim without the "*" key, default dim), every dim checked."""
    if isinstance(plan, int) and not isinstance(plan, bool):
        if default is not None:
            raise ValueError(f"an int plan ({plan}) is itself the default; default={default} cannot be given too")
        return {}, _check_dim("plan", plan)
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be an int or a dict of module-name glob -> partition_dim, "
                        f"got {type(plan).__name__}")
    globs = {}
    for key, dim in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"plan keys must be module-name globs (str), got {key!r}")
        globs[key] = _check_dim(f"plan[{key!r}]", dim)
    star = globs.pop("*", None)
    if default is not None:
        _check_dim("default", default)
        if star is not None and star != default:
            raise ValueError(f"plan['*'] ({star}) and default ({default}) disagree")
    return globs, next(d for d in (default, star, 0) if d is not None)


def _match(name: str, globs: dict[str, int]) -> int | None:
    """The dim the plan gives module `name` itself: its exact key, else the globs matching it (which must agree)."""
    if name in globs:
        return globs[name]
    hits = {key: dim for key, dim in globs.items() if fnmatchcase(name, key)}
    if len(set(hits.values())) > 1:
        raise ValueError(f"module {name!r} matches plan keys with different partition_dims: {hits}")
    return next(iter(hits.values()), None)


def _check_layer(name: str, module: nn.Module, dim: int, workers_per_group: int) -> None:
    if dim != 1:
        return
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        raise ValueError(f"{name}: a Conv2d with groups={module.groups} cannot take partition_dim 1 "
                         "(only groups=1 splits its filters)")
    size = out_size(module)
    if size % workers_per_group:
        what = "out_features" if isinstance(module, nn.Linear) else "out_channels"
        raise ValueError(f"{name}: workers_per_group ({workers_per_group}) must divide {what} ({size}) "
                         "for partition_dim 1")


def resolve_plan(model: nn.Module, plan: Plan, workers_per_group: int, *, default: int | None = None) -> dict[str, int]:
    """partition_dim for every nn.Linear/nn.Conv2d of `model`, by qualified name, in module order.

    `plan` is one dim for every such layer, or a dict of fnmatch globs over the names of
    ``model.named_modules()`` -> dim. A layer takes the dim of its own exact name, else of
    the globs matching it, else of its nearest matched ancestor ({"classifier": 1} splits
    every layer under it), else the default ("*" or `default`, 0 when neither is given).
    Keys may also match parameterless modules (ReLU, pooling, containers): they work on
    "own samples, all features" unchanged. The root module itself is never partitioned.

    Raises ValueError, naming the values, for a key that matches no module, a dim outside
    (0, 1, -1), dim != 0 on another module with parameters, dim 1 on a grouped Conv2d or
    on a layer whose output size `workers_per_group` does not divide.
    """
    check_int("workers_per_group", workers_per_group)
    globs, fallback = _normalise(plan, default)
    named = [(name, m) for name, m in model.named_modules() if name]
    for key in globs:
        if not any(fnmatchcase(name, key) for name, _ in named):
            shown = ", ".join(name for name, _ in named[:12]) + (", ..." if len(named) > 12 else "")
            raise ValueError(f"plan key {key!r} matches no module of {type(model).__name__} (modules: {shown})")
    dims: dict[str, int] = {}
    for name, module in named:
        own = _match(name, globs)
        if not is_partitionable(module):
            if own not in (None, 0) and any(True for _ in module.parameters(recurse=False)):
                raise ValueError(f"{name} ({type(module).__name__}) cannot take partition_dim {own}: only nn.Linear "
                                 "and nn.Conv2d are partitioned")
            continue
        dim = own
        parts = name.split(".")
        while dim is None and len(parts) > 1:
            parts.pop()
            dim = _match(".".join(parts), globs)
        dim = fallback if dim is None else dim
        _check_layer(name, module, dim, workers_per_group)
        dims[name] = dim
    return dims
