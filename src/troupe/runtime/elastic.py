"""A worker's membership in an elastic job: the quorum it steps with, its vote, its heal.

`troupe run --elastic` restarts a dead worker's group alone (a group of one process by default,
of `--nworker-groups`' size otherwise); the other groups train on. This module is one process's
side (the launcher's is runtime/lighthouse.py; the keys they share, runtime/quorum.py); its group
is in a quorum or out of it as a whole:

* **join**: ask the lighthouse to be admitted (`Ready`), wait for a quorum that names this rank,
  and make the quorum's process group the default one (so every communicator of the World,
  and through them every regime, reduces over exactly the groups present);
* **vote**, once per step, after the gradients were reduced: every member says whether its
  reduction succeeded; the round's one `Decision` (commit or not, and the next quorum) is
  the same on every member, so a group lost mid-step is left out of that step everywhere
  (runtime/vote.py: over the quorum's group, the store touched by its leader alone);
* **advance**, after the step: move to the decided quorum; a member named its `source` hands
  its state (model, optimizer, strategy, sampler, RNG) to the joiners through the launcher's
  store, live, and steps on; a joiner loads it before its first step (place by place: the joining
  group's process j loads what the source group's process j posted).

`Fixed` is the same interface (`runtime/membership.py`) for a job whose processes never change (every
other launcher).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from troupe.runtime import handoff, liveness, settings, vote
from troupe.runtime.failover import FailedOver
from troupe.runtime.quorum import (ASKED, ASKED_COUNT, REJOIN_EXIT, Decision, ElasticOptions, Quorum, Ready,
                                  poll_interval, round_key)
from troupe.util import LostLauncher
from troupe.runtime.membership import Membership

log = logging.getLogger("troupe.elastic")
PARTNER_GRACE = 2.0
"""Seconds a process whose group lost a partner waits to be stopped by its launcher before it leaves."""


class Fixed(Membership):
    """The membership of a job whose processes never change: every step commits, nothing moves (the
    `Membership` defaults)."""


class Elastic(Membership):
    """This worker's place in an elastic job: its worker group (`options.group_size` processes) is a
    member of the quorum or not, as a whole."""

    elastic = True
    builds_together = False
    """A restarted worker makes its DistOpt alone while the others train: `troupe.track` gives it
    the quorum's values instead of a broadcast."""
    lost: tuple[type[BaseException], ...] = (RuntimeError,)
    """A failed collective (Gloo raises RuntimeError subclasses) costs the step, not the job."""
    data_place: tuple[int, int] | None = None
    """None: each worker group draws its share among the groups present (`troupe.data`)."""

    def __init__(self, options: ElasticOptions, rank: int, incarnation: int, backend: str,
                 connect: Callable[[float], dist.Store]):
        self.options, self.rank, self.backend = options, rank, backend
        self.group_vote_min = settings.current().group_vote_min
        """A quorum this large votes over its process group; a smaller one through the store (TROUPE_GROUP_VOTE_MIN)."""
        self.group, self.place = divmod(rank, options.group_size)
        self.incarnation = incarnation
        # Three connections: votes and heals wait long; a forming group gives up after `timeout`
        # (a member died meanwhile); the heartbeat thread has its own socket (`liveness.Beat`).
        self.store = connect(max(options.form_within, 4 * (options.timeout + options.evict_after)))
        self._pg_store = connect(options.timeout)
        self._connect = connect
        self._failover = getattr(self.store, "failover", None)
        """Where the job's store is (node 0's launcher's, or the standby's after a failover: runtime/failover.py);
        None when `connect` gives plain torch stores."""
        self._quorum_gen = 0
        """The failover's generation when this process entered its quorum."""
        self.quorum: Quorum | None = None
        self.round = 0
        self.decision: Decision | None = None
        self.requests = 0
        self.objects: dict[str, Any] = {}
        self.step_count: Callable[[], int] = lambda: -1
        self.on_reconfigure: list[Callable[[], None]] = []
        self.holds_work: list[Callable[[], bool]] = []
        """Whether a strategy has a collective in flight on the quorum's group beyond the step (elastic
        Streaming DiLoCo's delayed exchange): then a group left behind is set aside, not shut down
        (shutting it down would wait for that collective, for the group's whole timeout if a peer is gone)."""
        self.heals = 0
        """Times this process received state from a peer."""
        self.heal_bytes = 0
        """Bytes of state this process sent to or received from peers in heals (peer to peer: `_heal_if_ready`)."""
        self.stepped_with: tuple[int, ...] | None = None
        """The worker groups whose processes' gradients the last step averaged (None: the step was left out)."""
        self._kept: Any = None
        """The worker group's own process group, when `troupe.shard` asked for one (`group_process_group`)."""
        self._kept_saved: dict[str, Any] | None = None
        self._pending_heal: tuple[Quorum, str] | None = None
        self._failed_step = False
        self._proposals = vote.Proposals()
        self._polled = float("-inf")
        """When a wait last asked the store whether the step was decided without this process (`_poll_due`)."""
        self._graveyard: list[tuple[float, Any]] = []
        """Groups of failed steps, kept unshut until their operation in flight has timed out."""
        self._posted: str | None = None
        self._drawn: tuple[int, int, int] | None = None
        """Under a constant global batch: (quorum id, round, batches) of the batch the loader drew last."""
        self._weighed = False
        # The first beat (`Beat.start`) before anything else: the lighthouse gives a restarted rank `evict_after`
        # from its start to be heard, and this process may ask to join before its thread's first beat.
        self._beat = liveness.Beat(rank, lambda: connect(options.evict_after), options.heartbeat,
                                   name="troupe-elastic-heartbeat").start()

    # --- joining -------------------------------------------------------------------------

    def stand_by(self) -> None:
        """Before `troupe.track`: a process group of this process alone, so that the World and a
        DistOpt can be made (without collectives) while the script loads its data. The worker asks
        to join only when it is ready to step: the others never wait for its start-up."""
        _leave_group()
        _init_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)

    @contextmanager
    def first_lives(self, name: str, size: int) -> Iterator[None]:
        """Inside the block the default process group is one of the job's `size` processes in their first
        lives, made on the launcher's store under `name` (plan "auto" timed in the job: troupe.partition,
        which every process calls before its first quorum); then this process stands by alone again. A
        member lost meanwhile raises RuntimeError (within the time a first quorum has to form)."""
        if self.joined or self.incarnation:
            raise RuntimeError("first_lives is for the job's first processes, before their first quorum")
        _leave_group()
        failed = False
        try:
            # the first processes reach it as each finishes its start-up: as long to meet as a first quorum has
            wait = max(self.options.form_within, self.options.timeout)
            _init_group(self.backend, store=dist.PrefixStore(f"{name}/", _torch_store(self.store)), rank=self.rank,
                        world_size=size, timeout=datetime.timedelta(seconds=wait))
            yield
        except BaseException:
            failed = True
            raise
        finally:
            _leave_group(self._set_aside if failed else None)
            _init_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)

    def group_process_group(self) -> Any:
        """A process group of this worker group's k processes alone, made once per life of the group (they live,
        die and restart together) on the launcher's store, and kept across quorums: torch's FSDP2
        (`troupe.shard`) keeps the group it shards over, which the quorum's groups, made anew for every quorum,
        cannot be. Made while this process stands by, before it joins; every process of the group calls it."""
        if self._kept is not None:
            return self._kept
        if self.joined:
            raise RuntimeError("troupe.shard under troupe run --elastic must come before troupe.track (before this "
                               "process joins the job)")
        k = self.options.group_size
        wait = max(self.options.form_within, self.options.timeout)
        _leave_group()
        try:
            # Meanwhile the default group is the worker group, each process at its place: a mesh made over the kept
            # group now finds each process at its place.
            _init_group(self.backend, store=dist.PrefixStore(f"group/{self.group}/{self.incarnation}/",
                                                             _torch_store(self.store)),
                        rank=self.place, world_size=k, timeout=datetime.timedelta(seconds=wait))
            self._kept = dist.new_group(list(range(k)), timeout=datetime.timedelta(seconds=self.options.timeout),
                                        use_local_synchronization=True)
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.rank}: worker group {self.group}'s processes did not meet within {wait:.0f} s "
                               f"({str(e).splitlines()[0][:160]})") from None
        return self._kept

    def make_mesh(self, build: Callable[[Any], Any]) -> Any:
        """`build(group)` while the default group is this worker group (`group_process_group`), then stand by alone
        again, keeping the group."""
        group = self.group_process_group()
        try:
            return build(group)
        finally:
            self._leave()
            _init_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
            self._restore_kept({0: self.place})

    def _leave(self, set_aside: Callable[[Any], None] | None = None) -> None:
        """`_leave_group`, keeping the worker group's own process group (`group_process_group`) alive: its entries in
        torch's tables of groups are taken out first (leaving the default group shuts down and forgets every group
        in them: no public call destroys the default group alone, see the comment on `_leave_group`) and put back by
        `_restore_kept` once the next default group exists."""
        if self._kept is not None:
            from torch.distributed import distributed_c10d as c10d

            w, pg = c10d._world, self._kept
            if pg in w.pg_map:
                self._kept_saved = {"map": w.pg_map.pop(pg), "name": w.pg_names.pop(pg),
                                    "backend": w.pg_backend_config.pop(pg), "tag": w.pg_to_tag.pop(pg, None)}
                w.pg_group_ranks.pop(pg, None)
                for tagged in w.tags_to_pg.values():
                    if pg in tagged:
                        tagged.remove(pg)
        _leave_group(set_aside)

    def _restore_kept(self, ranks: dict[int, int]) -> None:
        """Put the kept group back in torch's tables, with `ranks` (this quorum's rank -> place) as its members."""
        if self._kept is None or self._kept_saved is None:
            return
        from torch.distributed import distributed_c10d as c10d

        w, pg, saved = c10d._world, self._kept, self._kept_saved
        w.pg_map[pg], w.pg_names[pg], w.pg_backend_config[pg] = saved["map"], saved["name"], saved["backend"]
        if saved["tag"] is not None:
            w.pg_to_tag[pg] = saved["tag"]
        w.pg_group_ranks[pg] = ranks
        c10d._register_process_group(saved["name"], pg)

    @property
    def joined(self) -> bool:
        return self.quorum is not None

    def join(self) -> Quorum:
        """Ask to be admitted and wait until a quorum names this rank; make its process group."""
        while True:
            self.requests += 1
            # The last quorum's id: a standby's lighthouse numbers its quorums after it (runtime/failover.py).
            ready = Ready(f"{self.incarnation}.{self.requests}", self.step_count(),
                          {"quorum": self.quorum.id} if self.quorum is not None else {})
            try:
                self.store.set(f"ready/{self.rank}", ready.encode())
                self.store.append(ASKED, f"{self.rank} ")  # the lighthouse reads only the requests logged here,
                self.store.add(ASKED_COUNT, 1)  # and the log only when this count moved
                quorum = self._wait_for_admission(ready.token)
                if self._failover is not None:
                    self._failover.learn(self.store)
            except FailedOver as e:  # node 0's launcher is gone: ask the standby's lighthouse
                log.warning("troupe: rank %d asks to be admitted again (%s)", self.rank, e)
                continue
            self._proposals = vote.Proposals()  # (its count is the store's: the standby's starts again)
            try:
                self._enter(quorum, "r0")
                return quorum
            except (RuntimeError, FailedOver) as e:  # a member died while the group formed (or the store moved): again
                log.warning("troupe: rank %d could not form quorum %d (%s); asking to be admitted again",
                            self.rank, quorum.id, str(e).splitlines()[0][:160])

    def _wait_for_admission(self, token: str) -> Quorum:
        while True:
            if self.store.check(["closed"]):
                log.warning("troupe: rank %d: the job finished while it waited to rejoin; leaving", self.rank)
                raise SystemExit(0)
            if self.store.check(["latest"]):
                quorum = Quorum.decode(self.store.get("latest"))
                if quorum.admits(self.rank, token):
                    return quorum
            time.sleep(0.01)

    def _enter(self, quorum: Quorum, tag: str) -> None:
        """Make `quorum`'s process group the default one (every communicator re-reads its rank and size).

        `tag` tells apart two groups of one quorum: a failed round rebuilds the same members' group."""
        self._bury()
        busy = self._failed_step or any(holds() for holds in self.holds_work)
        self._leave(self._set_aside if busy else None)
        store = dist.PrefixStore(f"pg/{quorum.id}/{tag}/", _torch_store(self._pg_store))
        self._quorum_gen = self._generation()
        _init_group(self.backend, store=store, rank=quorum.index(self.rank), world_size=quorum.size,
                    timeout=datetime.timedelta(seconds=self.options.timeout))
        k = self.options.group_size
        self._restore_kept({quorum.index(self.group * k + j): j for j in range(k)})
        self.quorum, self.round = quorum, 0
        for hook in self.on_reconfigure:
            hook()
        if quorum.joiners and (self.group == quorum.source or self.group in quorum.joiners):
            # Place by place: each joiner's process copies its counterpart in the source group.
            self._pending_heal = (quorum, f"heal/{quorum.id}/{tag}/{self.place}")
            self._heal_if_ready()

    # --- one step ------------------------------------------------------------------------

    @property
    def constant_batch(self) -> bool:
        return self.options.batch == "constant"

    def batch_ranks(self) -> tuple[int, ...]:
        """The ranks whose batch this process takes in the coming step (called by the loader as it
        draws the step's batch): its own; under a constant global batch also those of the missing
        groups' processes at its place that its group covers (`Quorum.covered_by`)."""
        q = self.quorum
        if q is None:
            raise RuntimeError("under troupe run --elastic, call troupe.track(model=..., optimizer=...) before the "
                               "first batch: it joins the running job (the batch depends on who is present)")
        if not self.constant_batch:
            return (self.rank,)
        groups = q.covered_by(self.group, self.options.groups)
        self._drawn = (q.id, self.round, len(groups))
        return tuple(g * self.options.group_size + self.place for g in groups)

    def grad_weight(self) -> float:
        """Under a constant global batch: what this process's gradient (the mean over its batch of
        k groups' batches) counts for in a mean over the quorum's processes, k * present / groups, so
        that the mean is that over all the job's batches. Read as the step's reduction starts."""
        q = self.quorum
        if self._drawn is None or self._drawn[:2] != (q.id, self.round):
            raise RuntimeError(
                "troupe run --elastic-batch constant: this step's batch was not drawn by troupe.data.loader after "
                "the last step (it takes the missing groups' batches too, chosen per step): make the loader with "
                "troupe.data.loader(...) and draw each batch after the previous step")
        self._weighed = True
        return self._drawn[2] * len(q.members) / self.options.groups

    def vote(self, ok: bool, error: BaseException | None = None) -> bool:
        """Say whether this step's reduction succeeded; return whether every member applies it.

        A member lost mid-step makes the lighthouse decide the round (never committed); an
        error on this rank alone while nobody was lost is this rank's bug and is raised."""
        q = self.quorum
        if q is None:
            raise RuntimeError("under troupe run --elastic, call troupe.track(model=..., optimizer=...) before the "
                               "first step: it joins the running job and copies its state")
        if self.constant_batch and ok and not self._weighed:
            raise RuntimeError("troupe run --elastic-batch constant: this step's gradients were reduced without "
                               "troupe's gradient reducer (which weighs them for the constant global batch)")
        self._weighed = False
        self.round += 1
        try:
            try:
                if self._generation() != self._quorum_gen:
                    raise FailedOver("the quorum was made on the store before the failover")
                decision, clean = self._cast(ok)
            except FailedOver:
                decision, clean = self._failover_round(q, self.round), False
        except RuntimeError as e:
            raise LostLauncher(f"rank {self.rank}: lost the elastic job's store (the launcher): "
                               f"{str(e).splitlines()[0][:160]}") from None
        self.decision = decision
        self.stepped_with = q.members if decision.commit else None
        self._failed_step = not decision.commit or not clean  # a vote collective may be in flight on the group
        if not ok and decision.by == "vote" and error is not None and decision.next == q:
            raise error  # nobody was lost: the failure is this rank's own
        return decision.commit

    def _cast(self, ok: bool) -> tuple[Decision, bool]:
        """This round's decision (runtime/vote.py) and whether every vote collective finished here: over the
        quorum's group; through the store when a collective fails or is given up (then as a failed vote: this
        member's group may be out of step) or when the leader asks for it."""
        q, k, index = self.quorum, self.round, self.quorum.index(self.rank)
        if self.backend != "gloo" or q.size < self.group_vote_min:  # NCCL: no CPU tensors; a small quorum
            return vote.through_store(self.store, q, k, ok, self._proposal), True
        return vote.cast(self.store, q, k, index, ok,
                         vote.GroupExchange(index, q.size, k, lambda: vote.decided_without_us(self.store, q, k)
                                            if self._poll_due() else None),
                         lambda: self._proposals.pending(self.store, q), self._proposal)

    def _failover_round(self, q: Quorum, k: int) -> Decision:
        """Round `k` of a quorum made before the failover, decided at the standby: a decision a member applied
        stands (it was mirrored there first); else the first compare-and-set of "not committed, no quorum", after
        which every member asks the standby's lighthouse to be admitted (runtime/failover.py)."""
        self.store.current()  # (another of this process's stores may have seen the failover first)
        failover = Decision(False, None, by="failover").encode()
        return Decision.decode(self.store.compare_set(round_key(q.id, k, "d"), "", failover))

    def _generation(self) -> int:
        return 0 if self._failover is None else self._failover.generation

    def interrupted(self) -> str | None:
        """Why a reduction in flight should give up: the lighthouse decided this step without our
        vote (a member was lost), or the job's store failed over. None: keep waiting (or not time to ask the
        store again yet)."""
        q = self.quorum
        if q is None:
            return None
        if self._generation() != self._quorum_gen:
            return f"rank {self.rank}: the job's store failed over to the standby (node 0's launcher is gone)"
        try:
            if self._poll_due() and self.store.check([round_key(q.id, self.round + 1, "d")]):
                return f"rank {self.rank}: quorum {q.id}'s step was decided without this rank's vote (a member was lost)"
        except FailedOver as e:
            return f"rank {self.rank}: {e}"
        return None

    def _poll_due(self) -> bool:
        """Whether a wait may ask the store now: every member of a large quorum asking every 0.1 s would cost the
        store more than the vote does (`poll_interval`)."""
        now = time.monotonic()
        if now - self._polled < poll_interval(self.quorum.size):
            return False
        self._polled = now
        return True

    def _set_aside(self, group: Any) -> None:
        self._graveyard.append((time.monotonic() + self.options.timeout + 1.0, group))

    def _bury(self) -> None:
        """Let go of the groups set aside whose operation in flight has surely timed out by now."""
        now = time.monotonic()
        self._graveyard = [(t, g) for t, g in self._graveyard if t > now]

    def _proposal(self) -> Quorum | None:
        if not self.store.check(["proposal"]):
            return None
        proposal = Quorum.decode(self.store.get("proposal"))
        return proposal if proposal.base == self.quorum.id else None

    def advance(self) -> None:
        """After the step: move to the quorum the round decided (a step that failed rebuilds even
        the same quorum's group); leave and ask to be admitted again when it does not name us."""
        d, self.decision = self.decision, None
        if d is None:
            return
        nxt = d.next
        if nxt is not None and nxt == self.quorum and d.commit:
            return
        if nxt is not None and self.group not in nxt.members:
            # The others stepped on without us (we were paused or late): our state and the script's
            # place in its loop are behind. A fresh process catches up through troupe.track.
            log.warning("troupe: rank %d was left out of quorum %d (paused or late); it restarts to rejoin",
                        self.rank, nxt.id)
            raise SystemExit(REJOIN_EXIT)
        if nxt is None:  # too few groups left: all of us are at this step; wait for restarts to come back
            self.join()
            return
        try:
            self._enter(nxt, f"r{self.round}" if nxt.id == self.quorum.id else "r0")
        except (RuntimeError, FailedOver):
            self.join()

    # --- heal ----------------------------------------------------------------------------

    def track(self, objects: dict[str, Any]) -> int:
        """Hand these objects' state to joiners (as a source) or load it from one (as a joiner)."""
        self.objects = dict(objects)
        optimizer = objects.get("optimizer")
        if optimizer is not None and hasattr(optimizer, "step_count"):
            self.step_count = lambda: optimizer.step_count
        if not self.joined:
            self.join()
        self._heal_if_ready()
        return max(self.step_count(), 0)

    def track_by_default(self, params: list[torch.Tensor], optimizer: Any) -> None:
        """For a script that never calls `troupe.track`: join at the first forward of a module holding
        `params` (before the first backward reduces anything), healing that module (the parameters alone
        if it holds only some), `optimizer` (the DistOpt) and the RNG from a peer. In a restarted process the
        script's loop and data start from its beginning (troupe.track(..., sampler=...) resumes them)."""
        ours, pid = {id(p) for p in params}, os.getpid()
        handle = None

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            if os.getpid() != pid:  # a DataLoader worker forked from this process
                return
            held = {id(p) for p in module.parameters()}
            if not held & ours:
                return
            handle.remove()
            if self.joined or self.objects:  # the script called troupe.track
                return
            self.track({"model": module if ours <= held else _Tensors(params), "optimizer": optimizer})

        handle = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

    def _heal_if_ready(self) -> None:
        """Peer to peer, over the quorum's own process group (Gloo): the source group's process at this place
        sends its state to the joining groups' processes at the same place, which load it before their first
        step; nothing of it passes through the launcher's store. Both ends arrive here right after forming that
        group (`_enter`), the source as it moves to the quorum, a joiner as it joins; the others go on to the
        step, whose reduction waits for them. Under another backend the state goes through the store."""
        if self._pending_heal is None or not self.objects:
            return
        (q, key), self._pending_heal = self._pending_heal, None
        if self.backend != "gloo":
            self._heal_through_store(q, key)
            return
        if self.group == q.source:
            blob = _pack(self.objects)
            for joiner in q.joiners:
                peer = q.index(joiner * q.group_size + self.place)
                try:
                    _send_blob(blob, peer)
                except RuntimeError as e:  # the joiner died meanwhile: the step's vote leaves its group out
                    log.warning("troupe: rank %d: its state did not reach worker group %d's process (%s)", self.rank,
                                joiner, str(e).splitlines()[0][:160])
                    continue
                self.heal_bytes += len(blob)
        else:
            blob = _recv_blob(q.index(q.source * q.group_size + self.place))
            self.heal_bytes += len(blob)
            _unpack(blob, self.objects)
            self.heals += 1

    def _heal_through_store(self, q: Quorum, key: str) -> None:
        """The heal through the launcher's store (a backend whose process group carries no CPU tensors)."""
        if self.group == q.source:
            self.store.set(key, _pack(self.objects))
            if self._posted is not None:
                self.store.delete_key(self._posted)  # its joiners have it by now (they loaded it before stepping)
            self._posted = key
        else:
            _unpack(self.store.get(key), self.objects)
            self.heals += 1

    def partner_lost(self, error: BaseException) -> None:
        """An exchange inside this worker group failed outside the step's reduction (a partitioned
        model's forward or backward): a partner process died or froze, and the group cannot compute.
        Wait for the launcher, which stops a dead process's whole group; if it does not (the partner
        is frozen: the lighthouse leaves the group out), leave with the rejoin code, as a process
        left out does. Never returns."""
        log.warning("troupe: rank %d: a process of its worker group %d was lost mid-step (%s); the group restarts "
                    "and rejoins", self.rank, self.group, str(error).splitlines()[0][:160])
        time.sleep(PARTNER_GRACE)
        os._exit(REJOIN_EXIT)

    def close(self) -> None:
        """Stop beating and say goodbye: the lighthouse leaves this rank out of the next step at once,
        instead of after `evict_after` of silence or when the process is gone (an interpreter that
        tears torch down takes seconds on a loaded host). "error" when an uncaught exception ends
        the script (Python sets `sys.last_value` before the exit hooks run), else "done"."""
        self._beat.stop()
        why = "error" if getattr(sys, "last_value", None) is not None else "done"
        for _ in range(2):  # (a second time at the standby, when the store failed over)
            try:
                self.store.set(f"bye/{self.rank}", why)
                self.store.add("byes", 1)
                return
            except FailedOver:
                continue
            except (RuntimeError, ConnectionError, OSError):
                return  # the launcher is gone: nobody to tell


class _Tensors:
    """Parameters as a heal's object (`track_by_default` where no one module holds them all)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): p.detach() for i, p in enumerate(self.params)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, p in enumerate(self.params):
            (p.to_local() if handoff.is_dtensor(p) else p).copy_(state[str(i)])


def _torch_store(store: Any) -> dist.Store:
    """The torch Store behind the job's store (a `FailoverStore`'s current one), for a process group's rendezvous."""
    return store.current() if hasattr(store, "current") else store


def _init_group(backend: str, **kwargs: Any) -> None:
    """`dist.init_process_group`, keeping `sys.excepthook`: torch wraps it at every group it makes to
    prefix tracebacks with the rank in that group, which here is a place in the quorum, not the job's
    rank, and would pile up one prefix per quorum this process has been in."""
    hook = sys.excepthook
    try:
        dist.init_process_group(backend, **kwargs)
    finally:
        sys.excepthook = hook


# Why c10d's private tables (`_world`), here and in `Elastic._leave`/`_restore_kept`: torch 2.13's public API has
# no call for three things a quorum change does. (1) Destroy the default group alone: destroy_process_group(group)
# destroys that group only, and destroy_process_group() (or group.WORLD) destroys the default group with every
# other group, the worker group's own one (`group_process_group`, a mesh's) with it; nor can a kept group be
# re-mapped onto the next default group's ranks (pg_group_ranks). (2) Drop a group without shutting it down: every
# destroy calls shutdown(), which for Gloo waits out an operation in flight (the group's timeout after a lost
# peer); the abort that would not is private and NCCL-only (_abort_process_group). (3) Name the next default
# group: init_process_group ignores group_name (deprecated) and names it by _world.group_count, which only a
# completed destroy resets. Groups built outside the tables (ProcessGroupGloo(store, rank, size)) do not help:
# torch.distributed's collectives (get_group_rank), DeviceMesh and FSDP look every group up in them. What would
# is torchft's way, one registered group whose backend is swapped at each quorum (a backend registered through
# dist.Backend.register_backend that forwards every collective): a redesign of the elastic wing, not done here.
def _leave_group(set_aside: Callable[[Any], None] | None = None) -> None:
    """Stop using the default group: destroy it, or (`set_aside` given: a step failed and a reduction
    may still be in flight on it) hand it over unshut. Shutting down a Gloo group waits for its
    operation in flight, i.e. for the group's whole timeout after a lost peer (`Elastic._bury`).
    The tables it edits, and why no public call does it: the comment above."""
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        if set_aside is not None:
            set_aside(c10d._get_default_group())
            c10d._update_default_pg(None)
            w = c10d._world
            for registry in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag,
                             w.tags_to_pg, w.pg_coalesce_state):
                registry.clear()
            c10d._unregister_all_process_groups()
        else:
            try:
                dist.destroy_process_group()
            except RuntimeError as e:  # shutting down a group whose peer died may fail: it is gone anyway
                log.debug("troupe: destroying the old quorum's group: %s", e)
            if dist.is_initialized():
                c10d._update_default_pg(None)
    # torch names the next default group by a counter it resets only when a destroy completes; every
    # member of the next quorum must use the same name (it prefixes the group's rendezvous keys).
    c10d._world.group_count = 0


def _send_blob(blob: bytes, peer: int) -> None:
    """`blob` to `peer` of the default process group: its length, then its bytes, as tensors."""
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), peer)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), peer)


def _recv_blob(peer: int) -> bytes:
    """What `_send_blob` sent from `peer`."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(data, peer)
    return data.numpy().tobytes()


def _pack(objects: dict[str, Any]) -> bytes:
    """The whole state of the objects a script tracks (`handoff.pack`)."""
    return handoff.pack({name: obj.state_dict() for name, obj in objects.items()})


def _unpack(blob: bytes, objects: dict[str, Any]) -> None:
    handoff.load_states(objects, handoff.unpack(blob))
