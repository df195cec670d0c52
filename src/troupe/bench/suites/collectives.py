"""collectives: troupe's bucketed all-reduce vs one flat all-reduce of the same bytes.

For each total size S the gradient is 8 tensors of S/8 (fp32):

* "flat all_reduce": one all-reduce of one tensor of S bytes (the floor: no copies, one call);
* "flat mean": the same, then divided by the world size in place: the floor of a mean, which
  troupe computes (one more pass over the bytes, the one troupe folds into its copy);
* "troupe buckets": what DistOpt does once gradients exist: ``sgd.zero_grad()``, ``p.grad``
  set for the 8 tensors, then ``sgd.synchronize()`` copies them into its buckets (DistOpt's bucket
  size), all-reduces every bucket asynchronously, averages and hands them back.

The two take turns call by call (`engine`); the table gives the median per call, the
ratio of medians, bus bandwidth S/t * 2(n-1)/n, and t = alpha + S * beta fitted to the
flat medians by least squares on relative error.
"""

from __future__ import annotations

import torch
from torch import nn

from troupe.bench import render
from troupe.observe.turns import Contestant, run_ab
from troupe.bench.options import Options, size_label
from troupe.bench.records import Record
from troupe.bench.stats import paired_ratios, ratio_of_medians, summarize
from troupe.bench.suites.common import schedule, to_records
from troupe.partition.planner import link

TENSORS = 8
FLAT, FLAT_MEAN, TROUPE = "flat all_reduce", "flat mean", "troupe buckets"


def fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """alpha (s) and beta (s/byte) for t = alpha + beta * bytes, fitted on relative error (the planner's fit)."""
    return link.fit_alpha_beta([float(s) for s in sizes], times, relative=True)


def _contestants(size: int, bucket_size: int | None) -> tuple[list[Contestant], object]:
    import troupe
    from troupe.runtime import world

    comm = world.init().comm
    numel = size // 4
    params = [nn.Parameter(torch.zeros(max(numel // TENSORS, 1))) for _ in range(TENSORS)]
    grads = [torch.randn(p.numel()) for p in params]
    kwargs = {} if bucket_size is None else {"bucket_size": bucket_size}
    sgd = troupe.DistOpt(torch.optim.SGD(params, lr=0.0), **kwargs)
    flat, flat_mean = torch.randn(numel), torch.randn(numel)

    def flat_step(i: int) -> None:
        comm.all_reduce(flat, "sum")

    def flat_mean_step(i: int) -> None:
        comm.all_reduce(flat_mean, "sum")
        flat_mean.div_(comm.world_size)

    def troupe_step(i: int) -> None:
        sgd.zero_grad()  # a new step: synchronize() reduces once per step
        for p, g in zip(params, grads):
            p.grad = g
        sgd.synchronize()

    buckets = len(sgd.reducer.buckets) if getattr(sgd, "reducer", None) else "-"
    return [Contestant(FLAT, flat_step, {"buckets": 1}), Contestant(FLAT_MEAN, flat_mean_step, {"buckets": 1}),
            Contestant(TROUPE, troupe_step, {"buckets": buckets})], sgd


def run(rank: int, world_size: int, options: Options) -> list[Record]:
    from troupe.runtime import world

    if options.bucket_size == "all":
        raise ValueError("collectives: --bucket-size takes a number of elements here, not 'all'")
    records = []
    for size in options.sizes:
        contestants, sgd = _contestants(size, options.bucket_size)
        measured = run_ab(contestants, schedule(options), world.init().comm)
        params = {"bytes": size, "tensors": TENSORS, "bucket_size": options.bucket_size or "default",
                  "steps": options.steps, "burnin": options.burnin}
        records += to_records(measured, contestants, benchmark="collectives", workload=f"{TENSORS} fp32 tensors",
                              params=params, world_size=world_size)
        del sgd, contestants
    return records


def table(records: list[Record]) -> str:
    n = records[0].world_size
    rows, sizes, flat_medians = [], [], []
    for size, rs in render.group(records, lambda r: r.params["bytes"]).items():
        flat, mine = render.by_rep(rs, FLAT, "step_time"), render.by_rep(rs, TROUPE, "step_time")
        f, t = summarize(list(flat.values())), summarize(list(mine.values()))
        pairs = paired_ratios(mine, flat)
        sizes.append(size)
        flat_medians.append(f.median)
        rows.append([size_label(size), f"{render.ms(f.median)} ms ({render.ms(f.low)}-{render.ms(f.high)})",
                     f"{render.ms(t.median)} ms ({render.ms(t.low)}-{render.ms(t.high)})",
                     f"{ratio_of_medians(list(mine.values()), list(flat.values())):.2f}",
                     render.spread(pairs, lambda v: f"{v:.2f}"),
                     f"{size / t.median * 2 * (n - 1) / n / 1e9:.2f} GB/s",
                     render.param_of(rs, TROUPE, "buckets")])
        mean = render.by_rep(rs, FLAT_MEAN, "step_time")  # absent from runs before it was a contestant
        if mean:
            m = summarize(list(mean.values()))
            rows[-1][5:5] = [f"{render.ms(m.median)} ms ({render.ms(m.low)}-{render.ms(m.high)})",
                             f"{ratio_of_medians(list(mine.values()), list(mean.values())):.2f}"]
    header = ["size", FLAT, TROUPE, "troupe / flat (of medians)", "per-rep ratio (min-max)",
              "bus bandwidth (troupe)", "buckets"]
    if any(r.contestant == FLAT_MEAN for r in records):
        header[5:5] = [FLAT_MEAN, "troupe / flat mean (of medians)"]
    out = render.run_line(records, skip=("bytes",)) + "\n\n"
    if len(sizes) >= 2:
        alpha, beta = fit_alpha_beta(sizes, flat_medians)
        header.append("alpha-beta predicts")
        for row, size in zip(rows, sizes):
            row.append(f"{render.ms(alpha + beta * size)} ms")
        bandwidth = f" ({1 / beta / 1e9:.2f} GB/s algorithm bandwidth)" if beta > 0 else " (noise: beta <= 0)"
        fit = (f"\n\nalpha = {alpha * 1e6:.1f} us per all-reduce, beta = {beta * 1e9:.3f} ns/byte{bandwidth}, "
               "fitted to the flat medians (relative error)")
    else:
        fit = "\n\nalpha = (needs two sizes or more)"
    return out + render.markdown(header, rows) + fit


def plot(records: list[Record], out: str) -> None:
    render.plot_lines(records, out, x="bytes", title="all-reduce: troupe buckets vs one flat tensor",
                      xlabel="bytes per all-reduce", xfmt=lambda v: size_label(int(v)))
