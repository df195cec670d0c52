"""The master-copy arithmetic of asynchronous groups, pure state: fold a group's change in, adopt the result.

Used by both kinds of synchronisation between groups: Distributed Hogwild's co-located
servers (`groupsync`, also in-memory Hogwild) and separate server groups (`serversync`).
Each group keeps a replica of some slices; the slices are cut into G parts (G groups,
`parts`), and part k's master copy lives with group k. Every so often a group sends
``cur - last_sync`` of each part to that part's master (`request`), which folds it in
(`fold`) and answers with its value; the group adopts it, keeping the updates its
replica took meanwhile (`adopt`). Its own part it folds and adopts at once (`fold_own`)::

    master += (sent - last_sync) / G      group_merge "mean" (default; "sum": the full change)
    cur = master + (cur - sent)           sent: the part's value when the request left
    last_sync = master

A group whose master died may take its part over (`take_over`, separate server groups): the new master
copy starts from the value this group last adopted of it, plus its own change since (as `fold_own`).
What only the dead master held (the others' changes folded in since this group last adopted) is lost.

No messages, threads or locks here: the callers send, receive and hold their locks.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from troupe.cluster.serving.shard import Slice


def parts(slices: Sequence[Slice], ngroups: int) -> list[list[tuple[Slice, int, int]]]:
    """For each group k, the (slice, start, stop) ranges of `slices` whose master copy group k holds."""
    out: list[list[tuple[Slice, int, int]]] = [[] for _ in range(ngroups)]
    for s in slices:
        for k in range(ngroups):
            lo, hi = s.numel * k // ngroups, s.numel * (k + 1) // ngroups
            if hi > lo:
                out[k].append((s, lo, hi))
    return out


class Replica(Protocol):
    """A group's copy of its slices: a `ParamShard`, or `SliceValues` for values kept elsewhere."""

    slices: Mapping[int, Slice]
    values: Mapping[int, Tensor]
    """Each slice's current values, flat (updated in place)."""
    last_sync: MutableMapping[int, Tensor]
    """Each slice's values when the group last adopted its master copy."""
    dtype: torch.dtype


@dataclass
class SliceValues:
    """A `Replica` over tensors someone else owns (in-memory Hogwild's shared memory); last_sync starts as them."""

    slices: dict[int, Slice]
    values: Mapping[int, Tensor]
    last_sync: dict[int, Tensor]
    dtype: torch.dtype

    @classmethod
    def of(cls, slices: Sequence[Slice], values: Mapping[int, Tensor]) -> SliceValues:
        dtype = next(iter(values.values())).dtype if values else torch.float32
        return cls({s.id: s for s in slices}, values, {s.id: values[s.id].clone() for s in slices}, dtype)


class MasterCopies:
    """One group's side: the master copy of its own part, and the parts it sent to the others' masters.

    `shard` is the group's `Replica` (values and ``last_sync`` stay there); `group` is this
    group, `ngroups` the number of groups. The master copy is taken from the values by `start`.
    """

    def __init__(self, shard: Replica, group: int, ngroups: int, merge: str = "mean"):
        if merge not in ("mean", "sum"):
            raise ValueError(f"group_merge must be 'mean' or 'sum', got {merge!r}")
        self.shard = shard
        self.group, self.ngroups = group, ngroups
        self.parts = parts([shard.slices[k] for k in sorted(shard.slices)], ngroups)
        self.sizes = [sum(hi - lo for _, lo, hi in p) for p in self.parts]
        self.scale = 1.0 / ngroups if merge == "mean" else 1.0
        self.master: Tensor | None = None
        """The master copy of part `group` (None until `start`)."""
        self.version = 0
        """Changes folded into the master copy so far (a group's own and the others')."""
        self.taken: dict[int, Tensor] = {}
        """Master copies of other groups' parts, taken over when their masters died (`take_over`)."""
        self.taken_versions: dict[int, int] = {}
        self.sent: dict[int, Tensor] = {}
        """Part -> its value when the request now in flight left (what the answer is adopted against)."""
        self.merges: list[int] = []
        """Per other group's change folded in here: other merges since that group last adopted."""
        self.drift = 0.0
        """Largest |master - replica| over the parts this group adopted: how far apart the replicas were."""

    def start(self) -> None:
        """Take the master copy from the group's values (its initial values, or a resumed checkpoint)."""
        self.master = self.gather(self.group).clone()

    def gather(self, k: int, source: Mapping[int, Tensor] | None = None) -> Tensor:
        """Part k of the group's values (or of `source`, e.g. ``shard.last_sync``), as one vector."""
        source = self.shard.values if source is None else source
        pieces = [source[s.id][lo:hi] for s, lo, hi in self.parts[k]]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=self.shard.dtype)

    def request(self, k: int) -> Tensor:
        """``cur - last_sync`` of part k, to send to its master; remembers cur to adopt the answer against."""
        if k in self.sent:
            raise RuntimeError(f"a Merge of part {k} is already in flight")
        cur = self.gather(k).clone()
        self.sent[k] = cur
        return cur - self.gather(k, self.shard.last_sync)

    def copy_of(self, k: int) -> Tensor:
        """The master copy of part k, this group's own or one it took over."""
        return self.master if k == self.group else self.taken[k]

    @property
    def mastered(self) -> list[int]:
        """The parts whose master copy this group holds: its own, and those it took over."""
        return [self.group, *sorted(self.taken)]

    def fold(self, delta: Tensor, seen: int, part: int | None = None) -> tuple[int, Tensor]:
        """Another group's change into the master copy of `part` (default: this group's own; `seen`: the
        version it last adopted); returns (version, value) to answer with."""
        if part is None or part == self.group:
            self.master.add_(delta.to(self.master.dtype), alpha=self.scale)
            self.merges.append(max(self.version - seen, 0))
            self.version += 1
            return self.version, self.master.clone()
        master = self.taken[part]
        master.add_(delta.to(master.dtype), alpha=self.scale)
        self.taken_versions[part] += 1
        return self.taken_versions[part], master.clone()

    def fold_own(self) -> None:
        """This group's own change of each part it masters into its master copy, adopted at once."""
        for k in self.mastered:
            master = self.copy_of(k)
            cur = self.gather(k).clone()
            master.add_(cur - self.gather(k, self.shard.last_sync), alpha=self.scale)
            if k == self.group:
                self.version += 1
            else:
                self.taken_versions[k] += 1
            self._adopt(k, master, cur)

    def take_over(self, k: int) -> None:
        """Master part k from now on (its master died): its master copy starts from the value this group
        last adopted of it, and this group's own change since is folded in (as by `fold_own`)."""
        if k == self.group or k in self.taken:
            return
        self.sent.pop(k, None)  # a request to the dead master: no answer comes
        self.taken[k] = self.gather(k, self.shard.last_sync).clone()
        self.taken_versions[k] = 0
        cur = self.gather(k).clone()
        self.taken[k].add_(cur - self.taken[k], alpha=self.scale)
        self._adopt(k, self.taken[k], cur)

    def adopt(self, k: int, value: Tensor) -> None:
        """The master's answer to the request of part k in flight: cur += value - sent; last_sync = value."""
        self._adopt(k, value, self.sent.pop(k))

    def forget(self, k: int) -> None:
        """No answer will come for part k (its master is gone): keep the values as they are."""
        self.sent.pop(k, None)

    def settle(self, k: int, value: Tensor) -> None:
        """Part k's final value (every group has finished): cur = last_sync = value."""
        self._write(k, value, self.shard.values)
        self._write(k, value, self.shard.last_sync)

    def final(self, part: int | None = None) -> Tensor:
        """Set this group's own part (or `part`, one it took over) to its master copy (every change folded
        in) and return it."""
        part = self.group if part is None else part
        master = self.copy_of(part)
        self.settle(part, master)
        return master.clone()

    def _adopt(self, k: int, value: Tensor, sent: Tensor) -> None:
        change = value - sent
        self.drift = max(self.drift, float(change.abs().max())) if change.numel() else self.drift
        offset = 0
        for s, lo, hi in self.parts[k]:
            self.shard.values[s.id][lo:hi].add_(change[offset : offset + hi - lo])
            self.shard.last_sync[s.id][lo:hi].copy_(value[offset : offset + hi - lo])
            offset += hi - lo

    def _write(self, k: int, value: Tensor, target: Mapping[int, Tensor]) -> None:
        offset = 0
        for s, lo, hi in self.parts[k]:
            target[s.id][lo:hi].copy_(value[offset : offset + hi - lo])
            offset += hi - lo
