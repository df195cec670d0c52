"""What every suite does around the engine: the schedule from options, measurements to records."""

from __future__ import annotations

from typing import Any

from troupe.observe.turns import Contestant, Measurement, Schedule
from troupe.bench.options import Options
from troupe.bench.records import Record

UNITS = {"step_time": "s", "cpu_time": "s", "wire_bytes": "B", "exposed_time": "s"}
"""The unit of each metric the engine produces."""


def batches_for(workload: Any, options: Options, rank: int, world_size: int) -> tuple[int, str, list]:
    """(batch size, data set, this rank's batches) for `workload`: what every contestant of a suite
    trains on (the options' batch size and data set where the workload takes them, else its own)."""
    batch_size = options.batch_size or workload.batch_size
    data = options.data if options.data in workload.datasets else workload.datasets[0]
    count = min(options.burnin + options.reps * options.steps, 64)
    return batch_size, data, workload.batches(rank, world_size, batch_size, count, data=data, seed=options.seed)


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
