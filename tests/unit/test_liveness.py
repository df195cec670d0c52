"""One liveness mechanism (runtime/liveness.py): a Beat thread counting up in a real TCP store, a Silence reading
many counters at once, on a clock the test moves."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from troupe.runtime import liveness
from troupe.runtime.ticket import Ticket


def _store(ticket: Ticket, host: bool) -> dist.Store:
    return dist.TCPStore(ticket.addr, ticket.port, is_master=host, timeout=datetime.timedelta(seconds=5))


def test_a_beat_counts_up_from_its_start_and_stands_still_once_stopped():
    ticket = Ticket()
    store = _store(ticket, True)
    beat = liveness.Beat(3, lambda: _store(ticket, False), every=0.05).start()
    assert store.add(liveness.key(3), 0) >= 1  # the first beat is made in start, before the thread's
    deadline = time.monotonic() + 5.0
    while store.add(liveness.key(3), 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.add(liveness.key(3), 0) >= 4
    beat.stop(wait=1.0)
    stopped = store.add(liveness.key(3), 0)
    time.sleep(0.2)
    assert store.add(liveness.key(3), 0) == stopped


def test_silence_says_how_long_each_counter_stood_still_and_who_never_beat(monkeypatch):
    ticket = Ticket()
    store = _store(ticket, True)
    clock = [100.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    silence = liveness.Silence(store)
    store.add(liveness.key(1), 1)
    assert silence.look([1, 2, "node/1"]) == {1: 0.0, 2: 0.0, "node/1": 0.0}  # counted from the first look
    clock[0] += 3.0
    store.add(liveness.key(1), 1)
    assert silence.look([1, 2, "node/1"]) == {1: 0.0, 2: 3.0, "node/1": 3.0}
    assert silence.started(1) and not silence.started(2)
    silence.expect(2)  # started again: silent from now, heard at the next read
    clock[0] += 1.0
    assert silence.silent_for(2) == 1.0
    assert silence.look([1, 2]) == {1: 1.0, 2: 0.0}
    clock[0] += 0.5
    assert silence.look([1, 2]) == {1: 1.5, 2: 0.5}
    silence.forget(1)
    assert silence.silent_for(1) == 0.0


def test_a_beat_that_cannot_reach_its_store_ends_unless_told_to_reconnect():
    ticket = Ticket()
    host = _store(ticket, True)
    connects = []

    def connect() -> dist.Store:
        connects.append(1)
        if len(connects) > 1:
            raise ConnectionError("no store")
        return _store(ticket, False)

    beat = liveness.Beat(0, connect, every=0.02, reconnect=False).start()
    del host  # the launcher's store goes with the job
    beat._thread.join(5.0)
    assert not beat._thread.is_alive() and connects == [1]
