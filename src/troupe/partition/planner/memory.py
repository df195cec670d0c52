"""Model-state memory of a plan: parameters, gradients and optimizer state on the worker holding the most.

Worker 0 of a group holds the most: P of a dim-0 or dim -1 layer, P/k of a dim-1 layer (every
worker of a group holds the same P/k). With `optimizer_slots` s (1 for momentum, 2 for Adam),
e bytes per element and a tensor held alike by n ranks, the bytes per element it holds are

    unsharded                                  (1 + 1 + s) * e
    shard "optimizer"    (ZeRO-1)              (1 + 1 + s/n) * e
    shard "gradients"    (ZeRO-2)              (1 + (1 + s)/n) * e
    shard "parameters"   (troupe.shard, FSDP)  (1 + 1 + s)/n * e, plus the largest layer gathered
                                               whole with its gradient (data parallel only)

where n is the ranks that hold the same tensor and share its state: every rank (W) for a
replicated or dim-0 parameter, the G ranks at its place in every worker group for a dim-1
slice or a dim -1 layer (a sharded DistOpt cuts a partitioned model's slices over their
holders, `troupe.strategies.partitioned.ShardedSlices`). Every term is a sum over layers, so
the constrained search (`search.best_dims_within`) runs over the chain exactly as the time does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from troupe.partition.planner.profile import LayerProfile, ModelProfile


class Setup(Protocol):
    """What the memory terms read of a run (`troupe.partition.planner.cost.Setup` has it)."""

    world_size: int
    workers_per_group: int
    optimizer_slots: int

    @property
    def groups(self) -> int: ...

SHARD_MODES = ("optimizer", "gradients", "parameters")
"""What `state_bytes` prices besides an unsharded plan: ZeRO-1, ZeRO-2 (``--shard``) and full sharding
(``troupe.shard``)."""

PLAN_SHARD_MODES = ("optimizer", "gradients")
"""The shard modes a partition plan composes with (a sharded DistOpt over a partitioned model)."""


def check_dims(profile: ModelProfile, dims: Sequence[int]) -> None:
    if len(dims) != len(profile.layers):
        raise ValueError(f"a plan needs one dim per layer ({len(profile.layers)}: {profile.names}), got {list(dims)}")


def check_shard(shard: str | None, dims: Sequence[int]) -> None:
    """`shard` is a known mode, and one that composes with `dims`."""
    if shard is not None and shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    if shard == "parameters" and any(dims):
        raise ValueError("shard 'parameters' (troupe.shard) cannot shard a partitioned model: a partition plan "
                         f"composes with the shard modes {PLAN_SHARD_MODES} (DistOpt(shard=...)) only")


def per_element(shard: str | None, sharers: int, slots: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) elements held per element of a tensor `sharers` ranks hold alike."""
    n = sharers
    if shard is None:
        return 1.0, 1.0, float(slots)
    if shard == "optimizer":
        return 1.0, 1.0, slots / n
    if shard == "gradients":
        return 1.0, 1 / n, slots / n
    return 1 / n, 1 / n, slots / n


def held(layer: LayerProfile, dim: int, k: int) -> float:
    """Elements of `layer` worker 0 holds under `dim`."""
    return layer.params / k if dim == 1 else layer.params


def sharers(dim: int, setup: Setup) -> int:
    """Ranks holding the same elements of a layer with `dim`: all W for dim 0, one per group (G) otherwise."""
    return setup.world_size if dim == 0 else setup.groups


def layer_state(layer: LayerProfile, dim: int, setup: Setup, e: int, shard: str | None = None) -> float:
    """Model-state bytes worker 0 holds for `layer` with `dim` ("parameters": without the gathered layer)."""
    return held(layer, dim, setup.workers_per_group) * e * sum(
        per_element(shard, sharers(dim, setup), setup.optimizer_slots))


def replicated_state(profile: ModelProfile, setup: Setup, shard: str | None = None) -> float:
    """Model-state bytes of the parameters outside the partitionable layers (always on every rank)."""
    return profile.replicated_params * profile.bytes_per_element * sum(
        per_element(shard, setup.world_size, setup.optimizer_slots))


def _gathered(profile: ModelProfile) -> int:
    """Full sharding gathers one layer at a time: the largest, whole."""
    return max([layer.params for layer in profile.layers] + [profile.replicated_params])


def state_bytes(profile: ModelProfile, dims: Sequence[int], setup: Setup, shard: str | None = None) -> float:
    """Model-state bytes on the worker holding the most: parameters, gradients and `optimizer_slots`
    optimizer states of what it holds, each cut over the ranks sharing it per `shard` (the ideal split,
    as measured in docs/sharding.md); "parameters" (data parallel only) adds the largest layer gathered
    whole with its gradient."""
    check_dims(profile, dims)
    check_shard(shard, dims)
    e = profile.bytes_per_element
    total = replicated_state(profile, setup, shard) + sum(
        layer_state(layer, d, setup, e, shard) for layer, d in zip(profile.layers, dims))
    return total + (2 * _gathered(profile) * e if shard == "parameters" else 0)


def param_bytes(profile: ModelProfile, dims: Sequence[int], setup: Setup, shard: str | None = None) -> float:
    """Parameter and optimizer-state bytes on the worker holding the most (`state_bytes` without the
    gradients)."""
    check_dims(profile, dims)
    check_shard(shard, dims)
    e, slots = profile.bytes_per_element, setup.optimizer_slots

    def without_grads(elements: float, n: int) -> float:
        p, _, s = per_element(shard, n, slots)
        return elements * e * (p + s)

    total = without_grads(profile.replicated_params, setup.world_size) + sum(
        without_grads(held(layer, d, setup.workers_per_group), sharers(d, setup))
        for layer, d in zip(profile.layers, dims))
    return total + (_gathered(profile) * e if shard == "parameters" else 0)


def dim0_held(profile: ModelProfile, dims: Sequence[int]) -> float:
    """Elements every rank holds (replicated and dim-0): a sharded step all-gathers them over W."""
    return profile.replicated_params + sum(layer.params for layer, d in zip(profile.layers, dims) if d == 0)


def sliced_held(profile: ModelProfile, dims: Sequence[int], k: int) -> float:
    """Elements of dim 1 and -1 layers worker 0 holds: a sharded step all-gathers them over G."""
    return sum(held(layer, d, k) for layer, d in zip(profile.layers, dims) if d != 0)
