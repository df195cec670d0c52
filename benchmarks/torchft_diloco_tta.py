"""torchft's DiLoCo on time_to_accuracy's workload, timed to 98.5% MNIST test accuracy: issue 28's anchor.

    python benchmarks/torchft_diloco_tta.py --link 100mbit --out benchmarks/results/tta100_torchft.jsonl
    python benchmarks/torchft_diloco_tta.py --max-steps 120 --eval-every 50     # loopback smoke test

The reference for troupe's own DiLoCo under the same workload::

    troupe bench run time_to_accuracy --args -n 4 --link 100mbit --lr 0.05 --epochs 3 --eval-every 50 \\
        --run-flags "--framework diloco --nworker-groups 4 --sync-freq 50" --name "diloco H=50 fp32"

`--groups` replica groups of one process each, every one a torchft ``Manager`` over
``ProcessGroupGloo`` on CPU with ``torchft.local_sgd.DiLoCo(manager, [model], inner, outer,
sync_every=H)``, and a torchft lighthouse. Everything else is benchmarks/time_to_accuracy.py's under
``--framework diloco``: examples/mnist_cnn.py's CNN from ``torch.manual_seed(0)``; group g trains
on ``troupe.data.partition(train, g, G)`` in an order drawn from a generator seeded by g; inner
SGD (lr ``--lr``, momentum 0.9, weight decay 1e-5, batch 64); outer SGD (lr 0.7, momentum 0.9,
Nesterov) on the mean fp32 pseudo-gradient every H inner steps; every ``--eval-every`` steps each
group scores its quarter of the test set and the counts are summed (the clock stopped meanwhile).
With H dividing ``--eval-every``, evaluations fall right after an outer step, when every group
holds the same parameters, so the sum is the full test set's accuracy of those parameters.

Group 0 prints time_to_accuracy's JSON line (plus ``sync_seconds`` and ``quorum_seconds``: the
inner steps that ended in an outer step, and torchft's quorum calls inside them); ``--out FILE``
appends its troupe bench records. The first quorum (the process group's rendezvous) is taken
before the clock starts, as troupe's job connects before its first step.

With ``--link RATE`` (a tc rate such as 100mbit, or "none") every group runs in its own simulated
host (`troupe.bench.netns.Hosts`, needs root) and the lighthouse in host 0; without it, all on
loopback. Every process is killed at ``--timeout``, and the namespaces are removed on any exit.
Needs ``pip install torchft==0.2.0``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import troupe
from troupe.bench.chaos_torchft import free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from time_to_accuracy import CNN, save_records  # noqa: E402  (the workload's model and record format)

PORTS = (29610, 29620)
"""On simulated hosts (fresh namespaces, so free): the lighthouse's, and group 0's TCPStore's (its
Manager's, and where the groups sum their evaluation counts). On loopback, free ports found then."""


def require_torchft() -> Any:
    """torchft, or SystemExit with one line saying how to install it."""
    try:
        import torchft
    except ImportError:
        raise SystemExit("torchft_diloco_tta.py needs torchft: pip install torchft==0.2.0") from None
    return torchft


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=4, help="replica groups (one process each)")
    p.add_argument("--sync-freq", type=int, default=50, help="H: inner steps between outer steps")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per group")
    p.add_argument("--lr", type=float, default=0.05, help="the inner SGD's")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=50, help="steps")
    p.add_argument("--target", type=float, default=0.985)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--link", default=None, help="simulated hosts: 'none' or a tc rate such as 100mbit (root)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the job may take")
    p.add_argument("--out", default=None, help="append group 0's troupe bench records (JSON lines) here")
    p.add_argument("--name", default=None, help="the contestant's name (default 'torchft diloco H=<H> fp32')")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # the launcher's: this group
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)  # this group's host address
    p.add_argument("--host0", default="127.0.0.1", help=argparse.SUPPRESS)  # group 0's (lighthouse, store)
    p.add_argument("--ports", default=",".join(map(str, PORTS)), help=argparse.SUPPRESS)  # see PORTS
    args = p.parse_args(argv)
    for name in ("groups", "sync_freq", "epochs", "batch_size", "eval_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.name = args.name or f"torchft diloco H={args.sync_freq} fp32"
    args.dist_option, args.spars = "diloco", None  # what save_records reads beside the name
    return args


# --- one replica group -----------------------------------------------------------------------


class CountPool:
    """Sums one integer per group through group 0's TCPStore; the sum comes back once every group has added."""

    def __init__(self, args: argparse.Namespace):
        from torch.distributed import TCPStore

        self.groups = args.groups
        self.store = TCPStore(args.host0, int(args.ports.split(",")[1]), is_master=args.worker == 0,
                              wait_for_workers=False, timeout=timedelta(seconds=args.timeout))

    def total(self, key: str, value: int) -> int:
        self.store.add(f"{key}/sum", value)
        if self.store.add(f"{key}/in", 1) == self.groups:
            self.store.set(f"{key}/done", "1")
        self.store.wait([f"{key}/done"])
        return self.store.add(f"{key}/sum", 0)


def make_manager(ft: Any, args: argparse.Namespace, pool: CountPool, model: Any, inner: Any) -> tuple[Any, Any]:
    """This group's torchft Manager (synchronous quorum, as DiLoCo requires; every group in every quorum)
    and the group's TCPStore."""
    from torch.distributed import TCPStore

    def state_dict() -> dict[str, Any]:  # what a healing group would receive from a live peer
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    # One store per replica group (torchft's rule): group 0's is the pool's; the others host their own.
    store = pool.store if args.worker == 0 else TCPStore(args.addr, 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=args.groups,
        load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=False,
        init_sync=False,  # every group starts from torch.manual_seed(0): nothing to copy at step 0
        timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=args.timeout), rank=0, world_size=1,
        store_addr=args.addr, store_port=store.port, lighthouse_addr=f"http://{args.host0}:{args.ports.split(',')[0]}",
        replica_id=f"group{args.worker}", hostname=args.addr)
    return manager, store


def evaluate(model: Any, x: Any, y: Any) -> int:
    """How many of (x, y) the model classifies right (batches of 500, as time_to_accuracy.py)."""
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 500]).argmax(1) == y[i:i + 500]).sum()) for i in range(0, len(x), 500))
    model.train()
    return correct


class Timed:
    """Wraps a callable and adds its run time to `seconds` (torchft's quorum, inside DiLoCo's sync)."""

    def __init__(self, fn: Any):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def train(ft: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Train this group to the end; the result time_to_accuracy.py prints (the same on every group)."""
    from torchft.local_sgd import DiLoCo

    g, groups = args.worker, args.groups
    pool = CountPool(args)
    train_x, train_y, test_x, test_y = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x, train_y, g, groups)
    tx, ty = troupe.data.partition(test_x, test_y, g, groups)
    torch.manual_seed(0)
    model = CNN()
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    manager, _store = make_manager(ft, args, pool, model, inner)
    manager.start_quorum()  # the process group's first configuration, before the clock (see the docstring)
    manager.should_commit()
    manager.start_quorum = quorum = Timed(manager.start_quorum)

    def accuracy(key: str) -> float:
        return pool.total(key, evaluate(model, tx, ty)) / (len(ty) * groups)

    gen = torch.Generator().manual_seed(g)
    clock, sync_clock, step, reached, curve = 0.0, 0.0, 0, None, []
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_freq):
        for _ in range(args.epochs):
            perm = torch.randperm(len(x), generator=gen)
            for b in range(len(x) // args.batch_size):
                if args.max_steps is not None and step >= args.max_steps:
                    break
                start = time.perf_counter()
                sel = perm[b * args.batch_size:(b + 1) * args.batch_size]
                inner.zero_grad()
                F.cross_entropy(model(x[sel]), y[sel]).backward()
                inner.step()  # DiLoCo's post-step hook takes the outer step every sync_freq steps
                took = time.perf_counter() - start
                clock += took
                step += 1
                if step % args.sync_freq == 0:
                    sync_clock += took
                if step % args.eval_every == 0:
                    acc = accuracy(f"eval{step}")
                    curve.append((step, round(clock, 2), round(acc, 4)))
                    if reached is None and acc >= args.target:
                        reached = (round(clock, 2), step)
        acc = accuracy("final")
    manager.shutdown(wait=False)
    return {"option": args.name, "spars": None, "world_size": groups, "seconds_to_target": reached and reached[0],
            "steps_to_target": reached and reached[1], "train_seconds": round(clock, 2), "steps": step,
            "final_acc": round(acc, 4), "curve": curve, "sync_seconds": round(sync_clock, 2),
            "quorum_seconds": round(quorum.seconds, 2)}


def worker(args: argparse.Namespace) -> None:
    """One replica group: train, and on group 0 print the JSON line (and append the records)."""
    ft = require_torchft()
    torch.set_num_threads(1)
    result = train(ft, args)
    if args.worker == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            save_records(args.out, result, args)
    sys.stdout.flush()
    os._exit(0)  # torchft's background threads (heartbeat, checkpoint server) would hold the exit


# --- the launcher ----------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace, group: int, addr: str, host0: str, ports: tuple[int, int]) -> list[str]:
    """The command line of group `group`'s process: this script with the launcher's options."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(group), "--addr", addr, "--host0", host0,
            "--ports", f"{ports[0]},{ports[1]}", "--timeout", str(args.timeout), "--name", args.name]
    for name in ("groups", "sync_freq", "epochs", "batch_size", "lr", "outer_lr", "outer_momentum", "eval_every",
                 "target", "max_steps", "out"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(Path(value).resolve()) if name == "out" else str(value)]
    return argv


def wait_listening(log: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until the lighthouse says it listens (RuntimeError if it exits or stays silent)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "listening on" in log.read_text():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"the lighthouse did not listen within {timeout:g} s")


def run_groups(args: argparse.Namespace, popen: Any, addrs: list[str], ports: tuple[int, int], logs: Path) -> str:
    """Start the lighthouse and the groups (`popen(host, argv, log)`), wait for them; group 0's JSON line."""
    # torchft's entry point, found beside this interpreter rather than through PATH.
    lighthouse = [sys.executable, str(Path(sys.executable).parent / "torchft_lighthouse"),
                  "--min_replicas", str(args.groups), "--bind", f"[::]:{ports[0]}"]
    procs = [popen(0, lighthouse, logs / "lighthouse.log")]
    try:
        wait_listening(logs / "lighthouse.log", procs[0])
        workers = [popen(g, worker_argv(args, g, addrs[g], addrs[0], ports), logs / f"group{g}.log")
                   for g in range(args.groups)]
        procs += workers
        deadline = time.time() + args.timeout
        while any(w.poll() is None for w in workers):
            failed = [g for g, w in enumerate(workers) if w.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"group {failed[0]} exited with {workers[failed[0]].returncode}:\n"
                                   + (logs / f"group{failed[0]}.log").read_text()[-3000:])
            if time.time() > deadline:
                raise TimeoutError(f"the groups did not finish within {args.timeout:g} s")
            time.sleep(0.2)
        if workers[0].returncode != 0:
            raise RuntimeError(f"group 0 exited with {workers[0].returncode}:\n"
                               + (logs / "group0.log").read_text()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return next(line for line in (logs / "group0.log").read_text().splitlines() if line.startswith("{"))


def launch(args: argparse.Namespace) -> str:
    """The whole job, on loopback or on simulated hosts; group 0's JSON line."""
    require_torchft()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="torchft-tta-") as tmp:
        logs = Path(tmp)

        def start(popen: Any) -> Any:
            def run(host: int, argv: list[str], log: Path) -> subprocess.Popen:
                with open(log, "w") as f:
                    return popen(host, argv, f)
            return run

        if args.link is None:
            local = start(lambda host, argv, f: subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT))
            return run_groups(args, local, ["127.0.0.1"] * args.groups, (free_port(), free_port()), logs)
        from troupe.bench.netns import Hosts

        with Hosts(args.groups, rate=None if args.link == "none" else args.link) as hosts:
            simulated = start(lambda host, argv, f: hosts.popen(host, argv, env=env, stdout=f,
                                                                stderr=subprocess.STDOUT))
            return run_groups(args, simulated, [hosts.addr(g) for g in range(args.groups)], PORTS, logs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    # SIGTERM ends the launcher through its `finally`s and `with`s: the processes killed, the namespaces removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(launch(args), flush=True)


if __name__ == "__main__":
    main()
