"""Statistics over repetitions: the median, its spread, and ratios of medians.

A repetition's value is already a median over its steps (`engine`); over repetitions
the median again, so a repetition in which another job took the core moves the result
less than a mean would. A ratio is taken between medians (``median(a) / median(b)``),
and the per-repetition ratios (neighbouring measurements) give its spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Median and range of one contestant's values over repetitions."""

    median: float
    low: float
    high: float
    n: int


def summarize(values: Sequence[float]) -> Summary:
    """Median, min and max of `values` (at least one)."""
    if not values:
        raise ValueError("summarize needs at least one value")
    return Summary(statistics.median(values), min(values), max(values), len(values))


def ratio_of_medians(values: Sequence[float], reference: Sequence[float]) -> float:
    """median(values) / median(reference)."""
    ref = statistics.median(reference)
    if ref == 0:
        raise ValueError("the reference's median is 0: no ratio")
    return statistics.median(values) / ref


def paired_ratios(values: dict[int, float], reference: dict[int, float]) -> list[float]:
    """value / reference for every repetition both have (by repetition index)."""
    return [values[rep] / reference[rep] for rep in sorted(values) if rep in reference and reference[rep]]
