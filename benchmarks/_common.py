"""Helpers shared by the benchmark scripts: interleaved repeats, medians, ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(fn: Callable[[], int], repeats: int) -> list[float]:
    """Run ``fn`` (which returns a sample count) ``repeats`` times; return samples/s each run."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return rates


def interleaved(cases: dict[str, Callable[[], int]], repeats: int,
                warmup: int = 1) -> dict[str, float]:
    """Median samples/s per case, running the cases round-robin so drift hits all alike."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            runs[name].extend(measure(fn, 1))
    return {name: statistics.median(r) for name, r in runs.items()}


def table(title: str, medians: dict[str, float], baseline: str, unit: str = "samples/s") -> str:
    """Format medians with their ratio to ``baseline``."""
    base = medians[baseline]
    lines = [title, f"  {'case':<36} {unit:>14} {'ratio':>8}"]
    for name, value in medians.items():
        lines.append(f"  {name:<36} {value:>14,.0f} {value / base:>8.2f}")
    return "\n".join(lines)
