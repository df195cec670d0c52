"""Elastic worker groups under `troupe run --elastic`: a lost worker restarts alone and heals.

Each job is tests/dist/scripts/elastic_train.py on 3 groups of one process. Every rank logs,
per iteration, which groups its step averaged over; the test replays exactly those steps in
one process (each group's batches from its own sampler) and compares.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
sys.path.insert(0, str(SCRIPT.parent))
import elastic_train as job  # noqa: E402

from tests.dist.world import master_port, run_nodes  # noqa: E402
from troupe.script.sampling import DistributedSampler  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.process]
GROUPS = 3


def troupe_run(out: Path, mode: str, *flags: str, timeout: float = 150, wait=None,
               extra: list[str] = (), n: int = GROUPS, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the job; `wait(proc, stderr_path)` runs while it does (stderr goes to a file it can read)."""
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", str(n), "--elastic", *flags, str(SCRIPT), str(out),
           mode, *extra]
    err = out / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        try:
            if wait is not None:
                wait(proc, err)
            stdout, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:  # never leave a job behind
                proc.terminate()
                proc.wait(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, err.read_text())


def reports(out: Path, n: int = GROUPS) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def committed_steps(logs: list[list]) -> dict[tuple[int, int], list[int]]:
    """(epoch, batch) -> the groups that step averaged over, for every step some rank logged as committed
    (every rank that logged it must name the same groups)."""
    steps: dict[tuple[int, int], list[int]] = {}
    for log in logs:
        for epoch, b, members in log:
            if members is not None:
                assert steps.setdefault((epoch, b), members) == members, f"groups disagree on step {(epoch, b)}"
    return steps


def replay(logs: list[list], group_size: int = 1, constant: bool = False, clip: float = 0.0) -> list[torch.Tensor]:
    """The steps the job committed, in one process: each the mean of the gradients of every process
    of the present groups (rank r = g * group_size + place reads its own shard of all processes');
    `constant`: of every process of the job (the fault-free run's step), whoever was present; `clip`:
    the mean clipped to that total norm (torch's clip_grad_norm_)."""
    steps = committed_steps(logs)
    x, y = job.data()
    n = len(logs)
    samplers = [DistributedSampler(len(x), rank=r, world_size=n, seed=7, tail="drop") for r in range(n)]
    model, sgd = job.model_and_optimizer()
    for (epoch, b), members in sorted(steps.items()):
        members = list(range(n // group_size)) if constant else members
        sgd.zero_grad()
        for r in (g * group_size + place for g in members for place in range(group_size)):
            idx = samplers[r].indices(epoch)[b * job.BATCH:(b + 1) * job.BATCH]
            (F.cross_entropy(model(x[idx]), y[idx]) / (len(members) * group_size)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sgd.step()
    return [p.detach() for p in model.parameters()]


def replay_diloco(runs: list[dict], h: int, group_size: int = 1) -> list[torch.Tensor]:
    """Elastic DiLoCo's committed steps in one process: each group present takes its inner step on the
    mean of its processes' gradients (rank r = g * group_size + place reads shard r; each gradient times
    1 / group_size, summed, as the reducer does); after every h-th committed step the groups present
    average theta_outer - theta, the outer optimizer (SGD, Nesterov momentum 0.9, lr 0.7) steps
    theta_outer and they all adopt it. A restarted group first copies (parameters and inner optimizer
    state) the lowest other group present, the heal's source, at the step count it resumed at (each
    rank's report is its last incarnation)."""
    import copy

    steps = committed_steps([r["log"] for r in runs])
    heals = {r["rank"] // group_size: r["resumed_at"] for r in runs if r["incarnation"] > 0}
    x, y = job.data()
    n = len(runs)
    samplers = [DistributedSampler(len(x), rank=r, world_size=n, seed=7, tail="drop") for r in range(n)]
    groups = [job.model_and_optimizer() for _ in range(n // group_size)]
    outer = [p.detach().clone() for p in groups[0][0].parameters()]
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    for count, ((epoch, b), members) in enumerate(sorted(steps.items()), start=1):
        for g in members:
            if heals.get(g) == count - 1:  # restarted: healed from the source, live
                src = min(m for m in members if m != g)
                groups[g][0].load_state_dict(groups[src][0].state_dict())
                groups[g][1].load_state_dict(copy.deepcopy(groups[src][1].state_dict()))
        for g in members:
            model, sgd = groups[g]
            mean = None
            for r in range(g * group_size, (g + 1) * group_size):
                sgd.zero_grad()
                idx = samplers[r].indices(epoch)[b * job.BATCH:(b + 1) * job.BATCH]
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                part = [p.grad * (1 / group_size) if group_size > 1 else p.grad.clone() for p in model.parameters()]
                mean = part if mean is None else [m + q for m, q in zip(mean, part)]
            for p, m in zip(model.parameters(), mean):
                p.grad = m
            sgd.step()
        if count % h == 0:
            with torch.no_grad():
                for i, o in enumerate(outer):
                    o.grad = sum(o - list(groups[g][0].parameters())[i] for g in members) / len(members)
                outer_opt.step()
                for g in members:
                    for p, o in zip(groups[g][0].parameters(), outer):
                        p.copy_(o)
    return [p.detach() for p in groups[0][0].parameters()]


def replay_streaming(runs: list[dict], h: int, fragments: int, delay: int) -> list[list[torch.Tensor]]:
    """Elastic Streaming DiLoCo's committed steps in one process, every group's model (groups of one
    process): each group present takes its inner step; after the step that makes the count c, fragment j's
    groups present take theta_outer - theta when c % h == sync_offset(j), and at c + delay the groups that
    took it and have not restarted since (a group healed meanwhile holds none) average it, the outer
    optimizer steps that fragment's theta_outer and every group present adopts it. A restarted group
    first copies (parameters, inner optimizer state) the lowest other group present."""
    import copy

    from troupe.cluster.workers.diloco import fragment_bounds, sync_offset

    steps = committed_steps([r["log"] for r in runs])
    heals = {r["rank"]: r["resumed_at"] for r in runs if r["incarnation"] > 0}
    x, y = job.data()
    n = len(runs)
    samplers = [DistributedSampler(len(x), rank=r, world_size=n, seed=7, tail="drop") for r in range(n)]
    groups = [job.model_and_optimizer() for _ in range(n)]
    params = [list(model.parameters()) for model, _ in groups]
    outer = [p.detach().clone() for p in params[0]]
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    bounds = fragment_bounds([p.numel() for p in outer], fragments)
    flights = []  # (merge at, fragment, taken at, {group: its pseudo-gradient})
    for count, ((epoch, b), members) in enumerate(sorted(steps.items()), start=1):
        for g in members:
            if heals.get(g) == count - 1:
                src = min(m for m in members if m != g)
                groups[g][0].load_state_dict(groups[src][0].state_dict())
                groups[g][1].load_state_dict(copy.deepcopy(groups[src][1].state_dict()))
        for g in members:
            model, sgd = groups[g]
            sgd.zero_grad()
            idx = samplers[g].indices(epoch)[b * job.BATCH:(b + 1) * job.BATCH]
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sgd.step()
        with torch.no_grad():
            for j, (lo, hi) in enumerate(bounds):
                if count % h == sync_offset(j, fragments, h):
                    flights.append((count + delay, j, count,
                                    {g: [o - p for o, p in zip(outer[lo:hi], params[g][lo:hi])] for g in members}))
            for due in [f for f in flights if f[0] == count]:
                flights.remove(due)
                _, j, taken, deltas = due
                lo, hi = bounds[j]
                took = [g for g in deltas if g in members and not taken <= heals.get(g, -1) < count]
                for i, o in enumerate(outer):
                    o.grad = sum(deltas[g][i - lo] for g in took) / len(took) if lo <= i < hi else None
                outer_opt.step()
                for g in members:
                    for p, o in zip(params[g][lo:hi], outer[lo:hi]):
                        p.copy_(o)
    return [[p.detach() for p in ps] for ps in params]


def replay_partial(runs: list[dict], chunk_size: int) -> list[list[torch.Tensor]]:
    """partialUpdate's committed steps in one process, every rank's model: each group present steps its own
    copy on its own gradient (SGD with momentum), then chunk ``counter % K`` of the parameters is averaged over
    the groups present and the counter moves on. A restarted group first copies the lowest other group
    present (parameters and optimizer state) at the step count it resumed at."""
    import copy

    from troupe.strategies.partial import plan_chunks

    steps = committed_steps([r["log"] for r in runs])
    heals = {r["rank"]: r["resumed_at"] for r in runs if r["incarnation"] > 0}
    x, y = job.data()
    n = len(runs)
    samplers = [DistributedSampler(len(x), rank=r, world_size=n, seed=7, tail="drop") for r in range(n)]
    ranks = [job.model_and_optimizer() for _ in range(n)]
    chunks = plan_chunks(list(ranks[0][0].parameters()), chunk_size)
    for count, ((epoch, b), members) in enumerate(sorted(steps.items())):
        for g in members:
            if heals.get(g) == count:  # restarted: healed from the source, live
                src = min(m for m in members if m != g)
                ranks[g][0].load_state_dict(ranks[src][0].state_dict())
                ranks[g][1].load_state_dict(copy.deepcopy(ranks[src][1].state_dict()))
        for g in members:
            model, sgd = ranks[g]
            sgd.zero_grad()
            idx = samplers[g].indices(epoch)[b * job.BATCH:(b + 1) * job.BATCH]
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            sgd.step()
        with torch.no_grad():
            for piece in chunks[count % len(chunks)]:
                views = [list(ranks[g][0].parameters())[piece.param].view(-1)[piece.start:piece.stop] for g in members]
                mean = sum(views) / len(members)
                for v in views:
                    v.copy_(mean)
    return [[p.detach() for p in model.parameters()] for model, _ in ranks]


@pytest.mark.timeout(240)
def test_partial_update_over_elastic_groups_undoes_a_lost_step_heals_and_replays(tmp_path):
    """--elastic with dist_option partialUpdate over 2 groups (chunks of 50 of the 212 parameters): each group
    steps on its own gradient and one chunk is averaged a step, before the vote. Rank 1 dies in its optimizer's
    step of step 6, when rank 0 has stepped and waits in the chunk's averaging: rank 0 undoes its update
    (parameters, momentum, counter) and waits (too few groups); rank 1 comes back with rank 0's parameters,
    momentum and chunk counter. Both ranks' parameters (which differ: only a chunk a step is averaged) equal
    a one-process replay of the committed steps, bit for bit."""
    proc = troupe_run(tmp_path, "kill-in-step", n=2, extra=["partialUpdate"], env={"ELASTIC_TEST_CHUNK": "50"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 exited with signal 9 (SIGKILL); restarting it alone" in proc.stderr
    runs = reports(tmp_path, n=2)
    assert [r["incarnation"] for r in runs] == [0, 1] and runs[1]["heals"] == 1
    assert [m for _, _, m in runs[0]["log"]][job.FAULT_AT] is None, "the step rank 1 died in was not left out"
    healed = torch.load(tmp_path / "rank1.pt")["healed"]
    assert healed["strategy"]["partial_counter"] == healed["steps"] == runs[1]["resumed_at"] > 0
    assert runs[0]["sha256"] != runs[1]["sha256"]  # partial: the ranks' parameters differ
    for rank, want in enumerate(replay_partial(runs, 50)):
        got = torch.load(tmp_path / f"rank{rank}.pt")["params"]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def cont_once_left(out: Path, group: int):
    """A `troupe_run` wait: once the frozen process's group has left the quorum and the others have
    stepped on for a second, SIGCONT it (its pid is in OUT/stopped)."""
    def wait(proc, stderr):
        deadline = time.monotonic() + 120
        while f"worker group(s) [{group}] left quorum" not in stderr.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, f"group {group} was never evicted"
            time.sleep(0.1)
        time.sleep(1)  # the others train on without it
        os.kill(int((out / "stopped").read_text()), signal.SIGCONT)
    return wait


def check_healed_and_equal(out: Path, restarted: tuple[int, ...], constant: bool = False) -> list[dict]:
    runs = reports(out)
    assert len({r["sha256"] for r in runs}) == 1, "the groups ended with different parameters"
    assert [r["incarnation"] for r in runs] == [int(r in restarted) for r in range(GROUPS)], \
        "a survivor was restarted, or the lost rank was not"
    params = torch.load(out / "rank0.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs], constant=constant)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return runs


@pytest.mark.timeout(240)
def test_killed_and_raising_workers_restart_alone_and_heal(tmp_path):
    proc = troupe_run(tmp_path, "kill")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 exited with signal 9 (SIGKILL); restarting it alone" in proc.stderr
    assert "rank 0 exited with code 1; restarting it alone" in proc.stderr
    runs = check_healed_and_equal(tmp_path, restarted=(0, 1))
    survivor = runs[2]["log"]
    lost_step = next(i for i, (_, _, m) in enumerate(survivor) if m is None)
    assert survivor[lost_step][:2] == [0, job.FAULT_AT]  # the step the worker died in is left out everywhere
    assert survivor[lost_step + 1][2] == [0, 2]           # the others train on without it
    assert [1, 2] in [m for _, _, m in survivor]           # and later without rank 0, the first rank
    assert survivor[-1][2] == [0, 1, 2]                   # and it is back
    # Both restarts ran in a spare the launcher had started in advance (Python up, torch imported).
    assert runs[0]["warm"] and runs[1]["warm"] and not runs[2]["warm"], "a restart did not run in a warm spare"
    # The joiner's state equals a healthy group's before its first step back: the heal overwrote the
    # restart's own (other) initial values, and from there it stepped with the others.
    healed = torch.load(tmp_path / "rank1.pt")["healed"]
    assert healed["steps"] == runs[1]["resumed_at"] > 0 and runs[1]["heals"] == 1
    assert healed["momentum"], "the optimizer's momentum was not handed over"


@pytest.mark.timeout(240)
def test_constant_batch_steps_are_the_fault_free_runs_steps(tmp_path):
    """--elastic-batch constant: while a group is missing the others take its batches too, so every
    step the job commits is the fault-free run's (the mean over all three groups' batches); only
    the step a worker died in is left out. The replay would differ from a shrinking batch's."""
    proc = troupe_run(tmp_path, "kill", "--elastic-batch", "constant")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = check_healed_and_equal(tmp_path, restarted=(0, 1), constant=True)
    survivor = runs[2]["log"]
    assert [0, 2] in [m for _, _, m in survivor] and [1, 2] in [m for _, _, m in survivor]
    shrunk = replay([r["log"] for r in runs])
    got = torch.load(tmp_path / "rank0.pt")["params"]
    assert any(not torch.allclose(g, s, rtol=1e-5, atol=1e-6) for g, s in zip(got, shrunk)), \
        "the run equals a shrinking batch's: the missing groups' batches were not taken"


@pytest.mark.timeout(240)
def test_beyond_max_groups_a_standby_group_takes_a_lost_ones_place_at_once(tmp_path):
    """--max-groups 2 of 3: two groups step (the first two ready), the third waits; a member dies and the
    standby joins in the same decision (healed), so no step runs with fewer than 2 groups; the restarted
    one stands by in turn and leaves when the job ends. The member dies at step 12, by when the standby (the
    last group ready) has long stood by (at step 6 it once had not yet, on a loaded host)."""
    fault_at = 12
    proc = troupe_run(tmp_path, "kill-member", "--max-groups", "2", env={"ELASTIC_TEST_FAULT_AT": str(fault_at)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the job finished while it waited to rejoin; leaving" in proc.stderr
    runs = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(GROUPS)
            if (tmp_path / f"rank{r}.json").exists()}
    assert len(runs) == 2, "the killed member stepped again, or a group never did"
    survivor = next(r for r, run in runs.items() if run["resumed_at"] == 0)  # stepped from the start
    standby = next(r for r in runs if r != survivor)
    first = runs[survivor]["log"][0][2]
    assert standby not in first and len(first) == 2 and survivor != max(first)  # the highest member was killed
    assert runs[survivor]["sha256"] == runs[standby]["sha256"], "the groups ended with different parameters"
    steps = [m for _, _, m in runs[survivor]["log"]]
    assert all(m == first for m in steps[:fault_at]) and steps[fault_at] is None, steps[:fault_at + 2]
    assert all(m == sorted([survivor, standby]) for m in steps[fault_at + 1:]), \
        "the standby did not take the lost member's place at once"
    assert runs[standby]["heals"] == 1 and runs[standby]["resumed_at"] == fault_at


@pytest.mark.timeout(240)
def test_diloco_over_elastic_groups_heals_the_outer_state_and_replays(tmp_path):
    """--elastic --framework diloco over 2 groups: rank 1 dies in a step that syncs, after an outer step;
    rank 0 undoes its inner step and waits (too few groups); rank 1 comes back and copies rank 0's
    parameters, inner and outer optimizer state. The committed steps replay in one process, bit for
    bit (two groups: their sum has one order)."""
    h, fault_at = 5, 9  # rank 1 dies in step 9 -> 10, the second outer step
    proc = troupe_run(tmp_path, "kill-once", "--framework", "diloco", "--sync-freq", str(h), n=2,
                      env={"ELASTIC_TEST_FAULT_AT": str(fault_at)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 exited with signal 9 (SIGKILL); restarting it alone" in proc.stderr
    runs = reports(tmp_path, n=2)
    assert len({r["sha256"] for r in runs}) == 1, "the groups ended with different parameters"
    assert [r["incarnation"] for r in runs] == [0, 1], "a survivor was restarted, or the lost rank was not"
    assert runs[0]["steps"] % h == 0
    assert [m for _, _, m in runs[0]["log"]][fault_at] is None, "the step rank 1 died in was not left out"
    healed = torch.load(tmp_path / "rank1.pt")["healed"]
    outer = healed["strategy"]["diloco"]
    assert healed["steps"] == fault_at and outer["steps"] == fault_at // h == 1 and outer["optimizer"]["state"], \
        "the outer state was not handed over"
    got = torch.load(tmp_path / "rank0.pt")["params"]
    for g, want in zip(got, replay_diloco(runs, h)):
        torch.testing.assert_close(g, want, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_streaming_diloco_over_elastic_groups_redoes_an_exchange_in_flight_and_replays(tmp_path):
    """--elastic Streaming DiLoCo (2 fragments, delay 2, H 6) over 2 groups: rank 1 dies at step 6,
    while fragment 0's exchange (taken at count 6) is in flight; rank 0 undoes nothing (the step only
    votes), waits for rank 1, which copies its state and the list of exchanges in flight; at count 8 the
    two redo that exchange over the new quorum, rank 1 without a pseudo-gradient of its own (not
    counted). Each group's model equals the one-process replay's, bit for bit."""
    h = 6
    proc = troupe_run(tmp_path, "kill-once", "--framework", "diloco", "--sync-freq", str(h), "--fragments", "2",
                      "--delay", "2", n=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 exited with signal 9 (SIGKILL); restarting it alone" in proc.stderr
    runs = reports(tmp_path, n=2)
    assert [r["incarnation"] for r in runs] == [0, 1], "a survivor was restarted, or the lost rank was not"
    assert [m for _, _, m in runs[0]["log"]][job.FAULT_AT] is None, "the step rank 1 died in was not left out"
    healed = torch.load(tmp_path / "rank1.pt")["healed"]
    assert healed["steps"] == job.FAULT_AT and healed["strategy"]["in_flight"] == [[8, 0]], \
        "the exchange in flight was not handed over"
    want = replay_streaming(runs, h, fragments=2, delay=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")["params"]
        for g, w in zip(got, want[rank], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan, shard", [(None, None), ({"0": 1, "2": -1}, None), (None, "optimizer")],
                         ids=["whole", "partitioned", "sharded"])
def test_diloco_over_elastic_groups_of_two_heals_place_by_place_and_replays(tmp_path, plan, shard):
    """--elastic --framework diloco --nworker-groups 2 on 4 processes: the inner step all-reduces inside
    each group, the outer exchange runs place by place; rank 3 dies in the second outer step, its whole
    group restarts and heals place by place from group 0; bit for bit the one-process replay. With the
    model partitioned inside each group (troupe.partition: a slice's gradient is the group's sum over
    its samples, divided by 2 in the inner step) the whole models equal the replay's within 1e-5; with the
    outer state sharded over each group (--shard optimizer: each place heals its own chunk of it) too."""
    h, fault_at = 5, 9
    env = {"ELASTIC_TEST_FAULT_AT": str(fault_at), **({"ELASTIC_TEST_PARTITION": json.dumps(plan)} if plan else {})}
    proc = troupe_run(tmp_path, "group-kill", "--framework", "diloco", "--sync-freq", str(h), "--nworker-groups",
                      "2", *(["--shard", shard] if shard else []), n=4, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = reports(tmp_path, n=4)
    assert len({r["sha256"] for r in runs}) == 1, "the processes ended with different parameters"
    assert [r["incarnation"] for r in runs] == [0, 0, 1, 1], "group 1 did not restart whole, or group 0 did"
    assert [m for _, _, m in runs[0]["log"]][fault_at] is None, "the step rank 3 died in was not left out"
    assert all(r["heals"] == 1 and r["resumed_at"] == fault_at for r in runs[2:])
    got = torch.load(tmp_path / "rank0.pt")["params"]
    for g, want in zip(got, replay_diloco(runs, h, group_size=2), strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-5 if plan or shard else 0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("option", ["sparseTopK", "powerSGD"])
def test_too_few_groups_wait_for_restarts_then_train_on_compressed(tmp_path, option):
    """Two groups down at once (fewer than min_groups): the survivor waits with its state and a new
    quorum forms when they are back. Under top-K and PowerSGD, whose error-feedback memory (and
    PowerSGD's warm-start Q) travel with the heal."""
    proc = troupe_run(tmp_path, "two-down", extra=[option])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "too few left: waiting for restarts" in proc.stderr
    runs = reports(tmp_path)
    assert len({r["sha256"] for r in runs}) == 1, "the groups ended with different parameters"
    assert [r["incarnation"] for r in runs] == [0, 1, 1], "a survivor was restarted, or a lost rank was not"
    assert runs[0]["log"][-1][2] == [0, 1, 2] and runs[1]["heals"] >= 1 and runs[2]["heals"] >= 1
    for r in (1, 2):  # before its first step back, a joiner holds its source's compression state
        healed = torch.load(tmp_path / f"rank{r}.pt")["healed"]["strategy"]
        assert healed["residuals"], "the error-feedback residuals were not handed over"
        if option == "powerSGD":  # a fresh process has drawn no Q yet: these came with the heal
            assert healed["powerSGD"]["q"] and healed["powerSGD"]["draws"] > 0


@pytest.mark.timeout(240)
def test_frozen_worker_is_evicted_and_comes_back_after_sigcont(tmp_path):
    proc = troupe_run(tmp_path, "stop", "--elastic-timeout", "3", "--evict-after", "8",
                      wait=cont_once_left(tmp_path, group=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 2 was left out of the quorum while it was paused; starting it again" in proc.stderr
    runs = check_healed_and_equal(tmp_path, restarted=(2,))  # back from SIGCONT, it restarts to catch up
    survivor = runs[0]["log"]
    assert [0, 1] in [m for _, _, m in survivor], "the others did not train on while rank 2 was stopped"
    assert survivor[-1][2] == [0, 1, 2]


@pytest.mark.timeout(240)
def test_restart_budget_that_runs_out_ends_the_job_naming_the_rank(tmp_path):
    proc = troupe_run(tmp_path, "always-raise", "--restarts-per-rank", "0")
    assert proc.returncode != 0
    assert "rank 1 exited with code 1 and has used its 0 restarts (--restarts-per-rank); stopped the job" \
        in proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", [None, "auto-job"], ids=["whole", "auto-job"])
def test_a_killed_process_restarts_its_whole_group_which_heals_place_by_place(tmp_path, plan):
    """2 groups of 2 processes, --min-groups 2: rank 3 dies, its partner rank 2 is stopped, group 0 waits
    (one group is too few) and both groups train on once group 1 is back and healed. "auto-job": the model
    partitioned by plan "auto" with link "job", which the four first processes time together; the restarted
    group takes the same plan from the launcher's store without timing anything."""
    env = {"ELASTIC_TEST_PARTITION": json.dumps(plan)} if plan else {}
    proc = troupe_run(tmp_path, "group-kill", "--nworker-groups", "2", "--min-groups", "2", n=4, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 exited with signal 9 (SIGKILL); stopped its worker group 1's other ranks [2]" in proc.stderr
    assert "too few left: waiting for restarts" in proc.stderr
    runs = reports(tmp_path, n=4)
    assert [r["incarnation"] for r in runs] == [0, 0, 1, 1], "group 0 was restarted, or group 1 not as a whole"
    assert len({r["sha256"] for r in runs}) == 1, "the processes ended with different parameters"
    assert [r["heals"] for r in runs[2:]] == [1, 1] and runs[2]["resumed_at"] == runs[3]["resumed_at"] > 0
    survivor = runs[0]["log"]
    lost_step = next(i for i, (_, _, m) in enumerate(survivor) if m is None)
    assert survivor[lost_step][:2] == [0, job.FAULT_AT]  # the step rank 3 died in is left out on group 0 too
    assert survivor[-1][2] == [0, 1]
    params = torch.load(tmp_path / "rank0.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs], group_size=2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if plan:  # one plan, every process and every life
        assert len({json.dumps(r["plan"]) for r in runs}) == 1 and runs[0]["plan"], [r["plan"] for r in runs]
        assert "planned with the loopback link's constants" not in proc.stderr
    # Each joiner's state equals its counterpart's (place by place) before its first step back.
    for r in (2, 3):
        healed = torch.load(tmp_path / f"rank{r}.pt")["healed"]
        assert healed["steps"] == runs[r]["resumed_at"] and healed["momentum"]
    # Peer to peer: each joiner received its state from its counterpart in group 0, which sent at least that
    # (also to group 1's first life, if it joined late at the start); the launcher's store carried none of it.
    sent, received = [r["heal_bytes"] for r in runs[:2]], [r["heal_bytes"] for r in runs[2:]]
    assert all(0 < got <= out for got, out in zip(received, sent)), (sent, received)
    if not plan:  # at least the model's parameters and momentum
        own = sum(p.numel() * p.element_size() for p in params)
        assert all(got > 2 * own for got in received), (received, own)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shard, optimizer, mode", [("optimizer", "sgd", "group-kill"),
                                                     ("gradients", "adamw", "group-kill-in-step"),
                                                     ("parameters", "adamw", "group-kill")])
def test_a_sharded_group_restarts_and_heals_each_chunk_from_its_place_in_a_live_group(tmp_path, shard, optimizer,
                                                                                    mode, monkeypatch):
    """--shard under --elastic: 2 groups of 2, each cutting the optimizer state (and under "gradients" the mean
    gradients) over its 2 processes; "parameters": the model sharded by troupe.shard (FSDP2 over the group's own
    process group), the shards' gradients all-reduced across the groups present. Rank 3 dies at a step
    boundary, or inside its optimizer's step after the step was committed (its partner, in the all-gather,
    leaves for the group's restart); group 1 restarts, each process heals its chunk from its place in group
    0, and the job equals one process replaying the committed steps; every process ends with the same
    parameters, and the partner says in one line that it leaves (no traceback)."""
    env = {"ELASTIC_TEST_ADAMW": "1"} if optimizer == "adamw" else {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the replay's optimizer too
    flags = ["--shard", shard] if shard != "parameters" else []
    if shard == "parameters":
        env["ELASTIC_TEST_FSDP"] = "1"  # troupe.shard in the job only: the replay trains the whole model
    proc = troupe_run(tmp_path, mode, "--nworker-groups", "2", "--min-groups", "2", *flags, n=4, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rank 3 exited with signal 9 (SIGKILL); stopped its worker group 1's other ranks [2]" in proc.stderr
    runs = reports(tmp_path, n=4)
    assert [r["incarnation"] for r in runs] == [0, 0, 1, 1], "group 0 was restarted, or group 1 not as a whole"
    assert len({r["sha256"] for r in runs}) == 1, "the processes ended with different parameters"
    assert [r["heals"] for r in runs[2:]] == [1, 1] and runs[2]["resumed_at"] == runs[3]["resumed_at"] > 0
    params = torch.load(tmp_path / "rank0.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs], group_size=2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Each joiner holds (and was handed) its chunk of the optimizer state, half of the model's elements per
    # buffer (momentum; AdamW's two moments), within one bucket's padding.
    own = sum(p.numel() for p in params)
    buffers = 2 if optimizer == "adamw" else 1
    for r in (2, 3):
        held = torch.load(tmp_path / f"rank{r}.pt")["healed"]["momentum"]
        assert held and abs(sum(t.numel() for t in held) - buffers * own / 2) <= buffers, (r, [t.shape for t in held])
    sent, received = [r["heal_bytes"] for r in runs[:2]], [r["heal_bytes"] for r in runs[2:]]
    assert all(0 < got <= out for got, out in zip(received, sent)), (sent, received)


@pytest.mark.timeout(240)
def test_a_partitioned_model_s_group_restarts_heals_its_slices_and_replays(tmp_path):
    """troupe.partition inside elastic groups: 3 groups of 2, the first layer's outputs split over each
    group's two processes (dim 1), the second layer on each group's process 0 (dim -1), a constant global
    batch. Rank 1 dies: its partner leaves with it (one line, no traceback), groups 1 and 2 train on at
    quorum places that are not their ranks, taking group 0's batches too; group 0 comes back, each
    process heals its own slice from its counterpart, and every process's whole model (its group's
    slices put together) equals the one-process replay of the fault-free run's steps."""
    proc = troupe_run(tmp_path, "kill-once", "--nworker-groups", "3", "--elastic-batch", "constant", n=6,
                      env={"ELASTIC_TEST_PARTITION": json.dumps({"0": 1, "2": -1}), "ELASTIC_TEST_CLIP": "0.2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 exited with signal 9 (SIGKILL); stopped its worker group 0's other ranks [0]" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    runs = reports(tmp_path, n=6)
    assert [r["incarnation"] for r in runs] == [1, 1, 0, 0, 0, 0], "a survivor was restarted, or group 0 not whole"
    assert len({r["sha256"] for r in runs}) == 1, "the groups' whole models differ"
    assert runs[0]["resumed_at"] == runs[1]["resumed_at"] > job.FAULT_AT
    survivor = runs[2]["log"]
    assert [1, 2] in [m for _, _, m in survivor] and survivor[-1][2] == [0, 1, 2]
    params = torch.load(tmp_path / "rank2.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs], group_size=2, constant=True, clip=0.2),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    unclipped = replay([r["log"] for r in runs], group_size=2, constant=True)
    assert any(not torch.allclose(g, u, rtol=1e-5, atol=1e-6) for g, u in zip(params, unclipped)), "the clip never bit"


@pytest.mark.timeout(240)
def test_a_frozen_process_takes_its_group_out_until_sigcont(tmp_path):
    """2 groups of 2, --min-groups 2: rank 3 SIGSTOPs itself; after --evict-after its whole group leaves
    the quorum and group 0, alone, waits with its state; after SIGCONT group 1 asks again, heals place
    by place from group 0 and both train on, nobody restarted."""
    proc = troupe_run(tmp_path, "group-stop", "--nworker-groups", "2", "--min-groups", "2", "--elastic-timeout", "3",
                      "--evict-after", "8", n=4, wait=cont_once_left(tmp_path, group=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no heartbeat within 8s (rank 3:" in proc.stderr and "too few left: waiting for restarts" in proc.stderr
    runs = reports(tmp_path, n=4)
    assert [r["incarnation"] for r in runs] == [0, 0, 0, 0], "a process was restarted"
    assert len({r["sha256"] for r in runs}) == 1, "the processes ended with different parameters"
    assert runs[2]["heals"] == runs[3]["heals"] >= 2  # the start, then back from SIGCONT
    survivor = runs[0]["log"]
    assert survivor[job.FAULT_AT][2] is None and survivor[-1][2] == [0, 1]  # the frozen step left out everywhere
    params = torch.load(tmp_path / "rank0.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs], group_size=2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_on_two_nodes_each_launcher_restarts_its_own_ranks(tmp_path):
    """2 nodes of 2 processes (two launchers on loopback, the quorum in node 0's): rank 3 dies on node 1,
    whose launcher restarts it; once it is back rank 0 fails on node 0, whose launcher restarts it.
    Node 1's launcher is a Slurm task (`troupe run --slurm`: its place, master and token from srun's
    environment), node 0's is given them as flags."""
    port = master_port()
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
             "SLURM_STEP_NODELIST": "127.0.0.1", "TROUPE_MASTER_PORT": str(port), "TROUPE_TOKEN": "elastic-nodes-test"}
    launches = []
    for node in (0, 1):
        where = (["--nnodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}", "--token", "elastic-nodes-test"]
                 if node == 0 else ["--slurm"])
        cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", *where, "--elastic", str(SCRIPT), str(tmp_path),
               "nodes-kill"]
        launches.append((cmd, ENV if node == 0 else {**ENV, **slurm}))
    codes, said = run_nodes(launches, tmp_path, ROOT, timeout=180)
    assert codes == [0, 0], said
    assert "rank 3 exited with signal 9 (SIGKILL); restarting it alone" in said[1]
    assert "rank 0 exited with code 1; restarting it alone" in said[0]
    runs = reports(tmp_path, n=4)
    assert [r["incarnation"] for r in runs] == [1, 0, 0, 1], "a survivor was restarted, or a lost rank was not"
    assert len({r["sha256"] for r in runs}) == 1, "the ranks ended with different parameters"
    assert runs[3]["heals"] == 1 and runs[0]["heals"] == 1 and runs[3]["warm"]  # node 1's own spare
    survivor = runs[1]["log"]
    assert [0, 1, 2] in [m for _, _, m in survivor] and [1, 2, 3] in [m for _, _, m in survivor]
    assert survivor[-1][2] == [0, 1, 2, 3]
    params = torch.load(tmp_path / "rank0.pt")["params"]
    for got, want in zip(params, replay([r["log"] for r in runs])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--min-groups", "4"], "min_groups (4) is larger than the job's 3 worker groups"),
    (["--min-groups", "1"], "min_groups must be >= 2"),
    (["--max-restarts", "2", "--checkpoint-dir", "ck"], "--elastic restarts a dead rank alone; --max-restarts"),
    (["--framework", "allreduce"], "--elastic runs data parallelism over worker groups, --framework diloco, or "
                                   "--framework downpour, sandblaster or hogwild (their workers restart alone); "
                                   "not AllReduce"),
    (["--framework", "downpour", "--min-groups", "2"], "--min-groups is for synchronous elastic groups (a quorum)"),
    (["--framework", "hogwild", "-n", "4", "--nworker-groups", "2", "--nworkers-per-group", "2", "--nserver-groups",
      "2", "--nservers-per-group", "2"],
     "--elastic runs a parameter-server job whose servers are separate (Downpour, Sandblaster), or Distributed "
     "Hogwild over groups of one process each (--framework hogwild); got 2 worker group(s) of 2 worker(s)"),
    (["--spares", "-1"], "--spares must be >= 0, got -1"),
    (["--nworker-groups", "1"], "--elastic --nworker-groups needs at least 2 worker groups"),
    (["-n", "4", "--nworker-groups", "3"],
     "-n 4 processes do not split into --nworker-groups 3 groups of equal size"),
    (["--nworker-groups", "2", "--nserver-groups", "2"], "not AllReduce or partition yet"),
    (["--framework", "diloco", "--elastic-batch", "constant"], "--elastic-batch constant weighs each step's"),
    (["--max-groups", "4"], "max_groups (4) must be from min_groups (2) to the job's 3 worker groups"),
    (["-n", "2", "--nnodes", "3", "--nworker-groups", "2"],
     "a worker group of 3 processes (--nworker-groups 2) would span two nodes of -n 2"),
])
def test_bad_elastic_flags_say_one_line(tmp_path, flags, message):
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", str(GROUPS), "--elastic", *flags, str(SCRIPT),
           str(tmp_path), "ok"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr


def test_another_node_without_node_0_says_so_in_one_line(tmp_path):
    from troupe.runtime.ticket import free_port

    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "1", "--nnodes", "2", "--node-rank", "1", "--master",
           f"127.0.0.1:{free_port('127.0.0.1')}", "--token", "t", "--elastic", str(SCRIPT), str(tmp_path), "ok"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "TROUPE_JOIN_TIMEOUT": "2"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "could not reach the job's rendezvous at 127.0.0.1:" in proc.stderr


LONG_JOB = """
import os, sys, time
import torch
import troupe

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.01))
troupe.track(model=model, optimizer=opt)
for step in range(100000):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    if step == 3:
        open(os.path.join(sys.argv[1], "stepping" + os.environ["RANK"]), "w").close()
    time.sleep(0.02)
"""


def test_another_node_ends_in_one_line_when_node_0_s_launcher_is_killed(tmp_path):
    """Node 0's `troupe run` (the job's store and quorum) SIGKILLed mid-run: node 1's launcher stops its ranks
    and exits 1 within the bound (`StoreWatch`: 15 s of silence), saying so in one line; its ranks say one
    line each, not a traceback."""
    from troupe.launcher.elastic import STORE_SILENCE_SECONDS
    script = tmp_path / "long.py"
    script.write_text(LONG_JOB)
    where = ["--nnodes", "2", "--master", f"127.0.0.1:{master_port()}", "--token", "n0-dies"]
    procs = [subprocess.Popen([sys.executable, "-m", "troupe.cli", "run", "-n", "1", *where, "--node-rank", str(node),
                               "--elastic", str(script), str(tmp_path)], cwd=tmp_path, env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "stepping1").exists() and time.monotonic() < deadline and procs[1].poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "stepping1").exists(), "node 1's rank never stepped"
        procs[0].kill()
        killed = time.monotonic()
        _, err = procs[1].communicate(timeout=STORE_SILENCE_SECONDS + 45)
        took = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert procs[1].returncode == 1, err
    assert took < STORE_SILENCE_SECONDS + 20, took
    assert "troupe run: node 0's launcher (the job's store at 127.0.0.1:" in err and "has not answered for" in err, err
    assert "Traceback" not in err, err
    assert "lost the elastic job's store (the launcher)" in err, err


def test_min_groups_without_elastic_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", "2", "--min-groups", "2", str(SCRIPT), str(tmp_path), "ok"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--min-groups needs --elastic" in proc.stderr, proc.stderr
