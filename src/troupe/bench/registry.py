"""The BENCHMARKS registry: every `troupe bench run NAME`, its defaults and the options it takes."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from troupe.bench.options import Options
from troupe.bench.records import Record

COMMON = frozenset({"reps", "steps", "burnin", "nproc", "threads", "seed", "timeout"})
"""Options every engine benchmark takes."""
TRAINING = COMMON | {"workloads", "data", "batch_size", "local"}


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """A named benchmark: how to run it (in a world, or as whole jobs) and how to render its records."""

    name: str
    help: str
    module: str
    """The suite's module under troupe.bench.suites: run(rank, world_size, options) (or main(argv) for a job suite),
    table(records), plot(records, out). Imported when first used: the engine suites import torch, which a job
    suite's harness (it only starts jobs) and `troupe bench list` never need (3 s of CPU a start)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    uses: frozenset[str] = COMMON
    jobs: bool = False
    """A job suite: starts whole jobs itself (`troupe.bench.jobs`); its own options come after --args."""

    @property
    def suite(self) -> ModuleType:
        return importlib.import_module(f"troupe.bench.suites.{self.module}")

    @property
    def run(self) -> Callable[[int, int, Options], list[Record]] | None:
        return None if self.jobs else self.suite.run

    @property
    def main(self) -> Callable[[list[str]], int] | None:
        return self.suite.main if self.jobs else None

    def table(self, records: list[Record]) -> str:
        return self.suite.table(records)

    def plot(self, records: list[Record], out: str) -> None:
        self.suite.plot(records, out)


_ENGINE = {"reps": 11, "burnin": 5, "nproc": 2, "threads": 1, "seed": 0, "timeout": 600.0}

BENCHMARKS: dict[str, Benchmark] = {
    "collectives": Benchmark(
        name="collectives", module="collectives",
        help="troupe's bucketed all-reduce (DistOpt.synchronize) vs one flat all-reduce of the same bytes",
        defaults={**_ENGINE, "steps": 20, "burnin": 3, "sizes": (1 << 20, 4 << 20, 16 << 20, 64 << 20)},
        uses=COMMON | {"sizes", "bucket_size"}),
    "ddp": Benchmark(
        name="ddp", module="ddp",
        help="troupe DistOpt step vs DDP step (example CNN and ResNet-18 with CIFAR shapes), step by step",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn", "resnet18"), "data": "mnist", "sweep": (2**19,),
                  "local": False, "flat": False},
        uses=TRAINING | {"sweep", "flat"}),
    "accumulate": Benchmark(
        name="accumulate", module="accumulate",
        help="4 micro-batches under no_sync() + clip_grad_norm_ + step: troupe vs DDP doing the same",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn",), "data": "mnist", "micro": 4, "clip": 1.0,
                  "local": False},
        uses=TRAINING | {"micro", "clip"}),
    "compression": Benchmark(
        name="compression", module="compression",
        help="wire bytes and step time per dist_option (plain, fp16, bf16, partialUpdate, sparseTopK, ...)",
        defaults={**_ENGINE, "steps": 12, "burnin": 4, "workloads": ("cnn",), "data": "mnist",
                  "dist_options": ("plain", "fp16", "bf16", "partialUpdate", "sparseTopK", "sparseThreshold")},
        uses=(TRAINING - {"local"}) | {"dist_options"}),
    "powersgd": Benchmark(
        name="powersgd", module="powersgd",
        help="troupe's dist_option powerSGD vs torch's powerSGD_hook under DDP (example CNN), step by step, "
             "per PowerSGD rank",
        defaults={**_ENGINE, "steps": 20, "burnin": 5, "workloads": ("cnn",), "data": "mnist",
                  "powersgd_ranks": (1, 2, 4)},
        uses=(TRAINING - {"local"}) | {"powersgd_ranks", "bucket_size"}),
    "graph": Benchmark(
        name="graph", module="graph",
        help="graph mode (whole step compiled, all-reduce in the graph) vs eager troupe, torch.compile(model), "
             "DDP and DDP + compile, step by step; exposed communication after backward",
        defaults={**_ENGINE, "burnin": None, "workloads": ("cnn", "resnet18"), "data": "synthetic", "local": False},
        uses=TRAINING),
}
JOB_SUITES = {
    "throughput": ("throughput", "samples/s vs workers on loopback and simulated hosts (netns, tc)"),
    "ps": ("ps", "time to MNIST accuracy per cluster framework vs all-reduce and DDP"),
    "bytes_per_step": ("bytes_per_step", "bytes on the wire per step by dist_option and framework, counters vs veth"),
    "time_to_accuracy": ("time_to_accuracy", "training time to an MNIST accuracy for one dist_option (loopback or "
                                           "simulated hosts)"),
    "fault_detection": ("fault_detection", "time to detect each injected fault (kill, raise, stop, hang, nan)"),
    "conformance": ("conformance", "every regime with every script shape and launcher: matched, reached or refused "
                                 "in one line (docs/conformance.md)"),
}
"""name -> (suite's module, what it measures): the suites that start whole jobs."""
for _name, (_module, _help) in JOB_SUITES.items():
    BENCHMARKS[_name] = Benchmark(name=_name, module=_module, help=_help, jobs=True, uses=frozenset({"timeout"}))


def get(name: str) -> Benchmark:
    """The benchmark called `name` (ValueError listing the valid names otherwise)."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {sorted(BENCHMARKS)}") from None
