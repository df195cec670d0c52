"""compression: bytes and step time of each dist_option, side by side.

One DistOpt (and model copy) per dist_option (``powerSGD:R``: PowerSGD at rank R), all taking turns step by step on the same
batches (default: the example's CNN on real MNIST, where the gradients' sparsity is
real). Wire bytes per step and rank come from the default Communicator's counters (ring
model); step time as in every engine benchmark. Ratios are to "plain" (dense fp32).
"""

from __future__ import annotations

from troupe.bench import contestants as kinds
from troupe.bench import render, workloads
from troupe.observe.turns import run_ab
from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.stats import ratio_of_medians, summarize
from troupe.bench.suites.common import batches_for, schedule, to_records

SPARS = {"sparseTopK": 0.01, "sparseThreshold": 1e-3}
"""spars per option (top-K: the fraction kept; threshold: the magnitude kept)."""
CHUNK_SIZE = 2**17
"""partialUpdate's chunk (elements): the CNN in 4 chunks, one averaged per step."""


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if world_size < 2:
        raise ValueError("compression measures communication: run it on 2 or more ranks (-n 2)")
    if "plain" not in options.dist_options:
        raise ValueError("--dist-options must include plain (the dense reference)")
    records = []
    for name in options.workloads:
        workload = workloads.get(name)
        batch_size, data, batches = batches_for(workload, options, rank, world_size)
        made = [contestant(workload, batches, options.seed, o) for o in options.dist_options]
        params = {"batch_size": batch_size, "data": data, "steps": options.steps, "burnin": options.burnin,
                  "chunk_size": CHUNK_SIZE}
        measured = run_ab(made, schedule(options), world.init().comm)
        records += to_records(measured, made, benchmark="compression", workload=name, params=params,
                              world_size=world_size)
    return records


def contestant(workload: workloads.Workload, batches: list, seed: int, label: str):
    """The DistOpt of one ``--dist-options`` entry: a dist_option name, or ``powerSGD:R`` for PowerSGD at rank R."""
    option, _, rank = label.partition(":")
    if rank and (option != "powerSGD" or not rank.isdigit() or int(rank) < 1):
        raise ValueError(f"--dist-options: only powerSGD takes a rank (powerSGD:2), got {label!r}")
    return kinds.troupe_opt(workload, batches, seed=seed, option=option, spars=SPARS.get(option),
                            chunk_size=CHUNK_SIZE, name=label, powersgd_rank=int(rank) if rank else None)


def table(records: list[Record]) -> str:
    parts = []
    for rs in render.group(records, render.section_key).values():
        plain_bytes = list(render.by_rep(rs, "plain", "wire_bytes").values())
        plain_time = list(render.by_rep(rs, "plain", "step_time").values())
        rows = []
        for name in render.contestants(rs):
            sent = list(render.by_rep(rs, name, "wire_bytes").values())
            times = list(render.by_rep(rs, name, "step_time").values())
            t = summarize(times)
            knob = render.param_of(rs, name, "spars", "") or render.param_of(rs, name, "powersgd_rank", "")
            rows.append([name, knob, f"{summarize(sent).median:,.0f}",
                         f"{ratio_of_medians(sent, plain_bytes):.4f}", render.ms(t.median),
                         render.spread(times, render.ms), f"{ratio_of_medians(times, plain_time):.3f}"])
        header = ["dist_option", "spars / rank", "wire bytes/step/rank", "bytes / plain", "step ms (median)",
                  "spread (min-max)", "step time / plain (of medians)"]
        parts.append(render.run_line(rs) + "\n\n" + render.markdown(header, rows))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    render.plot_bars(records, out, metric="wire_bytes", title="wire bytes per step and rank, by dist_option")
