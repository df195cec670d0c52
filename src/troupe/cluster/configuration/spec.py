"""What a server must know about the training job, as plain JSON: parameter sizes, dtype, optimizer.

A server holds slices of the parameters and runs the wrapped optimizer's class with its
hyper-parameters on them. Worker 0 describes both (`TrainingSpec.from_optimizer`) and the
bootstrap hands the description to every rank as JSON text, so a server process never
needs the user's script, model or optimizer object: the optimizer travels as a class path
(``torch.optim.sgd.SGD``) plus its numbers, never as pickled code. A server imports the
class by its path and accepts only subclasses of ``torch.optim.Optimizer``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_SKIPPED_KEYS = ("params", "param_names")
"""Param-group entries that are not hyper-parameters (the server's tensors are its own)."""


def _plain(value: Any, where: str) -> Any:
    """A hyper-parameter as JSON: numbers, bools, None, strings; tuples and lists as lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    raise ValueError(
        f"optimizer hyper-parameter {where} is a {type(value).__name__} ({value!r}); a parameter server gets "
        "hyper-parameters as plain numbers, bools and strings (give a float, not a Tensor)"
    )


def _restore(value: Any) -> Any:
    # torch's sequence hyper-parameters (betas, etas, step_sizes) are tuples; JSON has only lists
    return tuple(_restore(v) for v in value) if isinstance(value, list) else value


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def import_optimizer(path: str) -> type[torch.optim.Optimizer]:
    """The optimizer class named by `path` (``module.Class``); ValueError if it is not one."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"optimizer class path {path!r} has no module")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        hint = (" (a server started by `troupe run` does not run the training script: define the optimizer "
                "in a module on the PYTHONPATH)") if module == "__main__" else ""
        raise ValueError(f"cannot import the optimizer class {path!r}: {e}{hint}") from None
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise ValueError(f"{path!r} is not a torch.optim.Optimizer subclass")
    return obj


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's class, constructor defaults and per-param-group hyper-parameters (no tensors)."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: tuple[dict[str, Any], ...]
    """Hyper-parameters of each param group, in order (``lr`` among them)."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer | OptimizerSpec) -> OptimizerSpec:
        if isinstance(optimizer, OptimizerSpec):
            return optimizer
        groups = tuple({k: v for k, v in g.items() if k not in _SKIPPED_KEYS} for g in optimizer.param_groups)
        return cls(type(optimizer), dict(optimizer.defaults), groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": class_path(self.cls),
            "defaults": {k: _plain(v, f"defaults[{k!r}]") for k, v in self.defaults.items()},
            "groups": [{k: _plain(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
                       for i, g in enumerate(self.groups)],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerSpec:
        return cls(
            import_optimizer(data["class"]),
            {k: _restore(v) for k, v in data["defaults"].items()},
            tuple({k: _restore(v) for k, v in g.items()} for g in data["groups"]),
        )

    @property
    def lrs(self) -> list[float]:
        return [g["lr"] for g in self.groups]

    def build(self, tensors: Sequence[Sequence[Tensor]]) -> torch.optim.Optimizer | None:
        """This optimizer over new tensors (one list per param group; empty groups are left out)."""
        specs = [{**hyper, "params": list(ts)} for ts, hyper in zip(tensors, self.groups) if ts]
        if not specs:
            return None
        try:
            return self.cls(specs, **self.defaults)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            return self.cls(specs)


@dataclass(frozen=True)
class TrainingSpec:
    """Everything a server needs: the trainable parameters' sizes and dtype, their param groups, the optimizer."""

    numels: tuple[int, ...]
    dtype: torch.dtype
    param_group_of: tuple[int, ...]
    optimizer: OptimizerSpec = field(repr=False)
    owners: tuple[int | None, ...] = ()
    """Per parameter, under a partitioned model (`troupe.cluster.workers.layout`): the index inside each
    worker group of the one worker holding it (a dim-1 slice, a dim -1 layer), or None where every
    worker of the group holds it. Empty: nothing is partitioned."""

    def owner(self, param: int) -> int | None:
        return self.owners[param] if self.owners else None

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, params: Sequence[Tensor],
                       param_group_of: Sequence[int]) -> TrainingSpec:
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(f"parameter servers hold one dtype, but the trainable parameters have {dtypes}")
        dtype = params[0].dtype if params else torch.float32
        return cls(tuple(p.numel() for p in params), dtype, tuple(param_group_of), OptimizerSpec.of(optimizer))

    def to_json(self) -> str:
        return json.dumps({"numels": list(self.numels), "dtype": str(self.dtype).removeprefix("torch."),
                           "param_group_of": list(self.param_group_of), "optimizer": self.optimizer.to_dict(),
                           "owners": list(self.owners)})

    @classmethod
    def from_json(cls, text: str) -> TrainingSpec:
        data = json.loads(text)
        dtype = getattr(torch, data["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown parameter dtype {data['dtype']!r}")
        owners = tuple(None if o is None else int(o) for o in data.get("owners", []))
        if owners and len(owners) != len(data["numels"]):
            raise ValueError(f"{len(owners)} owners for {len(data['numels'])} parameters")
        return cls(tuple(int(n) for n in data["numels"]), dtype, tuple(int(g) for g in data["param_group_of"]),
                   OptimizerSpec.from_dict(data["optimizer"]), owners)
