"""Cluster topology (SINGA 0.x's ClusterProto): worker groups, server groups, and each rank's role.

Worker groups run asynchronously to each other, workers inside a group synchronously.
Group g talks to server group ``g // (nworker_groups // nserver_groups)``. The four
frameworks of the reference are four settings of one `ClusterConfig`:

>>> cfg = PRESETS["downpour"]
>>> cfg.nprocs, [r.kind for r in roles(cfg)]
(6, ['worker', 'worker', 'worker', 'worker', 'server', 'server'])

Ranks are laid out workers first, so a worker's global rank is its index among all
workers; with `server_worker_separate` the servers follow them, otherwise server j
shares the process of worker j.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

from troupe.cluster import jobfile
from troupe.runtime import settings
from troupe.util import check_int

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the tomli package (a dependency there)
    import tomli as tomllib

ENV_VAR = "TROUPE_CLUSTER"
"""Environment variable through which `troupe run` hands the cluster (JSON) to every rank."""


WIRE_DTYPES = ("fp32", "fp16", "bf16")
CHOICES = {"fetch": ("wait", "background", "predict"), "staleness_lr": ("constant", "inverse")}
"""Fields of separate servers with a fixed set of values, the default first."""
"""What `ClusterConfig.wire_dtype` may say."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """SINGA's ClusterProto, plus server-group synchronisation and shared memory."""

    nworker_groups: int = 1
    """Worker groups run asynchronously to each other."""
    nserver_groups: int = 1
    """Each server group holds a full copy of the parameters; must divide nworker_groups."""
    nworkers_per_group: int = 1
    """Workers of one group run synchronously (their updates are summed, then applied once)."""
    nservers_per_group: int = 1
    """The parameters are cut into slices balanced across the servers of a group."""
    nworkers_per_procs: int = 1
    """Workers hosted by one process."""
    nservers_per_procs: int = 1
    """Servers hosted by one process."""
    server_worker_separate: bool = False
    """Servers in processes of their own (True) or sharing the workers' processes (False)."""
    sync_freq: int = 10
    """With several server groups: every sync_freq updates a group syncs each slice with its master group."""
    share_memory: bool = False
    """Workers of one process share parameter memory (in-memory Hogwild)."""
    fetch_freq: int = 1
    """Separate servers: workers copy fresh slices every fetch_freq steps (Downpour's n_fetch); in between
    the servers only acknowledge their updates."""
    staleness_bound: int | None = None
    """Stale-synchronous: a worker group more than this many updates ahead of the slowest waits (None: no bound)."""
    group_merge: Literal["mean", "sum"] = "mean"
    """How the changes of asynchronous worker groups combine. "mean": each group counts 1/G (a Downpour
    server steps with lr / G per group's update; a Hogwild master copy adds a group's change / G), so
    the learning rate means what it means synchronously. "sum": SINGA's rule, each group's full change
    (G times the step; diverges at a learning rate one group trains well with)."""
    fetch: Literal["wait", "background", "predict"] = "wait"
    """Separate servers: when a worker takes in the fresh values its Updates bring back. "wait":
    ``step()`` waits for them (a round trip to the servers every step). "background": ``step()``
    sends the Updates and returns at once; the replies are received by a thread while the next
    step computes, and copied in at that step's ``step()``. Every step then computes on values
    that lack this worker's previous update (a delay of one own step; measured in
    docs/clusters.md), and a worker waits only when the servers take longer than a step. A
    synchronous group (Sandblaster) then trains as SGD with a one-step delay. "predict": as
    "background", and the worker also steps the wrapped optimizer on its own gradient (at the
    servers' learning rate) and adds that change to the values it computes on until the servers'
    values holding it arrive: no delay of its own update (exact with one worker), only the other
    groups' updates arrive late, as under "wait"."""
    staleness_lr: Literal["constant", "inverse"] = "constant"
    """Separate servers: the learning rate of an update computed on values that are tau updates
    old. "constant": the same for every update. "inverse": divided by max(1, tau) (Zhang et al.,
    "Staleness-aware Async-SGD", IJCAI 2016), so a stale gradient moves the values less."""
    send_updates: Literal["auto", "step"] = "auto"
    """Separate servers: when a worker's Update messages leave. "step": in ``step()``, after whatever the
    loop did to the gradients (clipping). "auto": in ``step()`` until a step shows that the loop leaves
    the gradients alone between backward and step, then during backward (overlapped with it); always
    in ``step()`` under ``nan_policy="skip"`` (docs/clusters.md)."""

    wire_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Separate servers: the precision of what crosses the wire after the start, the gradients a
    worker sends and the values it fetches. "fp16" or "bf16" halve both; the servers keep and update
    fp32 values (the first values a worker Puts travel in full). Co-located servers refuse it."""

    wire_topk: float | None = None
    """Separate servers: the fraction of each slice's update a worker sends, in (0, 1): the
    ceil(wire_topk * n) largest-magnitude elements of (its update + what it left out before), as
    (int32 index, value) pairs, values in `wire_dtype`; what it leaves out is kept per slice and
    added to the next step's update (error feedback). Unset: dense updates. Co-located servers refuse it."""

    partition_dim: int | dict[str, int] | None = None
    """A partitioned model (`troupe.partition(model)` in the script): every Linear/Conv2d's
    partition_dim (0 batch, 1 output features, -1 one worker), or, in TOML, a table of
    module-name globs -> dim; split inside each worker group of nworkers_per_group workers.
    Unset: the script decides (no partition unless it partitions by hand)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "partition_dim":
                _check_partition(value)
            elif f.type == "bool":
                if not isinstance(value, bool):
                    raise TypeError(f"{f.name} must be true or false, got {value!r}")
            elif f.name == "group_merge":
                if value not in ("mean", "sum"):
                    raise ValueError(f"group_merge must be 'mean' or 'sum', got {value!r}")
            elif f.name in CHOICES:
                if value not in CHOICES[f.name]:
                    raise ValueError(f"{f.name} must be one of {', '.join(CHOICES[f.name])}, got {value!r}")
                if value != CHOICES[f.name][0] and not self.server_worker_separate:
                    raise ValueError(f"{f.name} {value} needs separate servers (server_worker_separate: true)")
            elif f.name == "send_updates":
                if value not in ("auto", "step"):
                    raise ValueError(f"send_updates must be 'auto' or 'step', got {value!r}")
            elif f.name == "wire_dtype":
                if value not in WIRE_DTYPES:
                    raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {value!r}")
                if value != "fp32" and not self.server_worker_separate:
                    raise ValueError(f"wire_dtype {value} needs separate servers (server_worker_separate: true); "
                                     "co-located servers exchange fp32")
            elif f.name == "wire_topk":
                _check_topk(value, self.server_worker_separate)
            elif f.type == "int | None":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                    raise ValueError(f"{f.name} must be an integer >= 0 or unset, got {value!r}")
            else:
                check_int(f.name, value)
        if self.nworker_groups % self.nserver_groups:
            raise ValueError(
                f"nworker_groups ({self.nworker_groups}) must be divisible by nserver_groups "
                f"({self.nserver_groups}): each server group serves the same number of worker groups"
            )
        _check_packing("workers", self.nworkers_per_group, self.nworkers_per_procs)
        _check_packing("servers", self.nservers_per_group, self.nservers_per_procs)
        if not self.server_worker_separate and self.nworker_procs != self.nserver_procs:
            raise ValueError(
                f"with server_worker_separate false every process hosts workers and servers, so the "
                f"worker processes ({self.nworker_procs} = {self.nworkers} workers / nworkers_per_procs "
                f"{self.nworkers_per_procs}) must equal the server processes ({self.nserver_procs} = "
                f"{self.nservers} servers / nservers_per_procs {self.nservers_per_procs})"
            )

    # --- derived sizes -------------------------------------------------------------

    @property
    def nworkers(self) -> int:
        return self.nworker_groups * self.nworkers_per_group

    @property
    def nservers(self) -> int:
        return self.nserver_groups * self.nservers_per_group

    @property
    def nworker_procs(self) -> int:
        return -(-self.nworkers // self.nworkers_per_procs)

    @property
    def nserver_procs(self) -> int:
        return -(-self.nservers // self.nservers_per_procs)

    @property
    def nprocs(self) -> int:
        """OS processes troupe starts: SINGA's count (cluster.cc: sum if separate, else the max), except that
        the `nworkers_per_procs` workers of one process run as processes of their own sharing its memory."""
        if self.server_worker_separate:
            return self.nworker_procs + self.nserver_procs
        return max(self.nworker_procs, self.nserver_procs) * self.nworkers_per_procs

    @property
    def in_memory(self) -> bool:
        """In-memory Hogwild: several workers share one process's parameter memory."""
        return self.nworkers_per_procs > 1

    @property
    def synchronous(self) -> bool:
        """One worker group: every update waits for the whole group."""
        return self.nworker_groups == 1

    def server_group_of(self, worker_group: int) -> int:
        """The server group that worker group `worker_group` talks to."""
        return worker_group // (self.nworker_groups // self.nserver_groups)

    # --- (de)serialisation -----------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, fields: dict) -> ClusterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown cluster field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> ClusterConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({e}): {text!r}") from None
        return cls.from_dict(fields)


def _check_partition(value: object) -> None:
    dims = (0, 1, -1)
    if value is None or (not isinstance(value, bool) and value in dims):
        return
    if isinstance(value, dict) and value and all(
            isinstance(k, str) and not isinstance(v, bool) and v in dims for k, v in value.items()):
        return
    raise ValueError(f"partition_dim must be one of {dims} or a table of module-name globs -> one of them, "
                     f"got {value!r}")


def _check_topk(value: object, separate: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"wire_topk is the fraction of each slice's update a worker sends and must be in (0, 1) "
                         f"or unset (dense), got {value!r}")
    if not separate:
        raise ValueError(f"wire_topk {value} needs separate servers (server_worker_separate: true); co-located "
                         "servers and in-memory Hogwild exchange dense updates")


def _check_packing(what: str, per_group: int, per_procs: int) -> None:
    # SINGA places whole groups in a process or whole processes in a group, never a mix.
    if per_group % per_procs and per_procs % per_group:
        raise ValueError(
            f"n{what}_per_group ({per_group}) and n{what}_per_procs ({per_procs}) must divide one another"
        )


PRESETS: dict[str, ClusterConfig] = {
    "sandblaster": ClusterConfig(nworkers_per_group=3, nservers_per_group=2, server_worker_separate=True),
    "allreduce": ClusterConfig(nworkers_per_group=3, nservers_per_group=3),
    "downpour": ClusterConfig(
        nworker_groups=2, nworkers_per_group=2, nservers_per_group=2, server_worker_separate=True
    ),
    "hogwild": ClusterConfig(nworker_groups=3, nserver_groups=3),
}
"""The reference's four frameworks, exactly as its `cluster { ... }` blocks give them."""


def expendable_ranks(cluster: ClusterConfig) -> set[int]:
    """Ranks the job goes on without when they die or are cut off: with asynchronous worker
    groups, every worker but rank 0 (which hosts the job's rendezvous). With co-located servers
    the vanished worker's group, server and master copies go with it."""
    if cluster.nworker_groups <= 1:
        return set()
    return {r.rank for r in roles(cluster) if r.worker and r.rank != 0}


def preset(name: str, nprocs: int | None = None, **overrides) -> ClusterConfig:
    """A named framework, rescaled to `nprocs` processes when given.

    Rescaling keeps the framework's shape: Sandblaster and Downpour keep their server
    count and give the remaining processes to workers; AllReduce and Hogwild use one
    worker (and one co-located server) per process.
    """
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown framework {name!r}; choose one of {sorted(PRESETS)}") from None
    if nprocs is not None and nprocs != cfg.nprocs:
        cfg = _rescale(name, cfg, nprocs)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _rescale(name: str, cfg: ClusterConfig, nprocs: int) -> ClusterConfig:
    if name == "allreduce":
        return dataclasses.replace(cfg, nworkers_per_group=nprocs, nservers_per_group=nprocs)
    if name == "hogwild":
        return dataclasses.replace(cfg, nworker_groups=nprocs, nserver_groups=nprocs)
    nworkers = nprocs - cfg.nservers
    if nworkers < cfg.nworker_groups or nworkers % cfg.nworker_groups:
        raise ValueError(
            f"framework {name!r} has {cfg.nservers} server(s) and {cfg.nworker_groups} worker group(s): "
            f"-n {nprocs} leaves {nworkers} worker(s), which must be a positive multiple of {cfg.nworker_groups}"
        )
    return dataclasses.replace(cfg, nworkers_per_group=nworkers // cfg.nworker_groups)


# --- roles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    """What one rank does: a worker (group, index in group) and/or a server (group, index)."""

    rank: int
    worker: tuple[int, int] | None
    """(worker group, index within the group), or None on a server-only rank."""
    server: tuple[int, int] | None
    """(server group, index within the group), or None on a worker-only rank."""

    @property
    def kind(self) -> Literal["worker", "server", "worker+server"]:
        if self.worker and self.server:
            return "worker+server"
        return "worker" if self.worker else "server"

    def describe(self) -> str:
        parts = []
        if self.worker:
            parts.append(f"worker {self.worker[1]} of group {self.worker[0]}")
        if self.server:
            parts.append(f"server {self.server[1]} of group {self.server[0]}")
        return f"rank {self.rank}: " + " + ".join(parts)


def roles(config: ClusterConfig) -> list[Role]:
    """The role of every rank, ``len(roles(config)) == config.nprocs``.

    One server per process; `nworkers_per_procs` > 1 (in-memory Hogwild) gives each of a
    process's workers an OS process of its own, the first also hosting the server group.
    """
    if config.nservers_per_procs != 1:
        raise ValueError(f"troupe runs one server per process: nservers_per_procs must be 1 (got "
                         f"{config.nservers_per_procs})")
    if config.in_memory:
        shape = (config.server_worker_separate, config.share_memory, config.nworkers_per_group,
                 config.nservers_per_group)
        if shape != (False, True, 1, 1):
            raise ValueError(
                f"nworkers_per_procs {config.nworkers_per_procs} is in-memory Hogwild: the workers of a process share "
                "its server group's memory, which needs server_worker_separate false, share_memory true and "
                f"groups of one worker and one server (got server_worker_separate {shape[0]}, share_memory "
                f"{shape[1]}, nworkers_per_group {shape[2]}, nservers_per_group {shape[3]})"
            )
        k = config.nworkers_per_procs
        return [Role(r, (r, 0), (r // k, 0) if r % k == 0 else None) for r in range(config.nworkers)]
    workers = [(w // config.nworkers_per_group, w % config.nworkers_per_group) for w in range(config.nworkers)]
    servers = [(s // config.nservers_per_group, s % config.nservers_per_group) for s in range(config.nservers)]
    if config.server_worker_separate:
        return [Role(r, w, None) for r, w in enumerate(workers)] + [
            Role(len(workers) + i, None, s) for i, s in enumerate(servers)
        ]
    return [Role(r, w, s) for r, (w, s) in enumerate(zip(workers, servers))]


# --- text -------------------------------------------------------------------------------

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
    with open(path, encoding="utf-8") as f:
        return parse_cluster_text(f.read())


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
        return ClusterConfig.from_json(text)
    if text in PRESETS:
        sizes = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        world = next((os.environ[k] for k in sizes if k in os.environ), None)
        return preset(text, int(world) if world else None)
    if os.path.isfile(text):
        return load(text)
    raise ValueError(
        f"{ENV_VAR}={text!r} is neither JSON, a framework ({', '.join(sorted(PRESETS))}) nor an existing cluster file"
    )


FIELD_FLAGS = (
    "nworker_groups",
    "nserver_groups",
    "nworkers_per_group",
    "nservers_per_group",
    "nworkers_per_procs",
    "nservers_per_procs",
    "sync_freq",
    "fetch_freq",
    "staleness_bound",
)
"""ClusterConfig fields `troupe run` also takes as flags (--nworker-groups ...)."""


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
    if framework is not None:
        # Flags that do not change the shape (sync_freq, ...) keep the preset rescalable to -n.
        reshaped = set(fields) - {"sync_freq", "fetch_freq", "staleness_bound", "share_memory", "group_merge",
                                  "send_updates", "wire_dtype", "wire_topk", "fetch", "staleness_lr"}
        cfg = preset(framework, None if reshaped else nprocs)
    elif path is not None:
        cfg = load(path)
    else:
        cfg = ClusterConfig()
    if fields:
        cfg = ClusterConfig.from_dict(translate({**dataclasses.asdict(cfg), **fields}))
    if nprocs is not None and nprocs != cfg.nprocs:
        raise ValueError(
            f"-n {nprocs} does not fit the cluster, which needs {cfg.nprocs} processes "
            f"({cfg.nworker_groups}x{cfg.nworkers_per_group} workers, {cfg.nserver_groups}x{cfg.nservers_per_group} "
            f"servers, server_worker_separate={str(cfg.server_worker_separate).lower()}); leave -n out to use that"
        )
    roles(cfg)  # rejects what troupe cannot lay out
    return cfg
