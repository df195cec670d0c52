"""The one codec of a worker's state handed to another process: an elastic group's heal (runtime/elastic.py:
the whole state of what the script tracks, from a live peer) and a parameter-server worker's record
(runtime/rejoin.py: its own part of it, kept in the store for its next life).

`pack` takes each object's state (what the caller chose of it) and the RNG; a DTensor (a model sharded by
`troupe.shard`) goes as its local shard, since the two ends of a hand-off hold the same shards. `unpack`
reads it back and restores the RNG; `dress_module_state` and `dress_optimizer_state` make the shards
DTensors again where the receiving object holds DTensors.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch

RNG = "__rng__"


def pack(states: dict[str, Any]) -> bytes:
    """`states` (name -> an object's state) and this process's RNG, as bytes."""
    state = {name: _undress(s) for name, s in states.items()}
    state[RNG] = torch.get_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def unpack(blob: bytes) -> dict[str, Any]:
    """What `pack` packed, name -> state; this process's RNG is set to the sender's."""
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    torch.set_rng_state(state.pop(RNG))
    return state


def load_states(objects: dict[str, Any], states: dict[str, Any]) -> None:
    """Each object's ``load_state_dict`` of its packed state, its shards made DTensors again where it holds them."""
    for name, obj in objects.items():
        obj.load_state_dict(dress_module_state(obj, states[name]))
        dress_optimizer_state(obj)


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # none exists before troupe.shard imports it
    return module is not None and isinstance(t, module.DTensor)


def _undress(state: Any) -> Any:
    if is_dtensor(state):
        return state.to_local().detach().clone()
    if isinstance(state, dict):
        return {k: _undress(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_undress(v) for v in state)
    return state


def dress_module_state(obj: Any, state: Any) -> Any:
    """A module's state with each local shard made again the DTensor its own state holds there."""
    if not isinstance(obj, torch.nn.Module):
        return state
    own = obj.state_dict()
    return {k: _as_dtensor(v, own[k]) if is_dtensor(own.get(k)) and not is_dtensor(v) else v
            for k, v in state.items()}


def _as_dtensor(local: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def dress_optimizer_state(obj: Any) -> None:
    """An optimizer's state loaded for DTensor parameters: each per-element buffer (a local shard) made a DTensor
    like its parameter, as the optimizer made it."""
    if not (hasattr(obj, "param_groups") and hasattr(obj, "state")):
        return
    for group in obj.param_groups:
        for p in group["params"]:
            if not is_dtensor(p) or p not in obj.state:
                continue
            state = obj.state[p]
            for k, v in list(state.items()):
                if torch.is_tensor(v) and not is_dtensor(v) and v.dim() and v.shape == p.to_local().shape:
                    state[k] = _as_dtensor(v, p)
