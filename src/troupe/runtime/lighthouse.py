"""The elastic job's quorum keeper, in the launcher: who is alive, who may join, who is lost.

`troupe run --elastic` runs one `Lighthouse` beside the workers it supervises (not in a worker:
no worker is a single point of failure). It hosts the job's TCP store and, every `tick`:

1. follows the running quorum's rounds (the workers decide them; see runtime/vote.py);
2. reads each worker's heartbeat counter and the supervisor's word on dead processes;
3. a member lost (dead, or silent for `evict_after`): decides the current round itself
   (not committed) with the next quorum without it, so no survivor waits for a vote that
   will never come;
4. a worker asking to join (a restart, or one that lost its quorum): proposes the running
   quorum plus it; the next round's decision (by the quorum's leader) adopts it at a step boundary;
5. no running quorum (the start, or too few left): forms one from the workers ready, when
   there are `min_groups` (at the start: all groups, or `min_groups` after `form_within`).

On several nodes (`troupe run --nnodes N --elastic`) the lighthouse runs in node 0's launcher;
every other node's launcher supervises its own ranks and tells it what it sees through the
store (`Reporter`), so a rank on any node drops out of the step as soon as its launcher sees
it exit, and is admitted again when it asks.

The quorum's members are worker groups (`ElasticOptions.group_size` processes each; one by
default). What the workers and the supervisor report is per process; a group is alive when
every process of it beats, asks to join when every process of it has asked, and is lost when
any process of it is (the supervisor restarts the whole group).
"""

from __future__ import annotations

import threading
import time

from troupe.runtime import liveness
from troupe.runtime.quorum import (ASKED, ASKED_COUNT, PROPOSALS, Decision, ElasticOptions, Quorum, Ready, read_refusal,
                                  round_key)
from troupe.runtime.ticket import Ticket

TICK_SECONDS = 0.02


class Lighthouse:
    """The quorum of an elastic job's worker groups, kept in the launcher."""

    def __init__(self, ticket: Ticket, options: ElasticOptions, *, say=lambda line: None):
        import torch.distributed as dist  # the launcher imports torch only for an elastic job

        from troupe.runtime.launch import open_store, token_digest_record

        self.options, self.say, self.ticket = options, say, ticket
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
        self.reports = 0
        """Other nodes' reports read so far (`Reporter`)."""
        self.beats = liveness.Silence(self.store, range(options.processes))
        # Every rank's heartbeat counter exists from the start and the log of ranks asking is empty: a tick reads
        # all counters in one message (`_read_beats`) and only the requests logged since its last look.
        self.store.set(ASKED, "")
        self.asked_seen = 0
        """Characters of the log of ranks asking (`ASKED`) read so far."""
        self.asked_count = 0
        """Requests the workers had counted (`ASKED_COUNT`) when the log was last read."""
        self.requests: dict[int, Ready] = {}
        """Per rank, its latest request to be admitted (`ready/<rank>`)."""
        self.beats_read_at = float("-inf")
        self.admitted: dict[int, str] = {}
        """Per rank, the `Ready` token of the request it was last admitted with."""
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

    def end(self, code: int) -> None:
        """Node 0's launcher leaves on purpose with `code` (the job is over, failed, or was stopped): says so in its
        store and in the standby's (launcher/standby.py), which then does not take over."""
        import torch.distributed as dist

        from troupe.runtime.failover import ENDED_KEY, STANDBY_KEY
        from troupe.runtime.launch import open_store

        try:
            self.store.set(ENDED_KEY, str(code))
            if self.store.check([STANDBY_KEY]):
                host, port = self.store.get(STANDBY_KEY).decode().rsplit(":", 1)
                standby = open_store(Ticket(addr=host, port=int(port), token=self.ticket.token), False, 2.0)
                dist.PrefixStore(f"troupe/{self.ticket.token}/", standby).set(ENDED_KEY, str(code))
        except (RuntimeError, ConnectionError, OSError) as e:
            self.say(f"troupe run: could not tell the standby launcher that the job ended ({e})")

    # --- what the supervisor tells it -----------------------------------------------------

    def lost(self, rank: int, *, finished: bool = False) -> None:
        """The process of `rank` exited (`finished`: with code 0, its training done)."""
        with self._lock:
            self._lost(rank, finished=finished)

    def restarted(self, rank: int) -> None:
        """`rank` runs again (a new process: it asks to join when it is ready)."""
        with self._lock:
            self._restarted(rank)

    def asked(self, rank: int, incarnation: int) -> bool:
        """Whether life `incarnation` of `rank` asked to join the job (it got as far as its first step)."""
        with self._lock:
            return _asked(self.store, rank, incarnation)

    def refusal(self, rank: int) -> str | None:
        """Why `rank` refused the job (a restart would be refused again: the job stops), or None."""
        with self._lock:
            return read_refusal(self.store, rank)

    def _restarted(self, rank: int) -> None:
        self.dead.discard(rank)
        self.said_bye.discard(rank)
        self.leaving.discard(rank)
        self.store.delete_key(f"bye/{rank}")  # its last process's goodbye, said before it died
        self.beats.expect(rank)

    def _lost(self, rank: int, *, finished: bool) -> None:
        self.dead.add(rank)
        self.departed.add(rank)
        if finished:
            self.finished.add(rank)

    def take_over(self, gone: set[int]) -> None:
        """A standby's lighthouse (launcher/standby.py): node 0's launcher is gone, with its store and `gone`, its
        ranks; keep the job from here. No quorum runs here yet: the workers that fail over decide their rounds in
        flight themselves (runtime/failover.py) and ask to be admitted, and a quorum forms from them as after a
        collapse (every live group within `timeout`, then `min_groups`)."""
        from troupe.runtime.failover import TAKEOVER_KEY

        with self._lock:
            now = time.monotonic()
            self.dead |= set(gone)
            self.active, self.formed_once, self.collapsed_at = None, True, now
            # Every other rank is heard afresh, with `timeout` more than `evict_after` to beat here: its heartbeat
            # thread first waits out node 0's store, then reconnects to this one (seconds on a loaded host).
            for rank in set(range(self.options.processes)) - set(gone):
                self.beats.expect(rank, now + self.options.timeout)
            self._note("took over", gone=sorted(gone))
            self.store.set(TAKEOVER_KEY, "1")
        self.start()

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

    def _groups(self, ranks: set[int]) -> set[int]:
        """The groups that have a process among `ranks`."""
        return {r // self.options.group_size for r in ranks}

    def _whole(self, ranks: set[int]) -> set[int]:
        """The groups all of whose processes are among `ranks`."""
        return {g for g in self._groups(ranks) if set(self.options.ranks(g)) <= ranks}

    def tick(self) -> None:
        self._follow_rounds()
        self._read_reports()
        self._read_byes()
        now = time.monotonic()
        self._read_beats(now)
        self._read_requests()
        beating = {r for r in self.beats.seen
                   if r not in self.dead and self.beats.silent_for(r, now) < self.options.evict_after}
        alive = self._whole(beating)
        asking_ranks = self._asking_ranks(beating)
        asking = self._asking(asking_ranks, alive)
        departed, self.departed = self._groups(self.departed), set()
        finished = self._groups(self.finished)
        if finished and (self.active is None or set(self.active.members) <= finished):
            self.store.set("closed", "1")  # the job is over: a worker still waiting to be admitted leaves
            return
        if self.active is None:
            self._form(asking, alive - finished, now)
            return
        members = set(self.active.members)
        dead = self._groups(self.dead)
        lost = (members - alive) | (departed & members)
        silent = {r for g in sorted(members - departed - dead) for r in self.options.ranks(g)} - beating
        if silent:
            ages = ", ".join(f"rank {r}: {self.beats.silent_for(r, now):.1f}s" for r in sorted(silent))
            self.say(f"troupe run: no heartbeat within {self.options.evict_after:.0f}s ({ages})")
        # A member's process asking again could not make the quorum's group: it never formed, for anyone.
        failed_to_form = bool(self._groups(set(asking_ranks)) & members)
        if lost or failed_to_form:
            self._abort(lost, asking, collapse=failed_to_form)
        elif asking:
            self._propose(asking)

    def _read_reports(self) -> None:
        """What other nodes' launchers saw of their ranks since the last look (one counter read a tick)."""
        told = self.store.add("reports", 0)
        while self.reports < told:
            self.reports += 1
            what, rank = self.store.get(f"report/{self.reports}").decode().split()
            if what == "restarted":
                self._restarted(int(rank))
            else:
                self._lost(int(rank), finished=what == "finished")

    def done(self) -> bool:
        """Every rank of the job, on every node, has finished or is gone (dead, or silent for
        `evict_after`): node 0's launcher may take the store down."""
        with self._lock:
            now = time.monotonic()
            return all(r in self.finished or r in self.dead
                       or self.beats.silent_for(r, now) >= self.options.evict_after for r in self.beats.seen)

    def _read_byes(self) -> None:
        """Ranks that said goodbye since the last look leave the quorum now (one counter read a tick)."""
        byes = self.store.add("byes", 0)
        if byes == self.byes:
            return
        self.byes = byes
        for rank in set(self.beats.seen) - self.dead - self.said_bye:
            if self.store.check([f"bye/{rank}"]):
                self.said_bye.add(rank)
                self.departed.add(rank)
                if self.store.get(f"bye/{rank}") == b"done":
                    self.leaving.add(rank)

    def _read_beats(self, now: float) -> None:
        """Every live rank's heartbeat counter, in one message, twice a heartbeat (not every tick: silence is
        judged in seconds, and a job of thousands of processes would spend the tick reading them one by one)."""
        if now - self.beats_read_at < self.options.heartbeat / 2:
            return
        self.beats_read_at = now
        self.beats.read([r for r in self.beats.seen if r not in self.dead], now)

    def _read_requests(self) -> None:
        """The requests of the ranks that logged one since the last look (one counter read a tick; a worker writes
        its `ready/<rank>` first, then appends its rank to the log, then counts it)."""
        count = self.store.add(ASKED_COUNT, 0)
        if count == self.asked_count:
            return
        self.asked_count = count
        log = self.store.get(ASKED).decode()
        ranks = sorted({int(r) for r in log[self.asked_seen:].split()})
        self.asked_seen = len(log)
        for rank, blob in zip(ranks, self.store.multi_get([f"ready/{r}" for r in ranks])):
            ready = self.requests[rank] = Ready.decode(blob)
            # a quorum numbered after the one it left (it may come from node 0's lighthouse: runtime/failover.py)
            self.next_id = max(self.next_id, ready.extra.get("quorum", 0) + 1)

    def _asking_ranks(self, beating: set[int]) -> dict[int, Ready]:
        """The live processes with a request not admitted yet."""
        return {r: q for r, q in sorted(self.requests.items()) if r in beating and q.token != self.admitted.get(r)}

    def _asking(self, asking_ranks: dict[int, Ready], alive: set[int]) -> dict[int, Ready]:
        """The live groups every process of which asks: one request each, its processes' tokens
        joined in rank order, and the fewest steps any of them has taken."""
        out = {}
        for g in sorted(alive):
            requests = [asking_ranks.get(r) for r in self.options.ranks(g)]
            if all(requests):
                out[g] = Ready("|".join(q.token for q in requests), min(q.step for q in requests))
        return out

    def _admit(self, group: int, tokens: str) -> None:
        for rank, token in zip(self.options.ranks(group), tokens.split("|")):
            self.admitted[rank] = token

    def _tokens(self, group: int) -> str:
        return "|".join(self.admitted[r] for r in self.options.ranks(group))

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
        for group in quorum.joiners:
            self._admit(group, quorum.tokens[quorum.members.index(group)])
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
            need = self.options.cap if now - self.started <= self.options.form_within else self.options.min_groups
        elif now - self.collapsed_at <= self.options.timeout + 1.0:
            need = max(len(alive), self.options.min_groups)
        else:
            need = self.options.min_groups
        if len(asking) < min(need, self.options.cap):
            return
        # The furthest trained first (then the lowest numbered); beyond max_groups the rest stand by.
        chosen = sorted(asking, key=lambda g: (-asking[g].step, g))[:self.options.cap]
        asking = {g: asking[g] for g in chosen}
        source = max(asking, key=lambda r: (asking[r].step, -r))
        members = tuple(sorted(asking))
        quorum = Quorum(self.next_id, members, tuple(r for r in members if r != source), source, base=0,
                        tokens=tuple(asking[r].token for r in members), group_size=self.options.group_size)
        for group, ready in asking.items():
            self._admit(group, ready.token)
        self.active, self.cursor, self.formed_once = quorum, 1, True
        self._publish(quorum)
        self._note("formed", id=quorum.id, members=list(members), source=source)

    def _next_from(self, keep: set[int], asking: dict[int, Ready]) -> Quorum | None:
        room = max(self.options.cap - len(keep), 0)  # beyond max_groups the groups asking stand by
        asking = {g: asking[g] for g in sorted(set(asking) - keep, key=lambda g: (-asking[g].step, g))[:room]}
        members = tuple(sorted(keep | set(asking)))
        if len(members) < self.options.min_groups or not keep:
            return None
        tokens = tuple(asking[g].token if g in asking else self._tokens(g) for g in members)
        return Quorum(self.next_id, members, tuple(sorted(set(asking) - keep)), min(keep), base=self.active.id,
                      tokens=tokens, group_size=self.options.group_size)

    def _propose(self, asking: dict[int, Ready]) -> None:
        proposal = self._next_from(set(self.active.members), asking)
        if proposal is None or not proposal.joiners or proposal == self.proposed:
            return  # (no joiners: the quorum is full, the groups asking stand by)
        self.proposed = proposal
        self.store.set("proposal", proposal.encode())
        self.store.add(PROPOSALS, 1)  # after the proposal: a leader that sees the count moved reads this one
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
            self.cursor += 1  # the round's leader committed it before we knew: decide the next one
        self._note("lost", groups=sorted(lost), round=self.cursor, quorum=self.active.id, collapse=collapse)
        if collapse:
            self.say(f"troupe run: quorum {self.active.id} did not form; forming a new one from the workers asking")
        elif failed := lost - self._groups(self.finished | self.leaving):
            self.say(f"troupe run: worker group(s) {sorted(failed)} left quorum {self.active.id}; "
                     + ("the others go on" if nxt is not None else "too few left: waiting for restarts"))
        self._adopt(stored.next, by=stored.by)


def _asked(store, rank: int, incarnation: int) -> bool:
    """Whether `rank`'s latest request to join came from life `incarnation` (`Ready` tokens: "life.request")."""
    if not store.check([f"ready/{rank}"]):
        return False
    return Ready.decode(store.get(f"ready/{rank}")).token.split(".")[0] == str(incarnation)


class Reporter:
    """Another node's launcher's side of the lighthouse: what the supervisor sees of this node's
    ranks goes to node 0's lighthouse through the job's store, in the order seen."""

    def __init__(self, ticket: Ticket, timeout: float):
        import torch.distributed as dist

        from troupe.runtime.launch import open_store

        self.store = dist.PrefixStore(f"troupe/{ticket.token}/", open_store(ticket, False, timeout))
        self._formed = False

    def lost(self, rank: int, *, finished: bool = False) -> None:
        self._report("finished" if finished else "lost", rank)

    def restarted(self, rank: int) -> None:
        self._report("restarted", rank)

    @property
    def formed_once(self) -> bool:
        """A quorum has formed (this node's launcher then starts its spares)."""
        if not self._formed:
            try:
                self._formed = self.store.check(["latest"])
            except (RuntimeError, ConnectionError, OSError):
                pass  # node 0's launcher is gone: no spares
        return self._formed

    def stop(self) -> None:
        pass

    def asked(self, rank: int, incarnation: int) -> bool:
        """`Lighthouse.asked`, read from node 0's store (True when it is gone: nothing to conclude)."""
        try:
            return _asked(self.store, rank, incarnation)
        except (RuntimeError, ConnectionError, OSError):
            return True

    def refusal(self, rank: int) -> str | None:
        """`Lighthouse.refusal`, read from node 0's store."""
        try:
            return read_refusal(self.store, rank)
        except (RuntimeError, ConnectionError, OSError):
            return None

    def _report(self, what: str, rank: int) -> None:
        try:
            n = self.store.add("reports", 1)
            self.store.set(f"report/{n}", f"{what} {rank}")
        except (RuntimeError, ConnectionError, OSError):
            pass  # node 0's launcher is gone (the job is over, or it died): nobody is left to tell
