"""`troupe.shard(model)`: torch's FSDP2 applied per block, on a mesh of troupe's process groups.

Why FSDP2 and not troupe's own code: it already gathers each block's parameters just before
the block runs (forward and backward) and frees them after, reduce-scatters gradients into
DTensor shards, handles tied and frozen parameters and mixed precision, and runs on Gloo.
troupe adds what a job needs around it: joining the job, one starting point on every rank,
the blocks found by default, HSDP over worker groups, and the DistOpt regime that steps it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from troupe.cluster.configuration.sources import from_env as cluster_from_env
from troupe.runtime import world as world_mod
from troupe.strategies.fsdp import CLAIMED_BY, SHARDED_BY, Sharding, check_cluster
from troupe.util import HOLDERS, Refusal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from troupe.runtime.world import World

Blocks = str | Sequence[str] | type[nn.Module] | tuple[type[nn.Module], ...]


def shard(model: nn.Module, *, blocks: Blocks | None = None, mixed_precision: str | MixedPrecisionPolicy | None = None,
          reshard_after_forward: bool = True, groups: int | None = None) -> nn.Module:
    """Shard `model`'s parameters, gradients and (through them) optimizer state over the ranks; return it.

    Every rank calls it with the same model, before making the optimizer over
    ``model.parameters()`` and the DistOpt. Rank 0's parameters and buffers reach every rank
    first. Each block is one FSDP2 unit (gathered for its forward and backward, freed after),
    innermost first, then the model itself.

    >>> model = troupe.shard(GPT(cfg))                       # blocks: the repeated transformer layers
    >>> sgd = troupe.DistOpt(torch.optim.AdamW(model.parameters(), lr=3e-4))
    >>> loss = model(x, y); loss.backward(); sgd.step(); sgd.zero_grad()

    Args:
        blocks: the modules to shard one by one: qualified names (``"layers.0"``), or a module
            class. Default: the children of the model's largest ModuleList/Sequential whose
            children are all of one class (torchtitan's per-transformer-block sharding).
        mixed_precision: ``"bf16"`` computes in bf16 with fp32 master parameters and an fp32
            reduction; or an FSDP2 ``MixedPrecisionPolicy``.
        reshard_after_forward: free each gathered block after its forward (False keeps it until
            backward: less communication, more memory).
        groups: worker groups that each shard the model and replicate each other (HSDP: gradients
            reduce-scattered in the group, then all-reduced across groups). Default: the job's
            cluster's, else 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"troupe.shard takes a torch.nn.Module, got {type(model).__name__}")
    if any(hasattr(p, CLAIMED_BY) for p in model.parameters()):
        raise ValueError("troupe.shard(model) must come before the DistOpt, and a DistOpt was already made over this "
                         "model's parameters: shard the model first, then make the optimizer and the DistOpt over "
                         "model.parameters()")
    names = block_names(model, blocks)  # bad input is refused before torch's FSDP is imported (a second)
    if isinstance(mixed_precision, str) and mixed_precision != "bf16":
        raise ValueError(f"troupe.shard: mixed_precision must be 'bf16', a torch MixedPrecisionPolicy or None, "
                         f"got {mixed_precision!r}")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule) or any(hasattr(p, SHARDED_BY) for p in model.parameters()):
        raise ValueError("troupe.shard: this model is already sharded")
    policy = _policy(mixed_precision)
    world = world_mod.init()
    if any(len(getattr(p, HOLDERS, range(world.world_size))) < world.world_size for p in model.parameters()):
        raise Refusal("troupe.shard cannot shard a model partitioned by troupe.partition (its slices differ from "
                      "rank to rank): shard its optimizer state instead, DistOpt(opt, shard='optimizer' or "
                      "'gradients'), which cuts each slice over the ranks that hold it")

    def wrap(mesh: DeviceMesh) -> None:
        modules = dict(model.named_modules())
        for name in sorted(names, key=lambda n: -n.count(".")):  # innermost first
            fully_shard(modules[name], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)

    if world.membership.elastic:
        groups = _elastic_groups(world, groups)
        # Over the worker group's own process group, kept across quorums; the groups present replicate (the
        # regime all-reduces the shards' gradients across them). A joining group's values come from its heal.
        world.membership.make_mesh(lambda group: wrap(DeviceMesh.from_group(group, world.device.type)))
        _watch_partners(model, world.membership.partner_lost)
    else:
        groups = _groups(world, groups)
        _same_start(world, model)
        wrap(_mesh(world, groups))
    sharding = Sharding(weakref.ref(model), groups, world.world_size // groups)
    for p in model.parameters():
        setattr(p, SHARDED_BY, sharding)
    return model


def block_names(model: nn.Module, blocks: Blocks | None) -> list[str]:
    """The qualified names of the modules `blocks` asks for (the default: `repeated_blocks`)."""
    if blocks is None:
        return repeated_blocks(model)
    modules = {n: m for n, m in model.named_modules() if n}
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)):
        names = [n for n, m in modules.items() if isinstance(m, blocks)]
        if not names:
            kinds = sorted({type(m).__name__ for m in modules.values()})
            raise ValueError(f"troupe.shard: blocks={_describe(blocks)} matches no module of {type(model).__name__}; "
                             f"its module classes are {kinds}")
        return _outermost(names)
    wanted = [blocks] if isinstance(blocks, str) else list(blocks)
    for name in wanted:
        if not isinstance(name, str):
            raise TypeError(f"troupe.shard: blocks must be module names or a module class, got {name!r}")
        if name not in modules:
            candidates = repeated_blocks(model) or [n for n, _ in model.named_children()]
            raise ValueError(f"troupe.shard: blocks names {name!r}, which is not a module of {type(model).__name__}; "
                             f"candidates: {candidates[:12]}")
    return list(dict.fromkeys(wanted))


def repeated_blocks(model: nn.Module) -> list[str]:
    """The children of the model's largest (by parameters) ModuleList or Sequential of two or more
    children of one class, by qualified name; [] when it has none (the model is one unit)."""
    best, best_size = [], 0
    for name, m in model.named_modules():
        children = list(m.named_children())
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
            continue
        if len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            prefix = f"{name}." if name else ""
            best, best_size = [prefix + n for n, _ in children], size
    return best


def _outermost(names: list[str]) -> list[str]:
    """Names not inside another of them (a class that nests in itself shards at its outer level)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _describe(blocks: Any) -> str:
    return "/".join(b.__name__ for b in blocks) if isinstance(blocks, tuple) else blocks.__name__


def _policy(mixed_precision: Any) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if mixed_precision == "bf16":
        # fp32 reduction: a bf16 sum over many ranks loses the small gradients
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"troupe.shard: mixed_precision must be 'bf16', a torch MixedPrecisionPolicy or None, "
                     f"got {mixed_precision!r}")


def _groups(world: World, groups: int | None) -> int:
    """Worker groups over the job's ranks: as given, else the cluster's (checked), else ``TROUPE_GROUPS``
    (`troupe run --nworker-groups G`), else 1."""
    if groups is None:
        cluster = cluster_from_env()
        check_cluster(cluster)
        if cluster is None:
            return world.sync_groups(None, "troupe.shard")
        groups = cluster.nworker_groups
    return world_mod.check_groups(groups, world.world_size, "troupe.shard: groups")


def _watch_partners(model: nn.Module, lost: Any) -> None:
    """An elastic group's FSDP2 exchanges (the all-gathers of forward and backward, the reduce-scatters) wait to
    completion, and a failed one (a partner process died, or froze past the group's timeout) hands the error
    to `lost` (`Elastic.partner_lost`: one line, then the group restarts), not to the script as a traceback."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class Allocate:
        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

    class Gather(Allocate, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001
            try:
                dist.all_gather_single(output_tensor, input_tensor, group=group)
            except RuntimeError as e:
                lost(e)
            return None

    class Scatter(Allocate, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
            try:
                dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            except RuntimeError as e:
                lost(e)
            return None

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(Gather())
            m.set_custom_reduce_scatter(Scatter())


def _elastic_groups(world: World, groups: int | None) -> int:
    """troupe run --elastic: the job's worker groups (--nworker-groups), each of 2 or more processes."""
    options = world.membership.options
    if groups is not None and groups != options.groups:
        raise ValueError(f"troupe.shard(groups={groups}) differs from the elastic job's {options.groups} worker groups: "
                         "under troupe run --elastic leave groups out (--nworker-groups sets them)")
    if options.group_size == 1:
        raise Refusal("troupe.shard under troupe run --elastic shards the model inside each worker group, and these "
                      "groups are of one process: give --nworker-groups G (groups of 2 or more processes)")
    return options.groups


@torch.no_grad()
def _same_start(world: World, model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (whole tensors: before sharding, not DTensors)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    world.job.check_same([(n, tuple(t.shape), str(t.dtype)) for n, t in named], "the model")
    world.job.broadcast_tensors([t.data for _, t in named])


def _mesh(world: World, groups: int) -> DeviceMesh:
    """A 1-D mesh over the job, or a (replicate, shard) mesh: group g holds ranks [g*k, (g+1)*k)."""
    from torch.distributed.device_mesh import DeviceMesh

    device = world.device.type
    if groups == 1:
        return DeviceMesh.from_group(world.job.group or dist.group.WORLD, device)
    shard_comm, replica_comm = world.group_comms(groups)
    return DeviceMesh.from_group([replica_comm.group, shard_comm.group], device,
                                 mesh=torch.arange(world.world_size).view(groups, -1),
                                 mesh_dim_names=("replicate", "shard"))
