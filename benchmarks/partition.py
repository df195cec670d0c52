"""Krizhevsky's "one weird trick" (2014) on simulated hosts: data parallel vs partitioned.

    python benchmarks/partition.py --links loopback 1gbit 100mbit --workloads cnn fcnet \
        --out benchmarks/results/partition.jsonl

Four workers (one process per simulated host; "loopback": four local processes) train
the same model under several plans, taking turns step by step in the same processes
(`troupe.observe.turns.run_ab`: burn-in, then repetitions of measured steps, order
reversed every other step, aligned by a barrier before every step; the slowest rank's
time per step; median per repetition):

* ``data``:      every worker the whole model, gradients all-reduced (DistOpt, plain);
* ``data fp16``: the same with fp16 gradients;
* ``hybrid kK``: groups of K workers, convolutions split the batch (dim 0) and the
                 linear layers their output features (dim 1): the weird trick;
* ``model k4``:  one group of 4, every layer split by features (dim 1);
* ``planner pick``: what `troupe plan --link LINK` picks (the named link's constants);
* ``planner pick (in-step)``: what the planner picks with this job's costs measured in
                 the step first (`instep.calibrate`, as ``troupe.partition(.., "auto", link="job")``).

Workloads: "cnn", the example's MNIST CNN (its linear layers hold 95% of its 431k
parameters), and "fcnet", an AlexNet-style net whose three linear layers hold 97.5% of
2.1M parameters; batch 32 per worker, MNIST-shaped synthetic data for timing. Every
plan computes the same function (tests/dist/test_partition_train.py), so training loss
per step is the same for all plain-fp32 plans: `--steps-to-loss` trains data and hybrid
side by side on real MNIST on loopback and records the step at which each reached the
loss, to turn step time into time to that loss. Records: troupe bench JSON lines.

The planner's prediction of every plan is printed twice: with the link `--link` names,
and with the link as a step in this job sees it: the calibration contestants of
`troupe.partition.planner.instep` (the local step followed by each kind of collective,
and by DistOpt reductions of two sizes) take the same turns as the plans.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKERS = 4
BATCH = 32


def fcnet():
    """AlexNet's shape, small: two convolutions, then three linear layers holding 97.5% of the parameters."""
    import torch.nn.functional as F
    from torch import nn

    class FCNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 5), nn.Conv2d(32, 64, 5)
            self.linear1, self.linear2, self.linear3 = nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)

        def forward(self, x):
            y = F.max_pool2d(F.relu(self.conv1(x)), 2)
            y = F.max_pool2d(F.relu(self.conv2(y)), 2).flatten(1)
            return self.linear3(F.relu(self.linear2(F.relu(self.linear1(y)))))

    return FCNet()


def make_model(name: str):
    if name == "fcnet":
        return fcnet()
    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import CNN

    return CNN()


HYBRID = {"conv*": 0, "linear*": 1}
PLANS = {  # name -> (workers per group, plan, dist_option)
    "data": (1, 0, "plain"),
    "data fp16": (1, 0, "fp16"),
    "hybrid k2": (2, HYBRID, "plain"),
    "hybrid k4": (4, HYBRID, "plain"),
    "model k4": (4, {"*": 1}, "plain"),
}


def contestant(name: str, workload: str, batches, seed: int = 0, plans: dict | None = None):
    """One plan's model and DistOpt; its step trains batch i (this worker's share)."""
    import torch
    import torch.nn.functional as F

    import troupe
    from troupe.observe.turns import Contestant

    k, plan, option = (plans or PLANS)[name]
    torch.manual_seed(seed)
    model = make_model(workload)
    if k > 1:
        troupe.partition(model, concrete(model, plan, k), workers_per_group=k)
    sgd = troupe.DistOpt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def step(i: int) -> dict[str, float]:
        x, y = batches[i % len(batches)]
        before = sgd.communicator.bytes_sent()
        sgd.update(F.cross_entropy(model(x), y), option)
        return {"wire_bytes": float(sgd.communicator.bytes_sent() - before)}

    params = sum(p.numel() for p in model.parameters())
    return Contestant(name, step, {"workers_per_group": k, "option": option, "param_elements": params}), model, sgd


def worker(args: argparse.Namespace) -> None:
    import torch

    import troupe
    from troupe.bench.suites.common import to_records
    from troupe.observe.turns import Schedule, run_ab
    from troupe.partition.planner import instep

    torch.set_num_threads(1)
    world = troupe.init()
    x, y = troupe.data.synthetic(BATCH * 8, seed=world.rank)
    batches = [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(8)]
    plans, profile = choose_plans(args, world, batches[0][0])
    local = local_contestant(args.workload, batches)
    plans[PICK_IN_STEP] = pick_in_step(world, profile, local, batches, args)
    made, dims = [local], {}
    for name in plans:
        c, model, _ = contestant(name, args.workload, batches, plans=plans)
        dims[name] = dims_of(model)
        c.params["dims"] = ",".join(map(str, dims[name]))
        made.append(c)
    made += instep.probes(world.comm, local.step)
    schedule = Schedule(reps=args.reps, steps=args.steps, burnin=args.burnin, align=True)
    measured = run_ab(made, schedule, world.comm)
    records = to_records(measured, made, benchmark="partition", workload=args.workload,
                         params={"link": args.link, "batch_size": BATCH}, world_size=world.world_size)
    if world.rank == 0:
        for r in records:
            print("RECORD " + r.to_json(), flush=True)
        print("PRED " + json.dumps(predict(args, plans, dims, profile, records, world.world_size)), flush=True)
    if args.steps_to_loss:
        steps_to_loss(args, world)


PICK = "planner pick"
PICK_IN_STEP = "planner pick (in-step)"


def concrete(model, plan, k: int) -> dict[str, int]:
    """`plan` resolved per layer (troupe's own rule, checked for k = 1), dim 1 only where k divides
    the layer's outputs, as the planner's hand plans do (10 classes cannot be split 4 ways, nor
    the example's 50 filters)."""
    from troupe.partition.plan import out_size, resolve_plan

    dims = resolve_plan(model, plan, 1)
    return {name: 0 if dim == 1 and out_size(model.get_submodule(name)) % k else dim for name, dim in dims.items()}


def dims_of(model) -> list[int]:
    """partition_dim of each Linear/Conv2d layer in forward-definition order."""
    import troupe

    return [row.partition_dim for row in troupe.partition.describe(model) if row.type in ("Linear", "Conv2d")]


def choose_plans(args: argparse.Namespace, world, sample):
    """The plans to measure, the planner's pick added, and the profile (rank 0's). Every rank
    profiles at once, as they will train (4 processes sharing this machine's cores)."""
    from troupe.partition.planner import candidates, parse_link, pick, profile_model

    profile = profile_model(make_model(args.workload), sample, workers_per_group=[1, 2, 4], reps=5)
    chosen = pick(candidates(profile, WORKERS, parse_link(args.link)))
    profile, k, plan = world.comm.all_gather_object((profile, chosen.workers_per_group, chosen.plan))[0]
    plans = {name: PLANS[name] for name in args.plans}
    plans[PICK] = (k, plan, "plain")
    return plans, profile


def pick_in_step(world, profile, local, batches, args: argparse.Namespace):
    """The planner's pick with the job's own costs: the calibration contestants run first (in
    their own aligned turns with the local step), then the same search as `troupe plan`."""
    from troupe.partition.planner import candidates, instep, pick

    measured = instep.calibrate(world.comm, local.step, reps=args.reps, steps=args.steps, burnin=args.burnin)
    chosen = pick(candidates(measured.scaled(profile), WORKERS, **measured.setup_args()))
    k, plan = world.comm.all_gather_object((chosen.workers_per_group, chosen.plan))[0]
    return k, plan, "plain"


def predict(args: argparse.Namespace, plans: dict, dims: dict, profile, records, world_size: int) -> dict:
    """Predicted step seconds of each plan, the profile's compute calibrated once by the measured
    "local" step (no communication: the same model, loss and optimizer step on b samples); with
    the link `--link` names, and with the link as a step in this job sees it (the calibration
    contestants, measured in the same turns: `troupe.partition.planner.instep`)."""
    import statistics

    from troupe.partition.planner import Setup, instep, parse_link, plan_cost

    def median(name: str) -> float:
        return statistics.median(r.value for r in records if r.contestant == name and r.metric == "step_time")

    link = parse_link(args.link)
    in_step = instep.solve({instep.LOCAL: median(LOCAL), **{name: median(name) for name in instep.NAMES}},
                           world_size)
    scaled = in_step.scaled(profile)
    factor = in_step.local / plan_cost(profile, [0] * len(profile.layers), Setup(world_size=1, link=link)).seconds
    out = {"compute_factor": factor, "in_step": in_step.to_json()}
    for name, (k, _, option) in plans.items():
        setup = Setup(world_size=WORKERS, workers_per_group=k, link=link, option=option)
        out[name] = {"seconds": plan_cost(scaled, dims[name], setup).seconds, "dims": dims[name], "k": k,
                     "seconds_in_step": plan_cost(scaled, dims[name], in_step.apply(setup)).seconds}
    return out


LOCAL = "local (no communication)"


def local_contestant(workload: str, batches):
    """The model's step without any communication: what the planner's compute is calibrated by."""
    import torch
    import torch.nn.functional as F

    from troupe.observe.turns import Contestant

    torch.manual_seed(0)
    model = make_model(workload)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return Contestant(LOCAL, step, {"workers_per_group": 1, "option": "none"})


def steps_to_loss(args: argparse.Namespace, world) -> None:
    """Train "data" and "hybrid k2" side by side on real MNIST; the step at which each reached the loss."""
    import torch
    import torch.nn.functional as F

    import troupe

    train_x, train_y, _, _ = troupe.data.load_mnist()
    x, y = troupe.data.partition(train_x, train_y, world.rank, world.world_size)
    reached: dict[str, int | None] = {}
    for name in ("data", "hybrid k2"):
        _, model, sgd = contestant(name, args.workload, [])
        average, reached[name] = None, None
        for step in range(args.max_loss_steps):
            sel = slice((step * BATCH) % (len(x) - BATCH), (step * BATCH) % (len(x) - BATCH) + BATCH)
            loss = F.cross_entropy(model(x[sel]), y[sel])
            sgd.update(loss, "plain")
            mean = torch.tensor([loss.item()])
            world.comm.all_reduce(mean, "mean")
            average = mean.item() if average is None else 0.9 * average + 0.1 * mean.item()
            if step >= 10 and average < args.loss:
                reached[name] = step + 1
                break
    if world.rank == 0:
        print("STEPS " + json.dumps({"workload": args.workload, "loss": args.loss, "steps": reached}), flush=True)


def _lines(out: str, tag: str) -> list[dict]:
    return [json.loads(line[len(tag) + 1:]) for line in out.splitlines() if line.startswith(tag + " ")]


def launch(args: argparse.Namespace, workload: str, link: str) -> str:
    """Run the worker on 4 local processes (loopback) or 4 simulated hosts; its stdout (rank 0's)."""
    from troupe.bench.jobs import run_job

    flags = ["--worker", "--workload", workload, "--link", link, "--reps", str(args.reps), "--steps",
             str(args.steps), "--burnin", str(args.burnin), "--plans", *args.plans]
    if args.steps_to_loss and link == "loopback":
        flags += ["--steps-to-loss", "--loss", str(args.loss)]
    job = run_job(["benchmarks/partition.py", *flags], WORKERS, link=None if link == "loopback" else link,
                  delay=args.delay, env={"TROUPE_TIMEOUT": "600"}, timeout=3600)
    return job.check(3000 if link == "loopback" else 1500).stdout


def prediction_table(records, predicted: dict) -> str:
    """Predicted vs measured step time per plan (measured: the median over repetitions)."""
    import statistics

    from troupe.bench import render

    rows = []
    for name, p in predicted.items():
        if name in ("compute_factor", "in_step"):
            continue
        values = [r.value for r in records if r.contestant == name and r.metric == "step_time"]
        if not values:
            continue
        measured = statistics.median(values)
        in_job = p["seconds_in_step"]
        rows.append([name, p["k"], ",".join(map(str, p["dims"])), f"{p['seconds'] * 1e3:.1f}",
                     f"{in_job * 1e3:.1f}", f"{measured * 1e3:.1f}", f"{measured / p['seconds']:.2f}",
                     f"{measured / in_job:.2f}"])
    cal = predicted["in_step"]
    ra, rb = cal["reduce"]
    kinds = ", ".join(f"{kind} {a * 1e3:.2f} ms + {b * 1e9:.2f} ns/B" for kind, (a, b) in cal["exchanges"].items()
                      if kind != "send")
    return (f"compute calibrated by the local step: x{predicted['compute_factor']:.2f} the profile; in the step: "
            f"sync {cal['sync_s'] * 1e3:.2f} ms, reductions {ra * 1e3:.2f} ms + {rb * 1e9:.2f} ns/B, {kinds}\n\n"
            + render.markdown(["plan", "k", "dims", "predicted ms (--link)", "predicted ms (in-step calibration)",
                               "measured ms", "measured / predicted (--link)", "measured / predicted (in-step calibration)"],
                              rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--workloads", nargs="+", default=["cnn", "fcnet"])
    p.add_argument("--links", nargs="+", default=["loopback", "1gbit", "100mbit"])
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--burnin", type=int, default=2)
    p.add_argument("--delay", default=None, help="netem delay per link, e.g. 1ms")
    p.add_argument("--steps-to-loss", action="store_true", help="also measure steps to --loss on real MNIST (loopback)")
    p.add_argument("--loss", type=float, default=0.5)
    p.add_argument("--max-loss-steps", type=int, default=2000, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="append the records (JSON lines) here")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from troupe.bench import render
    from troupe.bench.records import Record, save, stamp

    run = stamp(ROOT)
    for workload in args.workloads:
        for link in args.links:
            out = launch(args, workload, link)
            records = [Record.from_dict(r) for r in _lines(out, "RECORD")]
            if args.out:
                save(args.out, records, run)
            for s in _lines(out, "STEPS"):
                print(json.dumps(s), flush=True)
            print(f"\n{workload}, {link}:\n" + render.long_table(records, label="plan", reference="data"), flush=True)
            for pred in _lines(out, "PRED"):
                print(prediction_table(records, pred), flush=True)
                if args.out:
                    with open(Path(args.out).with_suffix(".predicted.jsonl"), "a") as f:
                        f.write(json.dumps({"workload": workload, "link": link, "predicted": pred}) + "\n")


if __name__ == "__main__":
    main()
