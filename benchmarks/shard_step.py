"""troupe.shard + DistOpt against FSDP2 used directly: step time, model-state bytes and peak memory per rank.

    python benchmarks/shard_step.py time --nproc 4 --reps 11 --steps 10 --burnin 3
    python benchmarks/shard_step.py time --nproc 4 --groups 2 --reps 11 --steps 10 --burnin 3
    python benchmarks/shard_step.py memory --nproc 4 --steps 3

The model is GPT-shaped without attention (an embedding tied to the output layer, `--layers`
residual MLP blocks of width `--dim`, LayerNorm), AdamW with a decay and a no-decay group, one
thread per rank, Gloo. Both contestants shard every block and then the root on the same mesh
(1-D over the job, or (replicate, shard) with `--groups G`) from the same initial values.

``time``: one world; the contestants train separate copies of the model on the same batches,
step by step in turns (`troupe.observe.turns.run_ab`: order reversed every other step and
repetition; each value is the median over a repetition's steps of the slowest rank's step; the
table gives the median over repetitions). A step is the PyTorch loop: forward, backward,
``step()``, ``zero_grad()``.

``memory``: each contestant in a fresh world; per rank, the model-state bytes counted from the
tensors held after the last step's backward (local parameter shards, gradient shards, optimizer
state) and the peak resident set (VmHWM) of the process. With `--mmap-threshold` glibc's mmap
threshold is pinned in each rank (``mallopt(M_MMAP_THRESHOLD, ...)``) so that freed gathered
blocks go back to the OS (docs/sharding.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("troupe.shard", "FSDP2")


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class MLPLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4)


def contestant(kind: str, args, mesh=None):
    """(model, optimizer, mesh) of one kind, from seed 0's initial values on every rank."""
    import troupe

    torch.manual_seed(0)
    model = MLPLM(args.vocab, args.dim, args.layers)
    if kind == "troupe.shard":
        model = troupe.shard(model, groups=args.groups)
        opt = troupe.DistOpt(adamw(model))
        return model, opt, next(model.parameters()).device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = _mesh(args.groups)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, adamw(model), mesh


def _mesh(groups: int):
    """The mesh troupe.shard would make, made by torch (for the memory mode's FSDP2-alone world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    if groups == 1:
        return init_device_mesh("cpu", (n,))
    return init_device_mesh("cpu", (groups, n // groups), mesh_dim_names=("replicate", "shard"))


def batches(args, world_size: int, rank: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (count, world_size * args.batch, args.seq + 1), generator=g)
    return tokens[:, rank * args.batch:(rank + 1) * args.batch]


def train_step(model, opt, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_rank(rank: int, world_size: int, args) -> dict:
    import troupe
    from troupe.observe.turns import Contestant, Schedule, run_ab

    model_a, opt_a, mesh = contestant(KINDS[0], args)
    model_b, opt_b, _ = contestant(KINDS[1], args, mesh)
    schedule = Schedule(reps=args.reps, steps=args.steps, burnin=args.burnin, align=True)
    data = batches(args, world_size, rank, schedule.burnin + schedule.reps * schedule.steps)
    runs = [Contestant(KINDS[0], lambda i: train_step(model_a, opt_a, data[i])),
            Contestant(KINDS[1], lambda i: train_step(model_b, opt_b, data[i]))]
    measured = run_ab(runs, schedule, troupe.init().job)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model_a.parameters(),
                                                                               model_b.parameters()))
    out: dict = {"same_parameters": same, "params": sum(p.numel() for p in model_a.parameters())}
    for m in measured:
        if m.metric == "step_time":
            out.setdefault(KINDS[m.contestant], []).append(m.value)
    return out


def memory_rank(rank: int, world_size: int, args, kind: str) -> dict:
    if args.mmap_threshold:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, args.mmap_threshold)  # M_MMAP_THRESHOLD
    model, opt, _ = contestant(kind, args)
    data = batches(args, world_size, rank, args.steps)
    held = 0
    for i in range(args.steps):
        logits = model(data[i][:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[i][:, 1:].reshape(-1)).backward()
        opt.step()
        if i == args.steps - 1:
            held = model_state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
    return {"model_state_bytes": held, "vmhwm_kib": vmhwm_kib(), "params": sum(p.numel() for p in model.parameters())}


def model_state_bytes(model: nn.Module, opt) -> int:
    """Bytes of this rank's parameter shards, gradient shards and optimizer state (distinct storages)."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                add(v)
    return sum(seen.values())


def vmhwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("time", "memory"))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--groups", type=int, default=1, help="worker groups (HSDP); 1: one sharded copy")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--burnin", type=int, default=3)
    parser.add_argument("--mmap-threshold", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the raw results (JSON) to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from troupe.runtime.spawn import run_ranks

    shape = (f"{args.nproc} ranks" + (f" ({args.groups} groups)" if args.groups > 1 else "") +
             f", vocab {args.vocab}, dim {args.dim}, {args.layers} blocks, {args.batch}x{args.seq} tokens per rank")
    if args.mode == "time":
        result = run_ranks(time_rank, args.nproc, args, threads=1, timeout=3000)[0]
        a, b = (statistics.median(result[k]) for k in KINDS)
        print(f"\n{shape}, {result['params']:,} parameters; reps {args.reps} x {args.steps} steps; "
              f"same parameters at the end: {result['same_parameters']}\n")
        print("| contestant | step ms (median of reps) | min..max of reps |\n|---|---|---|")
        for k in KINDS:
            print(f"| {k} | {statistics.median(result[k]) * 1e3:.1f} | "
                  f"{min(result[k]) * 1e3:.1f}..{max(result[k]) * 1e3:.1f} |")
        paired = statistics.median(x / y for x, y in zip(result[KINDS[0]], result[KINDS[1]]))
        print(f"\ntroupe.shard / FSDP2: {a / b:.3f}x (medians); median of the per-repetition ratios {paired:.3f}x")
    else:
        result = {}
        print(f"\n{shape}; after {args.steps} steps, mmap threshold {args.mmap_threshold or 'glibc default'}\n")
        print("| contestant | model-state MiB per rank | VmHWM MiB per rank |\n|---|---|---|")
        for kind in KINDS:
            per_rank = run_ranks(memory_rank, args.nproc, args, kind, threads=1, timeout=900)
            result[kind] = per_rank
            state = ", ".join(f"{r['model_state_bytes'] / 2**20:.1f}" for r in per_rank)
            peak = ", ".join(f"{r['vmhwm_kib'] / 1024:.0f}" for r in per_rank)
            print(f"| {kind} | {state} | {peak} |", flush=True)
        print(f"\n{per_rank[0]['params']:,} parameters; fp32 AdamW unsharded: "
              f"{16 * per_rank[0]['params'] / 2**20:.1f} MiB (16 bytes per parameter)")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "result": result}) + "\n")


if __name__ == "__main__":
    main()
