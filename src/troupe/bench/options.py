"""What `troupe bench run` passes to a benchmark: one frozen Options, validated once.

Every field is optional on the command line; a benchmark fills the ones it uses from
its defaults (`Benchmark.defaults`) and rejects the ones it does not use, by name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``64KiB``, ``1MiB``, ``16M`` (binary units)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError(f"not a size in bytes: {text!r} (e.g. 4096, 64KiB, 16MiB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2) and m.group(2).lower()])
    if value < 1:
        raise ValueError(f"a size must be >= 1 byte, got {text!r}")
    return value


def size_label(nbytes: int) -> str:
    """``4 KiB``, ``16 MiB``, ``512 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def bucket_label(size: int | str) -> str:
    """``2**k`` for powers of two, ``all`` for one bucket, else the number."""
    if size == "all":
        return "all"
    return f"2**{size.bit_length() - 1}" if size > 0 and size & (size - 1) == 0 else str(size)


def parse_bucket(text: str) -> int | str:
    """``65536``, ``2**16`` or ``all`` (one bucket for the whole model)."""
    text = str(text).strip()
    if text == "all":
        return "all"
    value = 2 ** int(text[3:]) if text.startswith("2**") else int(text)
    if value < 1:
        raise ValueError(f"a bucket size must be >= 1 element, got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every knob of `troupe bench run` (None: the benchmark's default)."""

    reps: int | None = None
    """Repetitions (median over them; 11 or more for numbers worth writing down)."""
    steps: int | None = None
    """Measured steps per repetition and contestant."""
    burnin: int | None = None
    """Untimed steps per contestant before the first repetition."""
    nproc: int | None = None
    """Ranks (local processes)."""
    threads: int | None = None
    """torch threads per rank."""
    workloads: tuple[str, ...] | None = None
    data: str | None = None
    """"mnist" or "synthetic"."""
    batch_size: int | None = None
    """Per rank (with --micro: the whole accumulated batch)."""
    sizes: tuple[int, ...] | None = None
    """Bytes per all-reduce (collectives)."""
    bucket_size: int | str | None = None
    """troupe's bucket size in elements, ``2**k`` or ``all``."""
    sweep: tuple[int | str, ...] | None = None
    """Several troupe bucket sizes, one contestant each."""
    local: bool | None = None
    """Also time the model with no communication."""
    flat: bool | None = None
    """Also time backward + one flat all-reduce + step."""
    dist_options: tuple[str, ...] | None = None
    powersgd_ranks: tuple[int, ...] | None = None
    """PowerSGD ranks, one pair of contestants each (powersgd)."""
    micro: int | None = None
    """Micro-batches per step (accumulate)."""
    clip: float | None = None
    """max_norm for clip_grad_norm_ (accumulate)."""
    seed: int | None = None
    timeout: float | None = None
    """Seconds the whole run may take before its ranks are killed."""

    def __post_init__(self) -> None:
        for name in ("reps", "steps", "nproc", "threads", "batch_size", "micro"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        for value in self.powersgd_ranks or ():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--powersgd-ranks must be ints >= 1, got {value!r}")
        if self.burnin is not None and self.burnin < 0:
            raise ValueError(f"--burnin must be >= 0, got {self.burnin}")
        for name in ("clip", "timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        if self.data is not None and self.data not in ("mnist", "synthetic"):
            raise ValueError(f"--data must be mnist or synthetic, got {self.data!r}")

    def given(self) -> list[str]:
        """Names of the fields that were set."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def with_defaults(self, defaults: dict[str, Any], uses: frozenset[str], benchmark: str) -> Options:
        """Fill unset fields from `defaults`; a set field this benchmark does not use is an error."""
        unused = sorted(set(self.given()) - uses)
        if unused:
            flags = ", ".join("--" + name.replace("_", "-") for name in unused)
            raise ValueError(f"benchmark {benchmark!r} does not use {flags}")
        filled = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **filled)
