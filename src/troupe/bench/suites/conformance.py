"""conformance: every regime with every script shape and launcher, each cell ending one stated way (docs/conformance.md).

    troupe bench run conformance --args                       # the whole matrix, a markdown table
    troupe bench run conformance --args --regimes plain downpour --launchers troupe torchrun

A cell is one job of `troupe/bench/conformance_cell.py` (a user's script of one shape) under one regime and one
launcher, killed at --cell-timeout. It ends one of these ways:

- ``matched``: worker 0's final model equals the one-process reference (the same script, one process, the whole
  batch) within 1e-5 (fp16 / bf16: within the codec's tolerance);
- ``reached``: an asynchronous or approximating regime's loss on the whole data fell at least half as far as the
  reference's did (from the same start, in the same steps);
- ``refused``: a non-zero exit within 10 s whose message is one line (no traceback, no C++ frames);
- ``warned``: ran and ended elsewhere, and troupe said why in one line as it started (a DDP script's
  DistributedSampler that counts the servers of a parameter-server job);
- anything else is a failure the table names: ``WRONG`` (ran, ended elsewhere), ``HUNG``, ``TRACEBACK``,
  ``SLOW REFUSAL``, ``SILENT`` (exit 0, no model).

The matrix is three planes of the regime x shape x launcher cube: every regime with every shape under
``troupe run``; every regime under every other launcher with the PyTorch-loop shape; every shape under every
launcher with plain. Elastic regimes run under ``troupe run --elastic`` only (the other launchers do not restart
ranks); the Ticket pattern has no env:// variables for a script that makes its own process group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from troupe.bench.suites.generic import plot, table  # noqa: F401  (the registry renders records with them)

CELL = str(Path(__file__).resolve().parents[1] / "conformance_cell.py")
SHAPES = ("singa", "torch", "ddp", "tied", "compiled", "eval")
LAUNCHERS = ("troupe", "torchrun", "mpiexec", "ticket", "slurm", "env")
EXACT, ASYNC = 1e-5, None


@dataclass(frozen=True)
class Regime:
    """How a cell asks for a regime: processes, `troupe run` flags, the same for other launchers (env), the script's
    --regime, and what it must end with (a tolerance to the reference, or None: reach the stated loss)."""

    name: str
    nprocs: int = 2
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    script: str = "plain"
    tol: float | None = EXACT
    elastic: bool = False


def _cluster(name: str, nprocs: int, flags: tuple[str, ...], fields: dict, tol: float | None, **kw) -> Regime:
    return Regime(name, nprocs, flags, {"TROUPE_CLUSTER": json.dumps(fields)}, tol=tol, **kw)


SANDBLASTER = {"nworkers_per_group": 2, "nservers_per_group": 1, "server_worker_separate": True}
DOWNPOUR = {"nworker_groups": 2, "nworkers_per_group": 1, "nservers_per_group": 1, "server_worker_separate": True}
DILOCO = {"framework": "diloco", "nworker_groups": 2, "nserver_groups": 2, "sync_freq": 4}
GROUP_FLAGS = ("--nworker-groups", "2", "--sync-freq", "4")
REGIMES = {r.name: r for r in (
    Regime("plain"), Regime("fp16", script="fp16", tol=1e-3), Regime("bf16", script="bf16", tol=2e-2),
    Regime("partialUpdate", script="partialUpdate", tol=ASYNC), Regime("sparseTopK", script="sparseTopK", tol=ASYNC),
    Regime("sparseThreshold", script="sparseThreshold", tol=ASYNC), Regime("powerSGD", script="powerSGD", tol=ASYNC),
    _cluster("sandblaster", 3, ("--framework", "sandblaster", "--nworkers-per-group", "2", "--nservers-per-group",
                                "1"), SANDBLASTER, EXACT),
    _cluster("allreduce", 2, ("--framework", "allreduce"), {"nworkers_per_group": 2, "nservers_per_group": 2}, EXACT),
    _cluster("downpour", 3, ("--framework", "downpour", "--nworkers-per-group", "1", "--nservers-per-group", "1"),
             DOWNPOUR, ASYNC),
    _cluster("hogwild", 2, ("--framework", "hogwild"), {"nworker_groups": 2, "nserver_groups": 2}, ASYNC),
    _cluster("diloco", 2, ("--framework", "diloco", *GROUP_FLAGS), DILOCO, ASYNC),
    _cluster("streaming-diloco", 2, ("--framework", "diloco", *GROUP_FLAGS, "--fragments", "2"),
             {**DILOCO, "fragments": 2}, ASYNC),
    Regime("partition", script="partition"),
    Regime("shard-optimizer", flags=("--shard", "optimizer"), env={"TROUPE_SHARD": "optimizer"},
           script="shard-optimizer"),
    Regime("shard-gradients", flags=("--shard", "gradients"), env={"TROUPE_SHARD": "gradients"},
           script="shard-gradients"),
    Regime("shard-parameters", script="shard-parameters"),
)}
ELASTIC = ("plain", "fp16", "bf16", "sparseTopK", "sparseThreshold", "powerSGD", "partialUpdate", "sandblaster",
           "downpour", "hogwild", "diloco", "streaming-diloco", "partition", "shard-optimizer", "shard-parameters")
SHARDED_GROUPS = ("shard-optimizer", "shard-parameters")
"""Under --elastic these shard inside each worker group: 2 groups of 2 processes (groups of one are refused)."""
for _name in ELASTIC:
    _r = REGIMES[_name]
    _groups = ("--nworker-groups", "2") if _name in SHARDED_GROUPS else ()
    REGIMES[f"{_name} --elastic"] = Regime(f"{_name} --elastic", 4 if _groups else _r.nprocs,
                                           (*_r.flags, "--elastic", *_groups), _r.env, _r.script, _r.tol, elastic=True)


def cells(regimes, shapes, launchers) -> list[tuple[str, str, str]]:
    """The three planes (see the module docstring), in order, each cell once."""
    chosen: dict[tuple[str, str, str], None] = {}
    for r in regimes:
        for s in shapes:
            if "troupe" in launchers:
                chosen[(r, s, "troupe")] = None
    for r in regimes:
        if "torch" in shapes and not REGIMES[r].elastic:
            for launcher in launchers:
                chosen[(r, "torch", launcher)] = None
    if "plain" in regimes:
        for s in shapes:
            for launcher in launchers:
                chosen[("plain", s, launcher)] = None
    return [c for c in chosen if not (c[1] == "ddp" and c[2] == "ticket")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(regime: Regime, shape: str, launcher: str, out: str, base: dict) -> list[tuple[list[str], dict]]:
    """The processes a launcher starts for one cell (each with its environment)."""
    py, n = sys.executable, regime.nprocs
    script = [CELL, out, "--shape", shape, "--regime", regime.script]
    env = {**base, **regime.env}
    if launcher == "troupe":
        return [([py, "-m", "troupe.cli", "run", "-n", str(n), "--threads", "1", *regime.flags, *script], base)]
    if launcher == "torchrun":
        return [([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *script], env)]
    if launcher == "mpiexec":
        mpi = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_rmaps_base_oversubscribe": "1"}
        return [([shutil.which("mpiexec") or "mpiexec", "-n", str(n), "--oversubscribe", py, *script], {**env, **mpi})]
    if launcher == "ticket":
        return [([py, *script, "--ticket", str(n)], env)]
    port = _free_port()
    if launcher == "slurm":
        job = str(40000 + secrets.randbelow(20000))
        return [([py, *script], {**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(n), "SLURM_LOCALID": str(r),
                                 "SLURM_NODEID": "0", "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost",
                                 "SLURM_TASKS_PER_NODE": str(n), "TROUPE_MASTER_PORT": str(port)})
                for r in range(n)]
    return [([py, *script], {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
                             "RANK": str(r)}) for r in range(n)]


@dataclass
class Ran:
    codes: list[int | None]
    err: str
    seconds: float
    hung: bool


def launch(cmds: list[tuple[list[str], dict]], cwd: str, timeout: float) -> Ran:
    """Start every process of a cell in its own session; kill them all (and their children) at `timeout`."""
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd, env in cmds]
    errs, hung = [], False
    try:
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(0.1, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                hung = True
                _kill(procs)
                _, err = p.communicate()
            errs.append(err)
    finally:
        _kill(procs)  # what a launcher left behind (its ranks) goes with it
    return Ran([p.returncode for p in procs], "\n".join(errs), time.monotonic() - start, hung)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _loss(shape: str, state: dict) -> float:
    import torch

    from troupe.bench import conformance_cell as cell

    model = cell.build(shape)
    model.load_state_dict(state)
    x, y = cell.dataset(shape)
    with torch.no_grad():
        return cell.loss_of(shape, model(x), y).item()


def _start_loss(shape: str) -> float:
    from troupe.bench import conformance_cell as cell

    return _loss(shape, cell.build(shape).state_dict())


FRAMES = re.compile(r"frame #\d+|Exception raised from|\.cpp:\d+")


def judge(regime: Regime, shape: str, ran: Ran, out: Path, reference: dict | None) -> tuple[str, str]:
    """(outcome, what the table says)."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in ran.err.splitlines() if line.strip()]
    if ran.hung:
        return "HUNG", f"killed after {ran.seconds:.0f} s: {lines[-1][:150] if lines else ''}"
    failed = any(ran.codes)
    if "Traceback" in ran.err or FRAMES.search(ran.err):
        where = next((line for line in reversed(lines) if re.match(r"\w*(Error|Exception)\b", line)), lines[-1])
        return "TRACEBACK", f"exit {ran.codes}: {where[:200]}"
    if failed:
        if ran.seconds > 10:
            return "SLOW REFUSAL", f"after {ran.seconds:.0f} s: {lines[-1][:200] if lines else ''}"
        said = next((line for line in lines if line.startswith("troupe: ")), lines[-1] if lines else "(no message)")
        return "refused", said[:220]  # a rank's own line says why; the launcher's last may only say who stopped
    if not (out / "model.pt").is_file():
        return "SILENT", "exited 0 without worker 0's model"
    import torch

    state = torch.load(out / "model.pt")["model"]
    if reference is None:
        return "SILENT", "no reference to compare with"
    if regime.tol is not None:
        diff = max((state[k] - reference[k]).abs().max().item() for k in reference)
        if diff <= regime.tol:
            return "matched", f"max |diff| {diff:.1e} (tolerance {regime.tol:g})"
        return _wrong(lines, f"max |diff| {diff:.1e} > {regime.tol:g} from the one-process reference")
    start, ref = _start_loss(shape), _loss(shape, reference)
    gain = (start - _loss(shape, state)) / (start - ref)
    if gain >= 0.5:
        return "reached", f"loss fell {gain:.2f} as far as the reference's (stated: >= 0.5)"
    return _wrong(lines, f"loss fell {gain:.2f} as far as the reference's, not >= 0.5")


def _wrong(lines: list[str], said: str) -> tuple[str, str]:
    """WRONG, or ``warned`` where troupe said in one line why the run is not the reference's."""
    warning = next((line for line in lines if line.startswith("troupe: ") and "or the workers train" in line), None)
    return ("warned", f"{said}; troupe said: {warning[8:]}") if warning else ("WRONG", said)


def run_cell(regime: Regime, shape: str, launcher: str, base: dict, timeout: float, reference: dict | None,
             keep: Path) -> tuple[str, str, float]:
    out = Path(tempfile.mkdtemp(prefix=f"{launcher}-{shape}-", dir=keep))
    ran = launch(_commands(regime, shape, launcher, str(out), base), str(out), timeout)
    outcome, said = judge(regime, shape, ran, out, reference)
    if outcome in ("matched", "reached", "refused"):
        shutil.rmtree(out, ignore_errors=True)
    else:
        (out / "stderr.txt").write_text(ran.err)
    return outcome, said, ran.seconds


def references(shapes, base: dict, keep: Path, timeout: float) -> dict[str, dict]:
    """Each shape once in one process (the whole batch), under `troupe run -n 1`."""
    import torch

    refs = {}
    for shape in shapes:
        out = Path(tempfile.mkdtemp(prefix=f"reference-{shape}-", dir=keep))
        ran = launch(_commands(Regime("reference", nprocs=1), shape, "troupe", str(out), base), str(out), timeout)
        if any(ran.codes) or ran.hung:
            raise RuntimeError(f"the one-process reference of {shape} failed:\n{ran.err[-3000:]}")
        refs[shape] = torch.load(out / "model.pt")["model"]
    return refs


def _fork_server(keep: Path, base: dict) -> tuple[subprocess.Popen, str]:
    sock = str(keep / "fork.sock")
    env = {k: v for k, v in base.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen([sys.executable, "-m", "troupe.cli", "fork-server", sock],
                            env={**env, "TORCH_CPP_LOG_LEVEL": "ERROR"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):
        if os.path.exists(sock):
            break
        time.sleep(0.1)
    return proc, sock


def render(rows: list[dict]) -> str:
    """The cells as three grids (the planes), each cell its outcome; a note per distinct detail that is not a pass."""
    notes: dict[str, int] = {}

    def cell(row: dict | None) -> str:
        if row is None:
            return ""
        if row["outcome"] in ("matched", "reached"):
            return row["outcome"]
        detail = re.sub(r"rank \d+", "rank R", row["detail"])
        n = notes.setdefault(f"{row['outcome']}: {detail}", len(notes) + 1)
        return f"{row['outcome']} [{n}]"

    at = {(r["regime"], r["shape"], r["launcher"]): r for r in rows}
    regimes = list(dict.fromkeys(r["regime"] for r in rows))

    def grid(title: str, names: list[str], columns: list[str], key) -> list[str]:
        shown = [n for n in names if any(at.get(key(n, c)) for c in columns)]
        if not shown:
            return []
        out = [f"### {title}", "", f"| | {' | '.join(columns)} |", "| --- |" + " --- |" * len(columns)]
        out += [f"| {n} | {' | '.join(cell(at.get(key(n, c))) for c in columns)} |" for n in shown]
        return [*out, ""]

    lines = grid("Every regime with every script shape, under troupe run", regimes, list(SHAPES),
                 lambda r, s: (r, s, "troupe"))
    lines += grid("Every regime under every launcher, the PyTorch loop", [r for r in regimes if not r.endswith(
        "--elastic")], list(LAUNCHERS),
                  lambda r, launcher: (r, "torch", launcher))
    lines += grid("Every script shape under every launcher, plain", list(SHAPES), list(LAUNCHERS),
                  lambda s, launcher: ("plain", s, launcher))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines += [f"{len(rows)} cells: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", ""]
    lines += [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines)


def environment() -> dict[str, str]:
    """The cells' environment: one thread, and timeouts short enough that a stuck cell fails before it is killed."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TROUPE_JOIN_TIMEOUT": "20", "TROUPE_TIMEOUT": "30",
            "TROUPE_PEER_TIMEOUT": "20", "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no pool of compile workers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench run conformance --args", description=__doc__.splitlines()[0])
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), metavar="R", help=f"of {list(REGIMES)}")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    p.add_argument("--cell-timeout", type=float, default=90.0, help="seconds before a cell's processes are killed")
    p.add_argument("--keep", default=None, help="where failed cells keep their output (default: a temporary folder)")
    p.add_argument("--out", default=None, help="append every cell as a JSON line")
    p.add_argument("--render", default=None, metavar="JSONL", help="print the grids of a run's cells (no run)")
    args = p.parse_args(argv)
    if args.render:
        print(render([json.loads(line) for line in Path(args.render).read_text().splitlines() if line.strip()]))
        return 0
    unknown = sorted(set(args.regimes) - set(REGIMES))
    if unknown:
        raise ValueError(f"unknown regime(s) {unknown}; choose from {list(REGIMES)}")
    keep = Path(args.keep or tempfile.mkdtemp(prefix="troupe-conformance-"))
    keep.mkdir(parents=True, exist_ok=True)
    base = environment()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the cells and server go too
    server, sock = _fork_server(keep, base)
    base["TROUPE_FORK_SERVER"] = sock
    start = time.monotonic()
    counts: dict[str, int] = {}
    done: list[dict] = []
    try:
        refs = references(args.shapes, base, keep, args.cell_timeout)
        todo = cells(args.regimes, args.shapes, args.launchers)
        print(f"{len(todo)} cells; failed cells keep their output under {keep}\n", file=sys.stderr, flush=True)
        print("| regime | shape | launcher | outcome | detail | s |\n| --- | --- | --- | --- | --- | --- |", flush=True)
        for regime, shape, launcher in todo:
            outcome, said, secs = run_cell(REGIMES[regime], shape, launcher, base, args.cell_timeout,
                                           refs.get(shape), keep)
            counts[outcome] = counts.get(outcome, 0) + 1
            done.append({"regime": regime, "shape": shape, "launcher": launcher, "outcome": outcome,
                         "detail": said, "seconds": round(secs, 2)})
            said = said.replace("|", "\\|")
            print(f"| {regime} | {shape} | {launcher} | {outcome} | {said} | {secs:.1f} |", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(done[-1]) + "\n")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    total = time.monotonic() - start
    print(f"\n{sum(counts.values())} cells in {total / 60:.1f} min: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + "\n", flush=True)
    print(render(done), flush=True)
    return 0 if set(counts) <= {"matched", "reached", "refused", "warned"} else 1
