"""A parameter-server worker's membership under `troupe run --elastic`: it restarts alone and rejoins.

Asynchronous workers (Downpour) share no step: there is no quorum to keep and nothing to vote on.
A dead worker is started again by the launcher; the servers hold the parameters and the optimizer
state, so what a restarted worker must get back is only its own: where it was in its data (the
sampler), its step counter, its RNG, its model's buffers, and whatever else the script tracks.

`Rejoining.track` takes those objects (`troupe.track`); after every step (`advance`) this worker's
record is written to the job's store under ``ps/place/<rank>`` (one small write; the servers apply
an update before they answer it, so the record never runs ahead of the servers). A restarted worker
loads its last record in `track` and returns its step count; its DistOpt has fetched the servers'
values already (`troupe.cluster.workers.ps_client.PSClient.start`). A step the worker died in after
the servers applied it and before the record was written is taken again from the same batch
(at least once, never lost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from troupe.runtime import handoff, liveness
from troupe.runtime.membership import Membership

log = logging.getLogger("troupe.elastic")


def place_key(rank: int) -> str:
    return f"ps/place/{rank}"


def closing_key(rank: int) -> str:
    """Set by a process whose beat stops because it is leaving (not frozen): its launcher lets it be."""
    return f"ps/closing/{rank}"


def gone_key(rank: int) -> str:
    """Set by a launcher when separate server `rank` died (never restarted): a worker that starts later
    sends its slices to the next server group's instead, and does not dial it."""
    return f"ps/gone/{rank}"


class Rejoining(Membership):
    """This process in a parameter-server job whose workers restart alone (`troupe run --elastic`).

    `elastic` is False although it exists only under `--elastic`: the flag says the processes that step
    *together* change (a quorum whose groups reduce, vote and heal), and a parameter-server worker steps
    with no other worker: it pushes to and pulls from its servers alone, whoever else is running. So every
    check of `elastic` (reduce over the quorum's groups, vote, draw the quorum's share of the data, join at
    the first forward) must not apply to it; what it does instead is here (a record after every step, a
    beat its servers and launcher watch) and in the cluster's bootstrap (`isinstance(..., Rejoining)`)."""

    elastic = False
    """No quorum and no vote: each worker steps against the servers on its own."""
    builds_together = True
    """Nothing is broadcast among the workers anyway (the servers hand out the first values)."""
    constant_batch = False
    """Each worker draws its own batch, whoever else is running."""

    def __init__(self, rank: int, incarnation: int, connect: Callable[[float], dist.Store], timeout: float):
        self.rank, self.incarnation = rank, incarnation
        self.connect = connect
        """A new connection to the job's store (the launcher's), with this timeout in seconds."""
        self.store = connect(timeout)
        self.data_place: tuple[int, int] | None = None
        """(this worker's index among the workers, the number of workers): its data shard, the same in
        every incarnation (set by the cluster bootstrap)."""
        self.objects: dict[str, Any] = {}
        self.records = 0
        self._warned = False
        self._beating: liveness.Beat | None = None

    def start_beating(self) -> None:
        """Count up this process's beat in the store every BEAT_SECONDS, in a thread, on a connection of its own
        (a frozen process's threads stop with it; a slow one's do not: its servers and launcher tell frozen from
        slow by it). A beat that fails ends the thread: the launcher's store is gone, the job is over."""
        self._beating = liveness.Beat(self.rank, lambda: self.connect(liveness.BEAT_SECONDS * 20),
                                      liveness.BEAT_SECONDS, reconnect=False, name="troupe-ps-beat").start()

    def close(self) -> None:
        """Stop beating, and wait for the beat thread (one inside a store call when the interpreter ends
        aborts the process: Python ends such a thread by unwinding through pybind11's frames). A beat that
        stops here is this process leaving, not freezing: said in the store first, for the launcher."""
        if self._beating is not None:
            try:
                self.store.set(closing_key(self.rank), "1")
            except (RuntimeError, ConnectionError, OSError):
                pass  # the launcher's store is gone: the job is over
            self._beating.stop(wait=liveness.BEAT_SECONDS * 4)

    @property
    def rejoined(self) -> bool:
        """This process restarts a worker that died: it joins a running job alone."""
        return self.incarnation > 0

    def advance(self) -> None:
        """After a step: write this worker's record (what a restart of it resumes from; 250 us a step
        for the MNIST CNN's, beside a 68 ms step)."""
        if self.objects:
            self.store.set(place_key(self.rank), _record(self.objects))
            self.records += 1
        elif self.rejoined and not self._warned:
            self._warned = True
            log.warning("troupe: rank %d restarted, but its script does not call troupe.track(...) before its loop: "
                        "it takes its data from the beginning again", self.rank)

    def track(self, objects: dict[str, Any]) -> int:
        """Keep these objects' state in the store after every step; a restarted worker loads its last one
        here and gets its step count (a fresh worker gets 0)."""
        self.objects = dict(objects)
        optimizer = objects.get("optimizer")
        if not self.rejoined or not self.store.check([place_key(self.rank)]):
            return 0  # a fresh job, or a worker that died before its first step: it starts from the beginning
        _restore(self.store.get(place_key(self.rank)), self.objects)
        return optimizer.step_count if optimizer is not None else 0


def _record(objects: dict[str, Any]) -> bytes:
    """The state a restarted worker needs of its own: not the model's parameters nor the optimizer's
    state (the servers hold them), but the DistOpt's step counter, its model's buffers and the rest."""
    states: dict[str, Any] = {}
    for name, obj in objects.items():
        if name == "optimizer":
            states[name] = {"step_count": obj.step_count, "skipped_steps": obj.skipped_steps}
        elif name == "model":
            states[name] = {k: b.detach().clone() for k, b in obj.named_buffers()}
        else:
            states[name] = obj.state_dict()
    return handoff.pack(states)


def _restore(blob: bytes, objects: dict[str, Any]) -> None:
    state = handoff.unpack(blob)
    for name, obj in objects.items():
        if name == "optimizer":
            obj.step_count, obj.skipped_steps = state[name]["step_count"], state[name]["skipped_steps"]
        elif name == "model":
            buffers = dict(obj.named_buffers())
            with torch.no_grad():
                for k, value in state[name].items():
                    buffers[k].copy_(value)
        else:
            obj.load_state_dict(state[name])
