"""The cost model: predicted step time, bytes per step and parameter memory of a partition plan.

It models what troupe's partition runtime does (connect.py, layers.py, DistOpt's
reductions), with W = G groups x k workers, b samples per worker, B = k*b per group,
s bytes per element, a link (alpha, beta), and per layer P parameters, A_in / A_out
activation elements per sample and c(n, parts) forward+backward seconds:

    all-reduce over n ranks of m bytes:  messages*alpha + 2(n-1)/n*m*beta   (0 when n == 1)
    dim 0:   c(b) + exposed(all-reduce over W of P*s, ceil(P/bucket) messages)
    dim 1:   c(B, k) + [alpha + (k-1)*b*A_in*s*beta]              forward all-gather of the input
                     + 2*[alpha + (k-1)/k*b*A_out*s*beta]          all-to-all, forward and backward
                     + g*[alpha + 2(k-1)*b*A_in*s*beta]            reduce-scatter of the input gradient
                     + all-reduce over G of P/k*s                  the slice's holders
    dim -1:  c(B) + (k-1)*[2*alpha + b*(A_in + A_out)*s*beta]      forward, serialised at worker 0
                  + (k-1)*[alpha + b*A_out*s*beta] + g*(k-1)*[alpha + b*A_in*s*beta]   backward
                  + all-reduce over G of P*s                       the group roots
    replicated leaves: c_rest(b) + exposed(all-reduce over W of P_rest*s)
    transition between consecutive layers: 0 (see `transition_cost`)
    synchronisation: sync, once per step when W > 1 (see `Setup.sync`)

Each kind of exchange inside a group (all-gather, all-to-all, reduce-scatter, send) may
see a link of its own (`Setup.exchange_links`: once processes share cores, a collective's
cost depends on its kind, measured by `instep`); reductions see `link`.

g is 1 when backward needs the layer's input gradient (0 for the model's first layer),
a layer called m times per forward pays its compute and exchanges m times. "bytes" are
the bytes whose transfer time is charged: what the busiest worker (worker 0) sends or,
for its serialised exchanges, receives. The communication-saving options replace the
data-parallel reduction of dim-0 (and replicated) parameters only: partitioned slices
are always reduced in fp32 over their holders, which is what the runtime does.

powerSGD (rank r) sends, per matrix n x m (first dim x the rest) that shrinks at least 2x,
P (n*r) in a first all-reduce with the tensors that travel whole, then Q (m*r) in a second:
two rounds per bucket. Its matrix products (M Q, M^T P, P Q^T: 6*r*n*m flops) are charged
as compute, scaled from the layer's own forward+backward time ((4 + 2g)*b*positions*n*m
flops), see `lowrank_seconds`. DiLoCo (`diloco_cost`) is a framework, not an option: a
data-parallel step inside each of G worker groups, plus one all-reduce of the whole model
among the groups every H steps, charged as 1/H of it per step.

One deviation, in alpha only: the runtime fuses small gradients into shared buckets and
all of a worker's partitioned slices into one message; here each layer pays its own
alpha(s), so the cost stays a sum over layers and the search over the chain is exact.
`Setup.fused_reductions` narrows it: a layer pays the fraction P / bucket_size of a
message and the step one message, still a sum over layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from troupe.partition.planner.link import Link
from troupe.partition.planner.memory import (  # noqa: F401  (param_bytes, state_bytes: the cost model's memory terms)
    SHARD_MODES,
    check_dims,
    check_shard,
    dim0_held,
    param_bytes,
    sliced_held,
    state_bytes,
)
from troupe.partition.planner.profile import LayerProfile, ModelProfile
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE
from troupe.util import check_int

DEFAULT_CHUNK_SIZE = 2**17
"""Partial update's elements per step: troupe.strategies.compressed.DEFAULT_CHUNK_SIZE, written
again because importing strategies (which imports partition) would close an import cycle."""

OPTIONS = ("plain", "fp16", "bf16", "sparseTopK", "partialUpdate", "powerSGD")
"""The dist_options the model prices (SINGA's names)."""

MIN_COMPRESSION_RATE = 2.0
"""powerSGD compresses an n x m matrix only if (n + m) * r * 2 < n * m: torch's (and troupe's) default."""

PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")
"""The dtypes DiLoCo's pseudo-gradients may travel in (`ClusterConfig.pseudo_grad_dtype`)."""

OUTER_SLOTS = 2
"""DiLoCo keeps the outer parameters and the outer (Nesterov) momentum: two parameter-sized copies."""

INDEX_BYTES = 4
"""Top-K sends an int32 index with every value."""

EXCHANGES = ("all_gather", "all_to_all", "reduce_scatter", "send")
"""The kinds of exchange inside a group: a dim-1 layer all-gathers its input, all-to-alls its
output (forward and backward) and reduce-scatters its input's gradient; a dim -1 layer sends."""


@dataclass(frozen=True)
class Cost:
    """Seconds split by kind, and bytes per step; costs add."""

    compute: float = 0.0
    intra: float = 0.0
    """Exchanges inside the worker group (connection layers)."""
    reduce: float = 0.0
    """Gradient/parameter reductions across groups (exposed part)."""
    bytes: float = 0.0
    sync: float = 0.0
    """The step's wait for its ranks at the first synchronisation (`Setup.sync`)."""

    @property
    def seconds(self) -> float:
        return self.compute + self.intra + self.reduce + self.sync

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.compute + other.compute, self.intra + other.intra, self.reduce + other.reduce,
                    self.bytes + other.bytes, self.sync + other.sync)

    def times(self, m: int) -> Cost:
        return Cost(self.compute * m, self.intra * m, self.reduce * m, self.bytes * m, self.sync * m)


ZERO = Cost()


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything about a run the cost depends on, except the model and the plan."""

    world_size: int
    workers_per_group: int = 1
    link: Link
    option: str = "plain"
    spars: float = 0.05
    """sparseTopK: fraction of each gradient sent."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """partialUpdate: parameter elements averaged per step."""
    powersgd_rank: int = 1
    """powerSGD: columns of the factors P and Q."""
    bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements per data-parallel bucket (each bucket is one message)."""
    overlap: float = 0.0
    """Fraction of the data-parallel reduction hidden behind backward (see `exposed`)."""
    optimizer_slots: int = 0
    """Optimizer state per parameter, in parameter-sized tensors (1 for momentum, 2 for Adam)."""
    exchange_links: Mapping[str, Link] | None = None
    """Links of the exchanges inside a worker group by kind (`EXCHANGES`); a kind not given
    (or None) sees `link`. Measured by `instep.calibrate`."""
    sync: float = 0.0
    """Seconds a step waits once, at its first synchronisation, beyond that collective's alpha
    and beta: processes sharing oversubscribed cores end their compute apart. 0 on cores of
    their own; measured by `instep.calibrate`."""
    fused_reductions: bool = False
    """Count reduction messages as the runtime sends them: one per step, plus P / bucket_size
    (a fraction) per layer's reduced parameters, since buckets and partitioned slices are
    fused across layers. False: each layer pays its own ceil(P / bucket_size) (and a slice
    reduction one), an upper bound that keeps the cost a plain sum over layers; it matters
    when alpha is large, as on oversubscribed cores (`instep`)."""

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        check_int("workers_per_group", self.workers_per_group)
        if self.world_size % self.workers_per_group:
            raise ValueError(f"workers_per_group ({self.workers_per_group}) must divide the world size "
                             f"({self.world_size})")
        if self.option not in OPTIONS:
            raise ValueError(f"option must be one of {OPTIONS}, got {self.option!r}")
        if not 0 < self.spars <= 1:
            raise ValueError(f"spars must be in (0, 1], got {self.spars!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        check_int("chunk_size", self.chunk_size)
        check_int("powersgd_rank", self.powersgd_rank)
        check_int("bucket_size", self.bucket_size)
        check_int("optimizer_slots", self.optimizer_slots, minimum=0)
        if not math.isfinite(self.sync) or self.sync < 0:
            raise ValueError(f"sync must be a finite number of seconds >= 0, got {self.sync!r}")
        unknown = sorted(set(self.exchange_links or ()) - set(EXCHANGES))
        if unknown:
            raise ValueError(f"exchange_links: unknown kinds {unknown} (known: {EXCHANGES})")

    @property
    def groups(self) -> int:
        """G: worker groups (replicas)."""
        return self.world_size // self.workers_per_group

    def exchange(self, kind: str) -> Link:
        """The link exchanges of `kind` (one of `EXCHANGES`) inside a group see."""
        return (self.exchange_links or {}).get(kind, self.link)


def exposed(seconds: float, setup: Setup) -> float:
    """The part of the bucketed data-parallel reduction backward does not hide.

    Assumption (the one place to calibrate): a fixed fraction `setup.overlap` of it runs
    under backward; the default 0 charges it all (no overlap). Reductions of partitioned
    slices run after the buckets, synchronously, and are always charged in full.
    """
    return (1.0 - setup.overlap) * seconds


def all_reduce(link: Link, ranks: int, nbytes: float, messages: float = 1) -> Cost:
    """Ring all-reduce: each rank sends 2(n-1)/n of the buffer."""
    if ranks == 1 or nbytes == 0:
        return ZERO
    sent = 2 * (ranks - 1) / ranks * nbytes
    return Cost(reduce=link.seconds(sent, messages), bytes=sent)


def _buckets(params: float, setup: Setup) -> float:
    if setup.fused_reductions:
        return params / setup.bucket_size
    return max(1, math.ceil(params / setup.bucket_size))


def _matrix(shape: Sequence[int]) -> tuple[int, int] | None:
    """A tensor of two or more dims as powerSGD views it (first dim x the rest); None for a vector."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else None


def compresses(shape: Sequence[int], rank: int) -> int:
    """The rank powerSGD sends `shape` at, or 0 when it travels whole (a vector, or factors not 2x smaller)."""
    matrix = _matrix(shape)
    if matrix is None:
        return 0
    n, m = matrix
    r = min(rank, n, m)  # torch clamps the rank to the smaller side (which then never compresses)
    return r if (n + m) * r * MIN_COMPRESSION_RATE < n * m else 0


def lowrank_elements(shapes: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """powerSGD's elements per step: (round one: P factors + tensors sent whole, round two: Q factors)."""
    first = second = 0
    for shape in shapes:
        r = compresses(shape, rank)
        if r:
            n, m = _matrix(shape)
            first, second = first + n * r, second + m * r
        else:
            first += math.prod(shape)
    return first, second


def dp_reduction(params: int, setup: Setup, s: int, shapes: Sequence[Sequence[int]] | None = None) -> Cost:
    """Data-parallel reduction (over all W ranks) of `params` replicated parameters, per the option
    (powerSGD needs the parameters' `shapes`)."""
    n, link = setup.world_size, setup.link
    if n == 1 or params == 0 or setup.option == "partialUpdate":  # partial update: see `partial_update`
        return ZERO
    messages = _buckets(params, setup)
    if setup.option == "powerSGD":
        if shapes is None:
            raise ValueError(f"option 'powerSGD' needs the shapes of the {params} parameters it reduces "
                             "(profile_model records them)")
        first, second = lowrank_elements(shapes, setup.powersgd_rank)
        cost = all_reduce(link, n, first * s, messages) + all_reduce(link, n, second * s, messages)
    elif setup.option in ("fp16", "bf16"):
        cost = all_reduce(link, n, params * 2, messages)
    elif setup.option == "sparseTopK":
        payload = math.ceil(setup.spars * params) * (INDEX_BYTES + s)
        received = (n - 1) * payload  # all-gathered: payloads of different ranks cannot be summed
        cost = Cost(reduce=link.seconds(received, messages), bytes=received)
    else:
        cost = all_reduce(link, n, params * s, messages)
    return Cost(reduce=exposed(cost.reduce, setup), bytes=cost.bytes)


def partial_update(dim0_params: int, setup: Setup, s: int) -> Cost:
    """partialUpdate's one chunk of the replicated parameters averaged per step (after the update,
    not overlapped): the parameters are cut into K = ceil(P0/chunk) equal chunks, one per step."""
    if setup.option != "partialUpdate" or setup.world_size == 1 or dim0_params == 0:
        return ZERO
    chunk = dim0_params / math.ceil(dim0_params / setup.chunk_size)
    return all_reduce(setup.link, setup.world_size, chunk * s)


def _msg(link: Link, nbytes: float, messages: float = 1) -> Cost:
    return Cost(intra=link.seconds(nbytes, messages), bytes=nbytes)


def _dim1_exchanges(layer: LayerProfile, setup: Setup, b: int, s: int) -> Cost:
    k, exchange = setup.workers_per_group, setup.exchange
    g = 1 if layer.input_grad else 0
    gather = _msg(exchange("all_gather"), (k - 1) * b * layer.in_elems * s)
    to_owners = _msg(exchange("all_to_all"), (k - 1) / k * b * layer.out_elems * s)
    scatter = _msg(exchange("reduce_scatter"), g * 2 * (k - 1) * b * layer.in_elems * s, g)  # Gloo: all-reduce bytes
    return gather + to_owners + to_owners + scatter


def _root_exchanges(layer: LayerProfile, setup: Setup, b: int, s: int) -> Cost:
    k, link = setup.workers_per_group, setup.exchange("send")
    g = 1 if layer.input_grad else 0
    forward = _msg(link, (k - 1) * b * (layer.in_elems + layer.out_elems) * s, 2 * (k - 1))
    backward = _msg(link, (k - 1) * b * (layer.out_elems + g * layer.in_elems) * s, (1 + g) * (k - 1))
    return forward + backward


def layer_cost(layer: LayerProfile, dim: int, setup: Setup, batch: int, s: int = 4) -> Cost:
    """One layer's cost per step with partition_dim `dim` (checked against the layer)."""
    k, b = setup.workers_per_group, batch
    if dim not in layer.dims(k):
        raise ValueError(f"{layer.name}: partition_dim {dim} is not possible with workers_per_group {k} "
                         f"(possible: {layer.dims(k)})")
    if dim == 0:
        return (Cost(compute=layer.compute(b)).times(layer.calls) + dp_reduction(layer.params, setup, s, layer.shapes)
                + Cost(compute=lowrank_seconds(layer, setup, b)))
    if dim == 1:
        work = Cost(compute=layer.compute(k * b, k)) + _dim1_exchanges(layer, setup, b, s)
        return work.times(layer.calls) + _slice_reduction(layer.params / k, setup, s)
    work = Cost(compute=layer.compute(k * b)) + _root_exchanges(layer, setup, b, s)
    return work.times(layer.calls) + _slice_reduction(layer.params, setup, s)


def lowrank_seconds(layer: LayerProfile, setup: Setup, batch: int) -> float:
    """powerSGD's matrix products for a dim-0 layer, scaled from the layer's measured time.

    One call's forward+backward on b samples is (4 + 2g)*b*q*n*m flops for a weight n x m
    applied at q = A_out / out_size positions (forward, weight gradient, input gradient when
    g = 1); powerSGD's M Q, M^T P and P Q^T are 6*r*n*m. Orthogonalising P (about n*r^2) and
    the error feedback (elementwise) are left out: small beside the products.
    """
    if setup.option != "powerSGD" or setup.world_size == 1 or not layer.shapes:
        return 0.0
    weight = sum(math.prod(shape) for shape in layer.shapes if _matrix(shape))  # n*m
    positions = layer.out_elems / layer.out_size
    per_flop = layer.compute(batch) / ((6 if layer.input_grad else 4) * batch * positions * weight)
    return sum(6 * r * math.prod(shape) * per_flop
               for shape in layer.shapes if (r := compresses(shape, setup.powersgd_rank)))


def _slice_reduction(params: float, setup: Setup, s: int) -> Cost:
    """A partitioned layer's parameters, reduced among their holders (one per group)."""
    messages = params / setup.bucket_size if setup.fused_reductions else 1
    return all_reduce(setup.link, setup.groups, params * s, messages)


def transition_cost(prev_dim: int | None, dim: int, layer: LayerProfile, setup: Setup) -> Cost:
    """Extra cost of entering `layer` with `dim` after a layer with `prev_dim` (None: first layer).

    Zero in this runtime: every partitioned layer takes and returns activations in the layout
    at module boundaries ("own b samples, all features"), so its own exchanges (priced in
    `layer_cost`) are the whole connection. A fused dim1 -> dim1 connection (connect.py's
    "later optimisation") would make this the place where it saves.
    """
    return ZERO


def replicated_cost(profile: ModelProfile, setup: Setup) -> Cost:
    """Everything outside the partitionable layers: computed on b samples, reduced over W."""
    s = profile.bytes_per_element
    reduction = dp_reduction(profile.replicated_params, setup, s, profile.replicated_shapes)
    return Cost(compute=profile.replicated_seconds) + reduction


def dim0_params(profile: ModelProfile, dims: Sequence[int]) -> int:
    """Parameters in the data-parallel reduction: replicated ones and those of dim-0 layers."""
    return profile.replicated_params + sum(layer.params for layer, d in zip(profile.layers, dims) if d == 0)


def plan_cost(profile: ModelProfile, dims: Sequence[int], setup: Setup) -> Cost:
    """Predicted cost per step of the whole plan (`dims` in `profile.layers` order)."""
    check_dims(profile, dims)
    s = profile.bytes_per_element
    total = replicated_cost(profile, setup) + partial_update(dim0_params(profile, dims), setup, s)
    if setup.world_size > 1:
        total = total + Cost(sync=setup.sync)
        if setup.fused_reductions:
            total = total + Cost(reduce=setup.link.alpha)  # the step's one fixed reduction message
    prev = None
    for layer, dim in zip(profile.layers, dims):
        total = total + transition_cost(prev, dim, layer, setup) + layer_cost(layer, dim, setup, profile.batch, s)
        prev = dim
    return total


def shard_cost(profile: ModelProfile, setup: Setup, shard: str, dims: Sequence[int] | None = None) -> Cost:
    """A step of plan `dims` (None: data parallel) with `shard`: the plan's step (a reduce-scatter and an
    all-gather send what the all-reduce did, and the reduce-scatter overlaps backward as the all-reduce
    did), plus the all-gather of the updated parameters, exposed after the update, on the all-gather's
    link (`Setup.exchange`): the replicated and dim-0 ones over W (in buckets), a partitioned plan's
    slices over their G holders (one message);
    "parameters" (data parallel only) also gathers every block for forward ((W-1)/W of the parameters
    more on the wire, 3(W-1)/W in all)."""
    dims = tuple(0 for _ in profile.layers) if dims is None else tuple(dims)
    check_dims(profile, dims)
    if shard is None:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got None")
    check_shard(shard, dims)
    n, s = setup.world_size, profile.bytes_per_element
    step = plan_cost(profile, dims, setup)
    gather = setup.exchange("all_gather")  # an all-gather's own cost where the job's were measured (`instep`)
    everyone = dim0_held(profile, dims)
    gathered = (n - 1) / n * everyone * s
    extra = Cost(reduce=gather.seconds(gathered, _buckets(everyone, setup))) if everyone else ZERO
    sliced = sliced_held(profile, dims, setup.workers_per_group)
    if sliced and setup.groups > 1:
        extra = extra + Cost(reduce=gather.seconds((setup.groups - 1) / setup.groups * sliced * s))
    if shard == "parameters":
        extra = extra + Cost(reduce=setup.link.seconds(gathered, len(profile.layers) or 1), bytes=gathered)
    return step + extra


def diloco_cost(profile: ModelProfile, setup: Setup, groups: int, sync_freq: int, pseudo_grad_dtype: str = "fp32",
                fragments: int = 1, delay: int = 0) -> Cost:
    """DiLoCo with `groups` worker groups of W/G data-parallel workers (plain all-reduce inside) and
    one outer exchange of every parameter among the groups each `sync_freq` steps, per step.

    The exchange is the runtime's (`troupe.cluster.workers.pseudograd`): in fp32 one all-reduce; in
    bf16, fp8, int8 or int4 an all-gather of each group's encoded pseudo-gradient, (G-1) pieces of its
    wire size sent per worker. Streaming DiLoCo (`fragments` K, `delay` tau): each fragment (1/K of
    the parameters, one message) is exchanged once per H steps; with tau > 0 it overlaps the next
    tau inner steps and only what is longer than them is exposed. The outer optimizer's own
    arithmetic is left out (one elementwise pass per H steps).
    """
    from troupe.cluster.workers.pseudograd import wire_size  # bytes exactly as the runtime packs them

    check_int("sync_freq", sync_freq)
    check_int("fragments", fragments)
    check_int("delay", delay, minimum=0)
    if groups < 2 or setup.world_size % groups:
        raise ValueError(f"DiLoCo needs 2 or more worker groups dividing the world size ({setup.world_size}), "
                         f"got {groups}")
    if pseudo_grad_dtype not in PSEUDO_GRAD_DTYPES:
        raise ValueError(f"pseudo_grad_dtype must be one of {PSEUDO_GRAD_DTYPES}, got {pseudo_grad_dtype!r}")
    if delay >= sync_freq:
        raise ValueError(f"delay ({delay}) must be smaller than sync_freq ({sync_freq})")
    inner = Setup(world_size=setup.world_size // groups, link=setup.link, bucket_size=setup.bucket_size,
                  overlap=setup.overlap, sync=setup.sync, fused_reductions=setup.fused_reductions)
    step = plan_cost(profile, tuple(0 for _ in profile.layers), inner)
    params = profile.replicated_params + sum(layer.params for layer in profile.layers)
    per_fragment = params / fragments
    if pseudo_grad_dtype == "fp32":
        one = all_reduce(setup.link, groups, per_fragment * profile.bytes_per_element)
    else:
        sent = (groups - 1) * wire_size(math.ceil(per_fragment), pseudo_grad_dtype)
        one = Cost(reduce=setup.link.seconds(sent), bytes=sent)
    exposed = max(0.0, one.reduce - delay * step.seconds)
    return step + Cost(reduce=fragments * exposed / sync_freq, bytes=fragments * one.bytes / sync_freq)
