"""`troupe run --elastic`'s supervisor (launcher/supervisor.py) over scripted processes: no real ones."""

from __future__ import annotations

import pytest

from troupe.launcher import supervisor as restarts
from troupe.launcher.policies import RESTART, LetGo, StopJob
from troupe.runtime.quorum import REJOIN_EXIT


class Proc:
    """A process whose poll() answers None `alive` times, then `code`."""

    def __init__(self, code: int, alive: int = 1):
        self.code, self.alive = code, alive

    def poll(self):
        if self.alive > 0:
            self.alive -= 1
            return None
        return self.code


class House:
    def __init__(self):
        self.events = []

    def lost(self, rank, *, finished=False):
        self.events.append(("finished" if finished else "lost", rank))

    def restarted(self, rank):
        self.events.append(("restarted", rank))


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(restarts, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(restarts, "BACKOFF_FIRST", 0.0)


class Processes:
    """Rank r's k-th process is script[r][k]; `spawns` records (rank, incarnation)."""

    def __init__(self, script, spawns, stop_all, kill):
        self.script, self.spawns, self.stop_all, self.kill = script, spawns, stop_all, kill

    def start(self, rank, incarnation):
        self.spawns.append((rank, incarnation))
        return self.script[rank][sum(1 for r, _ in self.spawns if r == rank) - 1]

    def poll(self):
        pass


class Policy:
    """A restart policy from plain functions: let_go(rank) and fixed(rank) say why, or None."""

    def __init__(self, fixed=lambda rank: None, let_go=lambda rank: None, frozen=dict,
                 early=lambda rank, life, proc: None):
        self.fixed, self.let_go, self.frozen, self.early = fixed, let_go, frozen, early

    def on_exit(self, rank, code):
        gone, reason = self.let_go(rank), None
        if gone is None:
            reason = self.fixed(rank)
        return LetGo(gone) if gone is not None else StopJob(reason) if reason is not None else RESTART

    def on_freeze(self):
        return self.frozen()

    def failed_early(self, rank, life, proc):
        return self.early(rank, life, proc)


def _kill(proc):
    proc.kill()


def run_supervisor(script, house, budget, say, stop_all, kill=_kill, group_size=1, finish_closes=True, **policy):
    spawns = []
    rules = restarts.Rules(restarts_per_rank=budget, group_size=group_size, finish_closes=finish_closes)
    code = restarts.Supervisor(sorted(script), Processes(script, spawns, stop_all, kill), house, Policy(**policy),
                               rules, say).run()
    return code, spawns


def supervise(script: dict[int, list[Proc]], budget: int, **kwargs):
    """Run the supervisor; rank r's k-th process is script[r][k]. Returns (code, spawns, lines, house)."""
    lines, house, stopped = [], House(), []
    code, spawns = run_supervisor(script, house, budget, lines.append, stopped.append, **kwargs)
    return code, spawns, lines, house


def test_asynchronous_workers_restart_after_another_has_finished_and_a_fixed_rank_stops_the_job():
    # Downpour under --elastic: worker 0 finishes first; worker 1 dies later and still restarts.
    code, spawns, _, _ = supervise({0: [Proc(0, alive=1)], 1: [Proc(-9, alive=5), Proc(0)], 2: [Proc(0, alive=9)]},
                                   budget=2, finish_closes=False)
    assert code == 0 and spawns == [(0, 0), (1, 0), (2, 0), (1, 1)]
    # A server (fixed) cannot restart alone: its death stops the job with one line that says why.
    code, spawns, lines, _ = supervise({0: [Proc(0, alive=50)], 1: [Proc(-9, alive=2)]}, budget=5,
                                       fixed=lambda rank: "a server cannot restart alone" if rank == 1 else None,
                                       finish_closes=False)
    assert code == 137 and spawns == [(0, 0), (1, 0)]
    assert lines[-1] == "troupe run: rank 1 exited with signal 9 (SIGKILL); a server cannot restart alone: stopped the job"


def test_a_rank_let_go_is_not_restarted_and_the_others_finish_with_code_0():
    # A server whose workers fail over (let_go) is not restarted, spends no budget and does not stop the job;
    # asked first, let_go wins over fixed.
    code, spawns, lines, _ = supervise({0: [Proc(0, alive=20)], 1: [Proc(-9, alive=2)]}, budget=0,
                                       let_go=lambda rank: "its workers fail over" if rank == 1 else None,
                                       fixed=lambda rank: "never asked", finish_closes=False)
    assert code == 0 and spawns == [(0, 0), (1, 0)]
    assert lines == ["troupe run: rank 1 exited with signal 9 (SIGKILL); its workers fail over; the others train on"]


def test_a_frozen_rank_is_killed_once_and_its_death_is_let_go():
    # A frozen separate server (frozen() names it) is killed at that look; its death then goes the way of any
    # other: let_go (its workers fail over), no restart, no budget. Asked again, a dead rank is not killed twice.
    server, killed, looks = Killable(), [], []

    def frozen():
        looks.append(1)
        return {1: "has not beaten for 2.0 s"} if len(looks) >= 3 else {}

    def kill(proc):
        killed.append(proc)
        proc.kill()

    code, spawns, lines, _ = supervise({0: [Proc(0, alive=20)], 1: [server]}, budget=0, finish_closes=False,
                                       let_go=lambda rank: "its workers fail over" if rank == 1 else None,
                                       frozen=frozen, kill=kill)
    assert code == 0 and spawns == [(0, 0), (1, 0)] and killed == [server]
    assert lines == ["troupe run: rank 1 has not beaten for 2.0 s; killing it",
                     "troupe run: rank 1 exited with signal 9 (SIGKILL); its workers fail over; the others train on"]


def test_a_dead_rank_restarts_alone_with_the_next_incarnation_and_the_job_ends_when_all_finish():
    code, spawns, lines, house = supervise({0: [Proc(0, alive=5)], 1: [Proc(-9), Proc(0)]}, budget=2)
    assert code == 0
    assert spawns == [(0, 0), (1, 0), (1, 1)]  # rank 0 never restarted
    assert ("lost", 1) in house.events and ("restarted", 1) in house.events
    assert any("rank 1 exited with signal 9 (SIGKILL); restarting it alone" in line for line in lines)


def test_a_budget_spent_stops_the_job_naming_the_rank():
    code, spawns, lines, _ = supervise({0: [Proc(0, alive=50)], 1: [Proc(3), Proc(3), Proc(3)]}, budget=2)
    assert code == 3 and spawns.count((0, 0)) == 1 and len([s for s in spawns if s[0] == 1]) == 3
    assert lines[-1] == ("troupe run: rank 1 exited with code 3 and has used its 2 restarts (--restarts-per-rank); "
                         "stopped the job")


def test_a_worker_left_out_while_paused_restarts_without_spending_its_budget():
    code, spawns, lines, _ = supervise({0: [Proc(0, alive=5)], 1: [Proc(REJOIN_EXIT), Proc(0)]}, budget=0)
    assert code == 0 and spawns == [(0, 0), (1, 0), (1, 1)]
    assert any("left out of the quorum while it was paused" in line for line in lines)


def test_the_back_off_doubles_for_restarts_in_quick_succession(monkeypatch):
    monkeypatch.setattr(restarts, "BACKOFF_FIRST", 0.5)
    delays = []
    clock = [0.0]
    monkeypatch.setattr(restarts.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(restarts.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + 0.01))
    code, _, lines, _ = supervise({0: [Proc(0, alive=1000)], 1: [Proc(1), Proc(1), Proc(1), Proc(0)]}, budget=5)
    delays = [float(line.split(" in ")[1].split("s")[0]) for line in lines if "restarting it alone" in line]
    assert code == 0 and delays == [0.0, 0.5, 1.0]


class Spare:
    """A waiting spare: its stdin is a buffer; `dead` makes it a spare that died waiting."""

    def __init__(self, dead: bool = False):
        self.dead, self.sent, self.closed, self.waited = dead, b"", False, False
        self.stdin = self

    def poll(self):
        return 1 if self.dead else None

    def write(self, data: bytes) -> None:
        if self.dead:
            raise BrokenPipeError
        self.sent += data

    def close(self) -> None:
        self.closed = True

    def wait(self, timeout=None):
        self.waited = True
        return 0


def test_spares_hand_a_rank_to_a_waiting_process_and_replace_it():
    from troupe.runtime.spare import Spares

    made = []
    spares = Spares(1, lambda: made.append(Spare()) or made[-1])
    assert len(made) == 1, "a spare is started at once"
    proc = spares.take({"RANK": "2"})
    assert proc is made[0] and proc.sent == b'{"RANK": "2"}\n' and proc.closed, "its rank is one line, then EOF"
    assert spares.take({"RANK": "1"}) is None, "taken spares are not handed out twice"
    spares.fill()
    assert len(made) == 2 and spares.waiting() == [made[1]]
    made[1].dead = True  # died while it waited: skipped and replaced
    assert spares.take({"RANK": "0"}) is None
    spares.fill()
    assert spares.waiting() == [made[2]]
    spares.stop()
    assert made[2].closed and made[2].waited and spares.waiting() == []


class Killable(Proc):
    """A process that runs until killed (then exits with -9)."""

    def __init__(self):
        super().__init__(-9, alive=10**9)

    def kill(self):
        self.alive = 0


def test_a_dead_rank_restarts_its_whole_worker_group_and_only_it_spends_budget():
    killed = []

    def kill(proc):
        killed.append(proc)
        proc.kill()

    partner = Killable()
    script = {0: [Proc(0, alive=30)], 1: [Proc(0, alive=30)], 2: [partner, Proc(0, alive=3)],
              3: [Proc(-9, alive=2), Proc(0, alive=3)]}
    lines, house = [], House()
    code, spawns = run_supervisor(script, house, 1, lines.append, lambda procs: None, group_size=2, kill=kill)
    assert code == 0 and killed == [partner]
    assert sorted(spawns) == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)]  # group 0 never restarted
    assert ("lost", 2) in house.events and ("restarted", 2) in house.events
    assert any("rank 3 exited with signal 9 (SIGKILL); stopped its worker group 1's other ranks [2] and "
               "restarting the group in 0.0s (restart 1 of 1 for rank 3)" in line for line in lines), lines


def test_the_same_failure_before_the_first_step_twice_stops_the_job_a_different_one_or_a_kill_does_not():
    # early(rank, life, proc): how that life failed when it never got to its first step (None: it did).
    errors = {(1, 0): "ValueError: bad data", (1, 1): "ValueError: bad data"}
    code, spawns, lines, _ = supervise({0: [Proc(0, alive=50)], 1: [Proc(1), Proc(1), Proc(0)]}, budget=5,
                                       early=lambda rank, life, proc: errors.get((rank, life)))
    assert code == 1 and spawns == [(0, 0), (1, 0), (1, 1)]
    assert lines[-1] == ("troupe run: rank 1 failed again before its first step, the same way (ValueError: bad "
                         "data): not a fault to train through; stopped the job")
    # Another error the second time, a life that got to its first step, or a kill: restarted as before.
    for second, proc in (("ValueError: other", Proc(1)), (None, Proc(1)), ("ValueError: bad data", Proc(-9))):
        errors = {(1, 0): "ValueError: bad data", (1, 1): second}
        code, spawns, _, _ = supervise({0: [Proc(0, alive=50)], 1: [Proc(1), proc, Proc(0)]}, budget=5,
                                       early=lambda rank, life, proc: errors.get((rank, life)))
        assert code == 0 and spawns == [(0, 0), (1, 0), (1, 1), (1, 2)], second
