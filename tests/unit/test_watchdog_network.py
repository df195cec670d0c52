"""The watchdog under network faults, without processes: a store that stops answering (a
partition), staleness judged by this host's clock, expendable ranks, refused joins."""

import threading
import time

import pytest
import torch.distributed as dist

from troupe.runtime import watchdog as wd
from troupe.runtime.settings import Settings

FAST = Settings(heartbeat=0.05, peer_timeout=0.4, stall_seconds=60.0, store_timeout=0.2)


class Silent:
    """A store that answers until `cut` is set, then blocks every call for good (a cut cable:
    TCPStore's own timeout does not cover a connection whose peer went silent)."""

    def __init__(self):
        self.inner, self.cut = dist.HashStore(), threading.Event()

    def __getattr__(self, name):
        call = getattr(self.inner, name)

        def blocking(*args):
            if self.cut.is_set():
                threading.Event().wait()  # never returns
            return call(*args)

        return blocking


@pytest.fixture
def deaths(monkeypatch):
    died: list[str] = []
    monkeypatch.setattr(wd.Watchdog, "_die", lambda self, why: died.append(why))
    return died


def make(store, rank=1, world=2, **kw) -> wd.Watchdog:
    dog = wd.Watchdog(store, rank, world, FAST, **kw)
    return dog


def beat_as(store, rank, step=0):
    store.set(f"hb/{rank}", f"{time.time():.3f} {step} -")


def test_bounded_returns_raises_and_gives_up():
    assert wd.bounded(lambda: 7, 1.0, "x") == 7
    with pytest.raises(KeyError):
        wd.bounded(lambda: {}["k"], 1.0, "x")
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="the store did not answer within 0.1s"):
        wd.bounded(lambda: threading.Event().wait(), 0.1, "the store did not answer")
    assert time.monotonic() - t < 1.0


def test_a_rank_cut_off_while_waiting_stops_naming_the_rendezvous_and_step(deaths):
    store = Silent()
    beat_as(store.inner, 0)
    dog = make(store, reconnect=lambda: store, where="the job's rendezvous at 10.0.0.1:1 (rank 0's host)")
    try:
        dog.step = 17
        with dog.waiting("gradient bucket 1"):
            store.cut.set()
            deadline = time.monotonic() + 5
            while not deaths and time.monotonic() < deadline:
                time.sleep(0.05)
        assert deaths, "a cut-off rank blocked in a collective must stop"
        assert "the job's rendezvous at 10.0.0.1:1 (rank 0's host) has been unreachable" in deaths[0]
        assert "since step 17" in deaths[0] and "TROUPE_PEER_TIMEOUT=0.4s" in deaths[0]
    finally:
        dog.stop()


def test_a_cut_off_rank_that_is_not_waiting_keeps_going(deaths):
    """Rank 0 leaving at the end of a job looks the same from here: only a blocked rank stops."""
    store = Silent()
    beat_as(store.inner, 0)
    dog = make(store, reconnect=lambda: store)
    try:
        store.cut.set()
        time.sleep(1.2)
        assert deaths == []
        assert dog._cut_off is not None  # it knows, and retries
    finally:
        dog.stop()


def test_reconnecting_after_a_short_outage_resumes_beating(deaths):
    broken, fresh = Silent(), dist.HashStore()
    beat_as(broken.inner, 0)
    beat_as(fresh, 0)
    dog = make(broken, reconnect=lambda: fresh)
    try:
        broken.cut.set()
        deadline = time.monotonic() + 3
        while not fresh.check(["hb/1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fresh.check(["hb/1"]), "the heartbeat must go on over the new connection"
        time.sleep(0.2)
        assert dog._cut_off is None and deaths == []
    finally:
        dog.stop()


def test_a_silent_peer_is_named_with_its_last_step_and_an_expendable_one_is_forgotten(deaths, capsys):
    store = dist.HashStore()
    beat_as(store, 0, step=3)
    beat_as(store, 2, step=5)
    dog = make(store, rank=1, world=3)
    dog.expendable = {2}
    try:
        stop = threading.Event()
        keep = threading.Thread(target=lambda: [beat_as(store, 0, 4) or time.sleep(0.05) for _ in iter(stop.is_set, True)],
                                daemon=True)
        keep.start()  # rank 0 keeps beating; rank 2 went silent at step 5
        deadline = time.monotonic() + 3
        while dog.alive(2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dog.alive(2) and dog.alive(0)
        time.sleep(0.2)
        assert deaths == []  # expendable: reported, not fatal
        assert "rank 2 sent no heartbeat" in capsys.readouterr().err
        dog.expendable = set()
        deadline = time.monotonic() + 3
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank(s) [2] sent no heartbeat" in deaths[0] and "rank 2 last heard at step 5" in deaths[0]
        stop.set()
    finally:
        dog.stop()


def test_staleness_uses_this_hosts_clock_not_the_writers(deaths):
    """A peer whose clock runs an hour behind still beats: its text changes every beat."""
    store = dist.HashStore()
    stop = threading.Event()

    def skewed():
        while not stop.is_set():
            store.set("hb/0", f"{time.time() - 3600:.3f} 1 -")
            time.sleep(0.05)

    threading.Thread(target=skewed, daemon=True).start()
    time.sleep(0.1)
    dog = make(store)
    try:
        time.sleep(1.0)
        assert dog.alive(0) and deaths == []
    finally:
        stop.set()
        dog.stop()


def test_rank_0_logs_join_attempts_refused_while_the_job_runs(deaths, caplog):
    store, refused = dist.HashStore(), [2]
    beat_as(store, 1)
    dog = make(store, rank=0, refusals=lambda: refused[0])
    try:
        assert dog.refused == 2  # those rank 0 reported when the job started
        with caplog.at_level("WARNING", logger="troupe"):
            refused[0] = 3
            deadline = time.monotonic() + 2
            while dog.refused < 3 and time.monotonic() < deadline:
                beat_as(store, 1)
                time.sleep(0.05)
        assert "refused 1 join attempt(s) with a wrong ticket token" in caplog.text and "(3 in all)" in caplog.text
    finally:
        dog.stop()


def test_a_rendezvous_that_refuses_connections_stops_a_waiting_rank_at_once(deaths):
    """Rank 0 exited (its host answers, nothing listens): no need to wait out the peer timeout."""
    store = Silent()
    beat_as(store.inner, 0)

    def refused():
        raise ConnectionRefusedError(111, "Connection refused")

    patient = Settings(heartbeat=0.05, peer_timeout=30.0, stall_seconds=60.0, store_timeout=0.2)
    dog = wd.Watchdog(store, 1, 2, patient, reconnect=refused, where="the job's rendezvous at 10.0.0.1:1 (rank 0's host)")
    try:
        dog.step = 9
        with dog.waiting("gradient bucket 1"):
            store.cut.set()
            started = time.monotonic()
            while not deaths and time.monotonic() - started < 10:
                time.sleep(0.02)
        # the store's deadline (0.2 s) and a beat, not the peer timeout (30 s)
        assert deaths and time.monotonic() - started < 10
        assert "refuses connections since step 9: rank 0, which hosts it, has exited" in deaths[0]
    finally:
        dog.stop()


def test_a_survivor_says_who_died_in_one_line_and_other_errors_keep_their_traceback(capsys):
    from types import SimpleNamespace

    from troupe.runtime.watchdog import PeerFailure, Watchdog

    seen = []
    dog = SimpleNamespace(_previous_hook=lambda *exc: seen.append(exc[0]), _ask=lambda f: None, rank=1, step=3)
    failure = PeerFailure("rank 1: gradient bucket 1 failed at step 3: rank(s) [0] died")
    Watchdog._excepthook(dog, PeerFailure, failure, None)
    err = capsys.readouterr().err
    assert err == f"troupe: PeerFailure: {failure}\n" and not seen
    Watchdog._excepthook(dog, ValueError, ValueError("boom"), None)
    assert seen == [ValueError]  # the rank's own error: the default hook prints its traceback
