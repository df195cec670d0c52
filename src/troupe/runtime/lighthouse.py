"""The elastic job's quorum keeper, in the launcher: who is alive, who may join, who is lost.

`troupe run --elastic` runs one `Lighthouse` beside the workers it supervises (not in a worker:
no worker is a single point of failure). It hosts the job's TCP store and, every `tick`:

1. follows the running quorum's rounds (the workers decide them; see runtime/elastic.py);
2. reads each worker's heartbeat counter and the supervisor's word on dead processes;
3. a member lost (dead, or silent for `evict_after`): decides the current round itself
   (not committed) with the next quorum without it, so no survivor waits for a vote that
   will never come;
4. a worker asking to join (a restart, or one that lost its quorum): proposes the running
   quorum plus it; the next round's last voter adopts the proposal at a step boundary;
5. no running quorum (the start, or too few left): forms one from the workers ready, when
   there are `min_groups` (at the start: all groups, or `min_groups` after `form_within`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from troupe.runtime.quorum import Decision, ElasticOptions, Quorum, Ready, round_key
from troupe.runtime.ticket import Ticket

TICK_SECONDS = 0.02


@dataclass
class _Beat:
    count: int = -1
    changed: float = field(default_factory=time.monotonic)


class Lighthouse:
    """The quorum of an elastic job (one process per worker group), kept in the launcher."""

    def __init__(self, ticket: Ticket, options: ElasticOptions, *, say=lambda line: None):
        import torch.distributed as dist  # the launcher imports torch only for an elastic job

        from troupe.runtime.launch import open_store, token_digest_record

        self.options, self.say = options, say
        self._base = open_store(ticket, True, 30.0)
        self._base.set("troupe/digest", token_digest_record(ticket.token))
        self.store = dist.PrefixStore(f"troupe/{ticket.token}/", self._base)
        self.started = time.monotonic()
        self.dead: set[int] = set()
        self.finished: set[int] = set()
        self.departed: set[int] = set()
        """Ranks whose process exited, or said goodbye, since the last tick (even if already started again)."""
        self.said_bye: set[int] = set()
        """Ranks whose process said goodbye (it may take seconds more to exit)."""
        self.leaving: set[int] = set()
        """Those of them that finished their script (not an error)."""
        self.byes = 0
        self.beats = {r: _Beat() for r in range(options.groups)}
        self.admitted: dict[int, str] = {}
        self.active: Quorum | None = None
        self.cursor = 1
        self.next_id = 1
        self.formed_once = False
        self.collapsed_at = 0.0
        self.proposed: Quorum | None = None
        self.events: list[tuple[float, str, dict]] = []
        """(seconds since start, what, details): quorums formed and adopted, members lost, rounds decided here."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="troupe-lighthouse", daemon=True)

    def start(self) -> Lighthouse:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # --- what the supervisor tells it -----------------------------------------------------

    def lost(self, rank: int, *, finished: bool = False) -> None:
        """The process of `rank` exited (`finished`: with code 0, its training done)."""
        with self._lock:
            self.dead.add(rank)
            self.departed.add(rank)
            if finished:
                self.finished.add(rank)

    def restarted(self, rank: int) -> None:
        """`rank` runs again (a new process: it asks to join when it is ready)."""
        with self._lock:
            self.dead.discard(rank)
            self.said_bye.discard(rank)
            self.leaving.discard(rank)
            self.store.delete_key(f"bye/{rank}")  # its last process's goodbye, said before it died
            self.beats[rank] = _Beat()

    # --- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                with self._lock:
                    self.tick()
            except Exception as e:  # noqa: BLE001  (the store or a worker's record: say it, keep watching)
                self.say(f"troupe run: lighthouse: {type(e).__name__}: {e}")

    def _note(self, what: str, **details) -> None:
        self.events.append((time.monotonic() - self.started, what, details))

    def tick(self) -> None:
        self._follow_rounds()
        self._read_byes()
        now = time.monotonic()
        alive = set()
        for rank, beat in self.beats.items():
            if rank in self.dead:
                continue
            count = self.store.add(f"hb/{rank}", 0)
            if count != beat.count:
                beat.count, beat.changed = count, now
            if now - beat.changed < self.options.evict_after:
                alive.add(rank)
        asking = self._asking(alive)
        departed, self.departed = self.departed, set()
        if self.finished and (self.active is None or set(self.active.members) <= self.finished):
            self.store.set("closed", "1")  # the job is over: a worker still waiting to be admitted leaves
            return
        if self.active is None:
            self._form(asking, alive, now)
            return
        silent = (set(self.active.members) - alive) - departed - self.dead
        lost = (set(self.active.members) - alive) | (departed & set(self.active.members))
        if silent:
            ages = ", ".join(f"rank {r}: {now - self.beats[r].changed:.1f}s" for r in sorted(silent))
            self.say(f"troupe run: no heartbeat within {self.options.evict_after:.0f}s ({ages})")
        # A member asking again could not make the quorum's group: it never formed, for anyone.
        failed_to_form = any(r in self.active.members for r in asking)
        if lost or failed_to_form:
            self._abort(lost, asking, collapse=failed_to_form)
        elif asking:
            self._propose(asking)

    def _read_byes(self) -> None:
        """Ranks that said goodbye since the last look leave the quorum now (one counter read a tick)."""
        byes = self.store.add("byes", 0)
        if byes == self.byes:
            return
        self.byes = byes
        for rank in set(self.beats) - self.dead - self.said_bye:
            if self.store.check([f"bye/{rank}"]):
                self.said_bye.add(rank)
                self.departed.add(rank)
                if self.store.get(f"bye/{rank}") == b"done":
                    self.leaving.add(rank)

    def _asking(self, alive: set[int]) -> dict[int, Ready]:
        out = {}
        for rank in sorted(alive):
            if self.store.check([f"ready/{rank}"]):
                ready = Ready.decode(self.store.get(f"ready/{rank}"))
                if ready.token != self.admitted.get(rank):
                    out[rank] = ready
        return out

    def _follow_rounds(self) -> None:
        """Move `active` along the rounds the workers decided (a round adopting a new quorum)."""
        while self.active is not None and self.store.check([round_key(self.active.id, self.cursor, "d")]):
            decision = Decision.decode(self.store.get(round_key(self.active.id, self.cursor, "d")))
            self._adopt(decision.next, by=decision.by)

    def _adopt(self, quorum: Quorum | None, *, by: str) -> None:
        if quorum is not None and self.active is not None and quorum.id == self.active.id:
            self.cursor += 1
            return
        self.active, self.cursor, self.proposed = quorum, 1, None
        if quorum is None:
            self.collapsed_at = time.monotonic()
            self._note("paused", why="fewer than min_groups")
            return
        for rank in quorum.joiners:
            if self.store.check([f"ready/{rank}"]):
                self.admitted[rank] = Ready.decode(self.store.get(f"ready/{rank}")).token
        self._publish(quorum)
        self._note("adopted", id=quorum.id, members=list(quorum.members), joiners=list(quorum.joiners), by=by)

    def _publish(self, quorum: Quorum) -> None:
        self.store.set("latest", quorum.encode())
        self.next_id = max(self.next_id, quorum.id + 1)

    def _form(self, asking: dict[int, Ready], alive: set[int], now: float) -> None:
        """A quorum from the workers asking: at the start all groups (or `min_groups` after
        `form_within`); after a collapse every live worker, or `min_groups` once the others have
        had `timeout` to give up the group they were forming and ask again (forming with the first
        few would leave the rest asking into a quorum that moves on without them)."""
        if not self.formed_once:
            need = self.options.groups if now - self.started <= self.options.form_within else self.options.min_groups
        elif now - self.collapsed_at <= self.options.timeout + 1.0:
            need = max(len(alive - self.finished), self.options.min_groups)
        else:
            need = self.options.min_groups
        if len(asking) < need:
            return
        source = max(asking, key=lambda r: (asking[r].step, -r))
        members = tuple(sorted(asking))
        quorum = Quorum(self.next_id, members, tuple(r for r in members if r != source), source, base=0,
                        tokens=tuple(asking[r].token for r in members))
        for rank, ready in asking.items():
            self.admitted[rank] = ready.token
        self.active, self.cursor, self.formed_once = quorum, 1, True
        self._publish(quorum)
        self._note("formed", id=quorum.id, members=list(members), source=source)

    def _next_from(self, keep: set[int], asking: dict[int, Ready]) -> Quorum | None:
        members = tuple(sorted(keep | set(asking)))
        if len(members) < self.options.min_groups or not keep:
            return None
        tokens = tuple(asking[r].token if r in asking else self.admitted[r] for r in members)
        return Quorum(self.next_id, members, tuple(sorted(set(asking) - keep)), min(keep), base=self.active.id,
                      tokens=tokens)

    def _propose(self, asking: dict[int, Ready]) -> None:
        proposal = self._next_from(set(self.active.members), asking)
        if proposal is None or proposal == self.proposed:
            return
        self.proposed = proposal
        self.store.set("proposal", proposal.encode())
        self._note("proposed", id=proposal.id, joiners=list(proposal.joiners))

    def _abort(self, lost: set[int], asking: dict[int, Ready], *, collapse: bool = False) -> None:
        """Decide the running round (not committed) with the next quorum without `lost`; with
        `collapse`, with none (every member asks again and a quorum forms from those asking)."""
        keep = set(self.active.members) - lost
        nxt = None if collapse else self._next_from(keep, asking)
        decision = Decision(False, nxt, by="lighthouse")
        while True:
            key = round_key(self.active.id, self.cursor, "d")
            stored = Decision.decode(self.store.compare_set(key, "", decision.encode()))
            if stored == decision or stored.next is None or stored.next.id != self.active.id:
                break
            self.cursor += 1  # the last voter committed that round before we knew: decide the next one
        self._note("lost", ranks=sorted(lost), round=self.cursor, quorum=self.active.id, collapse=collapse)
        if collapse:
            self.say(f"troupe run: quorum {self.active.id} did not form; forming a new one from the workers asking")
        elif not lost <= self.finished | self.leaving:
            self.say(f"troupe run: worker group(s) {sorted(lost - self.finished - self.leaving)} left quorum "
                     f"{self.active.id}; "
                     + ("the others go on" if nxt is not None else "too few left: waiting for restarts"))
        self._adopt(stored.next, by=stored.by)
