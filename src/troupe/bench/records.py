"""The one result format: JSON lines, one `Record` per measurement.

A record says what was measured (benchmark, contestant, workload, params, world_size,
rep, metric), the value and its unit, and where (git commit, torch version, machine,
date, run id). Every benchmark writes these, through `troupe bench run` or from a
script in ``benchmarks/``; `troupe bench table` and `troupe bench plot` read them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import secrets
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

UNITS = {"s", "B", "samples/s", "1/s", "ratio", "count", "steps", "perplexity"}
"""Units a record may carry (seconds, bytes, ...): tables scale by them."""


@dataclass(frozen=True, kw_only=True)
class Record:
    """One measurement (one value of one metric, one contestant, one repetition)."""

    benchmark: str
    """The benchmark's name (`troupe bench list`)."""
    contestant: str
    """Who was measured ("DDP", "troupe bucket 2**19", "flat all_reduce", ...)."""
    workload: str
    """What was trained or moved ("cnn", "resnet18", "8 tensors", ...)."""
    params: dict[str, Any]
    """Everything else that defines the measurement (sizes, batch size, steps, bucket size, ...)."""
    world_size: int
    rep: int
    """Repetition index (0-based); one record per repetition, statistics taken when rendering."""
    metric: str
    """What `value` is ("step_time", "cpu_time", "wire_bytes", "time_to_0.985", ...)."""
    value: float | None
    """None: not reached / not measured (a time to accuracy that never came)."""
    unit: str
    commit: str = ""
    """Short git commit of the code measured ("+dirty" when src/ had uncommitted changes)."""
    torch: str = ""
    machine: str = ""
    date: str = ""
    """UTC time the run started (ISO 8601)."""
    run: str = ""
    """Id shared by every record of one invocation (tables render one run at a time)."""
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name in ("benchmark", "contestant", "metric"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {sorted(UNITS)}, got {self.unit!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if isinstance(self.rep, bool) or not isinstance(self.rep, int) or self.rep < 0:
            raise ValueError(f"rep must be an int >= 0, got {self.rep!r}")
        if self.value is not None and not isinstance(self.value, (int, float)):
            raise ValueError(f"value must be a number or None, got {self.value!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a dict, got {type(self.params).__name__}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ValueError(f"record lacks {missing}: {data}")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"record has unknown fields {unknown}: {data}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Stamp:
    """Where and when a run happened: copied into each of its records."""

    commit: str
    torch: str
    machine: str
    date: str
    run: str = field(default_factory=lambda: secrets.token_hex(4))

    def apply(self, record: Record) -> Record:
        return dataclasses.replace(record, commit=self.commit, torch=self.torch, machine=self.machine,
                                   date=self.date, run=self.run)


def checkout_root() -> Path:
    """The source checkout this troupe runs from (examples/ and benchmarks/ live there)."""
    here = Path(__file__).resolve().parents[3]  # src/troupe/bench/records.py -> the checkout
    for root in (here, Path.cwd()):
        if (root / "benchmarks").is_dir() and (root / "examples").is_dir():
            return root
    raise RuntimeError(f"troupe bench needs a troupe source checkout (with examples/ and benchmarks/); none at "
                       f"{here} or {Path.cwd()}: run it from one")


def git_commit(root: Path) -> str:
    """Short HEAD commit of the checkout at `root`, "+dirty" if src/ differs from it; "" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def describe_machine() -> str:
    """One line: architecture, CPUs, OS, load at start, and the GPU if torch sees one."""
    import torch

    parts = [platform.machine(), f"{os.cpu_count()} cpus", f"{platform.system()} {platform.release()}"]
    if hasattr(os, "getloadavg"):
        parts.append(f"load {os.getloadavg()[0]:.1f}")
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    return ", ".join(parts)


def stamp(root: Path) -> Stamp:
    """The stamp of a run starting now, measuring the code in the checkout at `root`."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return Stamp(commit=git_commit(root), torch=torch.__version__, machine=describe_machine(), date=now.isoformat())


def write(path: str | Path, records: Iterable[Record]) -> int:
    """Append records to a JSON-lines file; returns how many were written."""
    lines = [r.to_json() for r in records]
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)
    return len(lines)


def save(path: str | Path, records: Iterable[Record], run: Stamp) -> int:
    """Stamp records with `run` (taken when the run started) and append them: what scripts call."""
    return write(path, [run.apply(r) for r in records])


def read(path: str | Path) -> list[Record]:
    """Every record in a JSON-lines file (blank lines skipped; a bad line names its number)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(Record.from_dict(json.loads(line)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a troupe bench record ({e})") from None
    return out
