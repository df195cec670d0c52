"""DistOpt: any torch optimizer, trained on many workers; the thin front over one UpdateStrategy."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from troupe import graphstep
from troupe.cluster import regimes as _cluster_regimes  # noqa: F401  (registers the cluster's worker regimes)
from troupe.runtime import settings as settings_mod
from troupe.cluster.configuration.sources import from_env as cluster_from_env
from troupe.reliability.nonfinite import NAN_POLICIES, NanPolicy, all_finite, nonfinite
from troupe.runtime import world as world_mod
from troupe.runtime.comm import Handle
from troupe.runtime.launch import Ticket
from troupe.singa.methods import SingaMethods
from troupe.strategies import fsdp, registry
from troupe.strategies.base import UpdateStrategy
from troupe.strategies.choice import Fixed, OptionSwitch, params_of, refuse
from troupe.strategies.compressed import CompressionConfig
from troupe.strategies.partitioned import broadcast_replicated
from troupe.strategies import sharded as _sharded  # noqa: F401  (registers the shard modes)
from troupe.sync.bucket import DEFAULT_BUCKET_SIZE, FIRST_BUCKET_SIZE, plan_buckets
from troupe.sync.compiled import SplitCompiledGraphs
from troupe.sync.reducer import GradReducer
from troupe.util import CLIP_CLUSTER, CLIP_REFUSED, REPLACED, Refusal, check_int

if TYPE_CHECKING:
    from troupe.reliability.pieces import ElementParts

DIST_OPTIONS = registry.dist_options()
"""`dist_option` names (SINGA's) and the DistOpt method each one calls (`troupe.strategies.registry`)."""


class DistOpt(SingaMethods, torch.optim.Optimizer):
    """Averages gradients across ranks, overlapped with backward, then steps the wrapped optimizer.

    Accepted wherever torch takes an optimizer (LR schedulers, ``GradScaler``); its
    ``param_groups`` and ``state`` are the wrapped optimizer's. Gradients are summed across
    ranks and divided by the world size before the wrapped optimizer runs, so momentum and
    weight decay see the averaged gradient. Rank 0's parameters are broadcast at construction.

    >>> sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9))
    >>> loss = F.cross_entropy(model(x), y)
    >>> loss.backward()                # buckets are all-reduced as autograd produces gradients
    >>> sgd.step(); sgd.zero_grad()    # or SINGA's sgd(loss): backward, all-reduce, step

    `split_compiled` (default True) lets a ``torch.compile``d model keep the reduction overlapped
    with its backward: graphs compiled while this DistOpt lives are split at bucket boundaries,
    as dynamo does for DDP (`troupe.sync.compiled`). `compile_step` and
    ``Model.compile(use_graph=True)`` compile the whole step instead (`troupe.graphstep`).

    `shard` ("optimizer" or "gradients"; default: ``troupe run --shard``, else None) cuts the wrapped
    optimizer's state, and with "gradients" also the reduced gradients, over the ranks by elements
    (ZeRO-1 / ZeRO-2, `troupe.strategies.sharded`); the model stays as it is. Clip with
    `troupe.clip_grad_norm_`: a sharded model's ``p.grad`` is None after the reduction. `groups` (default:
    ``troupe run --nworker-groups``, else 1) shards inside each of that many worker groups of consecutive
    ranks, which replicate each other (HSDP).

    `powersgd_rank` and `powersgd_start` configure ``dist_option="powerSGD"`` (`troupe.strategies.powersgd`):
    the factors' rank (default 1) and the plain steps before compression starts (default 0).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        ticket: Ticket | str | None = None,
        nccl_id: Ticket | str | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        backend: str | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        first_bucket_size: int = FIRST_BUCKET_SIZE,
        timeout: float | None = None,
        join_timeout: float | None = None,
        compression: CompressionConfig | None = None,
        nan_policy: NanPolicy = "raise",
        dist_option: str = "plain",
        spars: float | None = None,
        powersgd_rank: int | None = None,
        powersgd_start: int | None = None,
        split_compiled: bool = True,
        shard: str | None = None,
        groups: int | None = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DistOpt):
            raise TypeError(f"DistOpt wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_int("bucket_size", bucket_size)
        check_int("first_bucket_size", first_bucket_size)
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise TypeError(f"compression must be a troupe.CompressionConfig, got {type(compression).__name__}")
        if ticket is not None and nccl_id is not None:
            raise ValueError("give ticket= or its SINGA alias nccl_id=, not both")
        _check_not_replaced(optimizer)
        # Options given here that SINGA's per-call methods use when the call does not give them.
        self._option_args = {k: v for k, v in {"powersgd_rank": powersgd_rank, "powersgd_start": powersgd_start}.items()
                             if v is not None}
        for name, minimum in (("powersgd_rank", 1), ("powersgd_start", 0)):  # checked now, whatever the option
            if name in self._option_args:
                check_int(name, self._option_args[name], minimum=minimum)
        cluster = cluster_from_env()
        if shard is None:
            shard = settings_mod.current().shard  # troupe run --shard
        if groups is not None and shard is None:
            raise ValueError(f"DistOpt(groups={groups!r}) shards inside worker groups: give shard='optimizer' or "
                             "'gradients' too (without sharding every rank already holds the whole state)")
        # troupe.shard's model: FSDP2's regime (else the parameters are marked as this DistOpt's); else a
        # cluster's worker regime, a shard mode, or the dist_option's own
        regime = fsdp.claim_params(optimizer, dist_option, cluster, shard) or registry.resolve(dist_option, cluster, shard)
        self.world = world_mod.init(ticket if ticket is not None else nccl_id, local_rank, world_size, rank=rank,
                                    backend=backend, timeout=timeout, join_timeout=join_timeout)
        self.optimizer = optimizer
        self._model_params = params_of(optimizer)
        """The parameters the optimizer was given (a sharded DistOpt's optimizer then holds parts of them)."""
        self.bucket_size, self.first_bucket_size = bucket_size, first_bucket_size
        self.nan_policy = nan_policy
        self.skipped_steps = 0
        self.step_count = 0
        self._names: dict[int, str] = {}
        self._pending: list[Handle] = []
        self._synced = False
        self._lost: BaseException | None = None
        """An elastic job's peer lost in a `synchronize()` the script called: the step leaves itself out."""
        self._last_stats: dict[str, Any] = {}
        setup = registry.Setup(world=self.world, optimizer=optimizer, bucket_size=bucket_size,
                               first_bucket_size=first_bucket_size, compression=compression or CompressionConfig(),
                               nan_policy=nan_policy, step_count=lambda: self.step_count, name_of=self.param_name,
                               cluster=cluster, groups=groups, args={"spars": spars, **self._option_args})
        # A cluster's regime takes this rank's role here: a server rank serves and never returns.
        self._choice: OptionSwitch | Fixed = regime.choose(setup)
        # what torch's clip_grad_norm_ does with these parameters (troupe.partition.torch_clip, installed by the
        # troupe facade): refuse where a worker's gradient is not its group's; stay torch's under a cluster
        refusal = self._choice.current.clip_refusal()
        for p in self._model_params:
            if refusal is not None:
                setattr(p, CLIP_REFUSED, refusal)
            if cluster is not None:
                setattr(p, CLIP_CLUSTER, True)
        self.info = self._choice.info or self.world.info
        self.communicator = self.world.comm
        # rank 0's values (troupe.track gives an elastic joiner the quorum's; troupe.shard broadcast before sharding)
        if self.world.membership.builds_together and regime.replicated:
            broadcast_replicated(self.communicator, self._params())
        elif self.world.membership.elastic:  # a script without troupe.track joins at its model's first forward
            self.world.membership.track_by_default(self._params(), self)
        self._choice.start()  # e.g. a parameter-server worker's first Put/Get
        self._watch_reducer()
        self._split: SplitCompiledGraphs | None = None
        if split_compiled and self.reducer is not None:
            self._split = SplitCompiledGraphs(bucket_size * 4)  # fp32 elements to bytes, as DDP's cap
            if self._split.install():
                weakref.finalize(self, self._split.remove)

    # --- where this process is, and torch.optim.Optimizer's state: the wrapped optimizer's, read
    # through (its load_state_dict replaces these objects, so they are never copied here)

    local_rank = property(lambda self: self.info.local_rank)
    global_rank = property(lambda self: self.info.global_rank)
    world_size = property(lambda self: self.info.world_size)
    device = property(lambda self: self.info.device, doc="``cuda:local_rank`` under NCCL, else the CPU.")
    param_groups = property(lambda self: self.optimizer.param_groups)  # type: ignore[assignment]
    state = property(lambda self: self.optimizer.state)  # type: ignore[assignment]
    defaults = property(lambda self: self.optimizer.defaults)  # type: ignore[assignment]

    @property
    def strategy(self) -> UpdateStrategy:
        """The strategy this step uses (SINGA's per-call dist_option, or the cluster's)."""
        return self._choice.current

    @property
    def reducer(self) -> GradReducer | None:
        """The GradReducer that reduces gradients during backward (None in a world of one)."""
        return self._choice.reducer

    # --- the PyTorch loop ---------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward inside the block accumulates gradients locally, with no communication
        (gradient accumulation); the next backward outside it reduces the sum."""
        if self.reducer is not None:
            return self.reducer.paused()
        return self.strategy.no_sync()  # a strategy that reduces without a reducer (FSDP2); else nothing

    def synchronize(self) -> None:
        """Leave in ``p.grad`` what `step()` will apply: the mean over ranks (waits for the
        reductions of the last backward; reduces gradients that arrived without one)."""
        if not self._synced:
            try:
                self.strategy.synchronize()
            except self.world.membership.lost as e:  # an elastic job's lost peer: the step's vote hears of it
                self._lost = e
            self._synced = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize if needed, apply `nan_policy`, then the strategy's update (the wrapped optimizer's step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        membership = self.world.membership  # an elastic job's quorum: a lost peer costs the step, not the job
        error = self.reducer.failed if self.reducer is not None else None  # kept by backward's hooks
        if error is None:
            try:
                self.synchronize()
                error = self._lost
                if error is None:  # the part of its step a strategy takes before the vote (elastic DiLoCo's exchange)
                    self.strategy.ahead_of_vote()
            except membership.lost as e:
                error = e
        self._lost = None
        finite = True
        if error is None and self.nan_policy != "ignore":
            try:  # before the vote: a verdict agreed on among ranks is a collective, which a lost peer fails
                finite = self.strategy.all_finite()
            except membership.lost as e:
                error = e
        if error is not None:
            self._abandon_open_step()
            if self.reducer is not None:
                self.reducer.failed = None
        self._synced = False
        if not membership.vote(error is None, error):
            self.optimizer.zero_grad(set_to_none=True)  # every member leaves this step out alike
            self.strategy.left_out()  # undoes what the strategy took ahead of the vote
        elif not finite:
            self._skip()
        else:
            self._finish_step(self.strategy.step())
        membership.advance()  # a new quorum from the next step (joiners receive this step's state)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._abandon_open_step()
        self._synced, self._lost = False, None
        self._choice.zero_grad(self.optimizer, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters (on every rank, in the same order): rank 0's values are broadcast and
        the new parameters join the reduction."""
        self._choice.require("add_param_group")
        self.optimizer.add_param_group(param_group)
        self._model_params = params_of(self.optimizer)
        if self.world.membership.builds_together:  # else troupe.track gives a joiner the quorum's values
            broadcast_replicated(self.communicator, self._params())
        self._choice.add_params(self._params())
        self._watch_reducer()

    def compile_step(self, model: torch.nn.Module, loss_fn: Callable[..., Tensor], *, dist_option: str = "plain",
                     sequential: bool = False, backend: str = "inductor", trial: int | None = None
                     ) -> Callable[..., Tensor]:
        """Graph mode for a plain module: ``step(*batch)`` runs ``loss_fn(*batch)``, backward and the update
        as compiled graphs, the bucketed all-reduce inside the backward's (see `troupe.graphstep`).

        >>> step = sgd.compile_step(model, lambda x, y: F.cross_entropy(model(x), y))
        >>> loss = step(x, y)          # forward, backward + all-reduce, optimizer update; loss detached

        `dist_option` is "plain" (or "fp32"), "fp16" or "bf16"; `sequential=True` keeps every op in
        program order (SINGA), else the compiler may overlap communication with the backward.
        Where the platform cannot compile, the first step warns and steps run eagerly. With inductor,
        `trial` steps of each kind (default 5) are timed after two compiled ones, and if the compiled
        step is not faster here the eager one runs from then on (one warning says both times); 0
        keeps the compiled step.
        """
        return graphstep.compile_step(self, model, loss_fn, dist_option=dist_option, sequential=sequential,
                                      backend=backend, trial=trial)

    def graph_plan(self) -> graphstep.GraphPlan:
        """What graph mode compiles a step over (`troupe.graphstep.GraphHost`); a ValueError where it cannot
        run (graph mode reduces every gradient among all ranks)."""
        self._choice.require("graph_mode")
        if self.world.membership.elastic:  # its compiled step has no vote: a lost peer would end the job
            raise refuse("elastic", "in graph mode")
        params = [p for p in self._params() if p.requires_grad]
        buckets = [[params[j] for j in members]
                   for members in plan_buckets(params, self.bucket_size, self.first_bucket_size)]
        group = self.communicator.group if self.world_size > 1 else None
        return graphstep.GraphPlan(params, buckets, self.world_size, group, self.param_name, self.optimizer.step)

    def apply_reduced(self, update: Callable[[], Any]) -> None:
        """Graph mode's update: ``p.grad`` already holds the mean over ranks; apply `nan_policy`, then
        `update` (the compiled step of the wrapped optimizer), and count the step."""
        self._synced = False
        if self.nan_policy != "ignore" and not all_finite([p.grad for p in self._params() if p.grad is not None]):
            self._skip()
            return
        update()
        self._finish_step({})

    @property
    def last_step_stats(self) -> dict[str, Any]:
        """Traffic of the last half/partial/sparse step: bytes_sent, dense_bytes, ratio, residual_norm."""
        return self._last_stats

    @contextmanager
    def join(self):
        """Let ranks with fewer batches finish an epoch without hanging (PyTorch's `Join`, for DistOpt).

        Every rank wraps its loop in ``with sgd.join():``. A rank that leaves the block
        keeps taking part in the others' gradient reductions with zero gradients, marked
        inactive, and applies the same averaged update (so parameters stay equal), until
        every rank has left. Gradients are averaged over the ranks that still had data.
        Other collectives inside the loop (metrics every step) cannot be shadowed: reduce
        them after the block.
        """
        self._choice.require("join")
        yield self
        if not self._choice.shadows_joins:
            return
        while self.reducer.shadow() > 0:
            self.step()

    def param_name(self, param: Tensor) -> str:
        """The parameter's name in the attached model, or its position in the optimizer."""
        if id(param) in self._names:
            return self._names[id(param)]
        return f"param[{[id(p) for p in self._params()].index(id(param))}]"

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count,
                "strategies": self._choice.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        self._choice.load_state_dict(state.get("strategies", {}))

    def per_rank_state(self) -> list[str]:
        """Why this DistOpt's state belongs to each rank and cannot move to another world size
        (empty: every rank's model and optimizer state is the job's; troupe.checkpoint reshards it)."""
        return self._choice.per_rank_state()

    def optimizer_parts(self) -> ElementParts | None:
        """What the wrapped optimizer holds when it steps parts of parameters (``shard=...``); None when it
        holds whole parameters. troupe.checkpoint saves each part's state as a slice of the whole's."""
        return self._choice.optimizer_parts()

    def close(self) -> None:
        """Leave cleanly: under a parameter-server cluster, tell the servers this worker has finished (also done at exit)."""
        if self._split is not None:
            self._split.remove()
        self.strategy.close()

    def __repr__(self) -> str:
        return (
            f"DistOpt({type(self.optimizer).__name__}, {self.strategy.name}, rank {self.global_rank}/"
            f"{self.world_size}, {self.info.backend}, bucket_size={self.bucket_size})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistOpt holds process-group state and cannot be pickled; save state_dict() instead")

    # --- internals ----------------------------------------------------------------------

    def _watch_reducer(self) -> None:
        if self.reducer is not None:
            membership = self.world.membership
            self.reducer.defer = membership.lost
            if membership.constant_batch:
                self.reducer.weight = membership.grad_weight
            self.reducer.on_reduced = self._mark_synced
            self.reducer.label_buckets(self.param_name)  # by position; by name once a model is attached

    def _mark_synced(self) -> None:
        self._synced = True

    def _abandon_open_step(self) -> None:
        if self.reducer is not None and self.reducer.in_step:
            self.reducer.abort()

    def _skip(self) -> None:
        """A non-finite gradient (the same verdict on every rank): raise, or skip the step."""
        bad = nonfinite(self._params())
        names = ", ".join(self.param_name(p) for p in bad[:5]) or "a gradient"
        if self.nan_policy == "raise":
            raise FloatingPointError(
                f"rank {self.global_rank}: non-finite gradient at step {self.step_count} in {names} "
                "(DistOpt(nan_policy='skip') skips such steps instead)"
            )
        warnings.warn(f"troupe: skipped step {self.step_count}: non-finite gradient in {names}")
        self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._finish_step({})

    def _finish_step(self, stats: dict[str, Any]) -> None:
        """Count the step; per-step stats and the watchdog see it."""
        self.step_count += 1
        if stats:
            self._last_stats = {**stats, "step": self.step_count - 1}
        self.world.set_step(self.step_count)
        rec = self.world.recorder
        if rec is not None:
            extra = {k: v for k, v in stats.items() if k in ("option", "ratio", "residual_norm", "staleness")}
            rec.end_step(self.step_count, self.communicator.bytes_sent(), extra)

    def _params(self) -> list[Tensor]:
        return self._model_params


def _check_not_replaced(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer made before `troupe.partition`: it holds the whole layers the partition replaced, which
    the model no longer uses (it would step tensors no gradient reaches while the slices are never reduced)."""
    names = sorted({getattr(p, REPLACED) for p in params_of(optimizer) if hasattr(p, REPLACED)})
    if names:
        raise Refusal(f"the optimizer holds the parameters of {', '.join(names)}, which troupe.partition replaced by "
                      "slices: create the optimizer after troupe.partition(model, ...) (from model.parameters())")
