"""Start a multi-process benchmark's ranks; a rank that fails ends the command with one line.

``bench transfer`` and ``bench stall`` run on local gloo ranks
(:func:`eplb_fsm.sim.launcher.run_ranks`). A rank that raised, died or outlived
``--timeout`` used to end the command in a traceback per rank; here it becomes
``SystemExit("eplb-fsm bench KIND: ...")`` naming the rank and the last line of its
error, which bench/cli.py prints on one line (exit status 2).
"""

from __future__ import annotations

from typing import Any, Callable


def run_bench_ranks(kind: str, fn: Callable[..., Any], world: int, **kwargs: Any) -> list:
    """``run_ranks(fn, world, **kwargs)``'s per-rank results, or ``SystemExit`` naming ``kind`` and what failed."""
    # looked up at call time: tests stand in for run_ranks on the launcher module
    from eplb_fsm.sim import launcher

    try:
        return launcher.run_ranks(fn, world, **kwargs)
    except launcher.RankFailedError as exc:
        others = len(exc.failures) - 1
        also = f" ({others} other rank(s) failed too)" if others else ""
        raise SystemExit(f"eplb-fsm bench {kind}: rank {exc.first} of {world} failed{also}: "
                         f"{launcher.last_line(exc.failures[exc.first])}") from None
    except launcher.RanksTimeoutError as exc:
        raise SystemExit(f"eplb-fsm bench {kind}: rank(s) {exc.pending} still running after --timeout "
                         f"{exc.timeout:g} s (killed)") from None
