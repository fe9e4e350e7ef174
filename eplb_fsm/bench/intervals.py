"""How sure a benchmark's ratio of medians is: a paired bootstrap interval and a verdict.

On a shared 2-core machine one call of the same transfer takes anywhere from 11 to 25 ms
(docs/transfer.md, 2026-12-05 08:05), so a median of 15 rounds, and a ratio of two such
medians, moves by several per cent from one run to the next. A target that sits inside
that spread is neither met nor missed by one run's figure. The interval below says how
far the ratio could move with the rounds drawn again, and the verdict says whether the
target lies outside it.

Rounds are resampled as pairs: both sides of round i were measured in the same round,
so load that drifts during a run moves both alike and stays out of the interval.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: two-sided coverage of the intervals the benchmarks report
LEVEL = 0.95
#: bootstrap resamples (a fixed seed: the same samples always give the same interval)
RESAMPLES = 2000

MET, MISSED, UNRESOLVED = "met", "missed", "unresolved"


def median_ratio_interval(numerator: Sequence[float], denominator: Sequence[float], *,
                          level: float = LEVEL, resamples: int = RESAMPLES,
                          seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``median(numerator) / median(denominator)``.

    numerator, denominator: (n,) samples, element i of both from round i (resampled
    together). Returns (low, high) at ``level``, or None when there is nothing to
    resample (n < 2, a missing sample) or a resampled denominator median is <= 0: a
    ratio over it has no meaning (stall_metrics.ratio gives None there too), and an
    interval of negative ratios would read as a ceiling ``met``.
    Raises ValueError when the two lengths differ or ``level`` is not in (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if len(numerator) != len(denominator):
        raise ValueError(f"numerator and denominator must pair round by round: "
                         f"{len(numerator)} != {len(denominator)} samples")
    if len(numerator) < 2 or any(v is None for v in (*numerator, *denominator)):
        return None
    top = np.asarray(numerator, dtype=np.float64)
    bottom = np.asarray(denominator, dtype=np.float64)
    rounds = np.random.default_rng(seed).integers(0, top.size, size=(resamples, top.size))
    bottom_medians = np.median(bottom[rounds], axis=1)
    if np.any(bottom_medians <= 0.0):
        return None
    ratios = np.median(top[rounds], axis=1) / bottom_medians
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def verdict(interval: Sequence[float] | None, target: float, *, at_most: bool = False) -> str:
    """A target judged against an interval ``(low, high)``, a tuple or :func:`rounded`'s list:
    ``met`` or ``missed`` only when the whole interval lies on one side of it, else
    ``unresolved`` (also when there is no interval).

    The target is a floor (ratio >= target) by default, a ceiling (ratio <= target) with
    ``at_most``.
    """
    if interval is None:
        return UNRESOLVED
    low, high = interval
    if at_most:
        return MET if high <= target else MISSED if low > target else UNRESOLVED
    return MET if low >= target else MISSED if high < target else UNRESOLVED


def combined(verdicts) -> str:
    """One verdict for targets that must all hold: ``missed`` if any is missed, ``met`` if
    every one is met, else ``unresolved`` (also for none at all)."""
    verdicts = list(verdicts)
    if MISSED in verdicts:
        return MISSED
    return MET if verdicts and all(v == MET for v in verdicts) else UNRESOLVED


def power(interval: tuple[float, float] | None, exponent: float) -> tuple[float, float] | None:
    """The interval of ``ratio ** exponent`` (exponent > 0), e.g. a ratio over a size step
    normalised to one doubling; None stays None."""
    if exponent <= 0:
        raise ValueError(f"exponent must be > 0, got {exponent}")
    return None if interval is None else (interval[0] ** exponent, interval[1] ** exponent)


def rounded(interval: tuple[float, float] | None, digits: int = 3) -> list[float] | None:
    """The interval as a JSON list, rounded as the benchmark's figures are."""
    return None if interval is None else [round(interval[0], digits), round(interval[1], digits)]
