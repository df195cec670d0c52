"""Optimizer state cut over the ranks, checkpointed as slices of whole parameters, so that it reshards.

Three kinds of optimizer parameter hold a model parameter's elements: the parameter itself
(plain DistOpt), a flat range of its elements (``DistOpt(shard=...)``: a part, cut by the
gradient buckets), or its DTensor (``troupe.shard``: FSDP2's rows on dim 0). Each is a `Piece`:
a contiguous range ``[start, stop)`` of the parameter's flattened elements. A checkpoint keys
every state tensor by the parameter's name, as an unsharded optimizer would: a part's state is
saved as its chunk of the flattened parameter (`Chunks`, read by DCP like a DTensor's local
shard), a DTensor's as the DTensor. Loading asks DCP for the range each of this rank's pieces
holds, whatever the writer's layout was: DCP reads the overlap from every writer's files.

The structure a sharded DistOpt describes itself with (`ElementParts`) lives here, below the
strategies, so that this module needs nothing from them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from troupe.reliability.manifest import CheckpointError


@dataclass(frozen=True)
class ElementParts:
    """What a DistOpt whose optimizer steps parts of parameters holds (``DistOpt.optimizer_parts()``)."""

    groups: list[list[Tensor]]
    """The model's parameters per param group, as given to the optimizer (before its groups held parts)."""
    start: dict[int, tuple[Tensor, int]]
    """id(part) -> (its model parameter, where the part starts in the parameter's flattened elements)."""


class Chunks(torch.Tensor):
    """A tensor of `size` of which this rank holds `pieces` ((offsets, tensor)): what DCP saves from (each
    rank its own chunks) and loads into (DCP reads each chunk's overlap with every stored chunk).

    It implements the protocol DCP uses for a DTensor's local shards (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``) and no tensor operation."""

    @staticmethod
    def __new__(cls, size: Sequence[int], pieces: Sequence[tuple[Sequence[int], Tensor]]) -> Chunks:
        first = pieces[0][1]
        made = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=first.dtype, device=first.device)
        made.pieces = [(torch.Size(offsets), t) for offsets, t in pieces]
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"troupe's checkpoint Chunks are read and written by DCP only (not {func})")

    def __repr__(self) -> str:  # the default one runs tensor operations
        return f"Chunks(size={tuple(self.shape)}, offsets={[tuple(o) for o, _ in self.pieces]})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for offsets, t in self.pieces]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.pieces]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for offsets, t in self.pieces:
            if offsets == index.offset:
                return t
        raise ValueError(f"no chunk of {index.fqn} at {index.offset}")

    def staged(self) -> Chunks:
        """A copy in CPU memory (what an asynchronous save writes while training goes on)."""
        return Chunks(self.shape, [(o, t.detach().to("cpu", copy=True)) for o, t in self.pieces])


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return module is not None and isinstance(t, module.DTensor)


def is_sharded(t: Any) -> bool:
    """Whether each rank holds only its own chunks of `t` (DCP writes each chunk once, under one key)."""
    return isinstance(t, Chunks) or is_dtensor(t)


def staged(t: Tensor) -> Tensor:
    """A copy of `t` in CPU memory, in the same form (plain, Chunks or DTensor)."""
    if isinstance(t, Chunks):
        return t.staged()
    if is_dtensor(t):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t.to_local().detach().to("cpu", copy=True), t.device_mesh, t.placements,
                                  shape=t.shape, stride=t.stride(), run_check=False)
    return t.detach().to("cpu", copy=True)


# --- what the optimizer holds ---------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """The elements ``[start, stop)`` of model parameter `name` (of `shape`) that one optimizer parameter holds."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    make: Callable[[Tensor], Tensor]
    """The optimizer state tensor of this piece from its flat elements."""
    part: bool = False
    """A sharded DistOpt's part (its state is saved as a chunk of the flattened parameter)."""


def _whole(name: str, p: Tensor) -> Piece:
    shape = tuple(p.shape)
    return Piece(name, shape, 0, p.numel(), lambda flat: flat.view(shape))


def _rows(name: str, p: Tensor) -> Piece:
    """A DTensor's local shard as a flat range: FSDP2's rows of dim 0 (other placements are refused)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(p.shape)
    local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(local[1:]) != shape[1:]:
        raise CheckpointError(f"{name}: a DTensor sharded on a dimension other than 0 ({p.placements}) cannot be "
                              "checkpointed by troupe")
    row = math.prod(shape[1:])
    start = offset[0] * row if shape else 0
    mesh, placements, stride = p.device_mesh, p.placements, p.stride()

    def make(flat: Tensor) -> Tensor:
        return DTensor.from_local(flat.view(tuple(local)), mesh, placements, shape=p.shape, stride=stride,
                                  run_check=False)

    return Piece(name, shape, start, start + math.prod(local), make)


def _part(name: str, p: Tensor, start: int, n: int) -> Piece:
    return Piece(name, tuple(p.shape), start, start + n, lambda flat: flat, part=True)


@dataclass(frozen=True)
class Layout:
    """An optimizer's parameters as pieces of the model's named parameters."""

    groups: list[list[str]]
    """The parameter names per param group, as an unsharded optimizer would hold them."""
    pieces: list[Piece]
    """One per parameter of the torch optimizer, in its order (positions in its state_dict)."""
    counts: list[int]
    """How many of `pieces` each of the torch optimizer's param groups holds."""

    @property
    def names(self) -> list[str]:
        return [n for g in self.groups for n in g]


def layout(model: nn.Module, optimizer: torch.optim.Optimizer, parts: ElementParts | None) -> Layout:
    """The pieces the torch `optimizer` holds (`parts`: what a sharded DistOpt says about its own)."""
    names = {id(p): n for n, p in model.named_parameters()}
    given = parts.groups if parts is not None else [list(g["params"]) for g in optimizer.param_groups]
    flat = [p for g in given for p in g]
    position = {id(p): i for i, p in enumerate(flat)}

    def name(p: Tensor) -> str:
        return names.get(id(p), f"param[{position[id(p)]}]")

    pieces = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if parts is not None and id(p) in parts.start:
                whole, start = parts.start[id(p)]
                pieces.append(_part(name(whole), whole, start, p.numel()))
            else:
                pieces.append(_rows(name(p), p) if is_dtensor(p) else _whole(name(p), p))
    return Layout([[name(p) for p in g] for g in given], pieces, [len(g["params"]) for g in optimizer.param_groups])


# --- save -----------------------------------------------------------------------------------


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, parts: ElementParts,
                  comm: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors for DCP, the optimizer's rest) of a DistOpt whose optimizer steps parts of parameters
    (collective over `comm`: every rank learns which state the others' parts have, and its scalars).

    The same keys and rest as `troupe.reliability.state.named_state` of an unsharded optimizer;
    a part's per-element state is its chunk of the flattened parameter (1-D), a scalar (Adam's
    ``step``) is saved once, as every rank holding a part of the parameter has the same."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    shape = layout(model, optimizer, parts)
    sd = optimizer.state_dict()
    index: dict[str, tuple[str, str]] = {}
    scalars: dict[str, Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for i, state in sd["state"].items():
        piece = shape.pieces[i]
        numel = math.prod(piece.shape)
        for k, v in state.items():
            key = f"optim.{piece.name}.{k}"
            if not isinstance(v, Tensor):
                other.setdefault(piece.name, {})[k] = v
            elif v.dim() == 0:
                scalars[key], index[key] = v.detach().clone(), (piece.name, k)
            elif v.numel() == piece.stop - piece.start:
                index[key] = (piece.name, k)
                # a part, whole or not, is written by its rank alone; another parameter by every rank alike
                tensors[key] = Chunks((numel,), [((piece.start,), v.reshape(-1))]) if piece.part else v
            else:
                raise CheckpointError(f"optimizer state {key!r} of shape {tuple(v.shape)} is neither one value per "
                                      f"element of its part ({piece.stop - piece.start}) nor a scalar: "
                                      "troupe cannot checkpoint it sharded")
    for their_index, their_scalars, their_other in comm.all_gather_object((index, scalars, other)):
        for key, where in their_index.items():
            index.setdefault(key, where)
        for key, v in their_scalars.items():
            scalars.setdefault(key, v)
        for name, values in their_other.items():
            other.setdefault(name, {}).update(values)
    tensors.update(scalars)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(sd["param_groups"], shape.groups)]
    return tensors, {"param_names": shape.names, "param_groups": groups, "optim_index": dict(sorted(index.items())),
                     "optim_other": other}


# --- load -----------------------------------------------------------------------------------


def _request(stored: tuple[int, ...], dtype: torch.dtype, start: int, stop: int) -> tuple[Tensor, Callable[[], Tensor]]:
    """(what to ask DCP for, then the flat elements [start, stop) of the stored tensor of shape `stored`).

    A 1-D stored tensor (a sharded DistOpt's) gives the range itself; a shaped one the rows
    covering it (a part of a row needs the whole row)."""
    if len(stored) == 1:
        buf = torch.empty(stop - start, dtype=dtype)
        return Chunks(stored, [((start,), buf)]), lambda: buf
    row = math.prod(stored[1:])
    first, last = start // row, -(-stop // row)
    buf = torch.empty((last - first, *stored[1:]), dtype=dtype)
    return Chunks(stored, [((first,) + (0,) * (len(stored) - 1), buf)]), \
        lambda: buf.view(-1)[start - first * row : stop - first * row]


def optimizer_request(rest: dict[str, Any], stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      source: Callable[[str], str], shape: Layout) -> tuple[dict[str, Tensor], Callable[[], dict]]:
    """(DCP request for this rank's optimizer state, then the torch optimizer's state_dict from it).

    `rest` is the checkpoint's optimizer rest (`named_state`/`sharded_state`), `stored` the
    checkpoint's tensors, `source` a key's stored name; `shape` what this rank's optimizer holds."""
    piece_of = {p.name: (i, p) for i, p in enumerate(shape.pieces)}
    request: dict[str, Tensor] = {}
    finish: list[tuple[int, str, Callable[[], Tensor]]] = []
    for key, (name, k) in rest["optim_index"].items():
        if name not in piece_of:  # this rank holds no element of the parameter
            continue
        i, piece = piece_of[name]
        size, dtype = stored[source(key)]
        if not size:  # a scalar (Adam's step): the same for every piece
            request[source(key)] = buf = torch.empty((), dtype=dtype)
            finish.append((i, k, lambda buf=buf: buf))
            continue
        if math.prod(size) != math.prod(piece.shape):
            raise CheckpointError(f"optimizer state {key!r} has {math.prod(size)} elements in the checkpoint, "
                                  f"its parameter has {math.prod(piece.shape)}")
        if piece.start == piece.stop:  # a DTensor's empty shard (fewer rows than ranks)
            empty = torch.empty(0, dtype=dtype)
            finish.append((i, k, lambda piece=piece, empty=empty: piece.make(empty)))
            continue
        request[source(key)], flat = _request(size, dtype, piece.start, piece.stop)
        finish.append((i, k, lambda piece=piece, flat=flat: piece.make(flat())))

    def state_dict() -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        for i, k, made in finish:
            state.setdefault(i, {})[k] = made()
        for i, piece in enumerate(shape.pieces):
            if piece.name in rest["optim_other"]:
                state.setdefault(i, {}).update(rest["optim_other"][piece.name])
        ends = [sum(shape.counts[: g + 1]) for g in range(len(shape.counts))]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(end - n, end))}
                  for g, n, end in zip(rest["param_groups"], shape.counts, ends)]
        return {"state": state, "param_groups": groups}

    return request, state_dict
