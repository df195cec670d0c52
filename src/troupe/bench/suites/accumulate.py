"""accumulate: gradient accumulation, troupe vs DDP doing exactly the same thing.

Each step cuts the batch into ``--micro`` micro-batches (default 4); the first ones run
backward under ``no_sync()`` (DDP's own, troupe's ``DistOpt.no_sync``), the last one
reduces; then ``clip_grad_norm_`` (max_norm ``--clip``, default 1.0), the optimizer
step and ``zero_grad``. troupe is driven PyTorch style (``loss.backward()``,
``sgd.synchronize()``, ``sgd.step()``, ``sgd.zero_grad()``).
"""

from __future__ import annotations

from troupe.bench import contestants as kinds
from troupe.bench import render, workloads
from troupe.observe.turns import run_ab
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.suites.common import schedule, to_records
from troupe.bench.suites.ddp import per_workload
from troupe.bench.suites.ddp import table as ddp_table


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if world_size < 2:
        raise ValueError("accumulate compares communication: run it on 2 or more ranks (-n 2)")
    records = []
    m, clip = options.micro, options.clip
    for name in options.workloads:
        workload = workloads.get(name)
        opts = per_workload(options, name)
        batch_size = opts.batch_size or workload.batch_size
        if batch_size % m:
            raise ValueError(f"--batch-size {batch_size} does not split into --micro {m} equal micro-batches")
        data = opts.data if opts.data in workload.datasets else workload.datasets[0]
        count = min(opts.burnin + opts.reps * opts.steps, 64)
        batches = workload.batches(rank, world_size, batch_size, count, data=data, seed=opts.seed)
        made = [kinds.ddp(workload, batches, seed=opts.seed, micro=m, clip=clip, name=f"DDP no_sync x{m}"),
                kinds.troupe_opt(workload, batches, seed=opts.seed, micro=m, clip=clip, name=f"troupe no_sync x{m}")]
        if opts.local:
            made.append(kinds.local(workload, batches, seed=opts.seed, micro=m, clip=clip))
        params = {"batch_size": batch_size, "micro": m, "clip": clip, "data": data, "steps": opts.steps,
                  "burnin": opts.burnin}
        measured = run_ab(made, schedule(opts), world.init().comm)
        records += to_records(measured, made, benchmark="accumulate", workload=name, params=params,
                              world_size=world_size)
    return records


def table(records: list[Record]) -> str:
    reference = next((c for c in render.contestants(records) if c.startswith("DDP")), None)
    return ddp_table(records, reference=reference)


def plot(records: list[Record], out: str) -> None:
    render.plot_bars(records, out, title="gradient accumulation (no_sync + clip): troupe vs DDP")
