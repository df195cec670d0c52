"""graph: troupe's graph mode (the whole step compiled, all-reduce in the graph) vs eager troupe vs DDP.

Per workload (default: the example's MNIST CNN and ResNet-18 with CIFAR shapes) the
contestants (`troupe.bench.compiled`) train separate copies of the same model on the
same batches with the same optimizer, taking turns step by step (`engine`): DDP, DDP +
torch.compile, troupe with an eager model, troupe with the user's ``torch.compile(model)``
(split at buckets, and unsplit: one graph, one backward node) and
troupe's graph mode (``DistOpt.compile_step``, inductor), compiled throughout (``trial=0``) and as
a user gets it by default (its trial chooses the compiled or the eager step). Compilation and the
trial happen in the burn-in (12 steps: the optimizer's graph is rebuilt once its momentum exists,
then 5 compiled and 5 eager steps).
Besides step time, the eager-loop contestants report "exposed_time": the time from the end
of the backward's computation to the optimizer step (communication not hidden by it).
Ratios are to troupe with the eager model.
"""

from __future__ import annotations

import dataclasses

from troupe.bench import compiled as kinds
from troupe.bench import render, workloads
from troupe.observe.turns import run_ab
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.stats import summarize
from troupe.bench.suites.common import schedule, to_records
from troupe.graphstep import TRIAL_STEPS, WARMUP_STEPS

REFERENCE = "troupe (eager model)"
STEPS = {"cnn": 20, "resnet18": 3}
TRIAL = TRIAL_STEPS
"""Graph mode with its trial (what a user gets by default) is a contestant beside the compiled step."""


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if world_size < 2:
        raise ValueError("graph compares communication in and out of the graph: run it on 2 or more ranks (-n 2)")
    records = []
    for name in options.workloads:
        workload = workloads.get(name)
        # the burn-in covers graph mode's trial (compile, then TRIAL steps of each kind): what follows is its choice
        opts = dataclasses.replace(options, steps=options.steps or STEPS.get(name, 10),
                                   burnin=max(WARMUP_STEPS + 2 * TRIAL, options.burnin or 0))
        batch_size = opts.batch_size or workload.batch_size
        data = opts.data if opts.data in workload.datasets else workload.datasets[0]
        count = min(opts.burnin + opts.reps * opts.steps, 64)
        batches = workload.batches(rank, world_size, batch_size, count, data=data, seed=opts.seed)
        made = [kinds.ddp_eager(workload, batches, seed=opts.seed),
                kinds.ddp_compiled(workload, batches, seed=opts.seed),
                kinds.troupe_eager(workload, batches, seed=opts.seed, name=REFERENCE),
                kinds.troupe_compiled(workload, batches, seed=opts.seed),
                kinds.troupe_compiled(workload, batches, seed=opts.seed, split=False),
                kinds.troupe_graph(workload, batches, seed=opts.seed),
                kinds.troupe_graph(workload, batches, seed=opts.seed, trial=TRIAL)]
        params = {"batch_size": batch_size, "data": data, "steps": opts.steps, "burnin": opts.burnin}
        measured = run_ab(made, schedule(opts), world.init().comm)
        records += to_records(measured, made, benchmark="graph", workload=name, params=params, world_size=world_size)
        del made
    return records


def table(records: list[Record]) -> str:
    parts = []
    for rs in render.group(records, render.section_key).values():
        def exposed(name: str, rs: list[Record] = rs) -> str:
            values = list(render.by_rep(rs, name, "exposed_time").values())
            return render.ms(summarize(values).median) if values else "in the graph"

        compiled = ("compiled", lambda name, rs=rs: str(render.param_of(rs, name, "option")))
        parts.append(render.run_line(rs) + "\n\n"
                     + render.long_table(rs, label="contestant", reference=REFERENCE,
                                         columns=[compiled, ("exposed comm ms (median)", exposed)]))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    render.plot_bars(records, out, title="step time: graph mode vs eager troupe vs DDP")
