"""`troupe bench scale`: the control plane of an elastic job against the number of processes, measured here
and extrapolated by a fitted cost model.

Each point is one job, `troupe run -n N --elastic` (groups of one process, a model of 36 parameters, so that
the control plane and not compute grows with N), that takes `--steps` steps after `--warmup`. What it
measures, per N:

* **start_s**: from `troupe run`'s start until every process has committed its first step (the launcher
  forks the ranks, each joins the first quorum, the first quorum heals everyone from its source);
* **vote_ms**: per step, from the moment the last process starts its vote until the last process has the
  round's decision: the cost of the vote itself (runtime/vote.py: the ballots rise to the quorum's leader through a
  tree of messages, the leader writes the decision into the launcher's store and broadcasts it), without the
  members' skew in reaching it. The median over the measured steps;
* **step_ms**: the median step, as the slowest process sees it (a 36-parameter all-reduce over N processes
  on loopback, plus the vote);
* **launcher_cpu**: the launcher's CPU time (its store server, the lighthouse reading N heartbeat counters
  every 0.1 s, the supervisor) per second of training, in cores.

Each is fitted to ``a + b * N`` by least squares on the points up to `--fit-upto` processes and checked on
the points above it (goal: within 20 %). On this machine N processes share 2 cores, so the vote's and the
step's growth here is mostly the processes waiting for a core; the fitted limits say what holds on this host.

What grows with the job wherever it runs is what passes through node 0's launcher: its store (every vote, every
heartbeat) and its lighthouse (every rank's liveness and requests). `store_costs` measures those directly at
up to 10,000 ranks' keys (no process started: the operations themselves, on a real TCPStore), and
`control_plane_limits` gives from them, per step time, the largest job each part carries: the vote within 5 %
of the step (through the store: 2 operations per process and step; through the quorum's group: the leader's 2
operations and log2(N) Gloo hops each way, a hop measured by `gloo_hop_us`), the store's capacity (votes and
heartbeats), the
lighthouse's tick (before the fix: two round trips per rank each tick; now: every heartbeat counter in one
message 4 times a second and a log of requests), and which gives out first.

    troupe bench scale --sizes 2 4 8 16 32 64 --out runs/scale.json
    troupe bench scale --render runs/scale.json              # the table and the limits again
    troupe bench scale --store-only --out runs/store.json    # the launcher's costs at 64 .. 10,000 ranks only
    python -m troupe.bench.scale job OUT                      # one process (what troupe run starts)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troupe.runtime.quorum import POLL_READS_PER_S

START_TIMEOUT_S = 300.0
"""A job of N processes must end within this (plus 2 s per process)."""
STEP_BUDGET = 0.05
"""The share of a step the control plane may take."""
METRICS = ("start_s", "vote_ms", "step_ms", "launcher_cpu")


def job(out: Path, steps: int, warmup: int) -> None:
    """One process: `warmup + steps` steps of a tiny model; each step's vote timed (the wall clock, which every
    process on this host shares); OUT/rank{r}.json gets the times."""
    import torch
    import torch.nn.functional as F

    import troupe

    t0 = float(os.environ["TROUPE_SCALE_T0"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.01))
    membership = opt.world.membership
    arrived: list[float] = []
    decided: list[float] = []
    vote = membership.vote

    def timed_vote(ok: bool, error: BaseException | None = None) -> bool:
        arrived.append(time.time())
        try:
            return vote(ok, error)
        finally:
            decided.append(time.time())

    membership.vote = timed_vote
    troupe.track(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(opt.global_rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    ends: list[float] = []
    while opt.step_count < warmup + steps:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ends.append(time.time())
        if len(ends) == 1 and opt.global_rank == 0:
            (out / "stepped").touch()  # the driver starts counting the launcher's CPU
    (out / f"rank{opt.global_rank}.json").write_text(json.dumps({
        "rank": opt.global_rank, "first_step": ends[0] - t0, "arrived": arrived, "decided": decided, "ends": ends,
        "warmup": warmup}))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(n: int, out: Path, steps: int, warmup: int) -> dict[str, Any]:
    """One job of `n` processes into `out`; its point."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = {**os.environ, "TROUPE_SCALE_T0": repr(t0), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", str(n), "--elastic", "--min-groups", "2",
           "--ranks", "0", __file__, "job", str(out), "--steps", str(steps), "--warmup", str(warmup)]
    with open(out / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            cpu = _launcher_cpu(proc, out, n)
            code = proc.wait(timeout=START_TIMEOUT_S + 2 * n)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise RuntimeError(f"the job of {n} processes exited with code {code}: see {out / 'launcher.log'}")
    return point(n, [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)], cpu)


def _launcher_cpu(proc: subprocess.Popen, out: Path, n: int) -> float | None:
    """The launcher's CPU seconds per wall second while the job trains: from the first rank's first step to the
    first rank's report (sampled from /proc while it runs)."""
    deadline = time.time() + START_TIMEOUT_S + 2 * n
    start = None
    while time.time() < deadline and proc.poll() is None:
        files = list(out.glob("rank*.json"))
        try:
            if start is None and _any_stepped(out):
                start = (time.time(), _cpu_seconds(proc.pid))
            if start is not None and files:
                end = (time.time(), _cpu_seconds(proc.pid))
                return (end[1] - start[1]) / max(end[0] - start[0], 1e-9)
        except OSError:
            return None
        time.sleep(0.05)
    return None


def _any_stepped(out: Path) -> bool:
    marker = out / "stepped"
    return marker.exists()


def point(n: int, ranks: list[dict[str, Any]], launcher_cpu: float | None) -> dict[str, Any]:
    """The measures of one job from its processes' reports (see the module docstring)."""
    warmup = ranks[0]["warmup"]
    steps = min(len(r["decided"]) for r in ranks)
    votes, step_ms = [], []
    for s in range(warmup, steps):
        last_in = max(r["arrived"][s] for r in ranks)
        votes.append((max(r["decided"][s] for r in ranks) - last_in) * 1e3)
        if s > 0:
            step_ms.append(max(r["ends"][s] - r["ends"][s - 1] for r in ranks) * 1e3)
    return {"n": n, "start_s": max(r["first_step"] for r in ranks), "vote_ms": statistics.median(votes),
            "step_ms": statistics.median(step_ms), "launcher_cpu": launcher_cpu, "steps": len(votes)}


@dataclass(frozen=True)
class Fit:
    """``a + b * n``, fitted by least squares."""

    a: float
    b: float

    def __call__(self, n: float) -> float:
        return self.a + self.b * n

    @staticmethod
    def of(points: list[tuple[float, float]]) -> Fit:
        if len(points) < 2:
            raise ValueError("a fit needs at least 2 points")
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        return Fit(my - b * mx, b)


def fits(points: list[dict[str, Any]], upto: int) -> dict[str, Fit]:
    """Each metric fitted on the points of at most `upto` processes."""
    return {m: Fit.of([(p["n"], p[m]) for p in points if p["n"] <= upto and p.get(m) is not None])
            for m in METRICS if sum(1 for p in points if p["n"] <= upto and p.get(m) is not None) >= 2}


def limits(fit: dict[str, Fit]) -> dict[str, Any]:
    """The largest job (processes, i.e. groups of one) whose control plane fits, per step time: the vote within
    `STEP_BUDGET` of the step, the launcher within one core; and which gives out first."""
    found: dict[str, Any] = {}
    cpu = fit.get("launcher_cpu")
    cpu_limit = None if cpu is None else _reach(cpu, 1.0)
    for step_s in (1.0, 0.1):
        vote_limit = _reach(fit["vote_ms"], STEP_BUDGET * step_s * 1e3)
        bounds = {k: v for k, v in (("vote", vote_limit), ("launcher CPU", cpu_limit)) if v is not None}
        first = min(bounds, key=bounds.get) if bounds else None
        found[f"{step_s:g} s"] = {"processes": bounds.get(first) if first else None, "first": first, **bounds}
    return found


def _reach(fit: Fit, bound: float) -> int | None:
    """The largest n with fit(n) <= bound; None when it does not grow with n (no bound)."""
    if fit.b <= 1e-12:
        return None
    return math.floor((bound - fit.a) / fit.b + 1e-9)


def report(points: list[dict[str, Any]], upto: int) -> str:
    """The table of measured points, the fits with their error on the points they did not see, the limits."""
    fit = fits(points, upto)
    lines = ["| processes | start (s) | vote (ms) | step (ms) | launcher CPU (cores) |", "|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: p["n"]):
        cpu = "-" if p.get("launcher_cpu") is None else f"{p['launcher_cpu']:.2f}"
        lines.append(f"| {p['n']} | {p['start_s']:.2f} | {p['vote_ms']:.2f} | {p['step_ms']:.1f} | {cpu} |")
    lines += ["", f"Fitted on the points of at most {upto} processes, checked on the others:", "",
              "| measure | a (constant) | b (per process) | held-out points: measured / predicted |", "|---|---|---|---|"]
    for m, f in fit.items():
        held = [f"{p['n']}: {p[m]:.3g} / {f(p['n']):.3g} ({(f(p['n']) - p[m]) / p[m]:+.0%})"
                for p in points if p["n"] > upto and p.get(m)]
        lines.append(f"| {m} | {f.a:.4g} | {f.b:.4g} | {'; '.join(held) or '-'} |")
    if "vote_ms" in fit:
        lines += ["", "| step | largest job whose vote is <= 5 % of the step | launcher within one core | first to give out |",
                  "|---|---|---|---|"]
        for step, lim in limits(fit).items():
            lines.append(f"| {step} | {lim.get('vote', '-')} | {lim.get('launcher CPU', '-')} | {lim['first'] or '-'} |")
    return "\n".join(lines)


def store_costs(sizes: list[int], reps: int = 5, clients: int = 4) -> dict[str, Any]:
    """The launcher's side of the control plane measured directly, in this process, for jobs of `sizes`
    processes (no process started: the keys of that many ranks on a real TCPStore, libuv server, over loopback):

    * tick_before_ms: what one lighthouse tick read before the fix, two round trips per rank (its heartbeat
      counter, its request key), one rank after another; tick_after_ms: what it reads now, every counter in one
      message and the log of requests (`Lighthouse._read_beats`, `_read_requests`). Medians of `reps`;
    * store_ops_per_s: the store's throughput of small adds from `clients` connections at once (an elastic
      step's vote is 2 such operations per process, and a heartbeat one per process every 0.5 s)."""
    import datetime
    import threading

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), use_libuv=True)

    def client() -> Any:
        return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=60))

    store, out = client(), {"sizes": {}}
    for n in sizes:
        hb, ready = [f"n{n}/hb/{r}" for r in range(n)], [f"n{n}/ready/{r}" for r in range(n)]
        for k in hb:
            store.add(k, 1)
        store.set(f"n{n}/asked", "")
        before, after = [], []
        for _ in range(reps):
            t = time.perf_counter()
            for a, b in zip(hb, ready):
                store.add(a, 0)
                store.check([b])
            before.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            store.multi_get(hb)
            store.get(f"n{n}/asked")
            after.append((time.perf_counter() - t) * 1e3)
        out["sizes"][n] = {"tick_before_ms": statistics.median(before), "tick_after_ms": statistics.median(after)}
    per_client = 4000
    conns = [client() for _ in range(clients)]
    threads = [threading.Thread(target=lambda c=c, i=i: [c.add(f"ops/{i}", 1) for _ in range(per_client)])
               for i, c in enumerate(conns)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out["store_ops_per_s"] = clients * per_client / (time.perf_counter() - t)
    out["clients"] = clients
    out["hop_us"] = gloo_hop_us(server.port)
    return out


def gloo_hop_us(port: int, reps: int = 300) -> float:
    """One hop of the vote's messages: half a round trip of a 3-integer message between two Gloo process groups
    (one per thread of this process) on loopback, the median of `reps` round trips, in microseconds."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        store = dist.PrefixStore("hop/", dist.TCPStore("127.0.0.1", port, 1, False,
                                                       timeout=datetime.timedelta(seconds=60)))
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    rtts: list[float] = []

    def ping(rank: int) -> None:
        t = torch.zeros(3, dtype=torch.int64)
        for i in range(reps):
            start = time.perf_counter()
            if rank == 0:
                groups[0].send([t], 1, i).wait()
                groups[0].recv([t], 1, i).wait()
                rtts.append(time.perf_counter() - start)
            else:
                groups[1].recv([t], 0, i).wait()
                groups[1].send([t], 0, i).wait()

    for target in (make, ping):
        threads = [threading.Thread(target=target, args=(r,)) for r in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return statistics.median(rtts) / 2 * 1e6


TICKS_PER_S = 50
"""The lighthouse's ticks per second (runtime/lighthouse.py's TICK_SECONDS = 0.02)."""
BEAT_READS_PER_S = 4
"""Its reads of every heartbeat counter per second since the fix (twice a 0.5-s heartbeat)."""


def control_plane_limits(costs: dict[str, Any], n_max: int = 10_000) -> dict[str, Any]:
    """From the measured costs: per step time, the largest elastic job (groups of one process, up to `n_max`)
    whose vote costs the store at most 5 % of the step, and whose lighthouse needs at most half a core (it shares
    the launcher with the store's server), before and after the fix; what gives out first. The lighthouse's cost
    at n processes is interpolated linearly between the measured sizes (extrapolated beyond the largest). With
    a measured Gloo hop (`hop_us`), the same for the vote through the quorum's group ("tree vote", "store
    capacity now", "first now"): 2 store operations and 2 ceil(log2 n) hops a step within 5 % of it; the store
    serving 2 operations a step, the heartbeats and the waiting members' reads (`POLL_READS_PER_S`)."""
    sizes = sorted(int(n) for n in costs["sizes"])
    ops = costs["store_ops_per_s"]

    def tick_ms(n: int, which: str) -> float:
        """Linear between the measured sizes; the smallest's cost below them; the last two's line beyond."""
        pts = [(m, costs["sizes"][m if m in costs["sizes"] else str(m)][which]) for m in sizes]
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        lo, hi = next(((a, b) for a, b in zip(pts, pts[1:]) if n <= b[0]), (pts[-2], pts[-1]))
        return lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])

    def largest(ok: Any) -> int:
        """The largest n <= n_max with ok(n) (ok falls once, as n grows): by jumps of n / 64, then one by one
        back from a jump that went past it."""
        n = 2
        while n < n_max and ok(n + 1):
            jump = min(n_max, n + max(1, n // 64))
            if not ok(jump):
                return next(m for m in range(jump - 1, n, -1) if ok(m))
            n = jump
        return n

    found = {}
    for step_s in (1.0, 0.1):
        vote = largest(lambda n: (2 * n + 2) / ops <= STEP_BUDGET * step_s)
        # before: the tick read every rank's keys each time; past one tick period (20 ms) of reading, the
        # launcher's thread spends more than half its time in it and every tick comes late
        before = largest(lambda n: tick_ms(n, "tick_before_ms") <= 1e3 / TICKS_PER_S)
        # after: every counter read 4 times a second; every tick reads the log (the smallest size's read)
        after = largest(lambda n: (BEAT_READS_PER_S * tick_ms(n, "tick_after_ms")
                                   + TICKS_PER_S * tick_ms(0, "tick_after_ms")) / 1e3 <= 0.5)
        capacity = largest(lambda n: (2 * n + 2) / step_s + 2 * n <= ops)
        found[f"{step_s:g} s"] = now = {"vote": vote, "lighthouse before": before, "lighthouse after": after,
                                  "store capacity": capacity,
                                  "first before": min(("vote", vote), ("lighthouse", before),
                                                      ("store capacity", capacity), key=lambda x: x[1])[0],
                                  "first after": min(("vote", vote), ("lighthouse", after),
                                                     ("store capacity", capacity), key=lambda x: x[1])[0]}
        if "hop_us" in costs:
            # the vote through the quorum's group (runtime/vote.py): the leader's 2 store operations, the ballots up
            # a binomial tree and the decision down Gloo's (ceil(log2 n) hops each way); the store then carries the
            # heartbeats, 2 operations a step and at most POLL_READS_PER_S of waiting members' reads
            hop = costs["hop_us"] / 1e6
            tree = largest(lambda n: 2 / ops + 2 * (n - 1).bit_length() * hop <= STEP_BUDGET * step_s)
            capacity_now = largest(lambda n: 2 / step_s + 2 * n + POLL_READS_PER_S <= ops)
            now.update({"tree vote": tree, "store capacity now": capacity_now,
                        "first now": min(("vote", tree), ("lighthouse", after), ("store capacity", capacity_now),
                                         key=lambda x: x[1])[0]})
    return found


def store_report(costs: dict[str, Any]) -> str:
    lines = ["| processes | lighthouse tick's reads before (ms) | after (ms) |", "|---|---|---|"]
    for n, c in sorted(costs["sizes"].items(), key=lambda x: int(x[0])):
        lines.append(f"| {n} | {c['tick_before_ms']:.2f} | {c['tick_after_ms']:.2f} |")
    lines += ["", f"The store: {costs['store_ops_per_s']:.0f} small adds/s from {costs['clients']} connections.", "",
              "| step | vote within 5 % (store) | lighthouse within half a core: before / after | store capacity "
              "(votes + heartbeats) | first to give out: before / after |", "|---|---|---|---|---|"]
    limits = control_plane_limits(costs)
    for step, lim in limits.items():
        lines.append(f"| {step} | {lim['vote']} | {lim['lighthouse before']} / {lim['lighthouse after']} | "
                     f"{lim['store capacity']} | {lim['first before']} / {lim['first after']} |")
    if "hop_us" in costs:
        lines += ["", f"The vote through the quorum's group (a Gloo hop: {costs['hop_us']:.0f} us): the store touched "
                  "twice a step, the ballots and the decision log2(n) hops each way.", "",
                  "| step | vote within 5 %: through the store / the group | store capacity (heartbeats + 2 a step) "
                  "| first to give out |", "|---|---|---|---|"]
        for step, lim in limits.items():
            lines.append(f"| {step} | {lim['vote']} / {lim['tree vote']} | {lim['store capacity now']} | "
                         f"{lim['first now']} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.render:
        data = json.loads(Path(args.render).read_text())
        if data.get("points"):
            print(report(data["points"], data["fit_upto"]))
        if data.get("store"):
            print("\n" + store_report(data["store"]))
        return data
    if args.store_only:
        data = {"points": [], "store": store_costs(args.store_sizes), "cpus": os.cpu_count(),
                "loadavg": os.getloadavg()}
        if args.out:
            Path(args.out).write_text(json.dumps(data, indent=1))
        print(store_report(data["store"]))
        return data
    sizes = sorted(set(args.sizes))
    if not sizes or sizes[0] < 2:
        raise ValueError(f"--sizes must be 2 or more processes each, got {args.sizes}")
    if len([s for s in sizes if s <= args.fit_upto]) < 2:
        raise ValueError(f"--fit-upto {args.fit_upto} leaves fewer than 2 sizes to fit on ({sizes})")
    work = Path(args.workdir)
    points = []
    for n in sizes:
        print(f"troupe bench scale: {n} processes", file=sys.stderr, flush=True)
        points.append(measure(n, work / f"n{n}", args.steps, args.warmup))
        print(f"troupe bench scale: {json.dumps(points[-1])}", file=sys.stderr, flush=True)
    data = {"points": points, "fit_upto": args.fit_upto, "steps": args.steps, "warmup": args.warmup,
            "store": store_costs(args.store_sizes), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    print(report(points, args.fit_upto) + "\n\n" + store_report(data["store"]))
    return data


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64], help="processes per job")
    p.add_argument("--steps", type=int, default=150, help="steps measured per job (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fit-upto", type=int, default=32, help="fit the cost model on the jobs of at most this many "
                   "processes; the larger ones check it")
    p.add_argument("--workdir", default="/tmp/troupe-scale", help="each job's reports and launcher log")
    p.add_argument("--out", default=None, help="write the points as JSON")
    p.add_argument("--render", default=None, metavar="FILE", help="print the table of a --out FILE again")
    p.add_argument("--store-sizes", type=int, nargs="+", default=[64, 1024, 4096, 10_000],
                   help="job sizes at which the launcher's store and lighthouse costs are measured (no processes)")
    p.add_argument("--store-only", action="store_true", help="measure only those (seconds, no job started)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        p = argparse.ArgumentParser(prog="troupe.bench.scale job")
        p.add_argument("out", type=Path)
        p.add_argument("--steps", type=int, default=40)
        p.add_argument("--warmup", type=int, default=5)
        a = p.parse_args(argv[1:])
        job(a.out, a.steps, a.warmup)
        return
    p = argparse.ArgumentParser(prog="troupe bench scale")
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
