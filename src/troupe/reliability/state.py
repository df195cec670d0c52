"""A model and its optimizer as named tensors (what DCP stores) plus the small rest (what it must not).

`named_state` flattens ``model.state_dict()`` and the wrapped torch optimizer's state into
``model.<fqn>`` / ``optim.<fqn>.<key>`` tensors, keyed by parameter name, so the same keys
exist on every rank of any world size; what is not a tensor (param_groups, scalar state)
goes into the rank's small torch.save file. `fingerprints` says which tensors every rank
holds identically (saved once) and which differ (saved per rank). Only tensors reach DCP:
its non-tensor values are read back with ``torch.load(weights_only=False)``, and its
``.metadata`` file is read with an unpickler that builds nothing but DCP's own records
(`troupe.reliability.dcp_files`).

torch's ``get_optimizer_state_dict`` is not used: on an optimizer without state it runs a
zero-gradient ``step()`` first (Adam then starts from step 1), changing what it saves.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor, nn


def unwrap(optimizer) -> tuple[torch.optim.Optimizer, bool]:
    """(the torch optimizer, whether `optimizer` is a wrapper such as DistOpt holding it)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner, True
    return optimizer, False


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by their model names (``param[i]``, by position, when not in the model)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [names.get(id(p), f"param[{i}]") for i, p in enumerate(params)]


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors for DCP, the optimizer's non-tensor rest) of `model` and the torch `optimizer`."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    names = param_names(model, optimizer)
    sd = optimizer.state_dict()
    index: dict[str, tuple[str, str]] = {}
    other: dict[str, dict[str, Any]] = {}
    for i, state in sd["state"].items():
        for k, v in state.items():
            if isinstance(v, Tensor):
                key = f"optim.{names[i]}.{k}"
                tensors[key], index[key] = v, (names[i], k)
            else:
                other.setdefault(names[i], {})[k] = v
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, {"param_names": names, "param_groups": groups, "optim_index": index, "optim_other": other}


def optimizer_state(names: list[str], rest: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """The torch optimizer state_dict (by position in `names`) from `named_state`'s parts."""
    position = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, (name, k) in rest["optim_index"].items():
        state.setdefault(position[name], {})[k] = tensors[key]
    for name, values in rest["optim_other"].items():
        state.setdefault(position[name], {}).update(values)
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in rest["param_groups"]]
    return {"state": state, "param_groups": groups}


def fingerprints(tensors: dict[str, Tensor]) -> dict[str, str]:
    """A digest of each tensor's shape, dtype and bytes (equal on two ranks: the same tensor)."""
    out = {}
    for key, t in tensors.items():
        h = hashlib.blake2b(f"{tuple(t.shape)} {t.dtype}".encode(), digest_size=16)
        flat = t.detach().reshape(-1).cpu().contiguous()
        h.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
        out[key] = h.hexdigest()
    return out
