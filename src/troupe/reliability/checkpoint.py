"""Checkpoints that lose nothing: sharded through torch.distributed.checkpoint, verified, resharded.

Layout of one checkpoint on a filesystem every rank sees (layout "sharded")::

    DIR/step-00000120/.metadata  __0_0.distcp  __1_0.distcp ...  # DCP: model + wrapped optimizer
    DIR/step-00000120/rank0.pt  rank1.pt ...    # each rank's small rest: DistOpt counters and
                                                # residuals, param_groups, RNG, the script's `extra`
    DIR/step-00000120/MANIFEST.json             # written last, by rank 0: SHA-256 of every file

A tensor every rank holds identically (a data-parallel model and its momentum) is written
once, by one rank (DCP's save-plan dedup spreads them over the ranks); a tensor that
differs between ranks is written by each under ``rank{r}/<key>``. Such a checkpoint
resumes on any number of ranks when nothing in it belongs to one rank.

Without a shared filesystem (rank 0's probe file is not visible on every rank; layout
"local") each rank writes a standalone DCP checkpoint of its whole state under
``rank{r}/`` beside ``rank{r}.pt``, and every rank writes the manifest into its own
directory; a rank then needs (and verifies) only its own files, and the checkpoint
resumes on the same number of ranks, each on the node that holds its files.

A checkpoint exists only once its manifest does: the manifest is written after every
rank's files are on disk (fsynced), so a crash during a save leaves the previous
checkpoint as the latest good one. An asynchronous save (``async_save=True``) writes the
same files from a background thread (`troupe.reliability.background`) while training goes
on; the next checkpoint call waits for it and raises its failure. Extras are read with ``torch.load(weights_only=True)``
and DCP's metadata with an unpickler that builds only DCP's records: no code runs from a
checkpoint file. Checkpoints of the first format (``rank{r}.pt`` full copies) still load
on the same world size.

This module owns saving and the public API; the manifest and its checks are in
`troupe.reliability.manifest`, loading in `troupe.reliability.restore`, the save in
flight in `troupe.reliability.background`.
"""

from __future__ import annotations

import functools
import io
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from troupe.reliability import pieces, restore
from troupe.reliability import state as named
from troupe.reliability.background import Background, SaveFailed
from troupe.reliability.manifest import (FORMAT, MANIFEST, STEP_DIR, CheckpointError, complete, rng_state,
                                         set_rng_state, sha256, verify)
from troupe.runtime import world

__all__ = ["CheckpointError", "MANIFEST", "from_env", "in_flight", "latest", "load", "rng_state", "save",
           "set_rng_state", "verify", "wait"]

_PROBE = ".shared-disk-probe"


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


# --- save ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One save's plan, fixed when `save` is called: what the writing (maybe in the background) needs."""

    directory: Path
    target: Path
    step: int
    keep: int
    rest: bytes
    """This rank's small rest (``rank{r}.pt``), serialised already: training may change it now."""
    reasons: tuple[str, ...]
    """Why the optimizer's state belongs to each rank (DistOpt's ``per_rank_state()``)."""
    params: frozenset[str]
    """The model's parameter keys (``model.<name>``)."""


def save(directory: str | Path, step: int, model: nn.Module, optimizer, extra: dict[str, Any] | None = None,
         keep: int = 2, *, async_save: bool = False) -> Path:
    """Save the job's state as checkpoint `step` (call on every rank; it is collective).

    `optimizer` is a DistOpt (its residuals and counters are saved too) or a torch optimizer.
    `extra` holds plain data the script needs to resume (epoch, the sampler's ``state_dict()``,
    numpy RNG state). The newest `keep` complete checkpoints are kept.

    ``async_save=True`` (the same on every rank) returns once the state is copied in memory:
    the files are written in a background thread while training goes on, and the
    checkpoint becomes complete (its manifest written) only when every rank's files are.
    The next `save`, `load`, `latest` or `wait` waits for it first, and raises a
    CheckpointError there if it failed. It holds a second copy of the model and optimizer
    state in CPU memory until written.

    >>> checkpoint.save(ckpt_dir, step, model, sgd, {"sampler": train.sampler.state_dict()}, async_save=True)
    """
    wait()  # one save at a time: the previous one is complete (or its failure raised) first
    c = world.init().comm
    target = Path(directory) / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    (target / MANIFEST).unlink(missing_ok=True)  # saving a step again: incomplete until its new manifest
    inner, _ = named.unwrap(optimizer)
    parts = getattr(optimizer, "optimizer_parts", lambda: None)()  # a torch optimizer has none
    if parts is not None:
        tensors, optim_rest = pieces.sharded_state(model, inner, parts, c)
    else:
        tensors, optim_rest = named.named_state(model, inner)
    full = optimizer.state_dict() if inner is not optimizer else None
    rest = {
        "format": FORMAT, "step": step, "rank": c.rank, "world_size": c.world_size, "optim": optim_rest,
        "distopt": None if full is None else {k: v for k, v in full.items() if k != "optimizer"},
        "rng": rng_state(), "extra": extra or {},
    }
    buf = io.BytesIO()
    torch.save(rest, buf)
    job = _Job(Path(directory), target, step, keep, buf.getvalue(),
               tuple(getattr(optimizer, "per_rank_state", tuple)()),
               frozenset(f"model.{n}" for n, _ in model.named_parameters()))
    if not async_save:
        _write(c, tensors, job)
        return target
    # The staging copy: the optimizer updates `tensors` in place from the next step on.
    staged = {k: pieces.staged(v) for k, v in tensors.items()}
    saver = _background(world.current())
    comm = saver.comm(c)
    saver.submit(str(target), functools.partial(_write, comm, staged, job))
    return target


def wait() -> Path | None:
    """Block until this process's asynchronous save in flight is complete; return its checkpoint (None: none).

    Raises CheckpointError if it failed (the checkpoint is then incomplete, and `latest`
    still returns the one before). Call it before the job ends to see such a failure;
    otherwise the next `save`, `load` or `latest` does.
    """
    saver = _saver
    if saver is None or saver.world is not world.current():
        return None
    try:
        done = saver.wait()
    except SaveFailed as e:
        raise CheckpointError(str(e)) from e.__cause__
    return None if done is None else Path(done)


def in_flight() -> Path | None:
    """The checkpoint this process is still writing in the background (None: none), without waiting."""
    saver = _saver
    return Path(saver.what) if saver is not None and saver.world is world.current() and saver.busy else None


_saver: Background | None = None  # the World's save in flight (a new World: a new Background)


def _background(w: world.World) -> Background:
    global _saver
    if _saver is None or _saver.world is not w:
        _saver = Background(w)
    return _saver


def _write(c, tensors: dict[str, Tensor], job: _Job) -> None:
    """Write `tensors` and this rank's rest as checkpoint `job.target`, then (rank 0) its manifest; collective over `c`."""
    target = job.target
    shared, every_key, replicated = _survey(c, target, tensors)
    per_rank = sorted(every_key - replicated)
    import torch.distributed.checkpoint as dcp  # here, not at import troupe: about 1 s
    from torch.distributed.checkpoint import FileSystemWriter

    if shared:
        ours = {k if k in replicated else f"rank{c.rank}/{k}": v for k, v in tensors.items()}
        dcp.save(ours, storage_writer=FileSystemWriter(target, sync_files=True), process_group=c.group)
        written = sorted(target.glob(f"__{c.rank}_*.distcp")) + ([target / ".metadata"] if c.rank == 0 else [])
    else:
        dcp.save(tensors, storage_writer=FileSystemWriter(target / f"rank{c.rank}", sync_files=True), no_dist=True)
        written = sorted(p for p in (target / f"rank{c.rank}").rglob("*") if p.is_file())
    failure = None
    try:
        _atomic_write(target / f"rank{c.rank}.pt", job.rest)
        digests = {p.relative_to(target).as_posix(): sha256(p.read_bytes()) for p in written}
        digests[f"rank{c.rank}.pt"] = sha256(job.rest)
    except OSError as e:  # told to every rank below, so that none waits for this one's digests
        failure, digests = e, {}
    every = c.all_gather_object((digests, None if failure is None else f"rank {c.rank}: {failure}"))
    errors = [err for _, err in every if err]
    if errors:
        raise CheckpointError(f"{target}: not saved ({'; '.join(errors)})") from failure
    if c.rank == 0 or not shared:  # without a shared disk every rank writes the manifest it can see
        manifest = {
            "format": FORMAT, "step": job.step, "world_size": c.world_size, "layout": "sharded" if shared else "local",
            "per_rank_keys": per_rank, "not_reshardable": _refusals(job, per_rank, shared),
            "sha256": {name: d for ds, _ in every for name, d in sorted(ds.items())},
        }
        _atomic_write(target / MANIFEST, json.dumps(manifest, indent=1).encode())
        _prune(job.directory, job.keep)
    c.barrier()  # nobody goes on while the checkpoint could still be incomplete


def _survey(c, target: Path, tensors: dict[str, Tensor]) -> tuple[bool, set[str], set[str]]:
    """(whether every rank sees rank 0's files, every rank's tensor keys, those saved once: every rank holds
    them identically, or each rank its own chunks of them)."""
    nonce = None
    if c.rank == 0:
        nonce = secrets.token_hex(16)
        (target / _PROBE).write_text(nonce)  # only read now, never trusted later: no fsync
    nonce = c.all_gather_object(nonce)[0]
    try:
        sees = (target / _PROBE).read_text() == nonce
    except OSError:
        sees = False
    whole = {k: v for k, v in tensors.items() if not pieces.is_sharded(v)}
    views = c.all_gather_object((sees, named.fingerprints(whole), sorted(tensors.keys() - whole.keys())))
    replicated = {k for k, d in views[0][1].items() if all(theirs.get(k) == d for _, theirs, _ in views)}
    sharded = set().union(*(cut for _, _, cut in views))
    return all(s for s, _, _ in views), set().union(sharded, *(theirs for _, theirs, _ in views)), replicated | sharded


def _refusals(job: _Job, per_rank: list[str], shared: bool) -> list[str]:
    """Why this checkpoint cannot resume on another number of ranks (empty: it can)."""
    reasons = list(job.reasons)
    differ = [k for k in per_rank if k in job.params or k.startswith("optim.")]
    if differ and not reasons:
        reasons.append(f"parameters or optimizer state differ between ranks ({', '.join(differ[:3])})")
    if not shared:
        reasons.append("written without a shared filesystem (each rank's files are on its own node)")
    return reasons


def _prune(directory: Path, keep: int) -> None:
    done = complete(directory)
    for old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    newest = done[-1].name if done else ""
    for partial in directory.iterdir():  # saves that died before their manifest
        if STEP_DIR.match(partial.name) and not (partial / MANIFEST).is_file() and partial.name < newest:
            shutil.rmtree(partial, ignore_errors=True)


# --- find and check -----------------------------------------------------------------------


def latest(directory: str | Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint in `directory` (None when there is none)."""
    wait()  # this process's save in flight first: it may be the newest
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for candidate in reversed(complete(directory)):
        try:
            verify(candidate)
            return candidate
        except CheckpointError:
            continue
    return None


# --- load ---------------------------------------------------------------------------------


def load(checkpoint: str | Path, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG from `checkpoint` (on every rank; collective); return its `extra` and `step`.

    A checkpoint written by another number of ranks is resharded when every rank's model and
    optimizer state was the same: parameters, optimizer state and DistOpt counters are the
    job's, rank r < old world size takes its own RNG and `extra`, a new rank rank 0's `extra`
    and keeps its RNG (a `DistributedSampler`'s state in `extra` is the job's position: any
    rank's copy resumes the epoch). Per-rank state (residuals, partial update, partitions,
    parameter-server workers) is refused with a CheckpointError.
    """
    wait()  # this process's save in flight first
    return restore.load(Path(checkpoint), model, optimizer)


def from_env() -> tuple[Path | None, str]:
    """The checkpoint directory and resume mode `troupe run` passes to its ranks.

    Mode is "no" (start fresh), "yes" (``--resume``: a checkpoint must exist) or
    "auto" (a restart after a failure: resume if a checkpoint exists).
    """
    env = world.init().settings
    return env.checkpoint_dir, env.resume
