"""What every suite does around the engine: the schedule from options, measurements to records."""

from __future__ import annotations

from typing import Any

from troupe.observe.turns import Contestant, Measurement, Schedule
from troupe.bench.options import Options
from troupe.bench.records import Record

UNITS = {"step_time": "s", "cpu_time": "s", "wire_bytes": "B", "exposed_time": "s"}
"""The unit of each metric the engine produces."""


def schedule(options: Options) -> Schedule:
    return Schedule(reps=options.reps, steps=options.steps, burnin=options.burnin)


def to_records(measurements: list[Measurement], contestants: list[Contestant], *, benchmark: str, workload: str,
               params: dict[str, Any], world_size: int) -> list[Record]:
    """One Record per measurement: the shared params, then the contestant's own facts."""
    return [
        Record(benchmark=benchmark, contestant=contestants[m.contestant].name, workload=workload,
               params={**params, **contestants[m.contestant].params}, world_size=world_size, rep=m.rep,
               metric=m.metric, value=m.value, unit=UNITS.get(m.metric, "count"))
        for m in measurements
    ]
