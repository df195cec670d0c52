"""The UpdateStrategy interface: how one DistOpt turns gradients into an update.

DistOpt holds exactly one strategy for a step. A strategy receives everything it needs
(communicator, reducer, parameters, the wrapped optimizer) in ``__init__`` and never
reaches into DistOpt or module globals; DistOpt does step counting, nan_policy, stats
and trace marks once, around `step()`.

The life of one step, in the PyTorch loop:

* ``loss.backward()``: the GradReducer asks `reduce_hook()` for the hook of this step
  (None: gradients stay local) and `describe()` for what the ranks must agree on;
* `synchronize()`: afterwards ``p.grad`` holds what `step()` will apply (the mean over
  ranks, for the synchronous strategies);
* `all_finite()`: the same answer on every rank (nan_policy);
* `step()`: the update (optimizer step, and whatever the regime sends afterwards);
  returns the step's stats.

Around the steps: `start()` once, after rank 0's parameters reached every rank (a
parameter-server worker Puts or Gets the initial values); `close()` once at the end;
`per_rank_state()` says why a checkpoint of this strategy cannot move to another number
of ranks; `no_sync()` accumulates gradients when the strategy reduces without a reducer.

The elastic step (``troupe run --elastic``): `ahead_of_vote()` takes the part of the step that
must come before the members' vote, `left_out()` undoes it when the vote leaves the step out;
`reconfigured()` and `holds_work()` answer the membership when the quorum's group changes.
`BaseStrategy` gives every optional part a no-op default, so DistOpt calls them all directly.
Which regime builds which strategy is `troupe.strategies.registry`'s table.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from troupe.reliability.nonfinite import all_finite
from troupe.sync.hooks import ReduceHook
from troupe.sync.reducer import GradReducer

StepStats = dict[str, Any]
"""What one step adds to the stats row: option, bytes_sent, dense_bytes, ratio, residual_norm, ..."""


@runtime_checkable
class UpdateStrategy(Protocol):
    name: str
    """The dist_option (or cluster role) this strategy implements, for messages and stats."""
    reducer: GradReducer | None
    """The GradReducer that reduces (or packs) gradients during backward; None in a world of one."""

    def start(self) -> None:
        """Begin, once every rank holds rank 0's parameters (a PS worker's first Put/Get)."""

    def describe(self) -> str:
        """What every rank must agree on for this step (compared before the first collective)."""

    def reduce_hook(self) -> ReduceHook | None:
        """The reduce hook for this step's buckets; None keeps gradients local."""

    def synchronize(self) -> None:
        """Leave in ``p.grad`` what `step()` applies (waits for reductions in flight)."""

    def all_finite(self) -> bool:
        """Are this step's gradients finite? The same answer on every rank."""

    def step(self) -> StepStats:
        """Apply the update; return this step's stats."""

    def state_dict(self) -> dict[str, Any]: ...

    def per_rank_state(self) -> list[str]:
        """Why this strategy's state belongs to each rank (empty: a checkpoint reshards to any world size)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Leave the job's collective life cleanly (a last sync, telling servers)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward inside the block leaves gradients local, summed with the next backward's (used when the
        strategy reduces without a GradReducer: FSDP2)."""

    def ahead_of_vote(self) -> None:
        """The part of this step taken before the members' vote: a member lost in it fails the vote, not the job
        (elastic DiLoCo's exchange, partialUpdate's average)."""

    def left_out(self) -> None:
        """The vote left this step out: undo what `ahead_of_vote` took."""

    def reconfigured(self) -> None:
        """The quorum's group was made anew (``Elastic.on_reconfigure``): redo what was in flight on the old one."""

    def holds_work(self) -> bool:
        """Whether a collective may still run on the quorum's group beyond the step (``Elastic.holds_work``)."""

    def clip_refusal(self) -> str | None:
        """Why clipping this worker's gradient between synchronize() and step() would not clip what the loop means
        (one line), or None (`troupe.partition.torch_clip`)."""


class BaseStrategy:
    """The no-op defaults of `UpdateStrategy`'s optional parts: nothing to start, save or close, no state that
    ties a checkpoint to its ranks, accumulation without a reducer that does nothing, and no part in the
    elastic step beyond the vote."""

    def start(self) -> None:
        pass

    def per_rank_state(self) -> list[str]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()

    def ahead_of_vote(self) -> None:
        pass

    def left_out(self) -> None:
        pass

    def reconfigured(self) -> None:
        pass

    def holds_work(self) -> bool:
        return False

    def clip_refusal(self) -> str | None:
        return None


def reduced_buckets_finite(reducer: GradReducer | None, params: Sequence[Tensor]) -> bool:
    """All-finite over reduced gradients (the same everywhere): one sum per bucket."""
    if reducer is not None:
        return all_finite([b.data for b in reducer.buckets])
    return all_finite([p.grad for p in params if p.grad is not None])


class StepUndo:
    """The parameters and optimizer state before a step taken ahead of the members' vote (`troupe run
    --elastic`: DiLoCo's syncing steps, partialUpdate's every step), to put back if the vote leaves it out.
    One more copy of the model and its optimizer state while the step is in flight."""

    def __init__(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer):
        self.params, self.optimizer = list(params), optimizer
        self.values = [p.detach().clone() for p in self.params]
        self.state = copy.deepcopy(optimizer.state_dict())

    @torch.no_grad()
    def undo(self) -> None:
        for p, v in zip(self.params, self.values):
            p.copy_(v)
        self.optimizer.load_state_dict(self.state)
