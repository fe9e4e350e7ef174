"""What to do next, as pure functions of values every rank shares (no I/O, no clocks).

The controller asks these functions and executes the answer; the machine's guards then
read the answer as event data (``due``, ``worth``, ``moves``), so ``eplb-fsm replay``
re-drives the same guards from the trace. Inputs are the shared counters (steps since
the interval restarted, the threshold), the machine's state and layer, and the sums that
one all-reduce produced; every rank computes the same answer on the same step.

- :func:`decide_step`: on an engine step, record only, or also start planning or log
  balancedness;
- :func:`decide_poll`: whether (and how) the step asks if the async job in flight is
  ready everywhere: posted now and read on the next step, or joined to the step's
  all-reduce and read at once;
- :func:`decide_progress`: from the all-reduced ``[ready, failed, late, broken]`` flags of
  the job in flight: wait, take the plan, commit the layer (or, in ``committing``, close
  the rearrangement), or abort;
- :func:`decide_layer`: sync mode's per-layer agreement (and the one after the last
  commit): commit or abort;
- :func:`decide_plan`: is a plan worth moving to (the ``worth`` of ``plan_ready``);
- :func:`decide_salvage`: may survivors of a broken group finish on their new group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from eplb_fsm.fsm.machine import COLLECTING, COMMITTING, FAILED, PLANNING, TRANSFERRING

__all__ = [
    "Counters",
    "StepDecision",
    "Progress",
    "WAIT",
    "TAKE_PLAN",
    "COMMIT_LAYER",
    "ABORT",
    "decide_step",
    "decide_poll",
    "POST",
    "JOIN",
    "decide_progress",
    "decide_layer",
    "decide_plan",
    "decide_salvage",
    "salvage_vote",
    "agreed_ranks",
    "counts_equal",
]

WAIT = "wait"                 # not ready everywhere yet: ask again next step
TAKE_PLAN = "take_plan"       # every rank has the plan: fire plan_ready
COMMIT_LAYER = "commit_layer"  # every rank has the layer: fire layer_done and write it (committing: committed)
ABORT = "abort"               # some rank failed, ran late or broke a commit: fire fault

POST = "post"                 # issue the ready flags now, read the sum on the next step
JOIN = "join"                 # the ready flags go into this step's all-reduce, read now


@dataclass(frozen=True)
class StepDecision:
    """What one engine step does besides recording its load pass.

    ``due``: a rearrangement starts now (the ``due`` of ``step``); ``log``: all-reduce the
    pass for balancedness. Whether it also polls an async job: :func:`decide_poll`.
    """

    due: bool
    log: bool


def decide_step(state: str, since: int, threshold: int, has_models: bool, log_now: bool) -> StepDecision:
    """The step's decision from shared counters.

    ``since``: steps since the interval restarted with a model added, this one included
    (see :meth:`Counters.count_step`); ``threshold``: steps it needs. ``log_now``: the
    engine asked for balancedness and the logging interval is reached. In ``failed``
    nothing is logged until ``recover()``: the all-reduce would go over an EP group that
    broke (each interval another timeout and ``collective_error``), or one where a peer
    that is not failed issues other collectives.
    """
    due = state == COLLECTING and since >= threshold and has_models
    return StepDecision(due=due, log=bool(log_now) and state != FAILED)


def decide_poll(state: str, in_flight: bool, overlap: bool, joined: bool, fresh: bool = False,
                early: bool = False) -> str | None:
    """How this step asks whether the async job in flight is ready on every rank.

    ``in_flight``: async mode with a plan or layer job running, or in ``committing`` the
    confirmation that every rank wrote its layers whole (every rank has one or none,
    since jobs start on the same step everywhere); ``overlap``: the config's
    ``async_overlap_poll``; ``joined``: the step all-reduces something else anyway.
    None: nothing to ask. :data:`POST`: issue the flags now and act on their sum on the
    next step, so the engine's next forward hides the collective's latency (a layer
    commits one step later). :data:`JOIN`: put them into the step's all-reduce and act
    at once. ``fresh``: the job was handed over on this very step (on every rank), so
    its flags can only say "not yet": nothing is posted, the next step asks. ``early``: the
    job cannot be ready on every rank yet (a layer cut into chunks moves one chunk per
    engine step, and the ranks count its chunks alike from the shared plan), so only a
    step that all-reduces anyway carries its flags. Read after the flags posted on the
    step before, so it sees the state they left.
    """
    if not in_flight or state not in (PLANNING, TRANSFERRING, COMMITTING):
        return None
    if joined:
        return JOIN
    if early:
        return None
    if not overlap:
        return JOIN
    return None if fresh else POST


@dataclass(frozen=True)
class Progress:
    """The answer to an all-reduce of ``[ready, failed, late, broken]``: ``action`` and the counts behind it.

    ``broken``: ranks whose commit of an earlier layer raised part-way (their weights can't be
    trusted): every rank then fires a fault that is not recoverable (docs/design.md §8).
    """

    action: str
    ready: int
    failed: int
    late: int
    broken: int = 0


def _counts(summed: Sequence[float]) -> tuple[int, int, int, int]:
    """``[ready, failed, late, broken]`` as four integer counts."""
    values = [int(round(float(v))) for v in summed]
    if len(values) != 4:
        raise ValueError(f"summed flags must be [ready, failed, late, broken], got {len(values)} values")
    ready, failed, late, broken = values
    return ready, failed, late, broken


def decide_progress(summed: Sequence[float], world_size: int, state: str, early: bool = False) -> Progress:
    """From the summed ``[ready, failed, late, broken]`` flags of the job in flight (async mode).

    Any failure, broken commit or lateness aborts; all ``world_size`` ranks ready takes the
    result (the plan in ``planning``, the layer in ``transferring``, the end of the
    rearrangement in ``committing``); otherwise wait. ``early``: the
    step count has not reached the job's ready step (see :func:`decide_poll`), as on a
    balancedness-logging step that joins the flags: a layer paced over that many engine
    steps is not late for taking them, so only a failure aborts it then.
    """
    ready, failed, late, broken = _counts(summed)
    if failed or broken or (late and not early):
        action = ABORT
    elif ready < world_size:
        action = WAIT
    else:
        action = TAKE_PLAN if state == PLANNING else COMMIT_LAYER
    return Progress(action, ready, failed, late, broken)


def decide_layer(summed: Sequence[float]) -> Progress:
    """Sync mode: the summed ``[ready, failed, late, broken]`` of one layer's transfer (or of the
    agreement after the last commit); any failure or broken commit aborts."""
    ready, failed, late, broken = _counts(summed)
    return Progress(ABORT if failed or broken else COMMIT_LAYER, ready, failed, late, broken)


def decide_plan(moves: int, gain: float, min_gain: float, forced_scale: bool = False) -> bool:
    """Whether a plan is worth moving to (``worth`` of ``plan_ready``).

    A scale can't be refused (``forced_scale``): any move is worth it there. Otherwise the
    balancedness must improve by more than ``min_gain`` and something must move.
    """
    if forced_scale:
        return True
    return moves > 0 and gain > min_gain


def salvage_vote(committed: float, lost: Any, count: bool = True) -> list[float]:
    """One rank's part of a salvage, partial or rollback agreement, to be summed over the ranks:
    ``[layers committed, 1 if it would lose an expert, layers committed squared]`` and, with
    ``count``, a 1 (the sum counts the ranks that took part, :func:`agreed_ranks`)."""
    return [float(committed), 1.0 if lost else 0.0, float(committed) ** 2] + ([1.0] if count else [])


def agreed_ranks(summed: Sequence[float]) -> int:
    """How many ranks took part in a summed :func:`salvage_vote` with ``count``."""
    return int(round(float(summed[3])))


def counts_equal(total: float, squares: float, ranks: int) -> bool:
    """Whether ``ranks`` counts with this sum and sum of squares are all equal: G * sum(c^2) ==
    (sum c)^2 (Cauchy-Schwarz). The sums alone decide, so every rank gets the same answer."""
    return ranks * squares == total * total


def decide_salvage(summed: Sequence[float], ranks: int) -> bool:
    """The summed :func:`salvage_vote` of ``ranks`` ranks: safe when every rank committed the same
    number of layers and none would lose an expert. (Comparing the sum with a rank's own count
    times G would only say that rank's count is the mean.)"""
    total, lost, squares = (float(v) for v in summed[:3])
    return not int(round(lost)) and counts_equal(total, squares, ranks)


@dataclass
class Counters:
    """The step counters every rank advances identically (what :func:`decide_step` reads).

    ``steps``: engine steps taken (profile steps excluded); ``since``: steps since the
    interval restarted (at start, a rearrangement, a recovery or a scale) taken with at
    least one model added (:meth:`count_step`); ``threshold``: the steps the current
    interval needs.
    """

    steps: int
    since: int
    threshold: int

    def count_step(self, has_models: bool) -> None:
        """One engine step. Steps before the first ``add_model`` do not count toward the
        interval, so adding a model late never makes a rearrangement due at once: its load
        window has not seen a step yet."""
        self.steps += 1
        if has_models:
            self.since += 1

    def restart(self, interval: int) -> None:
        """The next rearrangement is due ``interval`` steps from now."""
        self.since = 0
        self.threshold = int(interval)

    @property
    def until_due(self) -> int:
        return max(0, self.threshold - self.since)
