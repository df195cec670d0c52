"""What makes a checkpoint complete and intact: its manifest, the checksums in it, the RNG states in it.

A step directory is a checkpoint once its ``MANIFEST.json`` exists (written last, see
`troupe.reliability.checkpoint`); `verify` checks every file against the manifest's SHA-256.
Shared by the saving side (`checkpoint`) and the loading side (`restore`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from troupe.runtime import world

MANIFEST = "MANIFEST.json"
FORMAT = 2
STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not fit this job."""


def sha256(data: bytes) -> str:
    """The hex SHA-256 of `data` (what the manifest records per file)."""
    return hashlib.sha256(data).hexdigest()


def rng_state() -> dict[str, Any]:
    """torch's CPU (and CUDA) generator states."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def complete(directory: Path) -> list[Path]:
    """The step directories in `directory` that have a manifest, oldest first (not verified)."""
    found = [p for p in directory.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def _current_rank() -> int | None:
    w = world.current()
    return None if w is None else w.comm.rank


def verify(checkpoint: Path, rank: int | None = None) -> dict[str, Any]:
    """The manifest of `checkpoint` after checking every file's checksum; raises CheckpointError.

    A checkpoint written without a shared filesystem checks only `rank`'s files (default:
    this process's rank once it has joined the job): the others are on other nodes.
    """
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint}: no readable {MANIFEST} ({e})") from None
    files = manifest["sha256"]
    rank = _current_rank() if rank is None else rank
    if manifest.get("layout") == "local" and rank is not None:
        files = {n: d for n, d in files.items() if n == f"rank{rank}.pt" or n.startswith(f"rank{rank}/")}
    for name, digest in files.items():
        path = checkpoint / name
        if not path.is_file() or sha256(path.read_bytes()) != digest:
            raise CheckpointError(f"{path}: missing or corrupted (checksum mismatch)")
    return manifest
