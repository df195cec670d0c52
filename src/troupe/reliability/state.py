"""A model and its optimizer as named tensors (what DCP stores) plus the small rest (what it must not).

`named_state` flattens ``model.state_dict()`` and the wrapped torch optimizer's state into
``model.<fqn>`` / ``optim.<fqn>.<key>`` tensors, keyed by parameter name, so the same keys
exist on every rank of any world size; what is not a tensor (param_groups, scalar state)
goes into the rank's small torch.save file. `fingerprints` says which tensors every rank
holds identically (saved once) and which differ (saved per rank). Only tensors reach DCP:
its non-tensor values are read back with ``torch.load(weights_only=False)``, and its
``.metadata`` file is read here with an unpickler that builds nothing but DCP's own records.

torch's ``get_optimizer_state_dict`` is not used: on an optimizer without state it runs a
zero-gradient ``step()`` first (Adam then starts from step 1), changing what it saves.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata


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


_DCP_MODULE = "torch.distributed.checkpoint."
_SAFE_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "bytearray", "int", "float", "bool", "str"}
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                 ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
                 ("torch.serialization", "_get_layout")}  # a layout by its name


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and torch sizes/dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_MODULE) or module == "torch.distributed.checkpoint":
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        if module == "torch":
            found = getattr(torch, name, None)
            if name == "Size" or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        if (module, name) in _SAFE_GLOBALS or (module == "builtins" and name in _SAFE_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused (not DCP metadata)")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with `_MetadataUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        name = ".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata"
        data = (Path(self.path) / name).read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor in the DCP checkpoint at `path`: key -> (shape, dtype)."""
    metadata = SafeReader(path).read_metadata()
    return {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}
