"""The BENCHMARKS registry: every `troupe bench run NAME`, its defaults and the options it takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from troupe.bench.options import Options
from troupe.bench.records import Record
from troupe.bench.suites import accumulate, collectives, compression, ddp, graph, scripts

COMMON = frozenset({"reps", "steps", "burnin", "nproc", "threads", "seed", "timeout"})
"""Options every engine benchmark takes."""
TRAINING = COMMON | {"workloads", "data", "batch_size", "local"}


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """A named benchmark: how to run it (in a world, or as a script) and how to render its records."""

    name: str
    help: str
    suite: ModuleType
    """Module with run(rank, world_size, options), table(records), plot(records, out)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    uses: frozenset[str] = COMMON
    script: str | None = None
    """benchmarks/NAME.py for the benchmarks that stay scripts (run with --out)."""

    @property
    def run(self) -> Callable[[int, int, Options], list[Record]] | None:
        return None if self.script else self.suite.run

    def table(self, records: list[Record]) -> str:
        return self.suite.table(records)

    def plot(self, records: list[Record], out: str) -> None:
        self.suite.plot(records, out)


_ENGINE = {"reps": 11, "burnin": 5, "nproc": 2, "threads": 1, "seed": 0, "timeout": 600.0}

BENCHMARKS: dict[str, Benchmark] = {
    "collectives": Benchmark(
        name="collectives", suite=collectives,
        help="troupe's bucketed all-reduce (DistOpt.synchronize) vs one flat all-reduce of the same bytes",
        defaults={**_ENGINE, "steps": 20, "burnin": 3, "sizes": (1 << 20, 4 << 20, 16 << 20, 64 << 20)},
        uses=COMMON | {"sizes", "bucket_size"}),
    "ddp": Benchmark(
        name="ddp", suite=ddp,
        help="troupe DistOpt step vs DDP step (example CNN and ResNet-18 with CIFAR shapes), step by step",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn", "resnet18"), "data": "mnist", "sweep": (2**19,),
                  "local": False, "flat": False},
        uses=TRAINING | {"sweep", "flat"}),
    "accumulate": Benchmark(
        name="accumulate", suite=accumulate,
        help="4 micro-batches under no_sync() + clip_grad_norm_ + step: troupe vs DDP doing the same",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn",), "data": "mnist", "micro": 4, "clip": 1.0,
                  "local": False},
        uses=TRAINING | {"micro", "clip"}),
    "compression": Benchmark(
        name="compression", suite=compression,
        help="wire bytes and step time per dist_option (plain, fp16, bf16, partialUpdate, sparseTopK, ...)",
        defaults={**_ENGINE, "steps": 12, "burnin": 4, "workloads": ("cnn",), "data": "mnist",
                  "dist_options": ("plain", "fp16", "bf16", "partialUpdate", "sparseTopK", "sparseThreshold")},
        uses=(TRAINING - {"local"}) | {"dist_options"}),
    "graph": Benchmark(
        name="graph", suite=graph,
        help="graph mode (whole step compiled, all-reduce in the graph) vs eager troupe, torch.compile(model), "
             "DDP and DDP + compile, step by step; exposed communication after backward",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn", "resnet18"), "data": "synthetic", "local": False},
        uses=TRAINING),
}
for _name, (_script, _help) in scripts.SCRIPTS.items():
    BENCHMARKS[_name] = Benchmark(name=_name, suite=scripts, help=_help, script=_script, uses=frozenset({"timeout"}))


def get(name: str) -> Benchmark:
    """The benchmark called `name` (ValueError listing the valid names otherwise)."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {sorted(BENCHMARKS)}") from None
