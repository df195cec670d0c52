"""DCP's files read safely: its ``.metadata`` through an unpickler that builds only DCP's records.

Imported when a checkpoint is saved or loaded, not with ``import troupe``:
``torch.distributed.checkpoint`` takes about a second to import, which every rank of every
job would otherwise pay.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

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
