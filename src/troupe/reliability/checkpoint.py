"""Checkpoints that lose nothing: every rank's state, written atomically, verified on load.

Layout of one checkpoint::

    DIR/step-00000120/rank0.pt  rank1.pt ...   # each rank's model, DistOpt, RNG and data position
    DIR/step-00000120/MANIFEST.json            # written last, by rank 0: world size + SHA-256 per file

A checkpoint exists only once its manifest does; every file is written to a temporary
name, fsynced and renamed, so a crash during a save leaves the previous checkpoint as
the latest good one. Loading uses ``torch.load(weights_only=True)`` (no code runs from a
checkpoint file) and refuses files whose checksum, world size or parameters do not match.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from troupe.runtime import world

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not fit this job."""


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rng_state() -> dict[str, Any]:
    """torch's CPU (and CUDA) generator states."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(directory: str | Path, step: int, model: nn.Module, optimizer, extra: dict[str, Any] | None = None,
         keep: int = 2) -> Path:
    """Save this rank's state as part of checkpoint `step` (call on every rank; it is collective).

    `optimizer` is a DistOpt (its residuals and counters are saved too) or a torch optimizer.
    `extra` holds plain data the script needs to resume (epoch, batch index, numpy RNG state).
    The newest `keep` complete checkpoints are kept.
    """
    c = world.init().comm
    target = Path(directory) / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "rank": c.rank,
        "world_size": c.world_size,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(target / f"rank{c.rank}.pt", data)
    digests = c.all_gather_object(_sha256(data))
    if c.rank == 0:
        manifest = {"step": step, "world_size": c.world_size, "sha256": {f"rank{r}.pt": d for r, d in enumerate(digests)}}
        _atomic_write(target / MANIFEST, json.dumps(manifest, indent=1).encode())
        _prune(Path(directory), keep)
    c.barrier()  # nobody trains on while the checkpoint could still be incomplete
    return target


def _complete(directory: Path) -> list[Path]:
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def _prune(directory: Path, keep: int) -> None:
    complete = _complete(directory)
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    newest = complete[-1].name if complete else ""
    for partial in directory.iterdir():  # saves that died before their manifest
        if _STEP_DIR.match(partial.name) and not (partial / MANIFEST).is_file() and partial.name < newest:
            shutil.rmtree(partial, ignore_errors=True)


def verify(checkpoint: Path) -> dict[str, Any]:
    """The manifest of `checkpoint` after checking every file's checksum; raises CheckpointError."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint}: no readable {MANIFEST} ({e})") from None
    for name, digest in manifest["sha256"].items():
        path = checkpoint / name
        if not path.is_file() or _sha256(path.read_bytes()) != digest:
            raise CheckpointError(f"{path}: missing or corrupted (checksum mismatch)")
    return manifest


def latest(directory: str | Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint in `directory` (None when there is none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for candidate in reversed(_complete(directory)):
        try:
            verify(candidate)
            return candidate
        except CheckpointError:
            continue
    return None


def load(checkpoint: str | Path, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore this rank's model, optimizer and RNG from `checkpoint`; return its `extra` and `step`."""
    c = world.init().comm
    checkpoint = Path(checkpoint)
    manifest = verify(checkpoint)
    if manifest["world_size"] != c.world_size:
        raise CheckpointError(
            f"{checkpoint} was written by {manifest['world_size']} ranks, this job has {c.world_size}"
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


def from_env() -> tuple[Path | None, str]:
    """The checkpoint directory and resume mode `troupe run` passes to its ranks.

    Mode is "no" (start fresh), "yes" (``--resume``: a checkpoint must exist) or
    "auto" (a restart after a failure: resume if a checkpoint exists).
    """
    env = world.init().settings
    return env.checkpoint_dir, env.resume
