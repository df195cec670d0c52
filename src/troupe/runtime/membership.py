"""Membership: which processes step together, as one interface the World hands out (`World.membership`).

Three kinds implement it, chosen by how the process was launched (runtime/launch.py):

* `Fixed` (runtime/elastic.py): every launcher but `troupe run --elastic`; the processes never change,
  every step commits, nothing is healed.
* `Elastic` (runtime/elastic.py): `troupe run --elastic` with synchronous worker groups; a quorum of
  groups that may change at every step, one vote per step, a heal from a live peer.
* `Rejoining` (runtime/rejoin.py): `troupe run --elastic` with parameter servers; a dead worker restarts
  alone and reloads its own record; there is no quorum and no vote.

DistOpt, the strategies, the data loader and `troupe.track` use only what is declared here. What only a
quorum has (`quorum`, `options`, `group`, `place`, `on_reconfigure`, `interrupted`, `partner_lost`,
`batch_ranks`, `grad_weight`, `make_mesh`, ...) is `Elastic`'s alone, read where `elastic` is True.
A kind subclasses `Membership` and inherits the defaults below where it has nothing to do.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Membership(Protocol):
    """Who steps with this process, whether a step commits, and what a restarted process gets back."""

    elastic: bool = False
    """The processes that step together change between steps (a quorum of worker groups: `Elastic`). Regimes
    then reduce over the quorum's groups and each step is voted on. False where each process steps alone
    against its servers, even under `troupe run --elastic` (`Rejoining`): nothing is reduced among workers."""
    builds_together: bool = True
    """Every rank makes its DistOpt at the same time, so making it may use collectives (a broadcast of rank 0's
    parameters). False: a restarted process makes it alone while the others train."""
    lost: tuple[type[BaseException], ...] = ()
    """Exceptions a step survives (none: a lost peer ends the job)."""
    constant_batch: bool = False
    """The global batch stays the same when processes are missing (only an elastic quorum may keep it)."""
    data_place: tuple[int, int] | None = None
    """(index, count) of this process's data shard when it is not its rank in the world (a rejoining
    worker's place among the workers). None: the rank's, or the quorum's share (`troupe.data`)."""
    incarnation: int = 0
    """Which life of this rank this process is (0: the job's first; a restart counts up)."""
    heals: int = 0
    """Times this process received state from a live peer."""
    heal_bytes: int = 0
    """Bytes of state this process sent to or received from peers in heals."""

    def vote(self, ok: bool, error: BaseException | None = None) -> bool:
        """Say whether this step's reduction succeeded here; return whether every member applies the step."""
        return ok

    def advance(self) -> None:
        """After a step: move on (to the next quorum; write a rejoining worker's record)."""
        return None

    def track(self, objects: dict[str, Any]) -> int | None:
        """Hand over the objects a restarted process must get back (`troupe.track`); return the step to resume
        from (None: nothing is ever restored)."""
        return None

    def track_by_default(self, params: list[torch.Tensor], optimizer: Any) -> None:
        """What a DistOpt does for a script that never calls `troupe.track` (join and heal at the first forward)."""
        return None

    def close(self) -> None:
        """Leave: stop beating, say goodbye (at the World's finish)."""
        return None
