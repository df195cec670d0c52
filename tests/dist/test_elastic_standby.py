"""No single point of failure in an elastic job: node 0's launcher (the job's store and quorum) dies, node 1's
launcher takes over from its standby, and the other nodes' worker groups train on (launcher/standby.py,
runtime/failover.py); a rank restarted after the takeover joins there and heals.

The chaos cell: tests/dist/scripts/elastic_train.py on 2 nodes of 2 processes (and on 3 nodes of 1) on loopback,
node 0's `troupe run` SIGKILLed mid-run. The survivors' logs name the groups of every committed step; one process replays them (each
rank's batches from its own sampler of the job's 4) and the survivors' parameters equal the replay's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist.test_elastic import ENV, ROOT, SCRIPT, job, replay
from tests.dist.world import master_port
from troupe.runtime.failover import Failover, FailedOver, FailoverStore, reachable

pytestmark = [pytest.mark.dist, pytest.mark.process]


def nodes(out: Path, signal_node_0: int, nnodes: int = 2, nproc: int = 2) -> tuple[list[int], float]:
    """elastic_train.py's node0-dies job on `nnodes` nodes of `nproc` (loopback); once rank 0 reached its step 6,
    node 0's `troupe run` gets `signal_node_0`. Returns every launcher's exit code and the seconds from the signal
    to the last one's end."""
    where = ["--nnodes", str(nnodes), "--master", f"127.0.0.1:{master_port()}", "--token", "standby"]
    errs = [open(out / f"node{node}.txt", "w") for node in range(nnodes)]  # noqa: SIM115  (closed below)
    procs = [subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", "-n", str(nproc), *where, "--node-rank",
                               str(node), "--elastic", "--min-groups", "2", str(SCRIPT), str(out), "node0-dies"],
                              cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=errs[node]) for node in range(nnodes)]
    try:
        deadline = time.monotonic() + 90
        while not (out / "node0").exists():
            assert time.monotonic() < deadline and procs[1].poll() is None, "rank 0 never reached its step 6"
            time.sleep(0.05)
        procs[0].send_signal(signal_node_0)
        sent = time.monotonic()
        codes = [proc.wait(timeout=120) for proc in procs[1:]]
        return [procs[0].wait(timeout=30), *codes], time.monotonic() - sent
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in errs:
            f.close()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nnodes, nproc", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_node_0_s_launcher_killed_mid_run_node_1_takes_over_and_the_job_goes_on(tmp_path, nnodes, nproc):
    """2 nodes of 2: node 1's launcher keeps the job and restarts the last rank there; 3 nodes of 1: node 2's
    launcher follows the standby and restarts the last rank there."""
    total = nnodes * nproc
    survivors, last = list(range(nproc, total)), total - 1
    # SIGKILL: the job's store, its quorum, and (with their launcher) node 0's ranks
    codes, took = nodes(tmp_path, signal.SIGKILL, nnodes, nproc)
    said = [(tmp_path / f"node{i}.txt").read_text() for i in range(nnodes)]
    assert codes[1:] == [0] * (nnodes - 1), said
    assert "troupe run: node 0's launcher (the job's store at 127.0.0.1:" in said[1] and "this node's launcher keeps " \
           f"the job" in said[1] and f"node 0's ranks {list(range(nproc))} are lost" in said[1], said[1][-3000:]
    if nnodes > 2:
        assert "troupe run: node 0's launcher is gone; this node follows the standby at 127.0.0.1:" in said[2], said[2]
    assert not any("Traceback" in text for text in said), said
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in survivors]
    # the last rank killed itself after the takeover: its launcher restarted it with the standby's ticket, and it
    # healed from a survivor
    assert [r["incarnation"] for r in runs] == [0] * (len(runs) - 1) + [1] and runs[-1]["heals"] == 1, \
        "the last rank did not restart and heal"
    assert f"rank {last} exited with signal 9 (SIGKILL); restarting it alone" in said[-1], said[-1][-3000:]
    assert len({r["sha256"] for r in runs}) == 1, "the survivors ended with different parameters"
    members = [m for _, _, m in runs[0]["log"]]  # the first survivor's: its one life, the whole job
    first_alone = members.index(survivors)
    assert list(range(total)) in members[:first_alone], "the job never stepped whole before the kill"
    assert None in members[:first_alone], "the round in flight at the kill was not left out"
    assert all(m in (survivors, None) for m in members[first_alone:]), members
    assert members[-job.FULL_STREAK:] == [survivors] * job.FULL_STREAK, members
    params = torch.load(tmp_path / f"rank{survivors[0]}.pt")["params"]
    # (committed_steps checks that every step two logs name committed has the same groups in both)
    for got, want in zip(params, replay([[]] * nproc + [r["log"] for r in runs]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert took < 90, took


@pytest.mark.timeout(200)
def test_node_0_s_launcher_stopped_on_purpose_ends_the_job_without_a_takeover(tmp_path):
    """SIGTERM to node 0's `troupe run` (a user stopping the job there) stops the job: it tells the standby, which
    stops node 1's ranks at once instead of taking over."""
    codes, took = nodes(tmp_path, signal.SIGTERM)
    said = (tmp_path / "node1.txt").read_text()
    assert codes == [130, 1], said[-3000:]
    assert "troupe run: node 0's launcher ended the job (exit code 130); stopping this node's ranks" in said, said
    assert "keeps the job" not in said and "Traceback" not in said, said[-3000:]
    assert took < 30, took


def test_without_a_standby_a_lost_store_is_the_one_line_error(tmp_path):
    """No standby known: the first failed operation on a store that refuses connections raises `lost` (the one
    line a rank dies with), not torch's error; a store that answers gives the operation's own error back."""
    import datetime

    import torch.distributed as dist

    from troupe.runtime.ticket import free_port

    port = free_port("127.0.0.1")
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    opened = lambda host, p, timeout: dist.TCPStore(host, p, is_master=False,  # noqa: E731
                                                    timeout=datetime.timedelta(seconds=timeout))
    failover = Failover(("127.0.0.1", port), opened, lost=lambda why: ConnectionAbortedError(f"lost: {why}"))
    store = failover.connect(1.0)
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError):  # a key that never comes: the store answers, the error is the get's own
        store.get("missing")
    assert reachable("127.0.0.1", port, 1.0)
    del server
    with pytest.raises(ConnectionAbortedError, match="lost: "):
        for _ in range(50):  # (the server's socket closes as its object goes)
            store.set("k", "w")
            time.sleep(0.05)
    assert not reachable("127.0.0.1", port, 1.0)


def test_a_store_that_moved_raises_failed_over_once_then_reaches_the_standby(tmp_path):
    """Two stores of one process: when one saw the failover, the other's next operation raises `FailedOver`
    (the caller decides what it meant) and the one after reaches the standby; a decision read before the
    failover is copied to the standby first, and the standby's value wins when it holds another."""
    import datetime

    import torch.distributed as dist

    from troupe.runtime.failover import STANDBY_KEY, TAKEOVER_KEY
    from troupe.runtime.ticket import free_port

    td = datetime.timedelta(seconds=5)
    ports = [free_port("127.0.0.1") for _ in range(2)]
    servers = [dist.TCPStore("127.0.0.1", p, is_master=True, timeout=td, wait_for_workers=False) for p in ports]
    opened = lambda host, p, timeout: dist.TCPStore(host, p, is_master=False,  # noqa: E731
                                                    timeout=datetime.timedelta(seconds=timeout))
    failover = Failover(("127.0.0.1", ports[0]), opened)
    a, b = failover.connect(10.0), failover.connect(10.0)  # (a loaded host may take seconds to connect)
    servers[0].set(STANDBY_KEY, f"127.0.0.1:{ports[1]}")
    failover.learn(a)
    assert failover.standby == ("127.0.0.1", ports[1])
    servers[0].set("q1/r1/d", "commit")
    assert a.get("q1/r1/d") == b"commit" and servers[1].get("q1/r1/d") == b"commit"  # mirrored before it is used
    servers[1].set("q1/r2/d", "the standby's")
    servers[0].set("q1/r2/d", "node 0's")
    assert a.get("q1/r2/d") == b"the standby's"
    servers[1].set(TAKEOVER_KEY, "1")
    standby = servers.pop()
    del servers  # node 0's store closes
    with pytest.raises(FailedOver):
        for _ in range(50):
            a.set("x", "1")
            time.sleep(0.05)
    assert failover.generation == 1
    with pytest.raises(FailedOver):
        b.add("n", 1)  # its first operation since the failover: not done (only the caller knows if it may be)
    assert b.add("n", 1) == 1 and a.add("n", 1) == 2 and standby.add("n", 0) == 2
    assert isinstance(b, FailoverStore) and b.current() is b.inner
    # Node 0's store still takes connections (a launcher stopped, or hung, whose host lives), but the standby took
    # over: an operation that fails there fails over all the same (it used to end the rank)
    hung = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), is_master=True, timeout=td, wait_for_workers=False)
    other = Failover(("127.0.0.1", hung.port), opened)
    other.standby = ("127.0.0.1", standby.port)
    with pytest.raises(FailedOver):
        other.connect(0.5).get("never")  # times out: the store answers, but the job is the standby's now
    assert other.generation == 1
