"""A parameter server's apply of one worker's update of the example CNN: one optimizer step per slice vs one fused.

    python benchmarks/ps_apply.py --reps 11 --steps 50 [--baseline /path/to/other/checkout/src]

One shard holds every slice of the CNN (one server, one worker per group as in Downpour, so each
update completes at once); a step is `ParamShard.update` of every slice, either one by one (each
completed update steps the optimizer) or inside `ParamShard.fused()` (one step at its end). The
contestants take turns step by step in this process, the order reversed every other step; a
repetition's value is the median of its steps, the table the median over repetitions.
`--baseline SRC` adds the ParamShard of another checkout (e.g. the commit before fusion).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from troupe.cluster.serving.shard import ParamShard, plan_slices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mnist_cnn import CNN  # noqa: E402


def make(shard_cls, params, nservers: int, foreach: bool | None):
    slices = [s for s in plan_slices([p.numel() for p in params], nservers) if s.server == 0]
    template = torch.optim.SGD([p.detach().clone() for p in params], lr=0.05, momentum=0.9, foreach=foreach)
    shard = shard_cls(slices, template, [0] * len(params), {0: {0}})
    for s in slices:
        shard.put(s.id, params[s.param].detach().reshape(-1)[s.start : s.stop])
    return shard, slices


def step_fn(shard, slices, grads, fused: bool):
    def send():
        for s in slices:
            shard.update(s.id, 0, grads[s.param][s.start : s.stop], shard.version[s.id])

    def step() -> None:
        if fused:
            with shard.fused():
                send()
        else:
            send()
    return step


def load_baseline(src: str):
    path = Path(src) / "troupe" / "cluster" / "serving" / "shard.py"
    spec = importlib.util.spec_from_file_location("baseline_shard", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ParamShard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--burn-in", type=int, default=10)
    p.add_argument("--nservers", type=int, default=1, help="servers per group; the shard is server 0's")
    p.add_argument("--baseline", help="src/ of another checkout: its ParamShard as a contestant")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = list(CNN().parameters())
    grads = [torch.randn(q.numel()) for q in params]
    contestants = {}
    if args.baseline:
        shard, slices = make(load_baseline(args.baseline), params, args.nservers, None)
        contestants["baseline (per slice)"] = step_fn(shard, slices, grads, fused=False)
    for name, fused, foreach in (("per slice", False, None), ("fused", True, None), ("fused, foreach", True, True)):
        shard, slices = make(ParamShard, params, args.nservers, foreach)
        contestants[name] = step_fn(shard, slices, grads, fused)
    names = list(contestants)
    for _ in range(args.burn_in):
        for name in names:
            contestants[name]()
    reps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.reps):
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.steps):
            order = names if (i + r) % 2 == 0 else names[::-1]
            for name in order:
                t = time.perf_counter()
                contestants[name]()
                times[name].append(time.perf_counter() - t)
        for name in names:
            reps[name].append(statistics.median(times[name]))
    ref = statistics.median(reps[names[0]])  # the baseline's when given, else one step per slice
    print(f"{len(slices)} slices of the CNN on server 0 of {args.nservers}; {args.reps} reps x {args.steps} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread")
    print(f"| contestant | median ms | min-max ms | vs {names[0]} |")
    print("| --- | --- | --- | --- |")
    for name in names:
        m = statistics.median(reps[name])
        print(f"| {name} | {m * 1e3:.3f} | {min(reps[name]) * 1e3:.3f}-{max(reps[name]) * 1e3:.3f} | {m / ref:.2f}x |")


if __name__ == "__main__":
    main()
