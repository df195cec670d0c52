"""Sharded data parallelism measured: model-state bytes and peak memory per rank, step time, what fits.

    python benchmarks/shard.py memory -n 4 --layers 12 --dim 768 --heads 12   # one fresh world per contestant
    python benchmarks/shard.py steps -n 4 --layers 4 --dim 256 --reps 11      # contestants step by step, same processes
    python benchmarks/shard.py fits -n 4 --limit-mib 1024                     # the largest model under a peak
    python benchmarks/shard.py bytes -n 4 --contestants plain,optimizer,gradients   # wire bytes per step

The model is examples/gpt.py's (GPT-2-shaped, tied embeddings), trained with AdamW in two
parameter groups on random bytes, one micro-batch per step, clipped to norm 1. Contestants:
``ddp`` (torch's DDP, ``gradient_as_bucket_view=True`` so its buckets are its gradients), ``plain``
(troupe.DistOpt), ``optimizer`` and ``gradients`` (``DistOpt(shard=...)``), ``shard`` (``troupe.shard(model)``, then
a DistOpt: FSDP2 per block under troupe) and ``fsdp2`` (torch's ``fully_shard`` per block and on the root,
used directly).

Model-state bytes are counted from the tensors each rank holds after a step (parameters,
gradients, optimizer state, and every buffer troupe or DDP adds that Python can reach: troupe's
gradient buckets and shards), each storage once. Peak memory is the rank's ``VmHWM``, with glibc's
mmap threshold pinned to 128 KiB (a freed gathered or reduced buffer goes back to the system
instead of staying in the heap: docs/sharding.md). `ideal` is the bytes per parameter the ZeRO
paper gives for fp32 Adam on k ranks (16; 8 + 8/k; 4 + 12/k) times the parameters.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CONTESTANTS = ("ddp", "plain", "optimizer", "gradients", "shard", "fsdp2")
IDEAL = {"ddp": lambda k: 16, "plain": lambda k: 16, "optimizer": lambda k: 8 + 8 / k,
         "gradients": lambda k: 4 + 12 / k, "shard": lambda k: 16 / k, "fsdp2": lambda k: 16 / k}
"""fp32 Adam's model-state bytes per parameter on k ranks."""


def gpt_module():
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pin_mmap_threshold(size: int = 128 * 1024) -> None:
    """glibc: allocations above `size` are mmapped, so freeing them returns the memory (M_MMAP_THRESHOLD)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, size)


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t is not None and torch.is_tensor(t) and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def build(name: str, args, seed: int = 0, measure: bool = True):
    """(model, step function, tensors this contestant holds) for one contestant."""
    import troupe

    gpt = gpt_module()
    torch.manual_seed(seed)
    model = gpt.GPT(args.dim, args.layers, args.heads, args.block_size)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        troupe.init()
        wrapped = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(gpt.param_groups(model, 0.1), lr=1e-4)
        clip, stepper, forward = torch.nn.utils.clip_grad_norm_, opt, wrapped
        extra = lambda: []  # noqa: E731  (its buckets are the gradients)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        troupe.init()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(gpt.param_groups(model, 0.1), lr=1e-4)
        clip, stepper, forward = torch.nn.utils.clip_grad_norm_, opt, model
        extra = lambda: []  # noqa: E731
    else:
        if name == "shard":
            model = troupe.shard(model)
        opt = torch.optim.AdamW(gpt.param_groups(model, 0.1), lr=1e-4)
        sgd = troupe.DistOpt(opt, shard=name if name in ("optimizer", "gradients") else None)
        clip, stepper, forward = troupe.clip_grad_norm_, sgd, model

        def extra():
            held = [b.buffer for b in sgd.reducer.buckets] if sgd.reducer is not None else []
            strategy = sgd.strategy
            return held + list(getattr(strategy, "grads", [])) + list(getattr(strategy, "values", []))
    g = torch.Generator().manual_seed(1 + seed)
    data = torch.randint(0, 256, (8, args.batch_size, args.block_size + 1), generator=g)

    held = [0]

    def step(i: int) -> None:
        batch = data[i % len(data)]
        loss = F.cross_entropy(forward(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        clip(model.parameters(), 1.0)
        stepper.step()
        if measure:
            held[0] = holds()  # with the step's gradients, before zero_grad
        stepper.zero_grad(set_to_none=name != "ddp")  # DDP's gradients are its buckets: keep them

    def holds():
        tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
        tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors += [p.grad for g in opt.param_groups for p in g["params"]]
        return held_bytes(tensors + extra())

    return model, step, lambda: held[0]


def memory_rank(rank: int, world_size: int, name: str, args) -> dict:
    torch.set_num_threads(1)
    pin_mmap_threshold()
    before = vm_hwm_mib()
    model, step, holds = build(name, args)
    params = sum(p.numel() for p in model.parameters())
    import time

    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)  # with the count of the bytes held: not the steps benchmark
    return {"contestant": name, "rank": rank, "params": params, "bytes": holds(), "peak_mib": vm_hwm_mib(),
            "start_mib": before, "step_s": statistics.median(times[1:] or times)}


def bytes_rank(rank: int, world_size: int, name: str, args) -> dict:
    """Wire bytes per step troupe's Communicators counted (the job's and its groups': the World's totals),
    by operation."""
    import troupe

    torch.set_num_threads(1)
    model, step, _ = build(name, args, measure=False)
    traffic = troupe.init().traffic
    step(0)
    before = {op: t.wire_bytes for op, t in traffic.items()}
    for i in range(1, 1 + args.steps):
        step(i)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {op: (t.wire_bytes - before.get(op, 0)) / args.steps / grad_bytes for op, t in traffic.items()}


def steps_rank(rank: int, world_size: int, names: list[str], args) -> list:
    import troupe
    from troupe.observe.turns import Contestant, Schedule, run_ab

    torch.set_num_threads(1)
    contestants = [Contestant(n, build(n, args, measure=False)[1]) for n in names]
    results = run_ab(contestants, Schedule(reps=args.reps, steps=args.per_rep, burnin=2), troupe.init().comm)
    return [(m.contestant, m.rep, m.metric, m.value) for m in results]


def run(fn, world_size: int, *fn_args, timeout: float = 3600.0):
    sys.path.insert(0, str(ROOT))
    from troupe.runtime.spawn import run_ranks

    return run_ranks(fn, world_size, *fn_args, timeout=timeout, env={"TROUPE_TIMEOUT": "1800"})


def memory(args) -> list[dict]:
    rows = []
    for name in args.contestants:
        ranks = run(memory_rank, args.n, name, args)
        params = ranks[0]["params"]
        ideal = IDEAL[name](args.n) * params
        row = {"contestant": name, "params": params, "ranks": args.n,
               "bytes_per_rank_mib": [round(r["bytes"] / 2**20, 1) for r in ranks],
               "bytes_per_param": round(max(r["bytes"] for r in ranks) / params, 3),
               "vs_ideal": round(max(r["bytes"] for r in ranks) / ideal, 4),
               "peak_mib": [round(r["peak_mib"]) for r in ranks],
               "peak_over_start_mib": [round(r["peak_mib"] - r["start_mib"]) for r in ranks],
               "step_s": round(max(r["step_s"] for r in ranks), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def steps(args) -> None:
    out = run(steps_rank, args.n, list(args.contestants), args)[0]
    names = list(args.contestants)
    per = {n: statistics.median(v for c, _, m, v in out if m == "step_time" and names[c] == n) for n in names}
    base = per[names[0]]
    for n in names:
        sent = [v for c, _, m, v in out if m == "bytes_sent" and names[c] == n]
        print(json.dumps({"contestant": n, "step_s": round(per[n], 4), "vs_first": round(per[n] / base, 3),
                          "reps": args.reps}), flush=True)


def wire(args) -> None:
    n = args.n
    for name in args.contestants:
        ops = run(bytes_rank, n, name, args)[0]
        print(json.dumps({"contestant": name, "ranks": n, "per_step_in_gradient_bytes": round(sum(ops.values()), 4),
                          "by_op": {k: round(v, 4) for k, v in sorted(ops.items())},
                          "all_reduce_alone": round(2 * (n - 1) / n, 4)}), flush=True)


def fits(args) -> None:
    """Per contestant, the most layers (at --dim) whose rank peak stays under --limit-mib."""
    for name in args.contestants:
        best = None
        for layers in args.layer_grid:
            sized = argparse.Namespace(**{**vars(args), "layers": layers, "steps": 2})
            ranks = run(memory_rank, args.n, name, sized)
            peak = max(r["peak_mib"] for r in ranks)
            ok = peak <= args.limit_mib
            print(json.dumps({"contestant": name, "layers": layers, "params": ranks[0]["params"],
                              "peak_mib": round(peak), "fits": ok}), flush=True)
            if not ok:
                break
            best = (layers, ranks[0]["params"])
        print(json.dumps({"contestant": name, "largest_fitting": best, "limit_mib": args.limit_mib}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["memory", "steps", "fits", "bytes"])
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--contestants", type=lambda s: s.split(","), default=list(CONTESTANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="memory: steps per world")
    p.add_argument("--reps", type=int, default=11, help="steps: repetitions")
    p.add_argument("--per-rep", type=int, default=3, help="steps: measured steps per repetition and contestant")
    p.add_argument("--limit-mib", type=float, default=1024.0, help="fits: the peak a rank may reach")
    p.add_argument("--layer-grid", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 12, 16, 24, 32])
    args = p.parse_args()
    {"memory": memory, "steps": steps, "fits": fits, "bytes": wire}[args.what](args)


if __name__ == "__main__":
    main()
