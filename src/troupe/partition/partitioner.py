"""The partitioner: cut the job into worker groups, replace a model's layers in place by
partitioned ones, label every parameter with the ranks that hold it, and put the whole
model back together for checkpoints (`full_state_dict`).

It owns the worker groups' communicators (made here, every rank in the same order) and
the `_troupe_holders` labels; it never reduces gradients (DistOpt does, over the holders).
"""

from __future__ import annotations

import sys
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor, nn

from troupe.cluster.configuration import sources as cluster_config
from troupe.partition.connect import WorkerGroup
from troupe.partition.layers import FeatureSplit, OnOneWorker, PartitionedLayer
from troupe.partition.plan import Plan, check_world, resolve_plan
from troupe.util import Refusal
from troupe.runtime import world
from troupe.util import HOLDERS, REPLACED

if TYPE_CHECKING:
    from troupe.partition.planner.link import Link
    from troupe.runtime.comm import Communicator

def _job_comm(comm: Communicator | None) -> Communicator:
    """The job-wide communicator: `comm` if given, else the World's (joining the job if needed)."""
    return comm if comm is not None else world.init().comm


def partition(
    model: nn.Module,
    plan: Plan | None = None,
    workers_per_group: int | None = None,
    *,
    comm: Communicator | None = None,
    default: int | None = None,
    sample: Tensor | None = None,
    link: str | Link = "loopback",
    memory_per_rank: float | str | None = None,
    optimizer_slots: int = 0,
) -> nn.Module:
    """Partition `model`'s nn.Linear / nn.Conv2d layers inside worker groups (SINGA 0.x), in place.

    The world of W ranks is cut into W // k groups of k consecutive ranks; a group computes
    one replica, each worker feeding its own b samples (the same b on every worker). Per layer, partition_dim 0 replicates
    it (data parallel), 1 splits its output features over the group's workers, -1 runs it on
    the group's worker 0 only. Rank 0's parameters and buffers are broadcast first, so every
    rank partitions the same initial model. Every rank must call this with the same model and
    plan (it makes the groups' communicators, a collective).

    >>> model = partition(CNN(), {"conv*": 0, "linear*": 1}, workers_per_group=2)
    >>> loss = F.cross_entropy(model(x_own), y_own)   # x_own: this worker's b samples

    Under a parameter-server cluster (``troupe run --cluster``, ``TROUPE_CLUSTER``) the groups are
    the cluster's worker groups (k = its nworkers_per_group): with separate servers each worker
    Puts, Updates and Gets only its own slices, and a server rank gets `model` back unchanged (it
    trains nothing); with co-located servers (AllReduce, Distributed Hogwild) a slice's one holder
    updates it on its own server and syncs it only with the same worker of the other groups.

    Args:
        plan: one partition_dim for every Linear/Conv2d, or a dict of module-name glob ->
            dim (see `resolve_plan`); "*" or `default` for layers no key matches (0).
            None: the cluster's ``partition_dim``; with no cluster or none set there, `model`
            comes back unchanged (so a script may always call ``troupe.partition(model)``).
        workers_per_group: k, the workers computing one replica; under a cluster its
            nworkers_per_group (giving another k is an error).
        comm: the job-wide communicator (its ranks are the global ranks); the World's by default.
        sample, link: for plan "auto": rank 0 profiles the model on `sample` (one batch of this
            worker's input) and the planner picks every layer's dim for this k on `link` (a
            planner Link or spelling; default the "loopback" constants); every rank gets rank 0's plan.
        memory_per_rank, optimizer_slots: for plan "auto": the bytes of model state a worker may hold
            (a number, or "2GiB"), counting parameters, gradients and `optimizer_slots` optimizer states
            (1 for SGD with momentum, 2 for Adam): the fastest plan that fits, or one ValueError naming the
            smallest need (docs/planner.md).
    """
    budget = _check_budget(plan, memory_per_rank, optimizer_slots)
    cluster = cluster_config.from_env() if comm is None else None
    if cluster is not None:
        plan = cluster.partition_dim if plan is None else plan
        if plan is None:
            return model
        if workers_per_group not in (None, cluster.nworkers_per_group):
            raise ValueError(f"workers_per_group {workers_per_group} differs from the cluster's nworkers_per_group "
                             f"({cluster.nworkers_per_group}): under a cluster a worker group computes one replica")
        workers_per_group = cluster.nworkers_per_group
        if cluster.elastic:  # elastic DiLoCo: its worker groups are the elastic groups
            return _partition_elastic(model, plan, workers_per_group, default, sample, link, budget, optimizer_slots)
        resolve_plan(model, plan if plan != "auto" else 0, workers_per_group, default=default)  # before joining
        from troupe.cluster import bootstrap  # the cluster's worker groups (its heavier modules load here only)

        cluster_job = bootstrap.joined(cluster, world.init())
        if cluster_job.role.worker is None:
            return model  # a server rank: its DistOpt serves the slices, it computes nothing
        job = cluster_job.workers_comm
    else:
        if plan is None:
            return model
        job = _job_comm(comm)
        if comm is None and world.init().membership.elastic:
            return _partition_elastic(model, plan, workers_per_group, default, sample, link, budget, optimizer_slots)
        if workers_per_group is None:
            raise ValueError("partition needs workers_per_group (the workers computing one replica)")
    if isinstance(plan, str) and plan == "auto":
        from troupe.partition.planner.auto import auto_plan  # only "auto" needs the planner and its profiling

        plan = auto_plan(model, workers_per_group, job, sample=sample, link=link, memory=budget,
                         optimizer_slots=optimizer_slots)
    dims = resolve_plan(model, plan, workers_per_group, default=default)
    ngroups = check_world(job.world_size, workers_per_group)
    moved = [name for name, dim in dims.items() if dim != 0]
    _check_untied(model, moved)
    job.broadcast_tensors([*model.parameters(), *model.buffers()])  # every rank slices rank 0's model
    if cluster is not None:  # the cluster's worker groups, made when every rank joined it
        g, j = cluster_job.role.worker
        group = WorkerGroup(cluster_job.group_comms[g] if workers_per_group > 1 else None, workers_per_group, j, g,
                            ngroups)
    else:
        group = _make_group(job, workers_per_group, ngroups)
    return _slice(model, dims, group)


def _check_budget(plan: Plan | None, memory_per_rank: float | str | None, optimizer_slots: int) -> float | None:
    """The budget of plan "auto" in bytes (None: none), checked on every rank before any collective."""
    if memory_per_rank is None and optimizer_slots == 0:
        return None  # the planner (and its imports) only for plan "auto"
    from troupe.partition.planner.auto import check_budget

    return check_budget(plan, memory_per_rank, optimizer_slots)


def _partition_elastic(model: nn.Module, plan: Plan, workers_per_group: int | None, default: int | None,
                       sample: Tensor | None = None, link: str | Link = "loopback", budget: float | None = None,
                       optimizer_slots: int = 0) -> nn.Module:
    """Under `troupe run --elastic`: the worker group computing one replica is the elastic group
    (`--nworker-groups`), whose communicator is made anew for every quorum. Nothing is broadcast:
    the process stands by alone until `troupe.track`, whose heal gives every group the source
    group's values place by place (process j of a group holds slice j, as its counterparts do)."""
    w = world.init()
    membership = w.membership
    k = membership.options.group_size
    if workers_per_group not in (None, k):
        raise Refusal(f"workers_per_group {workers_per_group} differs from the elastic job's worker groups of {k} "
                      f"processes: under --elastic a worker group computes one replica (troupe run --elastic "
                      f"--nworker-groups G for groups of {workers_per_group}, or workers_per_group={k})")
    if isinstance(plan, str) and plan == "auto":
        plan = _shared_auto_plan(w, model, k, sample, link, budget, optimizer_slots)
    dims = resolve_plan(model, plan, k, default=default)
    _check_untied(model, [name for name, dim in dims.items() if dim != 0])
    comm = None
    if k > 1:  # (a group of one holds every slice: nothing to exchange, nothing partitioned)
        comm = _GroupLink(w.replica_comms(escape=False)[0], membership)
        w.partitioned, w.replica_group = True, comm
    return _slice(model, dims, WorkerGroup(comm, k, membership.place, membership.group, membership.options.groups))


AUTO_PLAN_KEY = "partition/auto-plan"
"""Where an elastic job keeps its plan "auto" in the launcher's store, for every process and every restart."""


def _shared_auto_plan(w: world.World, model: nn.Module, k: int, sample: Tensor | None, link: str | Link,
                      budget: float | None = None, optimizer_slots: int = 0) -> Plan:
    """Plan "auto" under --elastic: every process stands by alone when it partitions, so rank 0 plans for the
    whole job in its own process and posts the plan in the launcher's store; every other process waits for
    it there, and a process started again later takes the same plan (the groups must compute one replica).

    With link "job" the job's processes in their first lives first meet in a group of their own
    (`Elastic.first_lives`) and time the step's collectives together as a fixed job does (`auto_plan`);
    each then offers the plan to the store, where the first one stays. A process lost meanwhile fails
    that group: rank 0 (in whichever life) then plans with the loopback link's constants, with a
    warning, and every process takes what the store holds, so that all groups compute one replica."""
    import json

    from troupe.partition.planner.auto import auto_plan, check_sample, plan_here, plan_of
    from troupe.partition.planner.link import Link as LinkType
    from troupe.partition.planner.link import parse_link

    check_sample(sample)
    membership, store = w.membership, w.membership.store
    in_job = isinstance(link, str) and link.strip().lower() == "job"
    if in_job and not store.check([AUTO_PLAN_KEY]) and not membership.incarnation:
        from troupe.runtime.comm import Communicator

        try:
            with membership.first_lives(AUTO_PLAN_KEY, w.world_size):
                timed = auto_plan(model, k, Communicator(), sample=sample, link="job", memory=budget,
                                  optimizer_slots=optimizer_slots)
            store.compare_set(AUTO_PLAN_KEY, "", json.dumps(["ok", timed]))
        except RuntimeError as e:
            if w.rank == 0:
                warnings.warn(f"plan 'auto' with link 'job': a process was lost while the job timed its step "
                              f"({str(e).splitlines()[0][:160]}); planned with the loopback link's constants")
    if not store.check([AUTO_PLAN_KEY]) and w.rank == 0:
        named = parse_link("loopback") if in_job else link if isinstance(link, LinkType) else parse_link(link)
        status, value = plan_here(model, k, w.world_size, sample, named, None, budget, optimizer_slots)
        store.compare_set(AUTO_PLAN_KEY, "", json.dumps([status, value]))
    return plan_of(json.loads(store.get(AUTO_PLAN_KEY)))  # waits for the plan


class _GroupLink:
    """An elastic worker group's communicator, as its partitioned layers use it: an exchange that fails
    means a partner process is gone (the group restarts as a whole), which the membership handles."""

    def __init__(self, comm: Communicator, membership: Any):
        self._comm, self._membership = comm, membership

    def __getattr__(self, name: str):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if not self._membership.joined:
                raise RuntimeError("under troupe run --elastic a partitioned model computes with its worker group, "
                                   "which forms when the group joins the job: call troupe.track(model=..., "
                                   "optimizer=...) before the first forward")
            try:
                return attr(*args, **kwargs)
            except RuntimeError as e:
                self._membership.partner_lost(e)
                raise

        return call


def _slice(model: nn.Module, dims: dict[str, int], group: WorkerGroup) -> nn.Module:
    """Replace every layer of dim 1 or -1 by its partitioned layer and label every parameter with its holders."""
    everyone = tuple(range(group.ngroups * group.workers_per_group))
    for p in model.parameters():
        setattr(p, HOLDERS, everyone)
    for name in (name for name, dim in dims.items() if dim != 0):
        layer = model.get_submodule(name)
        old = list(layer.parameters())  # before the partitioned layer takes the module apart
        new = FeatureSplit(layer, group) if dims[name] == 1 else OnOneWorker(layer, group)
        holders = group.holders(group.index) if dims[name] == 1 else group.holders(0)
        for p in new.parameters():
            setattr(p, HOLDERS, holders)
        kept = {id(p) for p in new.parameters()}
        for p in old:
            if id(p) not in kept:
                setattr(p, REPLACED, name)
        _replace(model, layer, new)
    return model


def _check_untied(model: nn.Module, names: list[str]) -> None:
    """A layer to slice or move must not share a parameter with another module (the tie would
    break); one module registered under two names is fine: it is replaced under both."""
    owners: dict[int, dict[int, str]] = defaultdict(dict)  # parameter -> owning module -> a name
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners[id(p)].setdefault(id(module), f"{mname}.{pname}" if mname else pname)
    for name in names:
        for p in model.get_submodule(name).parameters():
            if len(owners[id(p)]) > 1:
                raise Refusal(f"{name} shares a parameter with another module ({sorted(owners[id(p)].values())}): "
                              f"a tied parameter cannot be partitioned; leave {name} out of the plan (partition_dim "
                              "0: it stays whole on every worker)")


def _make_group(job: Communicator, k: int, ngroups: int) -> WorkerGroup:
    """This rank's worker group; every rank makes every group's communicator, in group order."""
    me = job.rank
    if k == 1:
        comm = None
    elif ngroups == 1:
        comm = job
    else:
        comms = [job.new_group(list(range(g * k, (g + 1) * k))) for g in range(ngroups)]
        comm = comms[me // k]
    return WorkerGroup(comm, k, me % k, me // k, ngroups)


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` wherever `old` is registered (a module shared under two names is replaced under both)."""
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if module is old:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, Tensor]:
    """The unpartitioned, unsharded model's state_dict on every rank (a collective: every rank calls it).

    Split layers are all-gathered, worker-0 layers broadcast from worker 0, and a model sharded
    by `troupe.shard` is gathered one tensor at a time; the keys are the original model's, so
    ``plain_model.load_state_dict(full_state_dict(model))`` works. ``rank0_only=True`` returns
    it on rank 0 and {} elsewhere: the other ranks hold one gathered tensor at a time.
    """
    local = model.state_dict()
    owned: dict[str, list[str]] = defaultdict(list)
    for key in local:
        owned[key.rpartition(".")[0]].append(key)
    whole: dict[int, dict[str, Tensor]] = {}
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if isinstance(module, PartitionedLayer):
            if id(module) not in whole:  # shared under two names: one collective
                whole[id(module)] = module.full_tensors()
            out.update({prefix + k: v for k, v in whole[id(module)].items()})
        else:
            out.update({key: local[key] for key in owned.get(name, [])})
    keep = not rank0_only or world.init().comm.rank == 0
    dtensor = sys.modules.get("torch.distributed.tensor")  # none exists before troupe.shard imports it
    gathered = {}
    for key, v in out.items():  # every rank gathers the same tensors in the same order
        v = v.full_tensor() if dtensor is not None and isinstance(v, dtensor.DTensor) else v
        if keep:
            gathered[key] = v
    return gathered


class LayerInfo(NamedTuple):
    """One row of `describe`."""

    name: str
    type: str
    partition_dim: int
    local_params: int
    """Parameter elements this rank holds for the layer."""


def describe(model: nn.Module) -> list[LayerInfo]:
    """(name, type, partition_dim, local parameter count) for every leaf module and every module
    with parameters of its own, in module order (partitioned or not)."""
    rows = []
    for name, module in model.named_modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, PartitionedLayer):
            rows.append(LayerInfo(name, module.kind, module.partition_dim, own))
        elif own or not any(True for _ in module.children()):
            rows.append(LayerInfo(name, type(module).__name__, 0, own))
    return rows
