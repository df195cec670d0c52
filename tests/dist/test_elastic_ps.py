"""Downpour and Sandblaster under `troupe run --elastic`: a killed worker restarts alone and rejoins
through its servers.

The job is tests/dist/scripts/ps_rejoin_train.py. With one worker the job is sequential SGD on the
server, so a run with a kill must end exactly where the fault-free run's replay in one process does;
with two workers the survivor is never restarted and no update is lost or taken twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "ps_rejoin_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
sys.path.insert(0, str(SCRIPT.parent))
import ps_rejoin_train as job  # noqa: E402

from tests.dist.world import master_port, run_nodes  # noqa: E402
from troupe.cluster.serving.mastercopies import parts  # noqa: E402
from troupe.cluster.serving.shard import plan_slices  # noqa: E402
from troupe.script.sampling import DistributedSampler  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.process]
ONE_WORKER = ["-n", "2", "--nworker-groups", "1", "--nworkers-per-group", "1", "--nservers-per-group", "1"]


def troupe_run(out: Path, mode: str, *flags: str, framework: str = "downpour", timeout: float = 120, **env: str
               ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "troupe.cli", "run", "--elastic", "--framework", framework, *flags, str(SCRIPT),
           str(out), mode]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=timeout)


def run_frozen(out: Path, framework: str, flags: list[str], frozen: Callable[[str], bool], never: str,
               then_wait: float = 0.0, **env: str) -> str:
    """The job in mode "stop" under `--evict-after 2`: once `frozen(stderr so far)`, (`then_wait` s later)
    SIGCONT the stopped worker; the job must end 0. Returns the launcher's stderr."""
    cmd = [sys.executable, "-m", "troupe.cli", "run", "--elastic", "--framework", framework, "--evict-after", "2",
           *flags, str(SCRIPT), str(out), "stop"]
    err = open(out / "stderr.txt", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **env}, stdout=subprocess.DEVNULL, stderr=err)
    said = lambda: (out / "stderr.txt").read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + 90
        while not frozen(said()):
            assert time.monotonic() < deadline and proc.poll() is None, f"{never}:\n{said()}"
            time.sleep(0.2)
        time.sleep(then_wait)
        # stopped past the bound (2 s) before SIGCONT, whatever else made its beat late on a loaded host: what a
        # process frozen that long does after SIGCONT is what these tests check
        time.sleep(max(0.0, (out / "stopped").stat().st_mtime + 3.0 - time.time()))
        os.kill(int((out / "stopped").read_text()), signal.SIGCONT)
        assert proc.wait(timeout=90) == 0, said()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    return said()


def replay(steps: int) -> list[torch.Tensor]:
    """One worker's run in one process: SGD (the server's optimizer) on its shard's batches in order."""
    x, y = job.data()
    sampler = DistributedSampler(len(x), rank=0, world_size=1, seed=7, tail="drop")
    model, sgd = job.model_and_optimizer()
    per_epoch = len(x) // job.BATCH
    for step in range(steps):
        epoch, b = divmod(step, per_epoch)
        idx = sampler.indices(epoch)[b * job.BATCH:(b + 1) * job.BATCH]
        sgd.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        sgd.step()
    return [p.detach() for p in model.parameters()]


def report(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def model_slices() -> list:
    """The job's model cut for one server per group (every test here has one)."""
    model, _ = job.model_and_optimizer()
    return plan_slices([p.numel() for p in model.parameters()], 1)


def on_two_nodes(out: Path, token: str, nproc: int, flags: list[str], env: dict[str, str]) -> list[str]:
    """The job in mode "kill" under two launchers on loopback (`nproc` processes each, node 0's hosting the job's
    store); the highest worker, rank 3 on node 1, is killed and restarted there. Both must end 0 with every
    worker's 24 steps, rank 3 in its second life from step 7. Returns each node's stderr."""
    port = master_port()
    launches = [([sys.executable, "-m", "troupe.cli", "run", "-n", str(nproc), "--nnodes", "2", "--node-rank",
                  str(node), "--master", f"127.0.0.1:{port}", "--token", token, "--elastic", *flags, str(SCRIPT),
                  str(out), "kill"], env) for node in (0, 1)]
    codes, said = run_nodes(launches, out, ROOT, timeout=150)
    assert codes == [0, 0], said
    assert "troupe run: rank 3 exited with signal 9 (SIGKILL); restarting it alone" in said[1]
    runs = [report(out, r) for r in range(4)]
    assert [r["incarnation"] for r in runs] == [0, 0, 0, 1] and all(r["steps"] == job.STEPS for r in runs)
    assert runs[3]["resumed_at"] == job.FAULT_AT
    return said


@pytest.mark.timeout(150)
def test_a_lone_worker_killed_mid_run_rejoins_and_ends_where_the_fault_free_run_does(tmp_path):
    proc = troupe_run(tmp_path, "kill", *ONE_WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = report(tmp_path, 0)
    assert run["incarnation"] == 1 and run["resumed_at"] == job.FAULT_AT and run["steps"] == job.STEPS
    assert [b for _, b in run["log"]] == list(range(job.FAULT_AT, job.STEPS))  # its data from where it died
    assert "troupe server rank 1: worker 0 is back (restarted)" in proc.stderr
    saved = torch.load(tmp_path / "rank0.pt")
    # Its first values were the servers' after the steps it took before it died, not its own fresh ones ...
    for got, want in zip(saved["fetched"], replay(job.FAULT_AT)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # ... and the job ends where one process taking every step ends.
    for got, want in zip(saved["params"], replay(job.STEPS)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.timeout(150)
def test_an_elastic_cluster_block_with_a_server_runs_the_same_job(tmp_path):
    """`elastic: true` in the cluster block (`troupe run --cluster FILE`, no flags): the same lone worker, killed,
    rejoins and ends where one process does."""
    conf = tmp_path / "job.conf"
    conf.write_text("cluster {\n  nworker_groups: 1\n  nworkers_per_group: 1\n  nserver_groups: 1\n"
                    "  nservers_per_group: 1\n  server_worker_separate: true\n  elastic: true\n}\n")
    cmd = [sys.executable, "-m", "troupe.cli", "run", "--cluster", str(conf), str(SCRIPT), str(tmp_path), "kill"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = report(tmp_path, 0)
    assert run["incarnation"] == 1 and run["resumed_at"] == job.FAULT_AT and run["steps"] == job.STEPS
    for got, want in zip(torch.load(tmp_path / "rank0.pt")["params"], replay(job.STEPS)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_a_worker_killed_twice_rejoins_each_time_while_the_other_trains_on_under_two_server_groups(tmp_path):
    # 2 workers (groups of one), 2 server groups of one server each (they sync their master copies).
    proc = troupe_run(tmp_path, "kill-twice", "--nworker-groups", "2", "--nworkers-per-group", "1",
                      "--nserver-groups", "2", "--nservers-per-group", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivor, restarted = report(tmp_path, 0), report(tmp_path, 1)
    assert survivor["incarnation"] == 0 and survivor["steps"] == job.STEPS  # never restarted
    assert restarted["incarnation"] == 2 and restarted["steps"] == job.STEPS
    resumed = restarted["resumed_at"]
    assert resumed == job.FAULT_AT + 5  # its second life resumed where its first restart had got to
    per_epoch = job.SAMPLES // 2 // job.BATCH
    assert [e * per_epoch + b for e, b in restarted["log"]] == list(range(resumed, job.STEPS))  # its data from there
    assert proc.stderr.count("troupe run: rank 1 exited with signal 9 (SIGKILL); restarting it alone") == 2
    # Every update of each worker reached its server group once: none lost, none taken twice.
    updates = [int(n) for n in re.findall(r"troupe server rank \d: (\d+) slice updates", proc.stderr)]
    assert updates == [job.STEPS * len(model_slices())] * 2, proc.stderr[-2000:]
    assert proc.stderr.count("2 worker restart(s) taken back") == 1  # worker 1's server group only
    assert proc.stderr.count("worker 1 is back (restarted)") == 2


@pytest.mark.timeout(150)
def test_a_sandblaster_worker_killed_mid_run_rejoins_its_synchronous_group(tmp_path):
    # One group of 2 workers and one server: while worker 1 is away the group's updates are worker 0's
    # alone (nobody waits for the dead one); back, it takes part in the group's next update again.
    proc = troupe_run(tmp_path, "kill", "--nworker-groups", "1", "--nworkers-per-group", "2",
                      "--nservers-per-group", "1", framework="sandblaster")
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivor, restarted = report(tmp_path, 0), report(tmp_path, 1)
    assert survivor["incarnation"] == 0 and survivor["steps"] == job.STEPS
    assert restarted["incarnation"] == 1 and restarted["resumed_at"] == job.FAULT_AT
    assert restarted["steps"] == job.STEPS
    assert "troupe server rank 2: worker 1 is back (restarted)" in proc.stderr
    assert ", 0 message(s) rejected," in proc.stderr


@pytest.mark.timeout(180)
def test_on_two_nodes_a_worker_restarts_on_its_own_node_and_the_job_ends_on_both(tmp_path):
    """Two launchers on loopback, 3 processes each (4 workers, 2 server groups of one): node 0's launcher
    hosts the job's store; worker 3, on node 1 beside both servers, is killed and restarted by node 1's
    launcher, fetches the servers' values through node 0's store and goes on; both launchers end 0."""
    said = on_two_nodes(tmp_path, "elastic-ps-nodes", 3, ["--framework", "downpour", "--nworker-groups", "4",
                                                          "--nworkers-per-group", "1", "--nserver-groups", "2",
                                                          "--nservers-per-group", "1"], ENV)
    # every update of each worker reached its server group once (2 workers per group)
    updates = [int(n) for n in re.findall(r"troupe server rank \d: (\d+) slice updates", said[1])]
    assert updates == [2 * job.STEPS * len(model_slices())] * 2, said[1][-2000:]


@pytest.mark.timeout(180)
def test_a_frozen_sandblaster_worker_is_evicted_then_restarts_and_rejoins_after_sigcont(tmp_path):
    """A group of 2 and one server, --evict-after 2: worker 1 SIGSTOPs itself before its update of step 7;
    its server sees its beat stop while worker 0's update waits, evicts it and the group goes on; after
    SIGCONT worker 1 reads the Evicted notice first, exits, is restarted and rejoins at step 7."""
    text = run_frozen(tmp_path, "sandblaster", ["--nworker-groups", "1", "--nworkers-per-group", "2",
                                                "--nservers-per-group", "1"],
                      lambda said: "evicted, it restarts when it wakes" in said, "worker 1 was never evicted",
                      then_wait=1.0)  # worker 0 trains on meanwhile
    assert "troupe server rank 2: worker 1 is gone (its group waited 2 s for its update and its beat had stopped" in text
    assert "was evicted by server rank 2" in text and "troupe run: rank 1 was evicted by its server while it was frozen; starting it again" in text
    assert "troupe server rank 2: worker 1 is back (restarted)" in text
    survivor, restarted = report(tmp_path, 0), report(tmp_path, 1)
    assert survivor["incarnation"] == 0 and survivor["steps"] == job.STEPS
    assert restarted["incarnation"] == 1 and restarted["resumed_at"] == job.FAULT_AT
    assert restarted["steps"] == job.STEPS


@pytest.mark.timeout(150)
def test_a_hogwild_group_killed_twice_copies_a_live_groups_state_and_rejoins_while_the_others_train_on(tmp_path):
    """Distributed Hogwild, 3 groups of one process, syncing every 2 steps: group 2 is killed at step 7 and
    again 5 steps after it is back. Each new life takes a live group's replica and its own part of the
    master copy, the survivors dial it back and sync with it again; nobody else restarts."""
    proc = troupe_run(tmp_path, "kill-twice", "-n", "3", "--sync-freq", "2", framework="hogwild", PAUSE="0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stderr
    runs = [report(tmp_path, r) for r in range(3)]
    assert [r["incarnation"] for r in runs] == [0, 0, 2] and all(r["steps"] == job.STEPS for r in runs)
    resumed = runs[2]["resumed_at"]
    assert resumed == job.FAULT_AT + 5  # its second life resumed where its first had got to
    per_epoch = job.SAMPLES // 3 // job.BATCH
    assert [e * per_epoch + b for e, b in runs[2]["log"]] == list(range(resumed, job.STEPS))
    assert text.count("troupe run: rank 2 exited with signal 9 (SIGKILL); restarting it alone") == 2
    assert text.count("troupe group sync rank 2: took the replica of rank 0 and this group's part of the master "
                      "copy at version") == 2
    for survivor in (0, 1):
        for life in (1, 2):
            assert f"troupe group sync rank {survivor}: rank 2 is back (life {life}); syncing with its group again" \
                in text, text[-3000:]
        assert re.search(rf"troupe group sync rank {survivor}: \d+ merges .* 0 message\(s\) rejected, groups gone "
                         r"without stopping: none, 2 new life\(s\) of other groups synced with again", text), \
            text[-3000:]
    # The new life's first values were taken from the others, not its own fresh (random) ones.
    fetched = torch.load(tmp_path / "rank2.pt")["fetched"]
    torch.manual_seed(1000 + 2)
    model, _ = job.model_and_optimizer()
    for got, fresh in zip(fetched, model.parameters()):
        assert not torch.allclose(got, fresh.detach().normal_())


@pytest.mark.timeout(180)
def test_a_frozen_hogwild_group_is_counted_gone_then_restarts_and_rejoins_after_sigcont(tmp_path):
    """3 groups, --evict-after 2: group 2 SIGSTOPs itself at step 7; the others see its beat stop and go on
    without it; after SIGCONT it finds itself frozen past the bound, exits with the rejoin code, and its new
    life rejoins at step 7 (no restart spent)."""
    text = run_frozen(tmp_path, "hogwild", ["-n", "3", "--sync-freq", "2"],
                      lambda said: all(f"troupe group sync rank {r}: rank 2 is gone (its beat stopped" in said
                                       for r in (0, 1)),
                      "group 2 was never counted gone", PAUSE="0.2")
    assert "troupe group sync rank 2: this process was stopped for" in text
    assert "troupe run: rank 2 was frozen past --evict-after: the other groups went on without it; starting it again" \
        in text, text[-3000:]
    assert "restart 1 of" not in text  # leaving frozen is not a failure
    runs = [report(tmp_path, r) for r in range(3)]
    assert [r["incarnation"] for r in runs] == [0, 0, 1] and all(r["steps"] == job.STEPS for r in runs)
    assert runs[2]["resumed_at"] == job.FAULT_AT
    assert all(f"troupe group sync rank {r}: rank 2 is back (life 1)" in text for r in (0, 1)), text[-3000:]


@pytest.mark.timeout(180)
def test_hogwild_groups_on_two_nodes_a_killed_group_restarts_on_its_node_and_rejoins(tmp_path):
    """Two launchers on loopback, 2 processes each (4 Hogwild groups of one): group 3, on node 1, is killed
    at step 7 and restarted by node 1's launcher; its new life finds the others through node 0's store,
    copies their state over links across the nodes, and every group takes its 24 steps."""
    said = on_two_nodes(tmp_path, "elastic-hogwild-nodes", 2, ["--framework", "hogwild", "--sync-freq", "2"],
                           {**ENV, "PAUSE": "0.2"})
    assert "troupe group sync rank 3: took the replica of rank 0" in said[1]
    for rank, node in ((0, 0), (1, 0), (2, 1)):
        assert f"troupe group sync rank {rank}: rank 3 is back (life 1)" in said[node], said[node][-2000:]


@pytest.mark.timeout(150)
def test_a_killed_server_s_workers_fail_over_to_another_server_group_and_the_job_goes_on(tmp_path):
    # 3 workers (groups of one), 3 server groups of one server: worker g's server is rank 3 + g. Worker 2 kills
    # rank 5 before its step 8 (that step's update dies with it); from then on its slices go to rank 3, also
    # after worker 2 itself is killed 5 steps later and restarts (it does not dial rank 5 again). The job runs
    # on past the heartbeat timeout (3 s; 0.3 s a step): a dead server's silence ends nobody. Ranks 3 and 4 keep syncing with each other,
    # and the dead one's part gets a new master (server group 0, the next live one after 2): all three parts end equal.
    proc = troupe_run(tmp_path, "kill-server", "--nworker-groups", "3", "--nworkers-per-group", "1",
                      "--nserver-groups", "3", "--nservers-per-group", "1", PAUSE="0.3", TROUPE_PEER_TIMEOUT="3",
                      TROUPE_CHECKPOINT_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [report(tmp_path, r) for r in range(3)]
    assert [r["incarnation"] for r in runs] == [0, 0, 1] and all(r["steps"] == job.STEPS for r in runs)
    assert [r["failovers"] for r in runs] == [[], [], []]  # worker 2's second life was sent to rank 3 at once
    assert runs[2]["resumed_at"] == job.FAULT_AT + 5 and [r["servers"] for r in runs] == [[3], [4], [3]]
    assert ("troupe run: rank 5 exited with signal 9 (SIGKILL); it was server 0 of server group 2, which is not "
            "restarted") in proc.stderr
    assert f"troupe worker rank 2: server rank(s) [5] gone at step {job.FAULT_AT + 1}" in proc.stderr
    assert "troupe server rank 3: serving worker group 2 too" in proc.stderr
    # Each survivor applied every update of its workers once: rank 3 worker 0's 24 and worker 2's 16 after the
    # one that died with rank 5, rank 4 worker 1's 24.
    slices = len(model_slices())
    updates = {int(r): int(n) for r, n in re.findall(r"troupe server rank (\d): (\d+) slice updates", proc.stderr)}
    assert updates == {3: (2 * job.STEPS - job.FAULT_AT - 1) * slices, 4: job.STEPS * slices}, proc.stderr[-2000:]
    assert "took over worker group(s) [2]" in proc.stderr
    for rank in (3, 4):  # serving until worker 2's second life ends: each said so once, and went on
        assert proc.stderr.count(f"troupe: rank {rank}: rank 5 sent no heartbeat for") == 1, rank
    states = [torch.load(tmp_path / f"ps-server-{rank}.pt", weights_only=True)["values"] for rank in (3, 4)]
    for k in (0, 1, 2):  # parts mastered by server groups 0 and 1 (ranks 3 and 4), and part 2, taken over by rank 3
        for s, lo, hi in parts(model_slices(), 3)[k]:
            torch.testing.assert_close(states[0][s.id][lo:hi], states[1][s.id][lo:hi], atol=1e-6, rtol=0)
    assert "part 2's master copy is server group 0's (this server) from now on" in proc.stderr


@pytest.mark.timeout(150)
def test_a_frozen_server_is_killed_past_evict_after_and_its_workers_fail_over(tmp_path):
    # 2 workers over 2 server groups of one server (worker g's server is rank 2 + g), --evict-after 2: worker 1
    # SIGSTOPs rank 3 before its step 8 and trains on. That step's update waits in the frozen server's socket
    # until rank 3's launcher sees its beat stand still for 2 s and kills it (a frozen server would otherwise be
    # waited for until SIGCONT); worker 1 then fails over to rank 2, and nobody restarts.
    proc = troupe_run(tmp_path, "stop-server", "--nworker-groups", "2", "--nworkers-per-group", "1",
                      "--nserver-groups", "2", "--nservers-per-group", "1", "--evict-after", "2",
                      TROUPE_PEER_TIMEOUT="3", TROUPE_CHECKPOINT_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [report(tmp_path, r) for r in range(2)]
    assert [r["incarnation"] for r in runs] == [0, 0] and all(r["steps"] == job.STEPS for r in runs)
    assert re.search(r"troupe run: rank 3 \(server 0 of server group 1\) has not beaten for [0-9.]+ s, past "
                     r"--evict-after 2 s: frozen or hung; killing it", proc.stderr), proc.stderr[-3000:]
    assert ("troupe run: rank 3 exited with signal 9 (SIGKILL); it was server 0 of server group 1, which is not "
            "restarted") in proc.stderr
    assert f"troupe worker rank 1: server rank(s) [3] gone at step {job.FAULT_AT + 1}" in proc.stderr
    assert runs[1]["servers"] == [2] and proc.stderr.count("; killing it") == 1
    # Rank 2 applied every update of worker 0 and every one of worker 1's after the one the frozen server held.
    slices = len(model_slices())
    updates = {int(r): int(n) for r, n in re.findall(r"troupe server rank (\d): (\d+) slice updates", proc.stderr)}
    assert updates == {2: (2 * job.STEPS - job.FAULT_AT - 1) * slices}, proc.stderr[-2000:]
