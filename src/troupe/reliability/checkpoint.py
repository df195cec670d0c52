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
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from troupe.reliability import state as named
from troupe.reliability.background import Background, SaveFailed
from troupe.runtime import world

MANIFEST = "MANIFEST.json"
FORMAT = 2
_PROBE = ".shared-disk-probe"
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
    staged = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
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
        digests = {p.relative_to(target).as_posix(): _sha256(p.read_bytes()) for p in written}
        digests[f"rank{c.rank}.pt"] = _sha256(job.rest)
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
    """(whether every rank sees rank 0's files, every rank's tensor keys, those every rank holds identically)."""
    nonce = None
    if c.rank == 0:
        nonce = secrets.token_hex(16)
        (target / _PROBE).write_text(nonce)  # only read now, never trusted later: no fsync
    nonce = c.all_gather_object(nonce)[0]
    try:
        sees = (target / _PROBE).read_text() == nonce
    except OSError:
        sees = False
    views = c.all_gather_object((sees, named.fingerprints(tensors)))
    replicated = {k for k, d in views[0][1].items() if all(theirs.get(k) == d for _, theirs in views)}
    return all(s for s, _ in views), set().union(*(theirs for _, theirs in views)), replicated


def _refusals(job: _Job, per_rank: list[str], shared: bool) -> list[str]:
    """Why this checkpoint cannot resume on another number of ranks (empty: it can)."""
    reasons = list(job.reasons)
    differ = [k for k in per_rank if k in job.params or k.startswith("optim.")]
    if differ and not reasons:
        reasons.append(f"parameters or optimizer state differ between ranks ({', '.join(differ[:3])})")
    if not shared:
        reasons.append("written without a shared filesystem (each rank's files are on its own node)")
    return reasons


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


# --- find and check -----------------------------------------------------------------------


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
        if not path.is_file() or _sha256(path.read_bytes()) != digest:
            raise CheckpointError(f"{path}: missing or corrupted (checksum mismatch)")
    return manifest


def latest(directory: str | Path) -> Path | None:
    """The newest complete, uncorrupted checkpoint in `directory` (None when there is none)."""
    wait()  # this process's save in flight first: it may be the newest
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


# --- load ---------------------------------------------------------------------------------


def load(checkpoint: str | Path, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG from `checkpoint` (on every rank; collective); return its `extra` and `step`.

    A checkpoint written by another number of ranks is resharded when every rank's model and
    optimizer state was the same: parameters, optimizer state and DistOpt counters are the
    job's, rank r < old world size takes its own RNG and `extra`, a new rank rank 0's `extra`
    and keeps its RNG. Per-rank state (residuals, partial update, partitions, parameter-server
    workers) is refused with a CheckpointError.
    """
    wait()
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
    names = named.param_names(model, inner)
    if job["optim"]["param_names"] != names:
        raise CheckpointError(f"{checkpoint}: the optimizer's parameters {names[:4]} do not match the "
                              f"checkpoint's {job['optim']['param_names'][:4]}")
    optim = {k: torch.empty(stored[source(k)][0], dtype=stored[source(k)][1]) for k in job["optim"]["optim_index"]}
    request = {source(k): v for k, v in {**wanted, **optim}.items()}  # the model's tensors load in place
    # Every rank reads what it needs by itself (the whole state, or its own): no collective plan.
    import torch.distributed.checkpoint as dcp

    from troupe.reliability import dcp_files

    dcp.load(request, storage_reader=dcp_files.SafeReader(path), no_dist=True)
    model.load_state_dict(model_sd)
    sd = named.optimizer_state(names, job["optim"], optim)
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


def from_env() -> tuple[Path | None, str]:
    """The checkpoint directory and resume mode `troupe run` passes to its ranks.

    Mode is "no" (start fresh), "yes" (``--resume``: a checkpoint must exist) or
    "auto" (a restart after a failure: resume if a checkpoint exists).
    """
    env = world.init().settings
    return env.checkpoint_dir, env.resume
