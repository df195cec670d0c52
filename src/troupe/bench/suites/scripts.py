"""Benchmarks that stay scripts in ``benchmarks/`` (each starts its own jobs, or needs root).

They write the same JSON-lines records with ``--out FILE``; `troupe bench run NAME`
runs the script with ``--out`` and the arguments after ``--args``; `troupe bench table`
renders their records with `table`.
"""

from __future__ import annotations

from troupe.bench import render
from troupe.bench.records import Record

SCRIPTS = {
    "throughput": ("benchmarks/throughput.py", "samples/s vs workers on loopback and simulated hosts (netns, tc)"),
    "ps": ("benchmarks/ps.py", "time to MNIST accuracy per cluster framework vs all-reduce and DDP"),
    "bytes_per_step": ("benchmarks/bytes_per_step.py", "bytes on the wire per step by dist_option and framework, "
                                                       "counters vs veth"),
    "time_to_accuracy": ("benchmarks/time_to_accuracy.py", "training time to an MNIST accuracy for one dist_option "
                                                           "(under troupe run, or shaped_link.sh)"),
    "faults": ("benchmarks/faults.py", "time to detect each injected fault"),
}
"""name -> (script, what it measures)."""


CURVE = "accuracy"
"""time_to_accuracy's evaluation points (params step, seconds): plotted, not tabled."""


def table(records: list[Record]) -> str:
    """Per section (workload and shared params): contestant x metric, median and range over repetitions."""
    parts = []
    for rs in render.group([r for r in records if r.metric != CURVE], render.section_key).values():
        parts.append(render.run_line(rs) + "\n\n" + render.generic_table(rs))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    """Accuracy against training time (time_to_accuracy), else bars of the first metric."""
    curve = [r for r in records if r.metric == CURVE]
    if curve:
        render.plot_curves(curve, out, x="seconds", xlabel="training time (s, evaluation excluded)",
                           ylabel="evaluation accuracy", title="time to accuracy")
        return
    metric = records[0].metric
    render.plot_bars([r for r in records if r.metric == metric and r.value is not None], out, metric=metric)
