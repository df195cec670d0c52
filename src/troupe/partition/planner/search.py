"""The search: the best partition_dim per layer for a group size, and the candidate list.

`best_chain` is exact: dynamic programming over the layer chain with the previous layer's
dim as the state, so any transition cost (zero in today's runtime, see
`cost.transition_cost`) is priced exactly. `candidates` runs it for every factorisation
W = G x k, adds the hand plans worth comparing (pure data parallel, Krizhevsky's "one weird
trick", all dim 1), the communication-saving options (powerSGD at several ranks) and DiLoCo
over worker groups at several H, and prices them all with `cost.plan_cost` / `cost.diloco_cost`.
Each candidate says how its update relates to synchronous SGD (`Candidate.sync_sgd`). It measures nothing: profiles and links come in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import math
from dataclasses import dataclass, replace

from troupe.partition.planner.cost import (
    OPTIONS,
    OUTER_SLOTS,
    Cost,
    Setup,
    diloco_cost,
    dim0_params,
    layer_cost,
    plan_cost,
    shard_cost,
    transition_cost,
)
from troupe.partition.planner.memory import (
    PLAN_SHARD_MODES,
    SHARD_MODES,
    check_shard,
    layer_state,
    param_bytes,
    replicated_state,
    state_bytes,
)
from troupe.partition.planner.link import Link
from troupe.partition.planner.profile import ModelProfile
from troupe.util import check_int

DILOCO = "diloco"
"""DiLoCo: a cluster framework, listed beside the dist_options (its candidates' option is 'diloco:H')."""

SHARD = "shard"
"""Sharded data parallelism, listed beside the dist_options (its candidates' option is 'shard:MODE')."""

REGIMES = (*OPTIONS, DILOCO, SHARD)
"""What `candidates` can list: every option the cost model prices, DiLoCo and the shard modes."""

LISTED_OPTIONS = ("plain", "fp16", "sparseTopK", "partialUpdate", "powerSGD", DILOCO, SHARD)
"""Regimes `candidates` lists by default (bf16 costs what fp16 does)."""

POWERSGD_RANKS = (1, 2, 4)
"""powerSGD ranks listed by default."""

SYNC_FREQS = (20, 50, 100)
"""DiLoCo's H (inner steps per outer step) listed by default."""

EXACT_OPTIONS = ("plain", SHARD)
"""Options `pick` chooses among by default: the others change what the update computes (a sharded
step computes plain's update, held in parts)."""

PICK_FROM = {"exact": EXACT_OPTIONS, "approx": (*OPTIONS, SHARD), "any": None}
"""`troupe plan --pick-from`: the same update as synchronous SGD; also synchronous SGD on compressed
gradients; also regimes that are not synchronous SGD at all (DiLoCo)."""

DATA_PARALLEL = "data parallel"


def best_chain(
    allowed: Sequence[Sequence[int]],
    node_cost: Callable[[int, int], float],
    edge_cost: Callable[[int, int | None, int], float],
) -> tuple[float, tuple[int, ...]]:
    """Minimum over dim assignments of sum_i node_cost(i, d_i) + edge_cost(i, d_{i-1}, d_i).

    `allowed[i]` lists layer i's dims in order of preference (ties go to the earlier one);
    the first layer's edge has previous dim None. Exact, in O(layers * dims^2).
    """
    best: dict[int | None, tuple[float, tuple[int, ...]]] = {None: (0.0, ())}
    for i, dims in enumerate(allowed):
        if not dims:
            raise ValueError(f"layer {i} has no allowed partition_dim")
        step = {}
        for d in dims:
            here = node_cost(i, d)
            step[d] = min(((total + edge_cost(i, prev, d) + here, path + (d,)) for prev, (total, path) in best.items()),
                          key=lambda entry: entry[0])
        best = step
    return min(best.values(), key=lambda entry: entry[0])


def best_dims(profile: ModelProfile, setup: Setup) -> tuple[int, ...]:
    """The cheapest dims (in `profile.layers` order) for `setup`'s group size and option."""
    if setup.option == "partialUpdate":
        raise ValueError("option 'partialUpdate' costs one chunk of the total dim-0 parameters per step, not a sum "
                         "over layers: search with another option and price fixed plans with plan_cost")
    layers, k, s = profile.layers, setup.workers_per_group, profile.bytes_per_element
    _, dims = best_chain(
        [layer.dims(k) for layer in layers],
        lambda i, d: layer_cost(layers[i], d, setup, profile.batch, s).seconds,
        lambda i, prev, d: transition_cost(prev, d, layers[i], setup).seconds)
    return dims


MEMORY_STEPS = 2**14
"""`best_dims_within` counts memory in steps of the budget / MEMORY_STEPS, rounded up per layer."""


def best_dims_within(profile: ModelProfile, setup: Setup, memory: float, shard: str | None = None) -> tuple[int, ...]:
    """The cheapest dims for `setup` whose model state on the worker holding the most (`memory.state_bytes`,
    with `shard`) fits in `memory` bytes; a ValueError naming the smallest need when none does.

    A constrained shortest path over the chain, solved exactly by dynamic programming over (previous
    dim, memory used): each state keeps the Pareto front of (memory, seconds), so no plan that fits
    and is faster is lost. A Lagrangian sweep of `best_chain` over seconds + lambda * bytes would
    find only the plans on the convex hull of the front and can miss the fastest one that fits; the
    front is small because a layer's memory takes two values (P, or P/k under dim 1). Memory is
    counted in steps of budget / `MEMORY_STEPS`, each layer's rounded up, so the plan found always
    fits; it may miss one within `len(layers)` steps of the budget (where it returns the
    least-memory plan if nothing else fits).
    """
    if shard not in (None, *PLAN_SHARD_MODES):
        raise ValueError(f"a partition plan composes with the shard modes {PLAN_SHARD_MODES} only, got {shard!r}")
    layers, k, s = profile.layers, setup.workers_per_group, profile.bytes_per_element
    fast = best_dims(profile, setup)
    if state_bytes(profile, fast, setup, shard) <= memory:
        return fast
    allowed = [layer.dims(k) for layer in layers]
    need = [{d: layer_state(layer, d, setup, s, shard) for d in dims} for layer, dims in zip(layers, allowed)]
    least = tuple(min(dims, key=lambda d: (n[d], dims.index(d))) for dims, n in zip(allowed, need))
    smallest = state_bytes(profile, least, setup, shard)
    if smallest > memory:
        what = "" if shard is None else f" with shard {shard!r}"
        raise ValueError(f"no partition plan for workers_per_group {k}{what} fits {memory / 2**20:,.1f} MiB of model "
                         f"state per worker: the smallest needs {smallest / 2**20:,.1f} MiB (dims "
                         f"{dict(zip(profile.names, least))}); a larger memory_per_rank, more workers per group, "
                         "or a sharded DistOpt")
    room = memory - replicated_state(profile, setup, shard)
    quantum = room / MEMORY_STEPS
    front: dict[int | None, list[tuple[int, float, tuple[int, ...]]]] = {None: [(0, 0.0, ())]}
    for i, dims in enumerate(allowed):
        step = {}
        for d in dims:
            seconds = layer_cost(layers[i], d, setup, profile.batch, s).seconds
            used = math.ceil(need[i][d] / quantum)
            step[d] = _pareto([(q + used, t + transition_cost(prev, d, layers[i], setup).seconds + seconds, path + (d,))
                               for prev, entries in front.items() for q, t, path in entries
                               if q + used <= MEMORY_STEPS])
        front = step
    found = [entry for entries in front.values() for entry in entries]
    return min(found, key=lambda entry: entry[1])[2] if found else least


def _pareto(entries: list[tuple[int, float, tuple[int, ...]]]) -> list[tuple[int, float, tuple[int, ...]]]:
    """The entries no other beats in both memory and seconds (the first of equal ones), by memory."""
    kept: list[tuple[int, float, tuple[int, ...]]] = []
    for entry in sorted(entries, key=lambda e: (e[0], e[1])):
        if not kept or entry[1] < kept[-1][1]:
            kept.append(entry)
    return kept


def plan_for(profile: ModelProfile, setup: Setup, memory: float | None = None,
             shard: str | None = None) -> dict[str, int]:
    """`best_dims` (within `memory` bytes of model state per worker, if given: `best_dims_within`) as a plan
    for `troupe.partition`: every layer by name (unused ones dim 0)."""
    dims = best_dims(profile, setup) if memory is None else best_dims_within(profile, setup, memory, shard)
    return {**dict(zip(profile.names, dims)), **{name: 0 for name in profile.unused}}


@dataclass(frozen=True)
class Candidate:
    """One priced plan: group size, dims per layer, option."""

    name: str
    workers_per_group: int
    dims: tuple[int, ...]
    layer_names: tuple[str, ...]
    option: str
    cost: Cost
    param_bytes: float
    """On the worker holding the most (see `cost.param_bytes`)."""
    worker_groups: int | None = None
    """DiLoCo's worker groups G (None for the synchronous regimes)."""
    run_flags: str = ""
    """DiLoCo: the `troupe run` flags beyond the framework, G and H that it was priced with."""
    state_bytes: float = 0.0
    """Model-state bytes (parameters, gradients, optimizer state) on the worker holding the most
    (`cost.state_bytes`): what a memory budget is checked against."""

    @property
    def seconds(self) -> float:
        return self.cost.seconds

    @property
    def regime(self) -> str:
        """The option or framework without its setting ('powerSGD:2' -> 'powerSGD')."""
        return self.option.partition(":")[0]

    @property
    def sync_sgd(self) -> str:
        """'exact': the update of synchronous SGD; 'approx': synchronous SGD on compressed gradients;
        'no': not equivalent to synchronous SGD (DiLoCo's local steps and outer optimizer)."""
        if self.regime in EXACT_OPTIONS:
            return "exact"
        return "no" if self.regime == DILOCO else "approx"

    @property
    def plan(self) -> dict[str, int]:
        return dict(zip(self.layer_names, self.dims))

    def dims_text(self) -> str:
        return ",".join(str(d) for d in self.dims) or "-"

    def to_json(self) -> dict:
        return {"candidate": self.name, "workers_per_group": self.workers_per_group, "dims": self.plan,
                "option": self.option, "sync_sgd": self.sync_sgd, "predicted_ms": self.seconds * 1e3,
                "compute_ms": self.cost.compute * 1e3, "intra_ms": self.cost.intra * 1e3,
                "reduce_ms": self.cost.reduce * 1e3, "mb_per_step": self.cost.bytes / 1e6,
                "param_mb": self.param_bytes / 1e6, "state_mb": self.state_bytes / 1e6,
                "worker_groups": self.worker_groups}


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def hand_plans(profile: ModelProfile, k: int) -> dict[str, tuple[int, ...]]:
    """Plans worth comparing by hand, for group size k: dim 1 where k divides the layer's outputs, else 0."""
    def split(layer, want: bool) -> int:
        return 1 if want and layer.allows_dim1(k) else 0

    return {
        "one weird trick": tuple(split(layer, layer.kind == "Linear") for layer in profile.layers),
        "all dim 1": tuple(split(layer, True) for layer in profile.layers),
    }


def _price(profile: ModelProfile, name: str, dims: tuple[int, ...], setup: Setup) -> Candidate:
    label = f"powerSGD:{setup.powersgd_rank}" if setup.option == "powerSGD" else setup.option
    return Candidate(name, setup.workers_per_group, dims, profile.names, label,
                     plan_cost(profile, dims, setup), param_bytes(profile, dims, setup),
                     state_bytes=state_bytes(profile, dims, setup))


SHARD_HOW = {"optimizer": " --shard optimizer", "gradients": " --shard gradients",
             "parameters": " (troupe.shard(model) in the script)"}
"""How to ask troupe for each shard mode (`describe_pick`)."""


def shard_candidates(profile: ModelProfile, base: Setup,
                     plans: Sequence[tuple[str, Setup, tuple[int, ...]]] = ()) -> list[Candidate]:
    """Data parallel over all W ranks with each shard mode: plain's update, its state cut over the ranks;
    and each partition plan of `plans` (name, setup with its k, dims) with the modes a sharded DistOpt
    offers a partitioned model (`PLAN_SHARD_MODES`: the slices cut over their G holders)."""
    if base.world_size == 1:
        return []
    setup = replace(base, workers_per_group=1, option="plain")
    zeros = tuple(0 for _ in profile.layers)
    listed = [(DATA_PARALLEL, setup, zeros, SHARD_MODES)]
    listed += [(name, replace(s, option="plain"), dims, PLAN_SHARD_MODES) for name, s, dims in plans
               if any(dims) and s.groups > 1]  # one group: each slice has one holder, nothing to cut
    return [Candidate(f"{name}, shard {mode}", s.workers_per_group, dims, profile.names, f"{SHARD}:{mode}",
                      shard_cost(profile, s, mode, dims), param_bytes(profile, dims, s, mode),
                      run_flags=SHARD_HOW[mode], state_bytes=state_bytes(profile, dims, s, mode))
            for name, s, dims, modes in listed for mode in modes]


def _variants(setup: Setup, options: Sequence[str], ranks: Sequence[int]) -> list[Setup]:
    """`setup` with each option of `options` (powerSGD once per rank; DiLoCo is not an option)."""
    out = []
    for option in options:
        if option == "powerSGD":
            out += [replace(setup, option=option, powersgd_rank=r) for r in ranks]
        elif option not in (DILOCO, SHARD):
            out.append(replace(setup, option=option))
    return out


def diloco_candidates(profile: ModelProfile, base: Setup, sync_freqs: Sequence[int], pseudo_grad_dtype: str = "fp32",
                      fragments: int = 1, delay: int = 0) -> list[Candidate]:
    """DiLoCo for every G >= 2 worker groups dividing W (data parallel inside each) and H in `sync_freqs`,
    its pseudo-gradients in `pseudo_grad_dtype`; Streaming DiLoCo with `fragments` > 1 (and `delay`).
    The option reads 'diloco:H', then ':DTYPE' and ':K<fragments>' / ':d<delay>' where not the default."""
    zeros = tuple(0 for _ in profile.layers)
    params = profile.replicated_params + sum(layer.params for layer in profile.layers)
    outer = OUTER_SLOTS * params * profile.bytes_per_element
    memory = param_bytes(profile, zeros, replace(base, workers_per_group=1)) + outer
    state = state_bytes(profile, zeros, replace(base, workers_per_group=1)) + outer
    given = [(pseudo_grad_dtype != "fp32", pseudo_grad_dtype, f"--pseudo-grad-dtype {pseudo_grad_dtype}"),
             (fragments > 1, f"K{fragments}", f"--fragments {fragments}"), (delay > 0, f"d{delay}", f"--delay {delay}")]
    suffix = "".join(f":{label}" for on, label, _ in given if on)
    flags = "".join(f" {flag}" for on, _, flag in given if on)
    return [Candidate(f"DiLoCo {g} groups x {base.world_size // g}", 1, zeros, profile.names, f"{DILOCO}:{h}{suffix}",
                      diloco_cost(profile, base, g, h, pseudo_grad_dtype, fragments, delay), memory, worker_groups=g,
                      run_flags=flags, state_bytes=state)
            for g in divisors(base.world_size) if g > 1 for h in sync_freqs]


def _plans(profile: ModelProfile, base: Setup, ks: Iterable[int],
           memory: float | None = None) -> list[tuple[str, Setup, tuple[int, ...]]]:
    """(name, setup with its k, dims) of every plan to list, plain option; with `memory`, also each k's
    fastest plan within it (`best_dims_within`) where that differs from its fastest."""
    zeros = tuple(0 for _ in profile.layers)
    plans = [(DATA_PARALLEL, replace(base, workers_per_group=1), zeros)]
    for k in ks:
        if k == 1:
            continue
        setup = replace(base, workers_per_group=k)
        plans.append((f"best for k={k}", setup, best_dims(profile, setup)))
        if memory is not None:
            try:
                plans.append((f"best for k={k} within budget", setup, best_dims_within(profile, setup, memory)))
            except ValueError:
                pass  # no plan for this k fits: the others say how much each needs
        plans += [(name, setup, dims) for name, dims in hand_plans(profile, k).items()]
    return plans


def candidates(
    profile: ModelProfile,
    world_size: int,
    link: Link,
    *,
    workers_per_group: Sequence[int] | None = None,
    options: Sequence[str] = LISTED_OPTIONS,
    powersgd_ranks: Sequence[int] = POWERSGD_RANKS,
    sync_freqs: Sequence[int] = SYNC_FREQS,
    pseudo_grad_dtype: str = "fp32",
    fragments: int = 1,
    delay: int = 0,
    memory: float | None = None,
    **setup_args: object,
) -> list[Candidate]:
    """Every plan worth listing, priced, fastest first.

    For each group size k (default: every divisor of `world_size`): the exact best dims
    (plain option), the hand plans, and pure data parallel; then each option of `options`
    on pure data parallel and on each k's best plan (an option reduces only the dim-0
    parameters, so it composes with any plan that has some). A plan with every dim 0 is
    data parallel whatever k is: equal plans are listed once, their names joined. powerSGD is
    listed once per rank of `powersgd_ranks` when the profile knows its parameters' shapes;
    "diloco" adds `diloco_candidates` (every G >= 2 dividing W, every H of `sync_freqs`; its
    pseudo-gradients in `pseudo_grad_dtype`, Streaming DiLoCo with `fragments` and `delay`).

    "shard" adds `shard_candidates`: data parallel with each shard mode, and each partition plan
    listed with the modes that compose with it. With `memory` (bytes of model state per worker) each
    k also lists its fastest plan within that budget (`best_dims_within`).

    `setup_args` go to `cost.Setup` (spars, chunk_size, bucket_size, overlap, optimizer_slots).
    """
    check_int("world_size", world_size)
    ks = sorted(set(divisors(world_size) if workers_per_group is None else workers_per_group))
    base = Setup(world_size=world_size, link=link, **setup_args)
    for k in ks:
        replace(base, workers_per_group=k)  # validates: k divides W
    unknown = [o for o in options if o not in REGIMES]
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} (known: {list(REGIMES)})")
    if "plain" not in options:
        options = ("plain", *options)
    if not profile.shapes_known:  # hand-built profiles: powerSGD cannot tell matrices from vectors
        options = tuple(o for o in options if o != "powerSGD")
    found: dict[tuple, Candidate] = {}
    plans = _plans(profile, base, ks, memory)
    for name, setup, dims in plans:
        variants = options if name == DATA_PARALLEL or name.startswith("best") else ("plain",)
        for variant in _variants(setup, variants, powersgd_ranks):
            if variant.option != "plain" and dim0_params(profile, dims) == 0:
                continue  # nothing for the option to reduce
            _add(found, _price(profile, name, dims, variant))
    listed = list(found.values())
    if DILOCO in options:
        listed += diloco_candidates(profile, base, sync_freqs, pseudo_grad_dtype, fragments, delay)
    if SHARD in options:
        shards: dict[tuple, Candidate] = {}
        for cand in shard_candidates(profile, base, plans):
            _add(shards, cand)
        listed += list(shards.values())
    return sorted(listed, key=lambda c: c.seconds)


def _add(found: dict[tuple, Candidate], cand: Candidate) -> None:
    k = 1 if not any(cand.dims) else cand.workers_per_group  # all dim 0: data parallel for any k
    key = (k, cand.dims, cand.option)
    if key in found:
        old = found[key]
        if cand.name not in old.name.split(" = "):
            found[key] = replace(old, name=f"{old.name} = {cand.name}")
    else:
        found[key] = replace(cand, workers_per_group=k) if k != cand.workers_per_group else cand


def pick(cands: Sequence[Candidate], options: Sequence[str] | None = EXACT_OPTIONS,
         memory: float | None = None) -> Candidate:
    """The fastest candidate whose option (its `regime`) is in `options` (None: any option) and whose
    model state fits in `memory` bytes per worker (None: no budget)."""
    eligible = [c for c in cands if options is None or c.regime in options]
    if not eligible:
        raise ValueError(f"no candidate with an option in {options} (candidates' options: "
                         f"{sorted({c.option for c in cands})})")
    fitting = [c for c in eligible if memory is None or c.state_bytes <= memory]
    if not fitting:
        least = min(eligible, key=lambda c: c.state_bytes)
        raise ValueError(f"no plan fits {memory / 2**20:,.1f} MiB of model state per worker: the smallest needs "
                         f"{least.state_bytes / 2**20:,.1f} MiB ({least.name}, option {least.option}); "
                         "more workers, or a larger --memory-per-rank")
    return min(fitting, key=lambda c: c.seconds)
