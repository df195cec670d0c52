"""The torchft reference of the chaos benchmark: torchft's fault-tolerant DDP under SIGKILL/SIGSTOP.

    python -m troupe.bench.chaos_torchft run --out runs/ddp-kill30 --groups 4 \\
        --duration 300 --kill-every 30 --mode ddp
    python -m troupe.bench.chaos_torchft summarize runs/ddp-kill30
    python -m troupe.bench.chaos_torchft table runs/ddp-free runs/ddp-kill30 ...

`run` starts a torchft lighthouse in its own process and G worker processes
(`troupe.bench.chaos_torchft_worker`), each one replica group of one process
(``torchft.Manager`` over ``ProcessGroupGloo`` on CPU) training the MNIST CNN of
examples/mnist_cnn.py on its shard of the training set. Every ``--kill-every`` seconds it
SIGKILLs a random worker and starts it again at once (same group; torchft heals it from a live
peer); every ``--stop-every`` seconds it SIGSTOPs one for ``--stop-for`` seconds. After
``--duration`` it lets a restarted group rejoin, asks every group to stop at one common step,
and collects each group's test accuracy and parameter hash. The files it writes are read by
`troupe.bench.chaos_summary` (the format is described there), which troupe's own elastic runs
share.

``--mode ddp`` uses torchft's ``DistributedDataParallel`` (its comm hook all-reduces DDP's
bucket); ``--mode allreduce`` all-reduces each gradient with ``Manager.allreduce`` and waits
for all of them before ``should_commit`` (the plain path, no DDP reducer).

Needs ``pip install torchft==0.2.0``; `summarize` and `table` do not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troupe.bench.chaos_summary import markdown_table, summarize
from troupe.bench.chaos_torchft_worker import import_torchft, worker

__all__ = ["summarize", "main"]

HANG_S = 60.0
"""A live worker that made no step for this long is recorded as a hang."""
SETTLE_S = 60.0
"""After the fault phase, how long to wait for every group to commit once more."""
EXIT_S = 90.0
"""How long the workers have to reach the stop step, evaluate and exit."""


def free_port() -> int:
    """A TCP port free on this host now (the lighthouse binds it a moment later)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_lighthouse(out: Path, min_groups: int, heartbeat_timeout_ms: int,
                     join_timeout_ms: int) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse in its own process (``torchft_lighthouse``), and its address."""
    import socket

    port = free_port()
    # What the torchft_lighthouse entry point runs, but found through this interpreter rather
    # than through PATH (lighthouse_main itself reads the raw argv, `-c` included).
    code = ("import sys, time; from torchft.coordination import LighthouseServer; "
            "server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]), "
            "heartbeat_timeout_ms=int(sys.argv[3]), join_timeout_ms=int(sys.argv[4])); time.sleep(1e9)")
    argv = [sys.executable, "-c", code, f"[::]:{port}", str(min_groups), str(heartbeat_timeout_ms),
            str(join_timeout_ms)]
    proc = subprocess.Popen(argv, stdout=open(out / "logs" / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {proc.returncode}; see {out / 'logs/lighthouse.log'}")
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return proc, f"http://localhost:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the lighthouse did not listen on port {port} within 30 s")


@dataclass
class Worker:
    """One group's current process and what the supervisor knows of it (times since t0)."""

    group: int
    proc: subprocess.Popen
    started: float
    incarnation: int = 0
    last_step: float = -1.0
    last_commit: float = -1.0
    stopped_until: float | None = None
    hang_reported: bool = False


class Supervisor:
    """Starts the workers, injects the faults on schedule, watches for crashes and hangs."""

    def __init__(self, args: argparse.Namespace, lighthouse: str, t0: float) -> None:
        self.args, self.lighthouse, self.t0 = args, lighthouse, t0
        self.out = Path(args.out)
        self.rng = random.Random(args.seed)
        self.faults = (self.out / "faults.jsonl").open("a")
        self.events_offset = 0
        self.max_step = 0
        self.workers = [self._spawn(g, 0) for g in range(args.groups)]

    def now(self) -> float:
        return time.time() - self.t0

    def record(self, group: int, kind: str, **extra: Any) -> None:
        self.faults.write(json.dumps({"t": self.now(), "group": group, "kind": kind, **extra}) + "\n")
        self.faults.flush()

    def _spawn(self, group: int, incarnation: int) -> Worker:
        a = self.args
        argv = [sys.executable, "-m", "troupe.bench.chaos_torchft", "worker", "--group", str(group),
                "--groups", str(a.groups), "--out", str(self.out), "--lighthouse", self.lighthouse,
                "--t0", repr(self.t0), "--mode", a.mode, "--min-groups", str(a.min_groups),
                "--seed", str(a.seed), "--batch-size", str(a.batch_size), "--lr", str(a.lr),
                "--pg-timeout", str(a.pg_timeout), "--timeout", str(a.timeout)]
        log = open(self.out / "logs" / f"group{group}.{incarnation}.log", "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return Worker(group, proc, self.now(), incarnation)

    def restart(self, w: Worker) -> None:
        self.workers[w.group] = self._spawn(w.group, w.incarnation + 1)
        self.record(w.group, "restart")

    def read_events(self) -> None:
        with open(self.out / "events.jsonl", "rb") as f:
            f.seek(self.events_offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.events_offset += len(complete)
        for line in complete.splitlines():
            e = json.loads(line)
            w = self.workers[e["group"]]
            w.last_step = max(w.last_step, e["t"])
            if e["committed"]:
                w.last_commit = max(w.last_commit, e["t"])
                self.max_step = max(self.max_step, e["step"])

    def watch(self, restart_crashed: bool) -> None:
        """Record (and restart) a worker that exited on its own; record one hang per process."""
        self.read_events()
        for w in self.workers:
            if w.proc.poll() is not None and w.proc.returncode != 0 and restart_crashed:
                self.record(w.group, "crash", exit_code=w.proc.returncode)
                self.restart(w)
            elif w.stopped_until is None and not w.hang_reported and w.proc.poll() is None \
                    and self.now() - max(w.last_step, w.started) > HANG_S:
                w.hang_reported = True
                self.record(w.group, "hang")

    def kill_one(self) -> None:
        w = self.rng.choice([w for w in self.workers if w.stopped_until is None])
        self.record(w.group, "kill")
        w.proc.kill()
        w.proc.wait()
        self.restart(w)

    def stop_one(self) -> None:
        candidates = [w for w in self.workers if w.stopped_until is None]
        if candidates:
            w = self.rng.choice(candidates)
            self.record(w.group, "stop")
            w.proc.send_signal(signal.SIGSTOP)
            w.stopped_until = self.now() + self.args.stop_for

    def cont(self, w: Worker) -> None:
        w.proc.send_signal(signal.SIGCONT)
        w.stopped_until = None
        w.started = self.now()  # its hang clock starts again
        self.record(w.group, "cont")

    def fault_phase(self) -> None:
        a = self.args
        next_kill = a.kill_every if a.kill_every > 0 else float("inf")
        next_stop = a.stop_every if a.stop_every > 0 else float("inf")
        while self.now() < a.duration:
            time.sleep(0.1)
            self.watch(restart_crashed=True)
            for w in self.workers:
                if w.stopped_until is not None and self.now() >= w.stopped_until:
                    self.cont(w)
            if next_kill <= self.now() < a.duration:
                self.kill_one()
                next_kill += a.kill_every
            if next_stop <= self.now() < a.duration:
                self.stop_one()
                next_stop += a.stop_every
        for w in self.workers:
            if w.stopped_until is not None:
                self.cont(w)

    def finish(self) -> None:
        """Let every group commit once more, stop all at one step, and write final.jsonl."""
        deadline = self.now() + SETTLE_S
        while self.now() < deadline and any(w.last_commit <= w.started for w in self.workers):
            time.sleep(0.1)
            self.watch(restart_crashed=True)
        target = self.max_step + 10
        tmp = self.out / "stop.tmp"
        tmp.write_text(str(target))
        tmp.rename(self.out / "stop")  # the workers never read half a number
        deadline = self.now() + EXIT_S
        while self.now() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(0.1)
            self.watch(restart_crashed=False)
        with (self.out / "final.jsonl").open("w") as f:
            for w in self.workers:
                if w.proc.poll() is None:
                    self.record(w.group, "hang", at_exit=True)
                    w.proc.kill()
                    w.proc.wait()
                elif w.proc.returncode != 0:
                    self.record(w.group, "crash", exit_code=w.proc.returncode, at_exit=True)
                path = self.out / f"final.{w.group}.json"
                result = json.loads(path.read_text()) if path.exists() else {
                    "group": w.group, "eval_acc": None, "params_sha256": None}
                f.write(json.dumps({**result, "exit_code": w.proc.returncode}) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One chaos run into args.out; returns its summary."""
    import_torchft()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty: give a new folder for each run")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "events.jsonl").touch()
    (out / "args.json").write_text(json.dumps(vars(args), default=str, indent=1))
    host = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    lighthouse, address = start_lighthouse(out, args.min_groups, args.heartbeat_timeout_ms, args.join_timeout_ms)
    try:
        sup = Supervisor(args, address, time.time())
        try:
            sup.fault_phase()
            sup.finish()
        finally:
            for w in sup.workers:
                if w.proc.poll() is None:
                    w.proc.kill()
    finally:
        lighthouse.kill()
    # Other jobs on the host move every figure here: keep the load beside the results.
    host["loadavg_after"] = os.getloadavg()
    (out / "host.json").write_text(json.dumps(host))
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# --- the command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.chaos_torchft", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True, help="folder for events/faults/final.jsonl and logs")
        s.add_argument("--groups", type=int, default=4, help="replica groups (one process each)")
        s.add_argument("--min-groups", type=int, default=2, help="the lighthouse's min_replicas")
        s.add_argument("--mode", choices=("ddp", "allreduce"), default="ddp")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--batch-size", type=int, default=64, help="per group")
        s.add_argument("--lr", type=float, default=0.05)
        s.add_argument("--pg-timeout", type=float, default=5.0,
                       help="ProcessGroupGloo timeout, s (torchft's train_ddp.py uses 5)")
        s.add_argument("--timeout", type=float, default=30.0,
                       help="Manager timeout, s (torchft's train_ddp.py uses 30)")
    r = sub.choices["run"]
    r.add_argument("--duration", type=float, default=120.0, help="seconds of the fault phase")
    r.add_argument("--kill-every", type=float, default=0.0, help="SIGKILL a random worker every T s (0: never)")
    r.add_argument("--stop-every", type=float, default=0.0, help="SIGSTOP a random worker every S s (0: never)")
    r.add_argument("--stop-for", type=float, default=10.0, help="seconds before its SIGCONT")
    r.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (torchft's default)")
    r.add_argument("--join-timeout-ms", type=int, default=60000, help="the lighthouse's (torchft's default)")
    w = sub.choices["worker"]
    w.add_argument("--group", type=int, required=True)
    w.add_argument("--lighthouse", required=True)
    w.add_argument("--t0", type=float, required=True, help="the job's start, time.time()")
    s = sub.add_parser("summarize", help="print a run's figures as JSON")
    s.add_argument("dir")
    t = sub.add_parser("table", help="a markdown table of runs; the first is the fault-free reference")
    t.add_argument("dirs", nargs="+")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "worker":
        worker(args)
    elif args.command == "run":
        summary = run(args)
        print(json.dumps({k: v for k, v in summary.items() if k != "per_kill"}, indent=1))
    elif args.command == "summarize":
        print(json.dumps(summarize(args.dir), indent=1))
    else:
        runs = {d: summarize(d) for d in args.dirs}
        print(markdown_table(runs, reference=args.dirs[0]))


if __name__ == "__main__":
    main()
