"""Where a `ClusterConfig` comes from: SINGA's ``cluster { }`` text or TOML, a file, the environment, `troupe run`.

`parse_cluster_text` and `load` read the seed's block (anywhere in a whole job.conf) or
TOML; `from_env` is what a rank was handed (``TROUPE_CLUSTER``: JSON, a framework name or a
file); `resolve` is what `troupe run` was asked for (a preset, a file and/or field flags),
checked against ``-n``. SINGA's packing of several servers or workers into one process is
translated to what troupe runs (`translate`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

from troupe.singa import jobfile
from troupe.cluster.configuration.config import ENV_VAR, ClusterConfig, keeps_shape
from troupe.cluster.configuration.presets import FOLLOW_GROUPS, PRESETS, preset
from troupe.cluster.configuration.roles import roles
from troupe.runtime import settings
from troupe.runtime.quorum import ENV_VAR as ELASTIC_VAR

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the tomli package (a dependency there)
    import tomli as tomllib


def translate(fields: dict) -> dict:
    """SINGA's packing of several servers or workers into one process, as troupe runs it: a
    process per server and per worker (with a warning saying so), except in-memory Hogwild.

    A troupe server spends its life in a blocking receive from any worker (Gloo's recv without
    a source), so two servers cannot share a process without sharing that receive; workers
    of one process share its memory only as in-memory Hogwild (share_memory, groups of one).
    Everything else the packing meant (who talks to whom) is unchanged by the translation.
    """
    out = dict(fields)
    notes = []
    if out.get("nservers_per_procs", 1) != 1:
        notes.append(f"nservers_per_procs {out['nservers_per_procs']} -> 1 (a process per server)")
        out["nservers_per_procs"] = 1
    k = out.get("nworkers_per_procs", 1)
    hogwild = (out.get("share_memory", False) and not out.get("server_worker_separate", False)
               and out.get("nworkers_per_group", 1) == 1 and out.get("nservers_per_group", 1) == 1)
    if k != 1 and not hogwild:
        notes.append(f"nworkers_per_procs {k} -> 1 (a process per worker; several workers share a process's "
                     "memory only as in-memory Hogwild: share_memory true, groups of one worker and one server)")
        out["nworkers_per_procs"] = 1
    if notes:
        warnings.warn("cluster: " + "; ".join(notes) + " (docs/clusters.md, 'Processes')", stacklevel=3)
    return out


def parse_cluster_text(text: str) -> ClusterConfig:
    """A `ClusterConfig` from a SINGA job file's ``cluster { key: value ... }`` block, or from TOML.

    The block may stand alone or anywhere in a whole job.conf (protocol-buffer text: the
    other JobProto fields and nested blocks are skipped, with a warning naming them); one
    field per line or several on one line, ``#`` comments. TOML may put the fields at the
    top level or under ``[cluster]``.
    """
    if not jobfile.has_cluster_block(text):
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"neither a `cluster {{ ... }}` block nor valid TOML: {e}") from None
        return ClusterConfig.from_dict(translate(data.get("cluster", data)))
    return ClusterConfig.from_dict(translate(jobfile.cluster_fields(text)))


def load(path: str | os.PathLike) -> ClusterConfig:
    """Read a cluster file (the seed's block or TOML)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the cluster file {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return parse_cluster_text(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def from_env() -> ClusterConfig | None:
    """The cluster configured for this rank, or None for plain data parallelism.

    ``TROUPE_CLUSTER`` holds JSON (what `troupe run` sets), a framework name (rescaled
    to ``WORLD_SIZE``) or the path of a cluster file, so that under torchrun and mpiexec
    ``TROUPE_CLUSTER=downpour torchrun --nproc-per-node 6 train.py`` works too.
    """
    text = (settings.current().cluster or "").strip()
    if not text:
        return None
    if text.startswith("{"):
        return _not_elastic(ClusterConfig.from_json(text))
    if text in PRESETS:
        sizes = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        world = next((os.environ[k] for k in sizes if k in os.environ), None)
        return preset(text, int(world) if world else None)
    if os.path.isfile(text):
        return _not_elastic(load(text))
    raise ValueError(
        f"{ENV_VAR}={text!r} is neither JSON, a framework ({', '.join(sorted(PRESETS))}) nor an existing cluster file"
    )


def _not_elastic(cluster: ClusterConfig) -> ClusterConfig:
    """A rank handed an elastic cluster (``TROUPE_CLUSTER`` under torchrun, mpiexec or srun): refused,
    since only `troupe run`'s launcher keeps an elastic job's quorum and restarts a dead group."""
    # troupe run --elastic sets one of them for its ranks (the quorum's, or a parameter-server job's rejoining)
    if cluster.elastic and not (os.environ.get(ELASTIC_VAR) or settings.current().rejoin):
        raise ValueError(f"{ENV_VAR} asks for elastic worker groups (elastic: true), which only "
                         "`troupe run --cluster FILE` (or --elastic) runs: its launcher keeps the quorum and "
                         "restarts a dead group; under torchrun, mpiexec or srun nobody would")
    return cluster


def resolve(
    framework: str | None = None,
    path: str | os.PathLike | None = None,
    nprocs: int | None = None,
    **fields,
) -> ClusterConfig | None:
    """The cluster `troupe run` was asked for (a preset, a file, and/or field flags), checked against -n.

    Returns None when none of them is given (plain data parallelism).
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    if framework is None and path is None and not fields:
        return None
    if framework is not None and path is not None:
        raise ValueError("give either --framework or --cluster, not both")
    if framework in FOLLOW_GROUPS and "nworker_groups" in fields:
        # --nworker-groups G -n N: G groups of N / G workers, the preset's shape otherwise.
        groups = fields.pop("nworker_groups")
        reshaped = [name for name in fields if not keeps_shape(name)]
        cfg = preset(framework, None if reshaped else nprocs, nworker_groups=groups)
    elif framework is not None:
        # Flags that do not change the shape (sync_freq, ...) keep the preset rescalable to -n.
        reshaped = [name for name in fields if not keeps_shape(name)]
        cfg = preset(framework, None if reshaped else nprocs)
    elif path is not None:
        cfg = load(path)
    else:
        cfg = ClusterConfig()
    if fields:
        base = dataclasses.asdict(cfg)
        if cfg.framework == "diloco":  # its servers follow the workers (with_servers), never the other way
            del base["nserver_groups"], base["nservers_per_group"]
        cfg = ClusterConfig.from_dict(translate({**base, **fields}))
    if nprocs is not None and nprocs != cfg.nprocs:
        raise ValueError(
            f"-n {nprocs} does not fit the cluster, which needs {cfg.nprocs} processes "
            f"({cfg.nworker_groups}x{cfg.nworkers_per_group} workers, {cfg.nserver_groups}x{cfg.nservers_per_group} "
            f"servers, server_worker_separate={str(cfg.server_worker_separate).lower()}); leave -n out to use that"
        )
    roles(cfg)  # rejects what troupe cannot lay out
    return cfg
