"""Loading a checkpoint into a model and optimizer, on the world size that wrote it or (resharded) another.

`troupe.reliability.checkpoint.load` waits for a save in flight, then calls `load` here.
Every rank reads what it needs by itself through DCP (no collective plan); DCP's metadata is
read by `dcp_files.SafeReader`, the rank's rest with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from troupe.reliability import pieces
from troupe.reliability import state as named
from troupe.reliability.manifest import CheckpointError, set_rng_state, verify
from troupe.runtime import world


def load(checkpoint: str | Path, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG from `checkpoint` (on every rank; collective); return its `extra` and `step`.

    A checkpoint written by another number of ranks is resharded when every rank's model and
    optimizer state was the same: parameters, optimizer state and DistOpt counters are the
    job's, rank r < old world size takes its own RNG and `extra`, a new rank rank 0's `extra`
    and keeps its RNG. Per-rank state (residuals, partial update, partitions, parameter-server
    workers) is refused with a CheckpointError.
    """
    c = world.init().comm
    checkpoint = Path(checkpoint)
    manifest = verify(checkpoint, c.rank)
    chosen = c.all_gather_object(checkpoint.name)
    if len(set(chosen)) > 1:
        raise CheckpointError(f"ranks resolved different checkpoints ({', '.join(chosen)}): a file of the newer one "
                              "is missing or corrupted on some node; remove it there, or load one step on every rank")
    if manifest.get("format") is None:
        return _load_first_format(checkpoint, manifest, c, model, optimizer)
    old = manifest["world_size"]
    if old != c.world_size and manifest["not_reshardable"]:
        raise CheckpointError(f"{checkpoint} was written by {old} ranks, this job has {c.world_size}, and it holds "
                              f"state that belongs to each rank: {'; '.join(manifest['not_reshardable'])}")
    own = torch.load(checkpoint / f"rank{c.rank if c.rank < old else 0}.pt", map_location="cpu", weights_only=True)
    job = own if old == c.world_size else torch.load(checkpoint / "rank0.pt", map_location="cpu", weights_only=True)
    model_sd = model.state_dict()
    wanted = {f"model.{k}": v for k, v in model_sd.items() if isinstance(v, Tensor)}
    path, stored, source = _locate(checkpoint, manifest, c)
    ours = {k: (tuple(v.shape), v.dtype) for k, v in wanted.items()}
    theirs = {k: stored[source(k)] for k in _model_keys(stored, manifest, source)}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()), key=str)[:3]
        raise CheckpointError(f"{checkpoint}: the model does not match the checkpoint (differences: {diff})")
    inner, _ = named.unwrap(optimizer)
    shape = pieces.layout(model, inner, getattr(optimizer, "optimizer_parts", lambda: None)())
    theirs_groups = [g["params"] for g in job["optim"]["param_groups"]]
    if job["optim"]["param_names"] != shape.names or theirs_groups != shape.groups:
        raise CheckpointError(f"{checkpoint}: the optimizer's parameters {shape.names[:4]} do not match the "
                              f"checkpoint's {job['optim']['param_names'][:4]}")
    # Each optimizer state tensor is read as the range of its parameter's elements this rank holds.
    optim, optimizer_state = pieces.optimizer_request(job["optim"], stored, source, shape)
    request = {**{source(k): v for k, v in wanted.items()}, **optim}  # the model's tensors load in place
    # Every rank reads what it needs by itself (the whole state, or its own): no collective plan.
    import torch.distributed.checkpoint as dcp

    from troupe.reliability import dcp_files

    dcp.load(request, storage_reader=dcp_files.SafeReader(path), no_dist=True)
    model.load_state_dict(model_sd)
    sd = optimizer_state()
    optimizer.load_state_dict(sd if job["distopt"] is None else {"optimizer": sd, **job["distopt"]})
    if c.rank < old:
        set_rng_state(own["rng"])
    return {"step": job["step"], **own["extra"]}


def _locate(checkpoint: Path, manifest: dict[str, Any], c):
    """(DCP checkpoint path, its tensors' shapes and dtypes, this rank's stored key for each key)."""
    local = manifest["layout"] == "local"
    path = checkpoint / f"rank{c.rank}" if local else checkpoint
    per_rank = set(manifest["per_rank_keys"])
    owner = c.rank if manifest["world_size"] == c.world_size else 0  # a reshard takes rank 0's buffers

    def source(key: str) -> str:
        return key if local or key not in per_rank else f"rank{owner}/{key}"

    from troupe.reliability import dcp_files

    try:
        stored = dcp_files.tensor_shapes(path)
    except (OSError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: unreadable DCP metadata ({e})") from None
    return path, stored, source


def _model_keys(stored: dict[str, Any], manifest: dict[str, Any], source) -> list[str]:
    """The checkpoint's model keys as this rank sees them (its own copy of those that differ by rank)."""
    keys = [k for k in stored if k.startswith("model.")]
    return keys + [k for k in manifest["per_rank_keys"] if k.startswith("model.") and source(k) in stored
                   and source(k) != k]


def _load_first_format(checkpoint: Path, manifest: dict[str, Any], c, model: nn.Module, optimizer) -> dict[str, Any]:
    """A checkpoint of troupe's first format: a full rank{r}.pt per rank, same world size only."""
    if manifest["world_size"] != c.world_size:
        raise CheckpointError(
            f"{checkpoint} was written by {manifest['world_size']} ranks, this job has {c.world_size} "
            "(a checkpoint of troupe's first format, one full copy per rank, resumes on the same number of ranks)"
        )
    state = torch.load(checkpoint / f"rank{c.rank}.pt", map_location="cpu", weights_only=True)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state["model"].items()}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise CheckpointError(f"{checkpoint}: the model does not match the checkpoint (differences: {diff})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return {"step": state["step"], **state["extra"]}
