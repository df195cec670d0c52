"""`troupe run` stopped by SIGTERM while it starts its ranks stops the ones it has started (before, the signal's
default action ended the launcher and left them running until their rendezvous timed out)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from troupe.launcher import processes
from troupe.launcher.flags import Place
from troupe.launcher.plan import LaunchPlan
from troupe.launcher.ports import Ports
from troupe.launcher.starter import Starter


def test_sigterm_while_the_ranks_start_stops_those_started(monkeypatch):
    started = []

    def start(self, rank, restart=False, **more):
        if rank == 1:  # the signal comes while rank 1 starts
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here, in the main thread
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        started.append(proc)
        return proc

    monkeypatch.setattr(Starter, "__call__", start)
    monkeypatch.setattr(Starter, "zygote", lambda self: None)
    plan = LaunchPlan(place=Place(nproc=3), argv=("script.py",))
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            processes.run_once(plan, None, Ports(), {})
        assert stopped.value.code == 143
        assert len(started) == 1 and started[0].poll() is not None, "the rank started before the signal runs on"
        assert signal.getsignal(signal.SIGTERM) == before, "the launcher's handler outlived the start"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
