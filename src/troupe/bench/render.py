"""Markdown tables and matplotlib plots from records (matplotlib is imported only to plot).

The helpers here are shared by every benchmark's table: grouping records, the run's
header line, a long table (one row per contestant) and a pivot table (one row per value
of a parameter, one column per contestant), bars and lines.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from troupe.bench.records import Record
from troupe.bench.stats import paired_ratios, ratio_of_medians, summarize

CONTESTANT_KEYS = ("buckets", "bucket_size", "option", "spars", "powersgd_rank", "trial", "chosen")
"""Params that describe a contestant rather than the measurement (left out when grouping sections)."""


def group(records: Iterable[Record], key: Callable[[Record], Hashable]) -> dict[Hashable, list[Record]]:
    """Records by `key`, groups in order of first appearance."""
    out: dict[Hashable, list[Record]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return out


def section_key(r: Record) -> tuple:
    """Workload and the params every contestant of one measurement shares."""
    shared = tuple(sorted((k, repr(v)) for k, v in r.params.items() if k not in CONTESTANT_KEYS))
    return (r.workload, r.world_size, shared)


def by_rep(records: Iterable[Record], contestant: str, metric: str) -> dict[int, float]:
    """rep -> value of one contestant's metric (None values left out)."""
    return {r.rep: r.value for r in records if r.contestant == contestant and r.metric == metric and r.value is not None}


def contestants(records: Iterable[Record]) -> list[str]:
    return list(group(records, lambda r: r.contestant))


def markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_line(records: Sequence[Record], skip: Sequence[str] = ()) -> str:
    """*Run:* what, where, when and which code, from the first record's stamp (params in `skip` left out)."""
    r = records[0]
    reps = 1 + max(x.rep for x in records)
    params = ", ".join(f"{k} {v}" for k, v in r.params.items() if k not in CONTESTANT_KEYS and k not in skip)
    where = "; ".join(x for x in (r.machine, f"torch {r.torch}" if r.torch else "",
                                  f"commit {r.commit}" if r.commit else "", r.date) if x)
    head = f"*Run:* {r.benchmark}, {r.workload}, {r.world_size} ranks, {reps} reps" + (f"; {params}" if params else "")
    return head + "." + (f" {where}" if where else "")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    s = summarize(values)
    return f"{fmt(s.low)}-{fmt(s.high)}"


def param_of(records: Sequence[Record], contestant: str, key: str, default: Any = "-") -> Any:
    return next((r.params.get(key, default) for r in records if r.contestant == contestant), default)


def long_table(records: Sequence[Record], *, label: str, reference: str | None, metric: str = "step_time",
               columns: Sequence[tuple[str, Callable[[str], str]]] = (), cpu: bool = True) -> str:
    """One row per contestant: median and spread of `metric` (ms), ratio of medians to `reference`."""
    names = contestants(records)
    reference = reference if reference in names else names[0]
    ref = by_rep(records, reference, metric)
    header = [label, *(c for c, _ in columns), "step ms (median)", "spread (min-max)",
              f"ratio to {reference} (of medians)", "per-rep ratio (min-max)"] + (["CPU ms/step (median)"] if cpu else [])
    rows = []
    for name in names:
        mine = by_rep(records, name, metric)
        if not mine:
            continue
        pairs = paired_ratios(mine, ref)
        row = [name, *(fn(name) for _, fn in columns), ms(summarize(list(mine.values())).median),
               spread(list(mine.values()), ms), f"{ratio_of_medians(list(mine.values()), list(ref.values())):.3f}",
               spread(pairs, lambda v: f"{v:.3f}") if pairs else "-"]
        if cpu:
            cpu_values = list(by_rep(records, name, "cpu_time").values())
            row.append(ms(summarize(cpu_values).median) if cpu_values else "-")
        rows.append(row)
    return markdown(header, rows)


def generic_table(records: Sequence[Record]) -> str:
    """Any records: one row per contestant and metric, median and range over repetitions."""
    rows = []
    for (name, metric), rs in group(records, lambda r: (r.contestant, r.metric)).items():
        values = [r.value for r in rs if r.value is not None]
        unit = f" {rs[0].unit}" if rs[0].unit in ("s", "B", "samples/s", "1/s") else ""
        fmt = (lambda v: f"{v:,.0f}") if rs[0].unit == "B" else (lambda v: f"{v:.6g}")
        if values:
            s = summarize(values)
            rows.append([name, metric, f"{fmt(s.median)}{unit}", f"{fmt(s.low)}-{fmt(s.high)}", f"{s.n}/{len(rs)}"])
        else:
            rows.append([name, metric, "not reached", "-", f"0/{len(rs)}"])
    return markdown(["contestant", "metric", "median", "range (min-max)", "measured/reps"], rows)


def plot_bars(records: Sequence[Record], out: str, *, metric: str = "step_time", title: str = "") -> None:
    """Median of `metric` per contestant (error bars: min-max over reps), one group per section."""
    plt = _pyplot()
    sections = group(records, section_key)
    fig, axes = plt.subplots(1, len(sections), figsize=(4.5 * len(sections) + 1, 4.2), squeeze=False)
    for ax, rs in zip(axes[0], sections.values()):
        names = contestants(rs)
        summaries = [summarize(list(by_rep(rs, n, metric).values())) for n in names]
        scale = 1e3 if rs[0].unit == "s" else 1.0
        med = [s.median * scale for s in summaries]
        err = [[(s.median - s.low) * scale for s in summaries], [(s.high - s.median) * scale for s in summaries]]
        ax.bar(range(len(names)), med, yerr=err, capsize=3, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"{metric} ({'ms' if scale == 1e3 else rs[0].unit}), median and range over reps")
        ax.set_title(f"{rs[0].workload}, {rs[0].world_size} ranks", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or records[0].benchmark)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_lines(records: Sequence[Record], out: str, *, x: str, metric: str = "step_time", title: str = "",
               xlabel: str = "", xfmt: Callable[[float], str] | None = None) -> None:
    """Median of `metric` against the numeric param `x`, one line per contestant, log-log."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in contestants(records):
        mine = [r for r in records if r.contestant == name and r.metric == metric]
        xs = sorted({r.params[x] for r in mine})
        meds = [summarize([r.value for r in mine if r.params[x] == v]).median for v in xs]
        scale = 1e3 if mine and mine[0].unit == "s" else 1.0
        ax.plot(xs, [m * scale for m in meds], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if xfmt is not None:
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: xfmt(v)))
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(f"{metric} (ms, median over reps)")
    ax.set_title(title or records[0].benchmark)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_curves(records: Sequence[Record], out: str, *, x: str, xlabel: str, ylabel: str, title: str) -> None:
    """`value` against the param `x`, one line per contestant and run (a training curve), linear axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, _), rs in group(records, lambda r: (r.contestant, r.run)).items():
        points = sorted((r.params[x], r.value) for r in rs if r.value is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'torch-troupe[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
