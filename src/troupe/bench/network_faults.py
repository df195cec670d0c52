"""`troupe bench faults`: network faults injected into real jobs on simulated hosts, one matrix.

    troupe bench faults                                   # every fault x every regime
    troupe bench faults --regimes plain-2 --faults loss-10 down-5s
    troupe bench faults --doc docs/network_faults.md         # also rewrite the doc's table

Each regime's job (`troupe.bench.faultjob` under `troupe run`, one node per simulated host)
runs once without a fault, then once per fault: at a random step after warm-up the fault is
injected on the link of one host (`troupe.bench.netns`), healed after its duration (or never),
and every host's process is waited for within a stated bound. Each cell's outcome is

* **healed**: every rank finished; a synchronous regime's parameters are bit-identical to the
  fault-free run's (the digest), an asynchronous one's accuracy is compared;
* **continued**: the asynchronous cluster finished without the cut-off host;
* **named and ended**: the job stopped, and every surviving rank's output names the
  unreachable rank(s) or host (the line is quoted);
* **restarted**: `troupe run --max-restarts` restarted from the last checkpoint and finished;
* **HANG**: a process was still running at the bound (a defect: the harness kills it);

with the time from the fault to detection (the last process's exit, or the report) and to
recovery (the first step after the heal, or after the resume). Namespaces are removed
afterwards, also after Ctrl-C or an error.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from troupe.bench import faultjob, netns

TIMEOUT = 40.0
"""TROUPE_TIMEOUT the matrix runs with (a collective's wait)."""
PEER_TIMEOUT = 15.0
"""TROUPE_PEER_TIMEOUT the matrix runs with (a silent peer or an unreachable rendezvous)."""
RATE = "1gbit"
"""Every host's link; the network straggler gets a hundredth of it."""
PORT = 29400


@dataclass(frozen=True)
class Regime:
    name: str
    hosts: int
    run_flags: tuple[str, ...] = ()
    job_flags: tuple[str, ...] = ()
    synchronous: bool = True


REGIMES = {r.name: r for r in (
    Regime("plain-2", 2),
    Regime("plain-4", 4),
    Regime("topk-4", 4, job_flags=("--dist-option", "sparseTopK")),
    Regime("downpour-4", 4, run_flags=("--framework", "downpour"), synchronous=False),
    Regime("hogwild-4", 4, run_flags=("--framework", "hogwild"), synchronous=False),
)}


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    inject: Callable[[netns.Hosts, int], None]
    """(hosts, victim host)."""
    lasts: float | None
    """Seconds until healed; None: for the rest of the run."""
    victim: Callable[[int], int] = lambda n: 1
    """The host whose link fails, given the number of hosts (host 1 is a worker in every regime)."""
    restart: bool = False
    """Run under `troupe run --max-restarts 1`; the link comes back once the job has stopped."""
    needs: Callable[[], str | None] = lambda: None
    only: Callable[[Regime], bool] = lambda regime: True
    """The regimes the fault means something in."""


def _halves(hosts: netns.Hosts, victim: int) -> None:
    hosts.partition(list(range(hosts.n // 2)), list(range(hosts.n // 2, hosts.n)))


INTRUDER = """
import os, socket, sys
import troupe
addr, port, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
try:
    troupe.init(ticket=troupe.Ticket(addr=addr, port=port, token="0" * 32), local_rank=1, world_size=2)
    print("INTRUDER joined the job", flush=True)
except PermissionError as e:
    print(f"INTRUDER refused: {e}", flush=True)
hit = 0
for target in targets:
    host, _, p = target.rpartition(":")
    try:
        with socket.create_connection((host, int(p)), timeout=2) as s:
            s.sendall(os.urandom(4096))
            hit += 1
    except OSError:
        pass
print(f"INTRUDER sent 4 KiB of random bytes to {hit} of {len(targets)} listening sockets", flush=True)
"""


def _listening(hosts: netns.Hosts, i: int) -> list[str]:
    """host i's listening TCP sockets as ADDR:PORT (the rendezvous and Gloo's)."""
    out = subprocess.run(["ip", "netns", "exec", hosts.names[i], "ss", "-ltnH"], capture_output=True,
                         text=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        if addr in ("0.0.0.0", "*", "[::]", "::") or addr == hosts.addr(i):
            found.append(f"{hosts.addr(i)}:{port}")
    return found


def _intrude(hosts: netns.Hosts, intruder: int) -> None:
    """From a host on the same switch that is not in the job: join with a wrong token, then send
    random bytes to every listening socket of the job's hosts."""
    targets = [t for i in range(hosts.n) if i != intruder for t in _listening(hosts, i)]
    done = hosts.popen(intruder, [sys.executable, "-c", INTRUDER, hosts.addr(0), str(PORT), *targets],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = done.communicate(timeout=120)
    print("\n".join(line for line in out.splitlines() if line.startswith("INTRUDER")), file=sys.stderr, flush=True)


FAULTS = {f.name: f for f in (
    Fault("loss-1", "1% packet loss, 20 s", lambda h, v: h.lose(v, 1), 20.0, needs=netns.loss_available),
    Fault("loss-10", "10% packet loss, 20 s", lambda h, v: h.lose(v, 10), 20.0, needs=netns.loss_available),
    Fault("loss-30", "30% packet loss, 20 s", lambda h, v: h.lose(v, 30), 20.0, needs=netns.loss_available),
    Fault("delay-200", "+200 ms delay with jitter, 10 s", lambda h, v: h.add_delay(v, 200, 50), 10.0,
          needs=netns.delay_available),
    Fault("down-5s", "link down 5 s", lambda h, v: h.link(v, up=False), 5.0),
    Fault("down", "link down for good", lambda h, v: h.link(v, up=False), None),
    Fault("partition-10s", "partition halves 10 s", _halves, 10.0),
    Fault("partition", "partition halves for good", _halves, None),
    Fault("store-down-10s", "rendezvous host's link down 10 s", lambda h, v: h.link(v, up=False), 10.0,
          victim=lambda n: 0),
    Fault("down-server", "a server host's link down for good", lambda h, v: h.link(v, up=False), None,
          victim=lambda n: n - 1, only=lambda r: "downpour" in r.run_flags or "sandblaster" in r.run_flags),
    Fault("intruder", "a host without the token joins, then sends random bytes to every socket", _intrude, None,
          victim=lambda n: n),
    Fault("slow-100x", "one host's link 100x slower", lambda h, v: h.slow(v, "10mbit"), None),
    Fault("down-restart", "link down until the job stops, then back; --max-restarts 1",
          lambda h, v: h.link(v, up=False), None, restart=True),
)}


@dataclass
class Cell:
    regime: str
    fault: str
    outcome: str
    detect: float | None = None
    recover: float | None = None
    acc: float | None = None
    baseline_acc: float | None = None
    fault_step: int | None = None
    report: str = ""
    seconds: float = 0.0
    codes: list[int | None] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    """The finished workers' parameter digests."""

    def row(self) -> str:
        t = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
        acc = "-" if self.acc is None else f"{self.acc:.3f}" + (
            "" if self.baseline_acc is None else f" ({self.baseline_acc:.3f})")
        report = self.report.replace("|", "/")[:150]
        return (f"| {self.regime} | {FAULTS[self.fault].what if self.fault in FAULTS else self.fault} | "
                f"{self.outcome} | {'-' if self.fault_step is None else self.fault_step} | {t(self.detect)} | "
                f"{t(self.recover)} | {acc} | {('`' + report + '`') if report else ''} |")


HEADER = ("| regime | fault | outcome | at step | detected after | recovered after | accuracy (fault-free) | "
          "what the surviving ranks report |\n| --- | --- | --- | --- | --- | --- | --- | --- |")

NOTE = re.compile(r"troupe: rank 0 refused .*")
REPORT = re.compile(r"(troupe: rank \d+ stopping.*|PeerFailure: .*|troupe server rank \d+: worker \d+ (?:is gone|died).*|"
                    r"troupe: rank \d+: rank \d+ sent no heartbeat.*|troupe group sync rank \d+: rank \d+ is gone.*|"
                    r"troupe run: rank \d+ exited.*|ConnectionError: .*|TimeoutError: .*)")


class Job:
    """One regime's job: a `troupe run` per host, each one's output read line by line."""

    def __init__(self, hosts: netns.Hosts, regime: Regime, steps: int, pace: float, workdir: Path,
                 restart: bool = False, timeouts: tuple[float, float] = (TIMEOUT, PEER_TIMEOUT)):
        self.hosts = hosts
        self.stacks = ""
        self.lines: list[list[tuple[float, str]]] = [[] for _ in range(regime.hosts)]
        self.ended: list[float | None] = [None] * regime.hosts
        token = secrets.token_hex(8)
        timeout, peer_timeout = timeouts
        env = {**os.environ, "TROUPE_TIMEOUT": str(timeout), "TROUPE_PEER_TIMEOUT": str(peer_timeout),
               "TROUPE_STALL_SECONDS": str(timeout), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        ckpt = workdir / "ckpt"
        self.procs = []
        for i in range(regime.hosts):
            cmd = [sys.executable, "-m", "troupe", "run", "--nnodes", str(regime.hosts), "--node-rank", str(i),
                   "--master", f"{hosts.addr(0)}:{PORT}", "--token", token, "-n", "1", *regime.run_flags]
            if restart:
                cmd += ["--max-restarts", "1", "--checkpoint-dir", str(ckpt)]
            cmd += [faultjob.__file__, "--steps", str(steps), "--pace", str(pace), *regime.job_flags]
            proc = hosts.popen(i, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(i, proc), daemon=True).start()

    def _read(self, i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines[i].append((time.time(), line.rstrip("\n")))
        proc.wait()
        self.ended[i] = time.time()

    def steps(self) -> list[tuple[int, float]]:
        return [(int(m.group(1)), float(m.group(2))) for host in self.lines for _, line in host
                if (m := re.match(r"STEP (\d+) ([0-9.]+)", line))]

    def max_step(self) -> int:
        return max((s for s, _ in self.steps()), default=-1)

    def wait(self, bound: float) -> bool:
        """True when every process ended within `bound` seconds; else they are killed."""
        deadline = time.time() + bound
        while time.time() < deadline and any(e is None for e in self.ended):
            time.sleep(0.1)
        hung = any(e is None for e in self.ended)
        if hung:
            self.stacks = self.hosts.stacks()  # where each process hangs (py-spy, when installed)
        self.hosts.kill_all()  # the supervisors' ranks run in their own sessions: kill by namespace
        for proc in self.procs:
            proc.wait()
        time.sleep(0.2)  # the readers' last lines
        return not hung

    def done(self) -> list[tuple[int, float, str]]:
        """(rank, accuracy, digest) of each worker that finished."""
        return [(int(m.group(1)), float(m.group(2)), m.group(3)) for host in self.lines for _, line in host
                if (m := re.match(r"DONE rank (\d+) steps \d+ acc ([0-9.]+) digest (\w+)", line))]

    def reports(self) -> list[tuple[int, float, str]]:
        return [(i, t, m.group(1)) for i, host in enumerate(self.lines) for t, line in host
                if (m := REPORT.search(line))]


def run_cell(hosts: netns.Hosts, regime: Regime, fault: Fault | None, steps: int, pace: float, workdir: Path,
             baseline: Cell | None, rng: random.Random, log: Callable[[str], None],
             timeouts: tuple[float, float] = (TIMEOUT, PEER_TIMEOUT)) -> Cell:
    """One job with (or without) one fault, and what became of it (`timeouts`: TROUPE_TIMEOUT and
    TROUPE_PEER_TIMEOUT for the job's ranks)."""
    name = "none" if fault is None else fault.name
    if fault is not None and (why := fault.needs()):
        return Cell(regime.name, name, f"not injected: {why}")
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    job = Job(hosts, regime, steps, pace, workdir, restart=fault is not None and fault.restart, timeouts=timeouts)
    fault_step = rng.randrange(steps // 5, steps // 3) if fault is not None else None
    injected = healed = None
    victim = None
    expected = (baseline.seconds if baseline else steps * pace + 30)
    bound = expected + sum(timeouts) + 60 + (fault.lasts or 0 if fault else 0)
    if fault is not None:
        while job.max_step() < fault_step and all(e is None for e in job.ended) and time.time() - started < bound:
            time.sleep(0.05)
        victim = fault.victim(regime.hosts)
        fault.inject(hosts, victim)
        injected = time.time()
        log(f"  {regime.name}: {fault.name} on host {victim} at step {job.max_step()}")
        if fault.lasts is not None:
            while time.time() - injected < fault.lasts and any(e is None for e in job.ended):
                time.sleep(0.05)
            hosts.heal()
            healed = time.time()
        elif fault.restart:  # the cable is replaced once the job has noticed (every process of the attempt ended)
            while not job.reports() and time.time() - injected < bound:
                time.sleep(0.1)
            time.sleep(timeouts[1] / 2)
            hosts.heal()
            healed = time.time()
    finished = job.wait(bound - (time.time() - started))
    if fault is not None and fault.lasts is None and not fault.restart:
        hosts.heal()
    cell = Cell(regime.name, name, "", fault_step=None if injected is None else fault_step,
                seconds=time.time() - started, codes=[p.returncode for p in job.procs])
    done = job.done()
    cell.digests = [d for _, _, d in done]
    workers = len({r for r, _, _ in done})
    expect_workers = _workers(regime)
    if done:
        cell.acc = sorted(a for _, a, _ in done)[len(done) // 2]
    if baseline is not None:
        cell.baseline_acc = baseline.acc
    reports = job.reports()
    if reports:
        cell.report = _first_named(reports)
    if not finished:
        cell.outcome = "HANG (killed at the bound)"
    elif fault is None:
        cell.outcome = "fault-free" if workers == expect_workers else "FAILED without a fault"
    elif workers == expect_workers and all(c == 0 for c in cell.codes):
        same = baseline is not None and set(cell.digests) == set(baseline.digests)
        ended = max((e for e in job.ended if e is not None), default=0.0)
        how = ("restarted" if fault.restart else "carried on" if fault.lasts is None
               else "rode through" if healed is None or ended < healed else "healed")
        if regime.synchronous:
            cell.outcome = f"{how}, bit-identical" if same else f"{how}, DIFFERENT parameters"
        else:
            cell.outcome = how
        notes = [m.group(0) for host in job.lines for _, line in host if (m := NOTE.search(line))]
        if notes:
            cell.report = f"host 0: {notes[0]}"
        elif baseline is not None and not reports:
            cell.report = f"run took {cell.seconds:.0f} s (fault-free {baseline.seconds:.0f} s)"
    elif not regime.synchronous and done and workers < expect_workers:
        cell.outcome = f"continued on {workers} of {expect_workers} workers"
    else:
        cell.outcome = "named and ended" if reports else "ended, NOT named"
    if injected is not None:
        exits = [e for e in job.ended if e is not None]
        if cell.outcome.startswith(("named", "ended")):
            cell.detect = max(exits) - injected if exits else None
        elif reports:
            cell.detect = min(t for _, t, _ in reports) - injected
        after = [t for s, t in job.steps() if healed is not None and t > healed]
        resumed = [t for host in job.lines for t, line in host if line.startswith("RESUMED")]
        if fault.restart and resumed:
            cell.recover = min(resumed) - injected
        elif after and cell.outcome.startswith(("healed", "continued")):
            cell.recover = min(after) - healed
    if job.stacks:
        (workdir / "stacks.txt").write_text(job.stacks)
    (workdir / "output.txt").write_text("\n".join(f"[host {i}] {line}" for i, host in enumerate(job.lines)
                                                  for _, line in host))
    return cell


def _workers(regime: Regime) -> int:
    if "--framework" not in regime.run_flags:
        return regime.hosts
    from troupe.cluster.configuration.presets import preset

    name = regime.run_flags[regime.run_flags.index("--framework") + 1]
    cfg = preset(name, regime.hosts)
    return cfg.nworker_groups * cfg.nworkers_per_group


def _first_named(reports: list[tuple[int, float, str]]) -> str:
    """The most telling report: a rank naming another, before a supervisor's summary."""
    reports = sorted(reports, key=lambda r: ("goes on without" not in r[2], r[2].startswith("troupe run"), r[1]))
    host, _, text = reports[0]
    return f"host {host}: " + re.sub(r"\[backend: .*", "[backend error]", text)


def _record(out: str | None, cell: Cell) -> None:
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(vars(cell)) + "\n")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(regimes: list[str], faults: list[str], steps: int, pace: float, seed: int, doc: str | None,
         out: str | None, workdir: str) -> int:
    why = netns.available()
    if why:
        print(f"troupe bench faults: simulated hosts are not available here: {why}", file=sys.stderr)
        return 2
    unknown = [r for r in regimes if r not in REGIMES] + [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown regime or fault {unknown}; regimes {list(REGIMES)}, faults {list(FAULTS)}")
    rng = random.Random(seed)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    # SIGTERM unwinds like Ctrl-C: the hosts' `with` removes the namespaces, rules and processes. SIGINT
    # too, said explicitly: a process started in the background of a shell inherits it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    cells: list[Cell] = []
    base = Path(workdir)
    print(HEADER, flush=True)
    for name in regimes:
        regime = REGIMES[name]
        with netns.Hosts(regime.hosts + 1, rate=RATE) as hosts:  # the last one is not in the job (an intruder)
            baseline = run_cell(hosts, regime, None, steps, pace, base / name / "none", None, rng, log)
            log(f"{name}: fault-free in {baseline.seconds:.0f} s, accuracy {baseline.acc}")
            cells.append(baseline)
            print(baseline.row(), flush=True)
            _record(out, baseline)
            if baseline.outcome != "fault-free":
                tail = (base / name / "none" / "output.txt").read_text().splitlines()[-5:]
                log(f"{name}: the fault-free run failed, its faults are not run:\n" + "\n".join(tail))
                continue
            for fault_name in faults:
                fault = FAULTS[fault_name]
                if fault.restart and not regime.synchronous or not fault.only(regime):
                    continue
                cell = run_cell(hosts, regime, fault, steps, pace, base / name / fault_name, baseline, rng, log)
                cells.append(cell)
                print(cell.row(), flush=True)
                _record(out, cell)
    if doc:
        write_doc(Path(doc), cells, steps, pace, seed)
    return 1 if any(c.outcome.startswith("HANG") for c in cells) else 0


MARK_BEGIN, MARK_END = "<!-- troupe bench faults: begin -->", "<!-- troupe bench faults: end -->"


def write_doc(path: Path, cells: list[Cell], steps: int, pace: float, seed: int) -> None:
    """Put the cells into the table between the markers in `path` (made, or appended, when absent):
    a cell replaces the row of the same regime and fault, the others stay, in matrix order."""
    text = path.read_text() if path.exists() else ""
    rows: dict[tuple[str, str], str] = {}
    if MARK_BEGIN in text and MARK_END in text:
        old = text[text.index(MARK_BEGIN):text.index(MARK_END)]
        for line in old.splitlines():
            cols = [c.strip() for c in line.split("|")]
            if len(cols) > 3 and cols[1] in REGIMES:
                rows[(cols[1], cols[2])] = line
    for c in cells:
        rows[(c.regime, FAULTS[c.fault].what if c.fault in FAULTS else c.fault)] = c.row()
    order = {what: n for n, what in enumerate(["none", *(f.what for f in FAULTS.values())])}
    regime_order = list(REGIMES)
    ordered = sorted(rows.items(), key=lambda kv: (regime_order.index(kv[0][0]), order.get(kv[0][1], 99)))
    table = "\n".join([
        MARK_BEGIN,
        f"Written by `troupe bench faults --steps {steps} --pace {pace} --seed {seed} --doc ...` "
        f"(last run {time.strftime('%Y-%m-%d')}; links {RATE}, TROUPE_TIMEOUT={TIMEOUT:g}s, "
        f"TROUPE_PEER_TIMEOUT={PEER_TIMEOUT:g}s)",
        "", HEADER, *(row for _, row in ordered), MARK_END])
    if MARK_BEGIN in text and MARK_END in text:
        text = text[:text.index(MARK_BEGIN)] + table + text[text.index(MARK_END) + len(MARK_END):]
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    path.write_text(text)
