"""Save and load time of troupe.checkpoint (DCP, sharded) against its first format (a full copy per rank).

    python benchmarks/checkpoint.py --ranks 2 4 --reps 11

The MNIST CNN of examples/mnist_cnn.py (431 k parameters; ``--model mlp``: 4 x
Linear(2048, 2048), 16.8 M) with SGD momentum under DistOpt, after one step. In the same
processes, each repetition saves with the first format, then with the current one (order
alternating), then loads each; times are rank 0's wall time of the collective call (both end
in a barrier). Prints the medians, the ratio current/first and the bytes on disk of one
checkpoint of each (the table in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def first_format_save(directory: Path, step: int, model, optimizer, comm) -> Path:
    """troupe.checkpoint.save as it was (commit 126112c): every rank torch.saves its full state."""
    from troupe.reliability.checkpoint import MANIFEST, _atomic_write, rng_state

    target = directory / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "rank": comm.rank, "world_size": comm.world_size, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "rng": rng_state(), "extra": {}}
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(target / f"rank{comm.rank}.pt", data)
    digests = comm.all_gather_object(hashlib.sha256(data).hexdigest())
    if comm.rank == 0:
        manifest = {"step": step, "world_size": comm.world_size,
                    "sha256": {f"rank{r}.pt": d for r, d in enumerate(digests)}}
        _atomic_write(target / MANIFEST, json.dumps(manifest, indent=1).encode())
    comm.barrier()
    return target


def first_format_load(checkpoint: Path, model, optimizer, comm) -> None:
    """troupe.checkpoint.load as it was: verify every file, then this rank's full copy."""
    from troupe.reliability.checkpoint import set_rng_state, verify

    verify(checkpoint)
    state = torch.load(checkpoint / f"rank{comm.rank}.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])


def _timed(comm, fn) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _mlp():
    """A larger model: 4 x Linear(2048, 2048), 16.8 M parameters."""
    from torch import nn

    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])


def child(reps: int, directory: str, which: str) -> None:
    import torch.nn.functional as F

    import troupe
    from troupe.reliability import checkpoint

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN() if which == "cnn" else _mlp()
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    comm = sgd.communicator
    x = torch.randn(8, 1, 28, 28) if which == "cnn" else torch.randn(8, 2048)
    y = torch.randint(0, 10, (8,))
    sgd(F.cross_entropy(model(x), y))
    old_dir, new_dir = Path(directory) / "first", Path(directory) / "dcp"
    times: dict[str, list[float]] = {"save first": [], "save dcp": [], "load first": [], "load dcp": []}
    for rep in range(reps):
        order = ("first", "dcp") if rep % 2 == 0 else ("dcp", "first")
        for kind in order:
            if kind == "first":
                times["save first"].append(_timed(comm, lambda: first_format_save(old_dir, rep, model, sgd, comm)))
            else:
                times["save dcp"].append(_timed(comm, lambda: checkpoint.save(new_dir, rep, model, sgd, keep=2)))
        for kind in order:
            if kind == "first":
                ckpt = old_dir / f"step-{rep:08d}"
                times["load first"].append(_timed(comm, lambda: first_format_load(ckpt, model, sgd, comm)))
            else:
                ckpt = new_dir / f"step-{rep:08d}"
                times["load dcp"].append(_timed(comm, lambda: checkpoint.load(ckpt, model, sgd)))
        comm.barrier()
        if comm.rank == 0 and rep >= 1:
            shutil.rmtree(old_dir / f"step-{rep - 1:08d}", ignore_errors=True)
    if comm.rank == 0:
        last = reps - 1
        size = {k: sum(p.stat().st_size for p in (d / f"step-{last:08d}").rglob("*") if p.is_file())
                for k, d in (("first", old_dir), ("dcp", new_dir))}
        print("RESULT " + json.dumps({"world_size": comm.world_size, "times": times, "bytes": size}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn",
                   help="cnn: examples/mnist_cnn.py's CNN (431 k parameters); mlp: 4 x Linear(2048, 2048)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.reps, args.child, args.model)
        return
    from troupe.bench.jobs import run_job

    print(f"{args.model}, SGD momentum, DistOpt plain; median of {args.reps} alternating reps (rank 0's wall time)\n")
    print("| ranks | save first format | save DCP | ratio | load first format | load DCP | ratio | "
          "bytes first format | bytes DCP |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            job = run_job(["benchmarks/checkpoint.py", "--reps", str(args.reps), "--model", args.model,
                           "--child", tmp], n, threads=None, env={"OMP_NUM_THREADS": "1"}, timeout=1200)
        line = next((ln for ln in job.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{n} ranks failed:\n{job.stdout}\n{job.stderr}")
        r = json.loads(line[len("RESULT "):])
        med = {k: statistics.median(v) * 1e3 for k, v in r["times"].items()}
        print(f"| {n} | {med['save first']:.1f} ms | {med['save dcp']:.1f} ms | "
              f"{med['save dcp'] / med['save first']:.2f} | {med['load first']:.1f} ms | {med['load dcp']:.1f} ms | "
              f"{med['load dcp'] / med['load first']:.2f} | {r['bytes']['first'] / 1e6:.2f} MB | "
              f"{r['bytes']['dcp'] / 1e6:.2f} MB |", flush=True)


if __name__ == "__main__":
    main()
