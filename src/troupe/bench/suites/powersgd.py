"""powersgd: troupe's dist_option "powerSGD" vs torch's ``powerSGD_hook`` under DDP, step by step.

Per workload (default: the example's MNIST CNN) and PowerSGD rank (``--powersgd-ranks``,
default 1 2 4), DDP with torch's hook and a DistOpt with ``dist_option="powerSGD"`` (PyTorch
loop: ``loss.backward(); sgd.step()``) train copies of the same model on the same batches,
taking turns (`troupe.observe.turns`); plain DDP and plain troupe run beside them for scale.
Both compress from step 2 (torch's DDP needs ``start_powerSGD_iter`` >= 2), inside the
burn-in. Each keeps its default buckets (DDP: 25 MB, one bucket for the CNN; troupe: 2**19
elements with a first bucket of 2**18, two buckets), and with ``--bucket-size all`` troupe
puts everything in one bucket as DDP does.
"""

from __future__ import annotations

from troupe.bench import contestants as kinds
from troupe.bench import render, workloads
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.stats import paired_ratios, ratio_of_medians, summarize
from troupe.bench.suites.common import batches_for, schedule, to_records
from troupe.observe.turns import run_ab

START = 2
"""Plain steps before compression, for both (the burn-in covers them)."""


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if world_size < 2:
        raise ValueError("powersgd compares communication: run it on 2 or more ranks (-n 2)")
    if options.burnin < START:
        raise ValueError(f"--burnin must be >= {START}: the steps before PowerSGD starts are not measured")
    records = []
    for name in options.workloads:
        workload = workloads.get(name)
        batch_size, data, batches = batches_for(workload, options, rank, world_size)
        seed, bucket = options.seed, options.bucket_size
        made = [kinds.ddp(workload, batches, seed=seed, name="DDP"),
                kinds.troupe_opt(workload, batches, seed=seed, bucket_size=bucket, loop="torch", name="troupe plain")]
        for r in options.powersgd_ranks:
            made.append(kinds.ddp(workload, batches, seed=seed, powersgd_rank=r, powersgd_start=START,
                                  name=f"DDP + powerSGD_hook r={r}"))
            made.append(kinds.troupe_opt(workload, batches, seed=seed, bucket_size=bucket, loop="torch",
                                         option="powerSGD", powersgd_rank=r, powersgd_start=START,
                                         name=f"troupe powerSGD r={r}"))
        params = {"batch_size": batch_size, "data": data, "steps": options.steps, "burnin": options.burnin}
        measured = run_ab(made, schedule(options), world.init().comm)
        records += to_records(measured, made, benchmark="powersgd", workload=name, params=params,
                              world_size=world_size)
        del made
    return records


def table(records: list[Record]) -> str:
    """Per rank: the hook's and troupe's step time, and troupe / hook (of medians, and the median of the
    per-repetition ratios)."""
    parts = []
    for rs in render.group(records, render.section_key).values():
        rows = []
        for name in render.contestants(rs):
            if not name.startswith("troupe"):
                continue
            reference = "DDP" if name == "troupe plain" else name.replace("troupe powerSGD", "DDP + powerSGD_hook")
            mine, theirs = render.by_rep(rs, name, "step_time"), render.by_rep(rs, reference, "step_time")
            t, h = summarize(list(mine.values())), summarize(list(theirs.values()))
            bytes_ = render.by_rep(rs, name, "wire_bytes")
            rows.append([name, reference, render.ms(h.median), render.ms(t.median),
                         render.spread(list(mine.values()), render.ms),
                         f"{ratio_of_medians(list(mine.values()), list(theirs.values())):.3f}",
                         f"{summarize(paired_ratios(mine, theirs)).median:.3f}",
                         f"{summarize(list(bytes_.values())).median:,.0f}"])
        header = ["troupe", "torch reference", "torch ms (median)", "troupe ms (median)", "troupe spread (min-max)",
                  "troupe / torch (of medians)", "troupe / torch (median of paired)", "troupe wire bytes/step/rank"]
        parts.append(render.run_line(rs) + "\n\n" + render.markdown(header, rows))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    render.plot_bars(records, out, title="step time: troupe powerSGD vs torch's powerSGD_hook under DDP")
