"""`troupe run`'s refusals: flags that do not go together, paths a job cannot use, each in one line."""

from __future__ import annotations

import dataclasses
import os

from troupe.launcher.flags import ElasticFlags, Flags, Recovery
from troupe.runtime import settings

PS_FRAMEWORKS = ("downpour", "sandblaster", "hogwild")
"""Under --elastic their workers restart alone and rejoin (no quorum)."""


def check_paths(flags: Flags) -> None:
    """The files and directories the job reads or writes on this node, checked before any rank starts
    (the directories are made)."""
    script, out = flags.argv[0], flags.outputs
    if not os.path.isfile(script):
        raise ValueError(f"script not found: {script}" if not os.path.exists(script)
                         else f"the script {script} is not a file")
    if not os.access(script, os.R_OK):
        raise ValueError(f"cannot read the script {script} (permission denied)")
    for flag, directory in (("--checkpoint-dir", flags.recovery.checkpoint_dir), ("--log-dir", out.log_dir),
                            ("--tensorboard", out.tensorboard)):
        if directory:
            _check_directory(flag, directory)
    for flag, path in (("--stats", out.stats), ("--timeline", out.timeline)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"{flag} {path}: its directory {parent} does not exist or is not writable")


def _check_directory(flag: str, directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{flag} {directory}: not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {directory}: cannot make the directory ({e.strerror})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {directory}: the directory is not writable")


def check_recovery(recovery: Recovery) -> dict[str, str]:
    """--max-restarts, --checkpoint-dir and --resume checked; the env var that tells the ranks where to save."""
    if recovery.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {recovery.max_restarts}")
    directory = recovery.directory
    if recovery.max_restarts and not directory:
        raise ValueError("--max-restarts needs --checkpoint-dir DIR (where the job saves what a restart resumes)")
    if recovery.resume and not os.path.isdir(recovery.resume):
        raise ValueError(f"--resume: no such directory {recovery.resume}")
    return {"TROUPE_CHECKPOINT_DIR": os.path.abspath(directory)} if directory else {}


def refuse_elastic_flags(elastic: ElasticFlags) -> None:
    """Without --elastic, its flags mean nothing: refused, each by name."""
    order = ("--min-groups", "--evict-after", "--elastic-timeout", "--spares", "--elastic-batch", "--max-groups")
    given = elastic.given()
    for flag in order:
        if given[flag] is not None:
            raise ValueError(f"{flag} needs --elastic")


def check_elastic(flags: Flags) -> tuple[Flags, int | None]:
    """What this step of elastic worker groups runs: data parallelism over groups of processes (one
    each, or `--nworker-groups` groups of equal size, none across two nodes), DiLoCo over such groups,
    or a parameter-server framework whose workers restart alone. Returns the flags the cluster is
    resolved from and the quorum's worker groups (None: one per process)."""
    if flags.recovery.max_restarts:
        raise ValueError("--elastic restarts a dead rank alone; --max-restarts restarts the whole job: give one")
    c = flags.cluster
    cluster_flags = {k: v for k, v in c.given().items() if k != "nworker_groups"}
    diloco, downpour = c.framework == "diloco", c.framework in PS_FRAMEWORKS or bool(c.servers_block)
    if (c.framework and not (diloco or downpour)) or (c.file and not c.servers_block) \
            or (cluster_flags and not (diloco or downpour)) or settings.current().cluster:
        raise ValueError("--elastic runs data parallelism over worker groups, --framework diloco, or --framework "
                         "downpour, sandblaster or hogwild (their workers restart alone); not AllReduce or "
                         "partition yet by cluster flags (--framework/--cluster/cluster flags other than "
                         "--nworker-groups; to partition inside elastic worker groups, call "
                         "troupe.partition(model, plan) in the script)")
    if downpour:
        _check_elastic_downpour(flags.elastic, c.framework or c.servers_block)
        return flags, None
    groups = _elastic_groups(flags, diloco)
    # The groups are the quorum's business, not a cluster's: the ranks see plain data parallelism
    # (under DiLoCo, a cluster whose worker groups are the quorum's).
    place = flags.place
    nworker_groups = (groups or (place.nproc or 2) * place.nnodes) if diloco else None
    _check_restarts(flags.elastic)
    return dataclasses.replace(flags, cluster=c.with_fields(nworker_groups=nworker_groups)), groups


def _elastic_groups(flags: Flags, diloco: bool) -> int | None:
    """--nworker-groups under --elastic (synchronous groups or DiLoCo), checked against -n and --nnodes."""
    place = flags.place
    if place.nproc is not None and place.nproc * place.nnodes < 2:
        raise ValueError(f"--elastic needs at least 2 processes (worker groups), got -n {place.nproc}")
    groups = flags.cluster.fields.get("nworker_groups")
    if groups is not None and groups < 2:
        raise ValueError(f"--elastic --nworker-groups needs at least 2 worker groups (one would have nobody to "
                         f"heal from), got {groups}")
    nodes, per_node = place.nnodes, place.nproc or 2
    if groups is not None and (per_node * nodes) % groups:
        on = f" x --nnodes {nodes}" if nodes > 1 else ""
        raise ValueError(f"--elastic: -n {per_node}{on} processes do not split into --nworker-groups {groups} "
                         f"groups of equal size")
    if groups is not None and per_node % (per_node * nodes // groups):
        raise ValueError(f"--elastic: a worker group of {per_node * nodes // groups} processes (--nworker-groups "
                         f"{groups}) would span two nodes of -n {per_node}: its launcher restarts it whole, on one node")
    if diloco and flags.elastic.batch == "constant":
        raise ValueError("--elastic-batch constant weighs each step's gradients over the groups; under --framework "
                         "diloco the groups take their inner steps alone (a missing group's pseudo-gradient is left "
                         "out of the outer step)")
    return groups


def _check_elastic_downpour(elastic: ElasticFlags, framework: str) -> None:
    """Downpour, Sandblaster or Hogwild under --elastic: no quorum (each worker talks to the servers, or the
    other groups, alone), so the quorum's flags mean nothing there (`--evict-after`: how long a Sandblaster
    server, or a Hogwild group, waits for a frozen worker)."""
    given = elastic.given()
    for flag in ("--min-groups", "--max-groups", "--elastic-batch", "--elastic-timeout"):
        if given[flag] is not None:
            raise ValueError(f"{flag} is for synchronous elastic groups (a quorum); under {framework} each worker "
                             "talks to the servers alone: leave it out")
    _check_restarts(elastic)
    if elastic.evict_after is not None and elastic.evict_after <= 0:
        raise ValueError(f"--evict-after must be > 0 seconds, got {elastic.evict_after}")


def _check_restarts(elastic: ElasticFlags) -> None:
    if elastic.restarts_per_rank < 0:
        raise ValueError(f"--restarts-per-rank must be >= 0, got {elastic.restarts_per_rank}")
    if elastic.spares is not None and elastic.spares < 0:
        raise ValueError(f"--spares must be >= 0, got {elastic.spares}")
