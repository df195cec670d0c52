"""The tables and plots of the job suites' records (contestant x metric, or curves).

The job suites (throughput, ps, bytes_per_step, time_to_accuracy, fault_detection) start
whole jobs (`troupe.bench.jobs`) rather than run inside one world; they write the same
JSON-lines records with ``--out FILE`` and `troupe bench table` renders them with `table`.
"""

from __future__ import annotations

from troupe.bench import render
from troupe.bench.records import Record

CURVES = ("accuracy", "perplexity")
"""time_to_accuracy's evaluation points (params step, seconds): plotted, not tabled."""


def table(records: list[Record]) -> str:
    """Per section (workload and shared params): contestant x metric, median and range over repetitions."""
    parts = []
    for rs in render.group([r for r in records if r.metric not in CURVES], render.section_key).values():
        parts.append(render.run_line(rs) + "\n\n" + render.generic_table(rs))
    return "\n\n".join(parts)


def plot(records: list[Record], out: str) -> None:
    """Accuracy against training time (time_to_accuracy), else bars of the first metric."""
    curve = [r for r in records if r.metric in CURVES]
    if curve:
        render.plot_curves(curve, out, x="seconds", xlabel="training time (s, evaluation excluded)",
                           ylabel=f"evaluation {curve[0].metric}", title=f"time to {curve[0].metric}")
        return
    metric = records[0].metric
    render.plot_bars([r for r in records if r.metric == metric and r.value is not None], out, metric=metric)
