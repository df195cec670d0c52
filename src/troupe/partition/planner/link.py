"""The link between workers as the planner sees it: latency alpha and inverse bandwidth beta.

A message of m bytes takes ``alpha + m * beta`` seconds. This module owns the spellings
``troupe plan --link`` accepts (named links, ``alpha=50us,beta=1gbit``) and `measure_link`,
which fits alpha and beta on loopback from two spawned Gloo processes. It knows nothing
about layers or plans.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from troupe.runtime.comm import Communicator

MEASURE_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
"""Message sizes (bytes) `measure_link` times; alpha and beta are the least-squares line through them."""


@dataclass(frozen=True)
class Link:
    """alpha seconds per message plus beta seconds per byte."""

    alpha: float
    beta: float
    name: str = ""

    def __post_init__(self) -> None:
        for field, value in (("alpha", self.alpha), ("beta", self.beta)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"link {field} must be a finite number >= 0, got {value!r}")

    def seconds(self, nbytes: float, messages: float = 1) -> float:
        """Time to move `nbytes` in `messages` messages."""
        return messages * self.alpha + nbytes * self.beta

    def describe(self) -> str:
        gbit = 8 / self.beta / 1e9 if self.beta else math.inf
        label = f"{self.name} " if self.name else ""
        return f"{label}(alpha {self.alpha * 1e6:.1f} us, beta {self.beta * 1e9:.3f} ns/B = {gbit:.3g} Gbit/s)"


NAMED_LINKS = {
    "loopback": (20e-6, 1 / 3e9),  # Gloo over TCP on one machine: a few GB/s
    "100mbit": (100e-6, 8 / 100e6),
    "1gbit": (50e-6, 8 / 1e9),
    "10gbit": (20e-6, 8 / 10e9),
}
"""Named links -> (alpha seconds, beta seconds per byte): rough constants for a TCP/Gloo link;
`measure` (loopback only) or an explicit ``alpha=...,beta=...`` replaces them."""

DEFAULT_ALPHA = 50e-6
"""Latency for a link given only as a bandwidth ("2.5gbit")."""

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATE_UNITS = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8, "gb/s": 1e9, "mb/s": 1e6, "kb/s": 1e3}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*$")
_SPELLINGS = (f"one of {sorted(NAMED_LINKS)}, 'measure', a bandwidth such as '2.5gbit' or '400mb/s', "
              "or 'alpha=50us,beta=1gbit' (beta as a bandwidth or as time per byte, e.g. 8ns)")


def _split(text: str, what: str) -> tuple[float, str]:
    match = _QUANTITY.match(text.lower())
    if not match:
        raise ValueError(f"{what}: cannot read {text!r} as a number with a unit")
    return float(match.group(1)), match.group(2)


def parse_time(text: str, what: str = "time") -> float:
    """'50us' -> 5e-05 seconds (units s, ms, us, ns)."""
    value, unit = _split(text, what)
    if unit not in _TIME_UNITS:
        raise ValueError(f"{what}: unknown time unit in {text!r} (use one of {sorted(_TIME_UNITS)})")
    return value * _TIME_UNITS[unit]


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """'1gbit' -> seconds per byte (8e-09); units gbit, mbit, kbit, gb/s, mb/s, kb/s."""
    value, unit = _split(text, what)
    if unit not in _RATE_UNITS:
        raise ValueError(f"{what}: unknown bandwidth unit in {text!r} (use one of {sorted(_RATE_UNITS)})")
    if value <= 0:
        raise ValueError(f"{what}: bandwidth must be > 0, got {text!r}")
    return 1.0 / (value * _RATE_UNITS[unit])


def _parse_beta(text: str) -> float:
    """beta as a bandwidth ('1gbit') or as seconds per byte ('8ns')."""
    _, unit = _split(text, "beta")
    return parse_time(text, "beta") if unit in _TIME_UNITS else parse_bandwidth(text, "beta")


def parse_link(text: str) -> Link:
    """A `--link` spelling -> Link. 'measure' is not parsed here (see `link_from_text`)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"link must be {_SPELLINGS}; got {text!r}")
    key = text.strip().lower()
    if key == "measure":
        raise ValueError("link 'measure' is measured, not parsed: use link_from_text (troupe plan --link measure)")
    if key in NAMED_LINKS:
        return Link(*NAMED_LINKS[key], name=key)
    if "=" in key:
        fields: dict[str, str] = {}
        for part in key.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in ("alpha", "beta") or name in fields:
                raise ValueError(f"link {text!r}: expected 'alpha=TIME,beta=BANDWIDTH', got the part {part!r}")
            fields[name] = value
        if set(fields) != {"alpha", "beta"}:
            raise ValueError(f"link {text!r}: give both alpha and beta (e.g. 'alpha=50us,beta=1gbit')")
        return Link(parse_time(fields["alpha"], "alpha"), _parse_beta(fields["beta"]), name=key)
    try:
        return Link(DEFAULT_ALPHA, parse_bandwidth(key), name=key)
    except ValueError:
        raise ValueError(f"unknown link {text!r}: use {_SPELLINGS}") from None


def link_from_text(text: str, timeout: float = 60.0) -> Link:
    """`parse_link`, plus 'measure': fit alpha and beta on loopback now (see `measure_link`)."""
    if isinstance(text, str) and text.strip().lower() == "measure":
        return measure_link(timeout=timeout)
    return parse_link(text)


def fit_alpha_beta(sizes: list[float], seconds: list[float], *, relative: bool = False) -> tuple[float, float]:
    """Least-squares line ``seconds = alpha + size * beta`` (both clamped at 0).

    `relative`: weigh each residual by 1/seconds, so on a shared machine a slow large size
    (whose absolute noise is largest) does not decide alpha alone.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(f"need times for at least two different sizes, got sizes {sizes}")
    weights = [1.0 / (t * t) if relative else 1.0 for t in seconds]  # squared residual weights
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, sizes)) / total
    my = sum(w * y for w, y in zip(weights, seconds)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, sizes))
    beta = max(sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, sizes, seconds)) / sxx, 0.0)
    return max(my - beta * mx, 0.0), beta


def _ping_pong(comm: Communicator, nbytes: int, reps: int) -> float:
    """The fastest one-way time of `nbytes` between ranks 0 and 1 (half a round trip) of `reps`: on a
    shared machine a round trip is only ever slowed down, and the median of ten could still be a
    slowed one, enough to make a 4 MiB message look no slower than 256 KiB (a zero slope)."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for i in range(reps + 1):
        comm.barrier()
        start = time.perf_counter()
        if comm.rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
        else:
            comm.recv(buf, 0)
            comm.send(buf, 0)
        if i:  # the first round trip warms the connection up
            times.append((time.perf_counter() - start) / 2)
    return min(times)


def _measure_rank(rank: int, world_size: int, reps: int) -> list[float]:
    """Rank 0's and rank 1's view of the ping-pong, one time per size in MEASURE_SIZES."""
    from troupe.runtime.world import init

    comm = init().comm
    return [_ping_pong(comm, size, reps) for size in MEASURE_SIZES]


def measure_link(timeout: float = 60.0, reps: int = 10) -> Link:
    """Fit alpha and beta on loopback: two spawned Gloo processes ping-pong three message sizes.

    The processes are killed after `timeout` seconds (then a ValueError says so).
    """
    from troupe.runtime.spawn import RankFailed, run_ranks

    env = {"TROUPE_TIMEOUT": "30", "TROUPE_JOIN_TIMEOUT": "30"}
    try:
        times = run_ranks(_measure_rank, 2, reps, timeout=timeout, env=env)[0]
    except TimeoutError:
        raise ValueError(f"measuring the link took longer than {timeout} s") from None
    except RankFailed as e:
        raise ValueError(f"measuring the link failed: {e}") from None
    alpha, beta = fit_alpha_beta([float(s) for s in MEASURE_SIZES], times)
    return Link(alpha, beta, name="measured loopback")
