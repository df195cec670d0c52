"""Gradients in the buckets: step time and peak memory per rank, troupe against DDP.

    python benchmarks/bucket_view.py time --workload cnn --reps 11 --steps 30 --burnin 5
    python benchmarks/bucket_view.py time --workload resnet18 --reps 11 --steps 3 --burnin 2
    python benchmarks/bucket_view.py time --workload cnn --micro 4 --clip 1.0 --reps 11 --steps 20 --burnin 3
    python benchmarks/bucket_view.py memory --workload cnn resnet18 --steps 5

``time``: in one 2-rank world (1 thread each), the contestants train separate copies of the same
model on the same batches, step by step in turns (`troupe.observe.turns.run_ab`), PyTorch loop
(``loss.backward(); step; zero_grad()``, set_to_none=True): DDP with its defaults, DDP with
``gradient_as_bucket_view=True``, troupe as it is now (gradients live in the buckets), and
troupe's reducer patched back to main's behaviour before this change (commit 3550747: the hook
copies each gradient in and sets ``p.grad = None``; ``no_sync`` leaves gradients where autograd
put them), so before and after alternate in the same processes.

``memory``: each contestant in a fresh 2-rank world; per rank, the rise of the peak resident
set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) from just before the model is built to the
end of `--steps` steps, and, after the last step, the bytes of the storages holding gradients
(distinct storages of every ``p.grad``, plus troupe's bucket buffers or DDP's buckets where they
are not those storages). torch's CPU allocator has no peak counter; ru_maxrss counts the
whole process, so only differences between contestants mean something.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("local", "DDP", "DDP grad-as-bucket-view", "troupe (grads in buckets)", "troupe (copy, as main)")


def as_main(reducer) -> None:
    """Patch one GradReducer back to main's behaviour (3550747): copy in, ``p.grad = None``, no_sync untouched."""

    def _add(param):
        bucket = reducer._bucket_of[id(param)]
        if bucket.add_grad(param, param.grad, reducer._scale):
            reducer._ready[bucket.index] = True
        param.grad = None

    reducer._add = _add
    reducer._keep_local = lambda param: None


def contestant(kind: str, workload, batches, micro: int, clip: float | None, held: list | None = None):
    """(Contestant, model) for one kind; with `held`, each step appends the bytes holding gradients
    just before ``zero_grad`` (see `grad_bytes`)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import troupe
    from troupe.bench import contestants as kinds
    from troupe.observe.turns import Contestant

    if kind == "local":
        model = workload.model(0)
        opt = kinds.make_sgd(model.parameters())
        no_sync, extra = None, lambda: []
    elif kind.startswith("DDP"):
        sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False})
        model = DDP(workload.model(0), gradient_as_bucket_view="view" in kind, **sync)
        opt = kinds.make_sgd(model.parameters())
        no_sync = model.no_sync
        view = "view" in kind
        # DDP's own buckets are not reachable from Python: copies of their shape give their sizes (with
        # gradient_as_bucket_view the p.grad storages are the buckets themselves)
        extra = lambda: [] if view else [(("ddp", i), b.buffer().untyped_storage().nbytes())  # noqa: E731
                                         for i, b in enumerate(model.reducer._get_zeros_like_grad_buckets())]
    else:
        model = workload.model(0)
        opt = troupe.DistOpt(kinds.make_sgd(model.parameters()))
        opt.sync_parameters(model)
        if "as main" in kind:
            as_main(opt.reducer)
        no_sync = opt.no_sync
        extra = lambda: [(b.buffer.untyped_storage().data_ptr(), b.buffer.untyped_storage().nbytes())  # noqa: E731
                         for b in opt.reducer.buckets]

    def finish():
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if held is not None:
            held.append(grad_bytes(model, extra))
        opt.zero_grad(set_to_none=True)

    from contextlib import nullcontext

    step = kinds._train_step(workload, model, batches, lambda loss: loss.backward(), finish, micro,
                             no_sync or nullcontext)
    return Contestant(kind, step, {}), model


def grad_bytes(model, extra) -> int:
    """Bytes of the distinct storages of every p.grad and of the buckets `extra` lists (key, bytes)."""
    seen = dict(extra())
    for p in model.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def batches_for(workload, rank, world_size, count, batch_size=None):
    return workload.batches(rank, world_size, batch_size or workload.batch_size, count,
                            data="synthetic" if "synthetic" in workload.datasets else workload.datasets[0], seed=0)


def time_rank(rank, world_size, args):
    from troupe.bench import workloads
    from troupe.observe.turns import Schedule, run_ab
    from troupe.runtime import world

    comm = world.init().comm
    out = {}
    for name in args.workload:
        workload = workloads.get(name)
        batches = batches_for(workload, rank, world_size, min(args.burnin + args.reps * args.steps, 64), args.batch_size)
        made = [contestant(k, workload, batches, args.micro, args.clip)[0] for k in KINDS[1:]]
        measured = run_ab(made, Schedule(reps=args.reps, steps=args.steps, burnin=args.burnin), comm)
        out[name] = [(made[m.contestant].name, m.rep, m.metric, m.value) for m in measured]
    return out


def memory_rank(rank, world_size, args, kind, name):
    from troupe.bench import workloads
    from troupe.runtime import world

    world.init()
    workload = workloads.get(name)
    batches = batches_for(workload, rank, world_size, args.steps, args.batch_size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held: list[int] = []
    made, _ = contestant(kind, workload, batches, args.micro, args.clip, held)
    for i in range(args.steps):
        made.step(i)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"peak_rise_mib": peak / 1024, "grad_bytes_mib": held[-1] / 2**20}


def medians(rows):
    import statistics

    by = {}
    for name, rep, metric, value in rows:
        if metric == "step_time":
            by.setdefault(name, {})[rep] = value
    ref = by["DDP"]
    lines = ["| contestant | step ms (median) | ratio to DDP (of medians) | per-rep ratio (min-max) |", "|---|---|---|---|"]
    for name, reps in by.items():
        ratios = [reps[r] / ref[r] for r in reps]
        lines.append(f"| {name} | {1e3 * statistics.median(reps.values()):.2f} | "
                     f"{statistics.median(reps.values()) / statistics.median(ref.values()):.3f} | "
                     f"{min(ratios):.3f}-{max(ratios):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("time", "memory"))
    parser.add_argument("--workload", nargs="+", default=["cnn"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--burnin", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--out", default=None, help="append the raw results (JSON) to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from troupe.runtime.spawn import run_ranks

    if args.mode == "time":
        result = run_ranks(time_rank, 2, args, threads=1, timeout=3000)[0]
        for name, rows in result.items():
            print(f"\n{name}, micro {args.micro}, clip {args.clip}, reps {args.reps} x {args.steps} steps\n")
            print(medians(rows))
    else:
        result = {}
        for name in args.workload:
            result[name] = {}
            print(f"\n{name}: rise of peak RSS per rank over {args.steps} steps; gradient-holding storages after the last step\n")
            print("| contestant | peak RSS rise MiB (rank 0, rank 1) | gradient storages MiB |\n|---|---|---|")
            for kind in KINDS:
                per_rank = run_ranks(memory_rank, 2, args, kind, name, threads=1, timeout=900)
                result[name][kind] = per_rank
                rises = ", ".join(f"{r['peak_rise_mib']:.1f}" for r in per_rank)
                print(f"| {kind} | {rises} | {per_rank[0]['grad_bytes_mib']:.1f} |", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "result": result}) + "\n")


if __name__ == "__main__":
    main()
