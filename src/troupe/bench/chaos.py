"""`troupe bench chaos`: an elastic job under a kill schedule, for troupe's own elastic mode.

The job is the chaos benchmark's (the MNIST CNN, 4 worker groups of one process, batch 64 per
group, group g reads shard g; the same as `chaos_torchft`'s, so the figures compare; `--group-size k`:
groups of k processes, each reading its own shard, the model partitioned inside them with `--partition`): run under
`troupe run --elastic`, which restarts a killed worker and heals it from a live one. This
driver only injects the faults (SIGKILL a random worker every `--kill-every` seconds; SIGSTOP
one every `--stop-every` for `--stop-for`), watches the launcher's log for workers that died
without being killed (crashes), and at the end stops every group at one step. The files it
leaves are `chaos_summary`'s: events.jsonl, faults.jsonl, final.jsonl (plus logs/, host.json: the launcher's
peak resident set among it; heals.jsonl: the bytes each restarted process received in its heal).

    troupe bench chaos --out runs/kill30 --kill-every 30 --duration 300
    troupe bench chaos --out runs/diloco30 --kill-every 30 --duration 300 --diloco 50
    troupe bench chaos --out runs/stream30 --kill-every 30 --duration 300 --diloco 50 --delay 5
    troupe bench chaos --out runs/downpour30 --kill-every 30 --duration 300 --downpour 2
    troupe bench chaos --out runs/failover --kill-every 30 --duration 300 --downpour 2 --kill-server-at 100
    troupe bench chaos --out runs/hogwild30 --kill-every 30 --duration 300 --hogwild 10
    troupe bench chaos --out runs/hybrid30 --kill-every 30 --duration 300 --groups 3 --group-size 2 --partition hybrid
    troupe bench chaos --out runs/zero30 --kill-every 30 --duration 300 --groups 2 --group-size 2 --shard optimizer
    troupe bench chaos --out runs/fsdp30 --kill-every 30 --duration 300 --groups 2 --group-size 2 --shard parameters
    python -m troupe.bench.chaos job OUT     # one worker (what troupe run starts)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from troupe.bench.chaos_summary import summarize
from troupe.bench.chaos_torchft_worker import Shard, build_cnn, params_sha256, stop_step

SETTLE_S = 60.0
"""After the fault phase: how long to wait for every group to commit once more."""
EXIT_S = 120.0
"""After the stop step is written: how long the job may take to end."""


PLANS = {"hybrid": {"conv*": 0, "linear*": 1}, "model": {"*": 1}}
"""`--partition`: the CNN's partition plans inside a worker group (examples/mnist_cnn.py's)."""


def _record_heal(out: Path, t: float, rank: int, model: Any, sgd: Any) -> None:
    """What this restarted process received from its peer, beside what it holds (its shard of a DTensor)."""
    import torch

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    held = sum(size(v) for g in sgd.param_groups for p in g["params"]
               for v in sgd.state[p].values() if torch.is_tensor(v) and v.dim())
    with open(out / "heals.jsonl", "a") as heals:
        heals.write(json.dumps({"t": t, "rank": rank, "received": sgd.world.membership.heal_bytes,
                                "params_bytes": sum(size(p) for p in model.parameters()),
                                "optimizer_bytes": held}) + "\n")


def job(out: Path, batch_size: int, lr: float, seed: int, dist_option: str = "plain", spars: float | None = None,
        partition: str | None = None, shard_model: bool = False, pad_mb: float = 0.0) -> None:
    """One process: train until the stop step, then evaluate and hash the parameters. Each process of a
    worker group reads its own shard; the group's process 0 writes the group's events and result."""
    import torch
    import torch.nn.functional as F

    import troupe

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    t0 = float(os.environ["TROUPE_CHAOS_T0"])
    model = build_cnn()
    if pad_mb:  # a larger model to heal: one more parameter, in the loss with weight 0 (its gradient is zero)
        model.pad = torch.nn.Parameter(torch.zeros(int(pad_mb * 2**20 / 4)))
    if partition:
        model = troupe.partition(model, PLANS[partition])  # inside the elastic worker group
    if shard_model:
        model = troupe.shard(model)  # FSDP2 inside each worker group
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), dist_option=dist_option,
                         spars=spars)
    membership = sgd.world.membership  # Downpour's rejoining workers (not elastic): groups of one
    rank, k = sgd.global_rank, membership.options.group_size if membership.elastic else 1
    group, place = divmod(rank, k)
    x, y, test_x, test_y = troupe.data.load_mnist()
    shard = Shard(x, y, rank, sgd.world_size, batch_size, seed)
    troupe.track(model=model, optimizer=sgd)  # a restarted group copies a live one's state here
    (out / "pids" / str(rank)).write_text(str(os.getpid()))
    if int(os.environ.get("TROUPE_INCARNATION", "0")):
        _record_heal(out, time.time() - t0, rank, model, sgd)
    with open(out / "events.jsonl", "a") as events:
        while True:
            stop = stop_step(out)
            if stop is not None and sgd.step_count >= stop:
                break
            bx, by = shard.batch(sgd.step_count)
            loss = F.cross_entropy(model(bx), by)
            if pad_mb:
                loss = loss + 0.0 * model.pad.sum()
            loss.backward()
            before = sgd.step_count
            sgd.step()
            sgd.zero_grad()
            if place == 0:
                events.write(json.dumps({"t": time.time() - t0, "group": group, "step": sgd.step_count,
                                         "committed": sgd.step_count > before, "samples": batch_size * k}) + "\n")
                events.flush()
    with torch.no_grad():
        acc = float((model(test_x).argmax(1) == test_y).float().mean())
        whole = model
        if partition:  # the group's slices put together (every process of the group takes part)
            whole = build_cnn()
            whole.load_state_dict(troupe.partition.full_state_dict(model))
        if shard_model:  # the group's shards put together (every process of the group takes part)
            whole = build_cnn()
            whole.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items() if k != "pad"})
    if place == 0:
        (out / f"final.{group}.json").write_text(json.dumps({"group": group, "eval_acc": acc,
                                                             "params_sha256": params_sha256(whole)}))


class Driver:
    """Starts `troupe run --elastic`, injects the faults, records them, stops the groups at one step."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out)
        self.rng = random.Random(args.seed)
        self.t0 = time.time()
        self.faults = (self.out / "faults.jsonl").open("a")
        self.k = args.group_size
        self.stopped: dict[int, float] = {}
        """Rank -> when it gets SIGCONT."""
        self.killed_pids: set[int] = set()
        self.server_killed = False
        self.log_seen = 0
        cmd = [sys.executable, "-m", "troupe.cli", "run", "-n", str(args.groups * self.k), "--elastic", "--min-groups",
               str(args.min_groups), "--restarts-per-rank", "1000", "--spares", str(args.spares), "--log-dir", str(self.out / "logs"),
               "--ranks", "0", __file__, "job", str(self.out), "--batch-size", str(args.batch_size),
               "--lr", str(args.lr), "--seed", str(args.seed), "--dist-option", args.dist_option,
               *(["--spars", str(args.spars)] if args.spars is not None else []),
               *(["--partition", args.partition] if args.partition else []),
               *(["--pad-mb", str(args.pad_mb)] if args.pad_mb else [])]
        if args.shard == "parameters":  # troupe.shard in the script: FSDP2 inside each group
            cmd.append("--shard-model")
        elif args.shard:  # each group cuts the optimizer state (and gradients) over its processes
            at = cmd.index("--ranks")
            cmd[at:at] = ["--shard", args.shard]
        if self.k > 1:  # worker groups of several processes
            at = cmd.index("--min-groups")
            cmd[at:at] = ["--nworker-groups", str(args.groups)]
        if args.diloco:  # troupe run's flags, before the script
            at = cmd.index("--ranks")
            cmd[at:at] = ["--framework", "diloco", "--sync-freq", str(args.diloco), "--delay", str(args.delay)]
        if args.downpour:  # the workers are the groups; the servers (killed only at --kill-server-at) come on top
            at = cmd.index("-n")
            cmd[at:at + 2] = []
            at = cmd.index("--min-groups")
            cmd[at:at + 2] = ["--framework", "downpour", "--nworker-groups", str(args.groups), "--nworkers-per-group",
                              "1", "--nserver-groups", str(args.downpour), "--nservers-per-group", "1"]
        if args.hogwild:  # the groups sync asynchronously through master copies every H steps, no quorum
            at = cmd.index("--min-groups")
            cmd[at:at + 2] = ["--framework", "hogwild", "--sync-freq", str(args.hogwild)]
        env = {**os.environ, "TROUPE_CHAOS_T0": repr(self.t0), "OMP_NUM_THREADS": "1"}
        self.launcher_log = (self.out / "launcher.log").open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.launcher_log, stderr=subprocess.STDOUT)

    def now(self) -> float:
        return time.time() - self.t0

    def record(self, group: int, kind: str, **extra: Any) -> None:
        self.faults.write(json.dumps({"t": self.now(), "group": group, "kind": kind, **extra}) + "\n")
        self.faults.flush()

    def pids(self) -> dict[int, int]:
        """The live process of each rank that has started training."""
        live = {}
        for path in (self.out / "pids").iterdir():
            pid = int(path.read_text() or 0)
            try:
                os.kill(pid, 0)
            except (ProcessLookupError, ValueError):
                continue
            if pid not in self.killed_pids:
                live[int(path.name)] = pid
        return live

    def watch(self) -> None:
        """Record a worker that exited on its own (the launcher's log says so) as a crash."""
        lines = (self.out / "launcher.log").read_text().splitlines()
        for line in lines[self.log_seen:]:
            m = re.search(r"troupe run: rank (\d+) exited with code (\d+)", line)
            if m:
                rank = int(m.group(1))
                self.record(rank // self.k, "crash", rank=rank, exit_code=int(m.group(2)))
        self.log_seen = len(lines)

    def fault_phase(self) -> None:
        a = self.args
        next_kill = a.kill_every if a.kill_every > 0 else float("inf")
        next_stop = a.stop_every if a.stop_every > 0 else float("inf")
        while self.now() < a.duration:
            time.sleep(0.1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended during the fault phase (code {self.proc.returncode}); "
                                   f"see {self.out / 'launcher.log'}")
            self.watch()
            for rank, until in list(self.stopped.items()):
                if self.now() >= until:
                    self._cont(rank)
            live = {r: p for r, p in self.pids().items() if r not in self.stopped}
            if next_kill <= self.now() and live:
                rank = self.rng.choice(sorted(live))
                os.kill(live[rank], signal.SIGKILL)
                self.killed_pids.add(live[rank])
                self.record(rank // self.k, "kill", rank=rank)
                next_kill += a.kill_every
            if a.kill_server_at is not None and a.kill_server_at <= self.now() and not self.server_killed:
                self._kill_server()
            if next_stop <= self.now() and live:
                rank = self.rng.choice(sorted(live))
                os.kill(live[rank], signal.SIGSTOP)
                self.stopped[rank] = self.now() + a.stop_for
                self.record(rank // self.k, "stop", rank=rank, pid=live[rank])
                next_stop += a.stop_every
        for rank in list(self.stopped):
            self._cont(rank)

    def _kill_server(self) -> None:
        """SIGKILL the server of the last server group (its workers fail over to the other groups' servers)."""
        rank = self.args.groups * self.k + self.args.downpour - 1  # the workers come first, then the servers
        starts = [line.split() for line in (self.out / "logs" / "pids.txt").read_text().splitlines()]
        pid = int([p for r, p in starts if int(r) == rank][-1])
        os.kill(pid, signal.SIGKILL)
        self.server_killed = True
        self.record(-1, "kill-server", rank=rank, pid=pid)

    def _cont(self, rank: int) -> None:
        pid = json.loads(self._last_fault(rank, "stop"))["pid"]
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        del self.stopped[rank]
        self.record(rank // self.k, "cont", rank=rank)

    def _last_fault(self, rank: int, kind: str) -> str:
        lines = (self.out / "faults.jsonl").read_text().splitlines()
        return next(line for line in reversed(lines) if json.loads(line).get("rank") == rank
                    and json.loads(line)["kind"] == kind)

    def finish(self) -> None:
        """Wait until every group commits again, stop all of them at one step, collect final.jsonl."""
        deadline = self.now() + SETTLE_S
        last_fault = max((json.loads(x)["t"] for x in (self.out / "faults.jsonl").read_text().splitlines()),
                         default=0.0)
        while self.now() < deadline:
            time.sleep(0.2)
            self.watch()
            events = [json.loads(x) for x in (self.out / "events.jsonl").read_text().splitlines() if x.strip()]
            back = {e["group"] for e in events if e["committed"] and e["t"] > last_fault + 1.0}
            if len(back) == self.args.groups:
                break
        steps = [json.loads(x)["step"] for x in (self.out / "events.jsonl").read_text().splitlines() if x.strip()]
        stop = max(steps, default=0) + 10
        self.launcher_peak_kib = _peak_kib(self.proc.pid)
        if self.args.diloco:  # after an outer step's merge: only there do the groups hold the same parameters
            h, tau = self.args.diloco, self.args.delay
            stop = -(-(stop - tau) // h) * h + tau
        (self.out / "stop.tmp").write_text(str(stop))
        (self.out / "stop.tmp").rename(self.out / "stop")
        try:
            code = self.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            self.record(-1, "hang", at_exit=True)
            self.proc.terminate()
            code = self.proc.wait()
        self.watch()
        with (self.out / "final.jsonl").open("w") as f:
            for g in range(self.args.groups):
                path = self.out / f"final.{g}.json"
                result = json.loads(path.read_text()) if path.exists() else {
                    "group": g, "eval_acc": None, "params_sha256": None}
                f.write(json.dumps({**result, "exit_code": code}) + "\n")


def _peak_kib(pid: int) -> int | None:
    """The peak resident set (VmHWM) of process `pid`, in KiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One chaos run of troupe's elastic mode into args.out; returns its summary."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty: give a new folder for each run")
    if args.kill_server_at is not None and (args.downpour or 0) < 2:
        raise ValueError("--kill-server-at needs --downpour S with S >= 2 (a server group to fail over to)")
    if args.group_size < 1:
        raise ValueError(f"--group-size must be >= 1, got {args.group_size}")
    if args.group_size > 1 and (args.downpour or args.hogwild):
        raise ValueError("--group-size runs data parallelism or DiLoCo over worker groups of several processes, "
                         "not --downpour or --hogwild")
    if args.partition and args.group_size < 2:
        raise ValueError("--partition splits the model inside a worker group: give --group-size 2 or more")
    if args.delay and not args.diloco or not 0 <= args.delay < (args.diloco or 1):
        raise ValueError(f"--delay is Streaming DiLoCo's, from 0 to below --diloco H: got {args.delay} with H "
                         f"{args.diloco}")
    if args.shard and (args.group_size < 2 or args.diloco or args.partition):
        raise ValueError("--shard cuts the optimizer state inside worker groups of 2 or more processes (--group-size), "
                         "without --diloco or --partition")
    if args.pad_mb and (args.partition or args.downpour or args.hogwild or args.pad_mb < 0):
        raise ValueError("--pad-mb is a size in MiB for the synchronous jobs (not --partition, --downpour, --hogwild)")
    if args.partition and args.diloco:
        raise ValueError("--partition runs without --diloco (troupe.partition inside elastic groups runs without a "
                         "framework)")
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "events.jsonl").touch()
    (out / "faults.jsonl").touch()
    (out / "args.json").write_text(json.dumps(vars(args), default=str, indent=1))
    host = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    driver = Driver(args)
    try:
        driver.fault_phase()
        driver.finish()
    finally:
        if driver.proc.poll() is None:
            driver.proc.terminate()
            driver.proc.wait()
    host["loadavg_after"] = os.getloadavg()
    host["launcher_peak_rss_kib"] = getattr(driver, "launcher_peak_kib", None)
    (out / "host.json").write_text(json.dumps(host))
    summary = summarize(out)
    heals = [json.loads(x) for x in (out / "heals.jsonl").read_text().splitlines()] \
        if (out / "heals.jsonl").exists() else []
    if heals:  # what each restarted process received in its heal, beside what it holds
        summary["heal_received_bytes_max"] = max(h["received"] for h in heals)
        summary["heal_held_bytes"] = max(h["params_bytes"] + h["optimizer_bytes"] for h in heals)
        summary["heals_recorded"] = len(heals)
    summary["launcher_peak_rss_kib"] = host["launcher_peak_rss_kib"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="a new folder for this run's files")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=1, help="processes per worker group (troupe run "
                   "--nworker-groups); a kill takes a random process, its group restarts")
    p.add_argument("--partition", choices=sorted(PLANS), default=None,
                   help="partition the CNN inside each worker group (troupe.partition; needs --group-size >= 2)")
    p.add_argument("--shard", choices=("optimizer", "gradients", "parameters"), default=None,
                   help="troupe run --shard: each worker group cuts the optimizer state (and gradients) over its "
                        "processes; parameters: the script shards the model with troupe.shard (FSDP2); needs "
                        "--group-size >= 2")
    p.add_argument("--pad-mb", type=float, default=0.0,
                   help="one more parameter of this many MiB in the model (weight 0 in the loss): a larger state "
                        "to heal, for the launcher's memory against the model's size")
    p.add_argument("--min-groups", type=int, default=2)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of the fault phase")
    p.add_argument("--kill-every", type=float, default=30.0, help="SIGKILL a random worker every T s (0: never)")
    p.add_argument("--stop-every", type=float, default=0.0, help="SIGSTOP a random worker every S s (0: never)")
    p.add_argument("--stop-for", type=float, default=10.0, help="seconds a stopped worker stays stopped")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spares", type=int, default=1, help="troupe run --spares: warm processes for restarts")
    p.add_argument("--dist-option", default="plain",
                   help="the workers' dist_option: plain, fp16, bf16, sparseTopK, sparseThreshold or powerSGD")
    p.add_argument("--spars", type=float, default=None, help="sparseTopK/sparseThreshold: spars (the DistOpt default when not given)")
    p.add_argument("--diloco", type=int, default=None, metavar="H",
                   help="DiLoCo over the elastic groups (troupe run --framework diloco --sync-freq H)")
    p.add_argument("--delay", type=int, default=0, metavar="TAU",
                   help="with --diloco: Streaming DiLoCo's delay (troupe run --delay TAU: each exchange overlaps "
                        "TAU inner steps; one fragment, so that the groups end bit-identical)")
    p.add_argument("--downpour", type=int, default=None, metavar="S",
                   help="Downpour: the groups are asynchronous workers of S server groups of one server each "
                        "(troupe run --framework downpour; only workers are killed)")
    p.add_argument("--kill-server-at", type=float, default=None, metavar="T",
                   help="with --downpour S >= 2: SIGKILL the last server group's server T s in (once); its "
                        "workers fail over to another server group's")
    p.add_argument("--hogwild", type=int, default=None, metavar="H",
                   help="Distributed Hogwild: the groups sync through master copies every H steps "
                        "(troupe run --framework hogwild --sync-freq H)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        p = argparse.ArgumentParser(prog="troupe.bench.chaos job")
        p.add_argument("out", type=Path)
        p.add_argument("--batch-size", type=int, default=64)
        p.add_argument("--lr", type=float, default=0.05)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dist-option", default="plain")
        p.add_argument("--spars", type=float, default=None)
        p.add_argument("--partition", choices=sorted(PLANS), default=None)
        p.add_argument("--shard-model", action="store_true")
        p.add_argument("--pad-mb", type=float, default=0.0)
        a = p.parse_args(argv[1:])
        job(a.out, a.batch_size, a.lr, a.seed, a.dist_option, a.spars, a.partition, a.shard_model, a.pad_mb)
        return
    p = argparse.ArgumentParser(prog="troupe bench chaos")
    add_arguments(p)
    print(json.dumps(run(p.parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
