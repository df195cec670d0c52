"""The planner's pick under a memory budget against the measured fastest plan that fits.

    python benchmarks/plan_memory.py --sizes 256 768 1536 --budgets 0.7 0.45 0.3 --reps 11

Per model size, one job of 4 processes on loopback (2 worker groups of 2 where k = 2), AdamW (2 slots):

1. every rank profiles the model at once (as they will train); rank 0's profile is the job's;
2. for each budget (a fraction of what plain data parallelism needs per worker, as the planner prices
   it) the planner lists its candidates (`candidates(..., options=("plain", "shard"), memory=budget)`:
   data parallel, each k's best plan, its best within the budget and the hand plans, each plain and
   with the shard modes a sharded DistOpt offers it) and picks the fastest that fits, with the named
   link's constants (`--link`, default loopback, as ``troupe.partition(model, "auto")`` does), or with
   ``--link job`` with this job's costs timed in the step first (`instep.calibrate`, as
   ``troupe.partition(model, "auto", link="job")`` does). Full
   parameter sharding (troupe.shard) is left out of both lists: it is not a partition plan;
3. every candidate of every budget (each once) is built and trained, all taking turns step by step in the
   same processes (`troupe.observe.turns.run_ab`: burn-in, then `--reps` repetitions of `--steps` steps,
   order reversed every other step, a barrier before each step, the slowest rank's time; the median
   per repetition, then the median over repetitions);
4. each candidate's model state is counted after a step, before zero_grad (parameters, gradients,
   optimizer state and troupe's buckets and shards, each storage once; the rank holding the most):
   a candidate fits a budget when that count does. The pick is scored against the fastest measured
   candidate that fits: goal, it fits, and its step is within 15% of that one's.

The model: an MLP 784 -> d -> d -> d -> 10 with a LayerNorm after the first layer (replicated), batch 32
per worker, synthetic data. Each process's peak resident set (VmHWM, glibc's mmap threshold pinned to
128 KiB) is printed too, for all candidates together (they live in the same processes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WORKERS, BATCH, SLOTS = 4, 32, 2


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.norm = nn.Linear(784, d), nn.LayerNorm(d)
        self.fc2, self.fc3, self.fc4 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)

    def forward(self, x):
        h = torch.relu(self.norm(self.fc1(x)))
        return self.fc4(torch.relu(self.fc3(torch.relu(self.fc2(h)))))


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and torch.is_tensor(t) and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def troupe_buffers(sgd) -> list:
    """The gradient buffers a DistOpt keeps beside the parameters: buckets, shards, a partitioned model's flats."""
    out = [b.buffer for b in sgd.reducer.buckets] if sgd.reducer is not None else []
    strategy = sgd.strategy
    out += list(getattr(strategy, "grads", []))
    slices = getattr(strategy, "slices", None)
    if slices is not None:
        out += [t for s in slices.sets for t in (s.flat, s.grad)]
    holders = getattr(strategy, "holders", None)
    if holders is not None:
        out += [flat for flat, _ in (f for f in holders.flats if f is not None)]
    return out


def build(cand: dict, size: int, data):
    """One candidate's model and DistOpt; (contestant, a function giving the bytes it held after its last step)."""
    import troupe
    from troupe.observe.turns import Contestant

    torch.manual_seed(0)
    model = MLP(size)
    if cand["k"] > 1:
        troupe.partition(model, cand["plan"], workers_per_group=cand["k"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = troupe.DistOpt(opt, shard=cand["shard"])
    held = [0]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        F.cross_entropy(model(x), y).backward()
        sgd.step()
        tensors = [t for p in model.parameters() for t in (p, p.grad)]
        tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors += [t for g in opt.param_groups for p in g["params"] for t in (p, p.grad)]
        held[0] = held_bytes(tensors + troupe_buffers(sgd))
        sgd.zero_grad()

    return Contestant(cand["name"], step), lambda: held[0]


def plan_candidates(profile, budgets: list[float], setup_args: dict) -> tuple[list[dict], list[dict]]:
    """(every candidate of every budget, each once; the pick of each budget, as an index into the first list)."""
    from troupe.partition.planner import candidates, pick

    listed: dict[tuple, dict] = {}
    picks = []
    for budget in budgets:
        cands = [c for c in candidates(profile, WORKERS, options=("plain", "shard"), optimizer_slots=SLOTS,
                                       memory=budget, **setup_args) if c.option != "shard:parameters"]
        for c in cands:
            key = (c.workers_per_group, c.dims, c.option)
            listed.setdefault(key, {"name": f"k={c.workers_per_group} {c.dims_text()} {c.option}", "planner_name": c.name, "k": c.workers_per_group, "plan": c.plan,
                                    "dims": c.dims_text(), "option": c.option,
                                    "shard": c.option.split(":")[1] if c.regime == "shard" else None,
                                    "predicted_s": c.seconds, "predicted_state": c.state_bytes})
        chosen = pick(cands, memory=budget)
        picks.append({"budget": budget, "key": (chosen.workers_per_group, chosen.dims, chosen.option)})
    keys = list(listed)
    return [listed[k] for k in keys], [{"budget": p["budget"], "pick": keys.index(p["key"])} for p in picks]


def worker(rank: int, world_size: int, size: int, fractions: list[float], args: argparse.Namespace) -> dict | None:
    import troupe
    from troupe.observe.turns import Schedule, run_ab
    from troupe.partition.planner import Setup, instep, parse_link, profile_model
    from troupe.partition.planner.memory import state_bytes

    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: freed buffers go back (docs/sharding.md)
    world = troupe.init()
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(4)]
    profile = profile_model(MLP(size), data[0][0], [1, 2, 4], reps=5)
    profile = world.comm.all_gather_object(profile)[0]
    link = parse_link("loopback" if args.link == "job" else args.link)
    plain = state_bytes(profile, tuple(0 for _ in profile.layers), Setup(world_size=WORKERS, link=link,
                                                                         optimizer_slots=SLOTS))
    setup_args: dict = {"link": link}
    if args.link == "job":  # this job's costs, timed in the step first (as troupe.partition(.., "auto", link="job"))
        measured = instep.calibrate(world.comm, local_step(size, data), reps=args.reps, steps=args.steps, burnin=2)
        profile, setup_args = measured.scaled(profile), measured.setup_args()
    cands, picks = plan_candidates(profile, [f * plain for f in fractions], setup_args)
    made = [build(c, size, data) for c in cands]
    measured = run_ab([c for c, _ in made], Schedule(reps=args.reps, steps=args.steps, burnin=2, align=True),
                      world.comm)
    held = torch.tensor([float(h()) for _, h in made], dtype=torch.float64)
    world.comm.all_reduce(held, "max")
    hwm = torch.tensor([vm_hwm_mib()], dtype=torch.float64)
    world.comm.all_reduce(hwm, "max")
    if rank != 0:
        return None
    for i, c in enumerate(cands):
        c["step_s"] = statistics.median(m.value for m in measured if m.contestant == i and m.metric == "step_time")
        c["held"] = float(held[i])
    params = sum(p.numel() for p in MLP(size).parameters())
    return {"size": size, "link": args.link, "params": params, "plain_state": plain, "candidates": cands, "picks": picks,
            "peak_mib": float(hwm)}


def local_step(size: int, data):
    """The model's step without communication (what `instep` calibrates the profile's compute by)."""
    torch.manual_seed(0)
    model = MLP(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def score(result: dict, fractions: list[float]) -> list[dict]:
    """Per budget: the pick, the measured fastest candidate that fits, and the goals."""
    rows = []
    cands = result["candidates"]
    for fraction, p in zip(fractions, result["picks"]):
        budget = p["budget"]
        fitting = [c for c in cands if c["held"] <= budget]
        chosen = cands[p["pick"]]
        best = min(fitting, key=lambda c: c["step_s"]) if fitting else None
        rows.append({"size": result["size"], "params": result["params"], "budget_fraction": fraction,
                     "budget_mib": budget / 2**20, "pick": chosen["name"], "pick_ms": chosen["step_s"] * 1e3,
                     "pick_held_mib": chosen["held"] / 2**20, "pick_fits": chosen["held"] <= budget,
                     "fastest": None if best is None else best["name"],
                     "fastest_ms": None if best is None else best["step_s"] * 1e3,
                     "ratio": None if best is None else chosen["step_s"] / best["step_s"],
                     "candidates": len(cands), "fitting": len(fitting)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 768, 1536], help="the MLP's width d")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.7, 0.45, 0.3],
                   help="memory budgets, as fractions of plain data parallelism's model state per worker")
    p.add_argument("--link", default="loopback", help="the planner's link: a troupe plan --link spelling, or 'job'")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="append the results (JSON lines) here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from troupe.runtime.spawn import run_ranks

    for size in args.sizes:
        result = run_ranks(worker, WORKERS, size, args.budgets, args, timeout=3600,
                           env={"TROUPE_TIMEOUT": "1800"})[0]
        for c in result["candidates"]:
            print(json.dumps({"size": size, **{k: v for k, v in c.items() if k != "plan"}}), flush=True)
        rows = score(result, args.budgets)
        for row in rows:
            print(json.dumps(row), flush=True)
        print(json.dumps({"size": size, "peak_mib_per_process": result["peak_mib"]}), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"result": result, "scores": rows}) + "\n")


if __name__ == "__main__":
    main()
