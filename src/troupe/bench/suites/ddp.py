"""ddp: a troupe DistOpt step vs a PyTorch DDP step, side by side in one world.

Per workload (default: the example's MNIST CNN and ResNet-18 with CIFAR shapes), the
contestants train separate copies of the same model (same initial weights) on the same
batches with the same optimizer, taking turns step by step (`engine`): DDP (its
defaults: bucket_cap_mb 25), troupe at each bucket size of ``--sweep`` (default 2**19
elements, passed explicitly so the label says what ran), and with ``--local`` / ``--flat`` the model without communication
and with one flat all-reduce after backward.
"""

from __future__ import annotations

from troupe.bench import contestants as kinds
from troupe.bench import render, workloads
from troupe.observe.turns import Contestant, run_ab
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.suites.common import batches_for, schedule, to_records

STEPS = {"cnn": 30, "resnet18": 6}
"""Measured steps per repetition when --steps is not given (a ResNet-18 step is ~15x the CNN's)."""
BURNIN = {"cnn": 5, "resnet18": 2}


def per_workload(options: Options, name: str) -> Options:
    """--steps/--burnin as given, else this workload's default."""
    import dataclasses

    return dataclasses.replace(options, steps=options.steps or STEPS.get(name, 20),
                               burnin=options.burnin if options.burnin is not None else BURNIN.get(name, 3))


def build(workload: workloads.Workload, options: Options, rank: int, world_size: int) -> tuple[list[Contestant], dict]:
    """The contestants of one workload (every rank builds them in the same order: each broadcasts)."""
    batch_size, data, batches = batches_for(workload, options, rank, world_size)
    made = [kinds.ddp(workload, batches, seed=options.seed)]
    made += [kinds.troupe_opt(workload, batches, seed=options.seed, bucket_size=b) for b in options.sweep]
    made.append(kinds.troupe_opt(workload, batches, seed=options.seed, bucket_size=options.sweep[0], loop="torch"))
    if options.flat:
        made.append(kinds.flat(workload, batches, seed=options.seed))
    if options.local:
        made.append(kinds.local(workload, batches, seed=options.seed))
    params = {"batch_size": batch_size, "data": data, "steps": options.steps, "burnin": options.burnin}
    return made, params


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if world_size < 2:
        raise ValueError("ddp compares communication: run it on 2 or more ranks (-n 2)")
    records = []
    for name in options.workloads:
        workload = workloads.get(name)
        opts = per_workload(options, name)
        made, params = build(workload, opts, rank, world_size)
        measured = run_ab(made, schedule(opts), world.init().comm)
        records += to_records(measured, made, benchmark="ddp", workload=name, params=params, world_size=world_size)
        del made
    return records


def table(records: list[Record], reference: str = "DDP") -> str:
    parts = []
    for rs in render.group(records, render.section_key).values():
        buckets = ("buckets", lambda name, rs=rs: str(render.param_of(rs, name, "buckets")))
        parts.append(render.run_line(rs) + "\n\n"
                     + render.long_table(rs, label="strategy", reference=reference, columns=[buckets]))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    render.plot_bars(records, out, title="step time: troupe DistOpt vs DDP")
