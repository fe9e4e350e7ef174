"""Option checks the bench verbs share, and how a verdict says what it was judged on.

Every check here returns ``(ok, rule)``; :func:`refuse` turns the first failed one into
``SystemExit("eplb-fsm bench KIND: RULE")``, which bench/cli.py prints as one usage-error
line (exit status 2). The verbs call them before anything runs: before a rank starts, a
trace is written or a tensor is allocated.

Bounds, and why:

- thread counts (``bench policy --torch-threads``, ``bench stall --engine-threads``) are at
  most :data:`MAX_THREADS`: torch hands the count to OpenMP, which at 20000 failed to start
  its threads and at 100000 crashed the process;
- what a run must hold in memory (bytes, estimated from the options, a lower bound) must
  fit in this machine's physical memory, else the allocation failed deep inside the run
  with torch's message (or a killed rank), naming no option (:func:`memory_rule`);
- what a run writes to the temporary folder must fit in its free space (:func:`disk_rule`).
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable

#: most threads a thread-count option takes (torch's intra-op pool, per process)
MAX_THREADS = 1024
#: issue 14's method: a target is judged on the median of at least this many runs
METHOD_REPEATS = 7


def refuse(kind: str, rules: Iterable[tuple[bool, str]]) -> None:
    """Raise ``SystemExit("eplb-fsm bench KIND: RULE")`` for the first ``(ok, rule)`` that is not ok."""
    for ok, rule in rules:
        if not ok:
            raise SystemExit(f"eplb-fsm bench {kind}: {rule}")


def at_least(option: str, value: int, minimum: int) -> tuple[bool, str]:
    """``option`` >= ``minimum``."""
    return value >= minimum, f"{option} must be >= {minimum}, got {value}"


def positive_finite(option: str, value: float) -> tuple[bool, str]:
    """``option`` > 0 and finite (inf overflowed sizes inside the ranks, nan compares false to everything)."""
    return 0 < value < float("inf"), f"{option} must be > 0 and finite, got {value}"


def seed_rule(value: int) -> tuple[bool, str]:
    """``--seed`` >= 0: numpy's generators take no negative seed."""
    return value >= 0, f"--seed must be >= 0 (a numpy seed), got {value}"


def timeout_rule(value: float) -> tuple[bool, str]:
    """``--timeout`` in (0, MAX_SECONDS]: inf overflowed gloo's timedelta on every rank."""
    from eplb_fsm.config import MAX_SECONDS

    return 0 < value <= MAX_SECONDS, f"--timeout must be in (0, {MAX_SECONDS:g}] seconds, got {value}"


def thread_rule(option: str, value: int) -> tuple[bool, str]:
    """``option`` (a thread count) in 1..:data:`MAX_THREADS`."""
    return 1 <= value <= MAX_THREADS, f"{option} must be in 1..{MAX_THREADS} (threads), got {value}"


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def memory_rule(need: float, what: str) -> tuple[bool, str]:
    """``need`` bytes (``what`` names the options and how they make it) fit in physical memory."""
    total = physical_memory()
    return (total is None or need <= total,
            f"{what} needs at least {_gib(need)} of memory, more than this machine's {_gib(total or 0)}")


def disk_rule(need: float, what: str, folder: str) -> tuple[bool, str]:
    """``need`` bytes (``what`` names the options) fit in the free space of ``folder``."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return True, ""
    return need <= free, f"{what} writes at least {_gib(need)} to {folder}, which has {_gib(free)} free"


def judged_on(repeats: int, option: str = "--repeats") -> dict:
    """What a verdict on ``repeats`` runs was computed on, and whether that follows issue 14's method."""
    return {"statistic": "median", "runs": repeats, "option": option, "method_runs": METHOD_REPEATS,
            "follows_method": repeats >= METHOD_REPEATS}
