"""Cluster topology (SINGA 0.x's ClusterProto): worker groups, server groups, and how they train.

Worker groups run asynchronously to each other, workers inside a group synchronously.
Group g talks to server group ``g // (nworker_groups // nserver_groups)``. The four
frameworks of the reference are four settings of one `ClusterConfig` (`presets`); the
role of every rank follows from it (`roles`).

Every field says in its metadata what the rest of troupe needs to know about it, so that a
new field is one declaration here: `troupe run`'s flag (`Flag`, turned into argparse
options by `flags`), the fields that need separate servers, and the fields that leave a
preset's shape alone. A `Literal[...]` field takes exactly the listed values, its default first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass
from typing import Any, Literal

from troupe.util import check_int

ENV_VAR = "TROUPE_CLUSTER"
"""Environment variable through which `troupe run` hands the cluster (JSON) to every rank."""


@dataclass(frozen=True)
class Flag:
    """How `troupe run` takes a field on its command line: ``--`` and the field's name with dashes."""

    help: str | None = None
    metavar: str | None = None


def option(default: Any, *, flag: Flag | None = None, separate_only: str | None = None,
           keeps_shape: bool = False, check: typing.Callable[[Any, bool], None] | None = None) -> Any:
    """A `ClusterConfig` field with what the rest of troupe needs to know about it.

    Args:
        flag: `troupe run` takes the field as a flag (None: only in a cluster file or JSON).
        separate_only: a value other than the default needs separate servers; the text says why
            ("" for no reason beyond that).
        keeps_shape: the field changes neither the number of processes nor their roles, so a
            preset given with it is still rescaled to ``troupe run -n``.
        check: ``check(value, server_worker_separate)`` raises for a bad value (instead of the
            checks the field's type implies).
    """
    metadata = {"flag": flag, "separate_only": separate_only, "keeps_shape": keeps_shape, "check": check}
    return dataclasses.field(default=default, metadata=metadata)


def _check_partition(value: object, separate: bool) -> None:
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


def _check_shard(value: object, separate: bool) -> None:
    if value not in (None, "optimizer", "gradients"):
        raise ValueError(f"shard must be optimizer or gradients, or unset, got {value!r}")
    if value is not None and separate:
        raise ValueError(f"shard {value} shards co-located servers (AllReduce); separate servers already hold "
                         "each slice's state once: leave out shard, or server_worker_separate")


def _check_outer_optimizer(value: object, separate: bool) -> None:
    outer_optimizer_class(value)


def _check_outer_lr(value: object, separate: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"outer_lr must be a number > 0, got {value!r}")


def _check_outer_momentum(value: object, separate: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {value!r}")


def _check_delay(value: object, separate: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"delay must be an integer >= 0, got {value!r}")


def _check_merge_alpha(value: object, separate: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"merge_alpha must be a number in [0, 1), got {value!r}")


OUTER_DEFAULT = "nesterov"
"""DiLoCo's outer optimizer: torch.optim.SGD with Nesterov momentum (Douillard et al. 2023)."""


def outer_optimizer_class(name: object) -> str:
    """The torch.optim class name `name` stands for ("nesterov" -> "SGD"; any case), else a ValueError listing them."""
    if name == OUTER_DEFAULT:
        return "SGD"
    import torch  # only a non-default name pays for torch here (the command line imports this module)

    known = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    found = known.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"outer_optimizer must be {OUTER_DEFAULT!r} or a torch.optim optimizer "
                         f"({', '.join(sorted(known.values()))}), got {name!r}")
    return found


ELEMENTWISE_OUTER = ("ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                     "SGD")
"""torch.optim optimizers whose step on a chunk of a flat vector equals their step on the whole tensors:
DiLoCo's outer optimizer under ``shard: optimizer`` (troupe.strategies.diloco_shard)."""

_SIZE = Flag()
"""A size or count flag: an integer >= 1, no help text."""

_DILOCO_ONLY = ("outer_optimizer", "outer_lr", "outer_momentum", "pseudo_grad_dtype",
                "fragments", "delay", "merge_alpha")
"""The fields that only DiLoCo reads."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """SINGA's ClusterProto, plus server-group synchronisation and shared memory."""

    nworker_groups: int = option(1, flag=_SIZE)
    """Worker groups run asynchronously to each other."""
    nserver_groups: int = option(1, flag=_SIZE)
    """Each server group holds a full copy of the parameters; must divide nworker_groups."""
    nworkers_per_group: int = option(1, flag=_SIZE)
    """Workers of one group run synchronously (their updates are summed, then applied once)."""
    nservers_per_group: int = option(1, flag=_SIZE)
    """The parameters are cut into slices balanced across the servers of a group."""
    nworkers_per_procs: int = option(1, flag=_SIZE)
    """Workers hosted by one process."""
    nservers_per_procs: int = option(1, flag=_SIZE)
    """Servers hosted by one process."""
    server_worker_separate: bool = option(False, flag=Flag())
    """Servers in processes of their own (True) or sharing the workers' processes (False)."""
    sync_freq: int = option(10, flag=_SIZE, keeps_shape=True)
    """With several server groups: every sync_freq updates a group syncs each slice with its master group."""
    share_memory: bool = option(False, keeps_shape=True, flag=Flag(
        "workers of one process share its parameter memory (in-memory Hogwild)"))
    """Workers of one process share parameter memory (in-memory Hogwild)."""
    fetch_freq: int = option(1, flag=_SIZE, keeps_shape=True)
    """Separate servers: workers copy fresh slices every fetch_freq steps (Downpour's n_fetch); in between
    the servers only acknowledge their updates."""
    staleness_bound: int | None = option(None, flag=_SIZE, keeps_shape=True)
    """Stale-synchronous: a worker group more than this many updates ahead of the slowest waits (None: no bound)."""
    group_merge: Literal["mean", "sum"] = option("mean", keeps_shape=True, flag=Flag(
        "how asynchronous worker groups' changes combine (default mean; sum is SINGA's)"))
    """How the changes of asynchronous worker groups combine. "mean": each group counts 1/G (a Downpour
    server steps with lr / G per group's update; a Hogwild master copy adds a group's change / G), so
    the learning rate means what it means synchronously. "sum": SINGA's rule, each group's full change
    (G times the step; diverges at a learning rate one group trains well with)."""
    fetch: Literal["wait", "background", "predict"] = option("wait", separate_only="", keeps_shape=True, flag=Flag(
        "separate servers: wait for the fresh values in step(), take them in the background while the next "
        "step computes, or that and predict this worker's own update locally (default wait)"))
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
    staleness_lr: Literal["constant", "inverse"] = option("constant", separate_only="", keeps_shape=True, flag=Flag(
        "separate servers: divide the learning rate of an update tau versions stale by tau (inverse) or not "
        "(default constant)"))
    """Separate servers: the learning rate of an update computed on values that are tau updates
    old. "constant": the same for every update. "inverse": divided by max(1, tau) (Zhang et al.,
    "Staleness-aware Async-SGD", IJCAI 2016), so a stale gradient moves the values less."""
    send_updates: Literal["auto", "step"] = option("auto", keeps_shape=True)
    """Separate servers: when a worker's Update messages leave. "step": in ``step()``, after whatever the
    loop did to the gradients (clipping). "auto": in ``step()`` until a step shows that the loop leaves
    the gradients alone between backward and step, then during backward (overlapped with it); always
    in ``step()`` under ``nan_policy="skip"`` (docs/clusters.md)."""

    wire_dtype: Literal["fp32", "fp16", "bf16"] = option(
        "fp32", separate_only="co-located servers exchange fp32", keeps_shape=True,
        flag=Flag("separate servers: precision of the gradients sent and values fetched (default fp32)"))
    """Separate servers: the precision of what crosses the wire after the start, the gradients a
    worker sends and the values it fetches. "fp16" or "bf16" halve both; the servers keep and update
    fp32 values (the first values a worker Puts travel in full). Co-located servers refuse it."""

    wire_topk: float | None = option(
        None, separate_only="co-located servers and in-memory Hogwild exchange dense updates", keeps_shape=True,
        check=_check_topk, flag=Flag("separate servers: send the top FRACTION of each slice's update, with error "
                                     "feedback (default: dense)", metavar="FRACTION"))
    """Separate servers: the fraction of each slice's update a worker sends, in (0, 1): the
    ceil(wire_topk * n) largest-magnitude elements of (its update + what it left out before), as
    (int32 index, value) pairs, values in `wire_dtype`; what it leaves out is kept per slice and
    added to the next step's update (error feedback). Unset: dense updates. Co-located servers refuse it."""

    framework: Literal["singa", "diloco"] = option("singa")
    """How the worker groups combine. "singa": as the layout says (SINGA's four frameworks: one
    group is synchronous; several sync through servers or master copies). "diloco": DiLoCo
    (Douillard et al. 2023): the groups train on their own and every sync_freq steps the mean of
    their pseudo-gradients (outer parameters minus the group's) steps the outer parameters with
    the outer optimizer; every group then adopts them. ``troupe run --framework diloco``."""
    outer_optimizer: str = option(OUTER_DEFAULT, keeps_shape=True, check=_check_outer_optimizer, flag=Flag(
        "DiLoCo: the outer optimizer, nesterov (SGD with Nesterov momentum; default) or a torch.optim name",
        metavar="NAME"))
    """DiLoCo: "nesterov" (torch.optim.SGD with momentum outer_momentum, nesterov=True, the paper's) or the
    name of any torch.optim optimizer (any case), made with lr=outer_lr (and momentum=outer_momentum where
    its constructor takes a momentum)."""
    outer_lr: float = option(0.7, keeps_shape=True, check=_check_outer_lr, flag=Flag(
        "DiLoCo: the outer optimizer's learning rate (default 0.7)"))
    """DiLoCo: the outer optimizer's learning rate (0.7, the paper's; outer SGD at lr 1 without momentum is
    the plain average of the groups' parameters)."""
    outer_momentum: float = option(0.9, keeps_shape=True, check=_check_outer_momentum, flag=Flag(
        "DiLoCo: the outer optimizer's momentum (default 0.9)"))
    """DiLoCo: the outer optimizer's momentum, for an outer optimizer that takes one."""
    pseudo_grad_dtype: Literal["fp32", "bf16", "fp8", "int8", "int4"] = option("fp32", keeps_shape=True, flag=Flag(
        "DiLoCo: the dtype the pseudo-gradients travel in (default fp32)"))
    """DiLoCo: the dtype the pseudo-gradients travel in. fp32: one all-reduce. bf16, fp8 (e4m3), int8, int4
    (fp8 and the integers with absmax scaling per chunk of 1024 elements, int4 two codes a byte): all-gathered, then decoded and summed in
    fp32 in group order, so that every group gets the same mean bit for bit
    (`troupe.strategies.pseudograd`)."""
    fragments: int = option(1, keeps_shape=True, flag=Flag(
        "Streaming DiLoCo: cut the model into K fragments that sync at staggered steps (default 1)", metavar="K"))
    """Streaming DiLoCo (arXiv 2501.18512): the parameters, in `parameters()` order, cut into K contiguous
    fragments balanced by element count (K at most the number of parameter tensors); fragment j takes its
    own outer step (its own slice of the outer optimizer) after every inner step that brings the step
    count to a multiple of sync_freq plus floor(j * sync_freq / K). 1: DiLoCo, everything at once."""
    delay: int = option(0, keeps_shape=True, check=_check_delay, flag=Flag(
        "Streaming DiLoCo: overlap each fragment's exchange with the next TAU inner steps (default 0)",
        metavar="TAU"))
    """Streaming DiLoCo's tau: a fragment's exchange starts at its sync step and runs in the background
    while the next `delay` inner steps run; its outer step and merge (`merge_alpha`) come after the
    `delay`-th of them. 0: at once, blocking. Must be < sync_freq (the exchange lands before the next)."""
    merge_alpha: float = option(0.0, keeps_shape=True, check=_check_merge_alpha, flag=Flag(
        "Streaming DiLoCo: the mixing factor of the delayed merge, in [0, 1) (default 0: adopt the outer values)"))
    """Streaming DiLoCo's mixing factor alpha: at a fragment's merge its parameters become
    alpha * theta (the group's, tau steps further on) + (1 - alpha) * theta_outer (after the outer step).
    0: adopt theta_outer, as DiLoCo does, and the groups are bit for bit equal in that fragment."""

    partition_dim: int | dict[str, int] | None = option(None, check=_check_partition)
    """A partitioned model (`troupe.partition(model)` in the script): every Linear/Conv2d's
    partition_dim (0 batch, 1 output features, -1 one worker), or, in TOML, a table of
    module-name globs -> dim; split inside each worker group of nworkers_per_group workers.
    Unset: the script decides (no partition unless it partitions by hand)."""

    shard: str | None = option(None, keeps_shape=True, check=_check_shard)
    """Co-located servers (AllReduce) in one worker group: "optimizer" or "gradients" shards the
    optimizer state (and the reduced gradients) over the group's processes by elements, as
    ``DistOpt(shard=...)`` does (ZeRO-1 / ZeRO-2, docs/sharding.md): each process holds its server's
    1/k of the state and no second copy of its slice. Unset: each co-located server keeps its slice's
    values beside the full parameters and gradients, as before. Under framework diloco, "optimizer"
    cuts the outer parameters and outer optimizer state over each group's processes, each exchanging
    only its chunk of the pseudo-gradient (docs/diloco.md)."""

    elastic: bool = option(False)
    """Elastic worker groups (what `troupe run --elastic` runs): synchronous data parallelism (or
    DiLoCo) over the nworker_groups groups of nworkers_per_group processes; a dead process restarts
    with its group, which heals from a live one while the others train on. Beside separate servers
    (Downpour, Sandblaster): a dead worker restarts alone and fetches the servers' values."""
    min_groups: int | None = option(None)
    """elastic: a step needs at least this many groups present (`troupe run --min-groups`; unset: 2)."""
    max_groups: int | None = option(None)
    """elastic: at most this many groups step together, the others stand by (`troupe run --max-groups`;
    unset: all)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name), self.server_worker_separate)
        if self.elastic or self.min_groups is not None or self.max_groups is not None:
            self._check_elastic()
            return
        if self.nworker_groups % self.nserver_groups:
            raise ValueError(
                f"nworker_groups ({self.nworker_groups}) must be divisible by nserver_groups "
                f"({self.nserver_groups}): each server group serves the same number of worker groups"
            )
        self._check_diloco()
        self._check_shard()
        _check_packing("workers", self.nworkers_per_group, self.nworkers_per_procs)
        _check_packing("servers", self.nservers_per_group, self.nservers_per_procs)
        if not self.server_worker_separate and self.nworker_procs != self.nserver_procs:
            raise ValueError(
                f"with server_worker_separate false every process hosts workers and servers, so the "
                f"worker processes ({self.nworker_procs} = {self.nworkers} workers / nworkers_per_procs "
                f"{self.nworkers_per_procs}) must equal the server processes ({self.nserver_procs} = "
                f"{self.nservers} servers / nservers_per_procs {self.nservers_per_procs})"
            )

    def _check_elastic(self) -> None:
        if not self.elastic:
            given = f"min_groups {self.min_groups}" if self.min_groups is not None else f"max_groups {self.max_groups}"
            raise ValueError(f"{given} is for elastic worker groups: add elastic: true")
        if self.server_worker_separate and self.framework != "diloco":
            self._check_elastic_servers()
            return
        if self.nworker_groups < 2:
            raise ValueError(f"elastic: true needs nworker_groups >= 2 (a group alone has nobody to heal from), "
                             f"got {self.nworker_groups}")
        diloco = self.framework == "diloco"
        # DiLoCo's servers follow its workers (its own check below says so): no servers of their own
        fields = ("server_worker_separate", "partition_dim") if diloco else \
            ("server_worker_separate", "nserver_groups", "nservers_per_group", "framework", "partition_dim")
        servers = [f"{name} {getattr(self, name)!r}" for name in fields if getattr(self, name) != _FIELDS[name].default]
        if servers:
            raise ValueError(f"elastic: true runs synchronous data parallelism (or DiLoCo) over elastic worker "
                             f"groups, without servers or partition (not yet): leave out {', '.join(servers)} "
                             "(Downpour's or Sandblaster's workers restart alone under troupe run --elastic "
                             "--framework downpour|sandblaster, with the cluster as flags)")
        if diloco:
            self._check_diloco()
            self._check_shard()

    def _check_elastic_servers(self) -> None:
        """elastic: true beside separate servers (Downpour, Sandblaster): the workers restart alone and fetch
        the servers' values (`troupe run --elastic --framework downpour`); no quorum, so no quorum settings."""
        quorum = [f"{name} {getattr(self, name)}" for name in ("min_groups", "max_groups")
                  if getattr(self, name) is not None]
        if quorum:
            raise ValueError(f"elastic: true with separate servers restarts each worker alone and keeps no quorum: "
                             f"leave out {', '.join(quorum)}")
        if self.partition_dim is not None:
            raise ValueError(f"elastic: true with separate servers runs without partition (not yet): leave out "
                             f"partition_dim {self.partition_dim!r}")
        if self.nworker_groups % self.nserver_groups:
            raise ValueError(
                f"nworker_groups ({self.nworker_groups}) must be divisible by nserver_groups "
                f"({self.nserver_groups}): each server group serves the same number of worker groups"
            )
        _check_packing("workers", self.nworkers_per_group, self.nworkers_per_procs)
        _check_packing("servers", self.nservers_per_group, self.nservers_per_procs)

    def _check_shard(self) -> None:
        if self.shard is None:
            return
        if self.framework == "diloco":
            self._check_diloco_shard()
            return
        if self.nworker_groups > 1 or self.share_memory:
            raise ValueError(
                f"shard {self.shard} runs in one worker group of co-located servers (AllReduce); several "
                "asynchronous groups (Hogwild), DiLoCo and shared memory do not shard yet: leave out shard, or "
                "for synchronous sharded groups (HSDP) run without a framework: troupe run --nworker-groups G "
                "--shard ...")

    def _check_diloco_shard(self) -> None:
        """DiLoCo's ``shard: optimizer`` cuts its outer state over each group's processes (strategies/diloco_shard.py)."""
        if self.shard != "optimizer":
            raise ValueError(f"shard {self.shard} under framework diloco: only shard optimizer (DiLoCo's outer "
                             "parameters and outer optimizer state cut over each group's processes) is available; "
                             "the inner step keeps its gradients and optimizer state whole")
        if self.nworkers_per_group < 2:
            raise ValueError(f"shard optimizer under framework diloco cuts the outer state over each group's "
                             f"processes and needs nworkers_per_group >= 2, got {self.nworkers_per_group}")
        if self.partition_dim is not None:
            raise ValueError(f"shard optimizer under framework diloco needs the whole model in each process of a "
                             f"group: leave out partition_dim {self.partition_dim!r} or shard")
        name = outer_optimizer_class(self.outer_optimizer)
        if name not in ELEMENTWISE_OUTER:
            raise ValueError(f"shard {self.shard} under framework diloco steps each process's chunk of the outer "
                             f"parameters alone, which torch.optim.{name} (outer_optimizer {self.outer_optimizer!r}) "
                             f"cannot (it looks beyond each element): use one of {', '.join(ELEMENTWISE_OUTER)}, or "
                             "leave out shard")

    def _check_diloco(self) -> None:
        if self.framework != "diloco":
            given = [f"{name} {getattr(self, name)!r}" for name in _DILOCO_ONLY
                     if getattr(self, name) != _FIELDS[name].default]
            if given:
                raise ValueError(f"{', '.join(given)}: only framework diloco has an outer optimizer "
                                 f"(troupe run --framework diloco; cluster field framework: diloco)")
            return
        if self.delay >= self.sync_freq:
            raise ValueError(f"delay {self.delay} must be < sync_freq {self.sync_freq}: a fragment's exchange "
                             f"must land before its next one starts")
        if self.nworker_groups < 2:
            raise ValueError(f"framework diloco averages worker groups and needs nworker_groups >= 2, "
                             f"got {self.nworker_groups}")
        if self.server_worker_separate or self.nworkers_per_procs != 1:
            raise ValueError(f"framework diloco runs one worker per process without separate servers, got "
                             f"server_worker_separate {self.server_worker_separate}, nworkers_per_procs "
                             f"{self.nworkers_per_procs}")
        if (self.nserver_groups, self.nservers_per_group) != (self.nworker_groups, self.nworkers_per_group):
            raise ValueError(f"framework diloco has no servers of its own: leave nserver_groups and "
                             f"nservers_per_group out (they follow the workers), got {self.nserver_groups}x"
                             f"{self.nservers_per_group} servers for {self.nworker_groups}x"
                             f"{self.nworkers_per_group} workers")

    def make_outer_optimizer(self, params: typing.Sequence[Any]) -> Any:
        """DiLoCo's outer optimizer over `params`: SGD with Nesterov momentum by default, or the named torch.optim one."""
        import inspect
        import warnings

        import torch

        name = outer_optimizer_class(self.outer_optimizer)
        cls = getattr(torch.optim, name)
        kwargs: dict[str, Any] = {"lr": self.outer_lr}
        if self.outer_optimizer == OUTER_DEFAULT:
            kwargs.update(momentum=self.outer_momentum, nesterov=True)
        elif "momentum" in inspect.signature(cls).parameters:
            kwargs["momentum"] = self.outer_momentum
        elif self.outer_momentum != _FIELDS["outer_momentum"].default:
            warnings.warn(f"outer_momentum {self.outer_momentum} has no effect: torch.optim.{name} takes no momentum")
        return cls(params, **kwargs)

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
    def worker_regime(self) -> str:
        """The registered regime of this cluster's workers (`troupe.cluster.regimes`)."""
        if self.framework == "diloco":
            return "elastic-diloco" if self.elastic else "diloco"
        if self.server_worker_separate:
            return "ps-client"
        if self.shard is not None:
            return "co-located-sharded"
        return "in-memory-hogwild" if self.in_memory else "co-located"

    @property
    def groups_wait(self) -> bool:
        """Do the worker groups wait for one another (DiLoCo's outer step), so that none can be left behind?"""
        return self.framework == "diloco"

    @property
    def synchronous(self) -> bool:
        """One worker group: every update waits for the whole group."""
        return self.nworker_groups == 1

    @property
    def servers_fail_over(self) -> bool:
        """Under `troupe run --elastic`: a dead separate server's workers fail over to the same server of
        another server group (asynchronous groups, several server groups) instead of the job ending."""
        return self.server_worker_separate and not self.synchronous and self.nserver_groups > 1

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
        return cls(**with_servers(fields))

    @classmethod
    def from_json(cls, text: str) -> ClusterConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({e}): {text!r}") from None
        return cls.from_dict(fields)


_FIELDS = {f.name: f for f in dataclasses.fields(ClusterConfig)}


def with_servers(fields: dict) -> dict:
    """`fields` with DiLoCo's server layout filled in where not given: each worker hosts one (unused)
    co-located server, so the servers follow the workers (what `roles` and the bootstrap lay out)."""
    if fields.get("framework") != "diloco":
        return fields
    return {"nserver_groups": fields.get("nworker_groups", 1),
            "nservers_per_group": fields.get("nworkers_per_group", 1), **fields}


def choices(name: str, cls: type = ClusterConfig) -> tuple[str, ...]:
    """The values field `name` may take when its type is a ``Literal[...]``, its default first; else ()."""
    hint = _hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def keeps_shape(name: str) -> bool:
    """Does field `name` leave the number of processes and their roles alone? (False for an unknown name.)"""
    f = {f.name: f for f in dataclasses.fields(ClusterConfig)}.get(name)
    return f is not None and f.metadata["keeps_shape"]


def flag_fields(cls: type = ClusterConfig) -> list[dataclasses.Field]:
    """The fields `troupe run` takes as flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag") is not None]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_field(f: dataclasses.Field, value: object, separate: bool) -> None:
    """One field's value: its own check, else the one its type implies; and separate servers where it needs them."""
    allowed = choices(f.name)
    if f.metadata["check"] is not None:
        f.metadata["check"](value, separate)
    elif f.type == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{f.name} must be true or false, got {value!r}")
    elif allowed:
        if value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(allowed)}, got {value!r}")
    elif f.type == "int | None":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{f.name} must be an integer >= 0 or unset, got {value!r}")
    else:
        check_int(f.name, value)
    why = f.metadata["separate_only"]
    if why is not None and value != f.default and not separate:
        raise ValueError(f"{f.name} {value} needs separate servers (server_worker_separate: true)"
                         + (f"; {why}" if why else ""))


def _check_packing(what: str, per_group: int, per_procs: int) -> None:
    # SINGA places whole groups in a process or whole processes in a group, never a mix.
    if per_group % per_procs and per_procs % per_group:
        raise ValueError(
            f"n{what}_per_group ({per_group}) and n{what}_per_procs ({per_procs}) must divide one another"
        )
