"""What the controller reports: the shared trace, rearrangement records, balancedness log.

Nothing here feeds a decision: every value is local bookkeeping for ``history``,
``balancedness_log``, the trace (docs/events.md) and structlog lines. The controller owns
one :class:`Reporter` (``controller.reporter``) and hands it what each record needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from eplb_fsm.fsm.planning import Plan
from eplb_fsm.stats import balancedness, load_fault, rank_loads_physical
from eplb_fsm.trace import EventTrace
from eplb_fsm.safe_log import log_safely

__all__ = ["SharedTrace", "Rearrangement", "Reporter", "abandon_trace"]

_log = structlog.get_logger("eplb_fsm")


class SharedTrace(EventTrace):
    """The controller's trace: records come from several threads (engine, worker, watchdog, liveness).

    :class:`EventTrace` itself orders them under one lock (each record's ``seq`` and its
    line go out together); the name stays for the controller's callers.
    """


def abandon_trace(trace: EventTrace, exc: BaseException, liveness: Any, worker: Any) -> None:
    """A controller's construction raised ``exc`` with its trace open: stop the threads that started, end the
    trace ``how=exception`` once a record of it is out (its header: else replay would read a death; before
    it there is nothing of this controller to end) and close it, so that a retry in this process may open
    the file again (one open trace per file and process)."""
    liveness.stop()
    if worker is not None:
        worker.close()
    if trace.seq:
        trace.end("exception", f"{type(exc).__name__}: {exc}")   # no-op when the header's writer ended it
    trace.close()


@dataclass
class Rearrangement:
    """Book-keeping of the rearrangement in flight (becomes a ``history`` entry)."""

    index: int
    step: int
    forced: bool
    started: float
    plan: Plan | None = None
    job: Any = None                   # async: the worker job in flight (plan or layer)
    job_step: int = -1                # async: the shared step count when that job was handed over
    chunks: int = 1                   # async: the chunks its layer job is cut into (async_max_bytes_per_step)
    ready_step: int = -1              # async: job_step + chunks (one chunk submitted ahead: job_step); before
    #                                   it no flags are posted for the layer job and only a failure aborts it
    layers_committed: int = 0
    broken: list = field(default_factory=list)   # this rank's writes that raised part-way (faults.broken_commit)
    scale: int | None = None          # the elastic scale's generation it serves: its fault names the scale


class Reporter:
    """Rearrangement records and the balancedness log of one rank.

    Owns ``history`` (one entry per rearrangement, committed or not), ``balancedness_log``
    ((step, value) pairs), ``count`` (rearrangements begun: shared, since every rank
    begins them on the same step) and the local seconds spent in each machine state.
    """

    def __init__(self, trace: Any, rank: int) -> None:
        self.trace = trace
        self.rank = rank
        self.history: list[dict] = []
        self.balancedness_log: list[tuple[int, float]] = []
        self.count = 0
        self._seconds_in: dict[str, float] = {}   # per state, closed stays only
        self._entered = time.perf_counter()        # when the current state was entered

    def time_transition(self, source: str, dest: str) -> None:
        """Close the stay in ``source`` when a transition leaves it (a self-transition does not)."""
        if source != dest:
            now = time.perf_counter()
            self._seconds_in[source] = self._seconds_in.get(source, 0.0) + now - self._entered
            self._entered = now

    def state_seconds(self, state: str) -> dict[str, float]:
        """Local seconds spent in each state, counting the current stay in ``state`` up to now."""
        out = dict(self._seconds_in)
        out[state] = out.get(state, 0.0) + time.perf_counter() - self._entered
        return out

    def begin(self, step: int, forced: bool, scale: int | None = None) -> Rearrangement:
        """Open the record of a rearrangement that starts at engine step ``step`` (``scale``: the generation of
        the elastic scale it serves, None for the policy's own)."""
        self.count += 1
        return Rearrangement(index=self.count, step=step, forced=forced, started=time.perf_counter(), scale=scale)

    @staticmethod
    def summary_fields(current: Rearrangement, steps: int) -> dict:
        """The ``committed`` transition's fields for the rearrangement ``current`` (``steps``: taken so far)."""
        plan = current.plan
        return {
            "rearrangement": current.index,
            "moves": plan.moves if plan else 0,
            "moved_bytes": plan.moved_bytes if plan else 0,
            "layers_committed": current.layers_committed,
            "steps_taken": steps - current.step,
            "seconds": round(time.perf_counter() - current.started, 6),
        }

    def finish(self, current: Rearrangement, outcome: str, reason: str | None, *, steps: int, num_layers: int,
               state: str) -> dict:
        """Close ``current``: append its ``history`` entry and write its ``rearrangement`` record."""
        plan = current.plan
        entry = {
            "index": current.index,
            "step": current.step,
            "end_step": max(steps - 1, current.step),
            "forced": current.forced,
            "outcome": outcome,
            "reason": reason,
            "moves": plan.moves if plan else 0,
            "moved_bytes": plan.moved_bytes if plan else 0,
            "changed_layers": int(sum(plan.changed)) if plan else 0,
            "layers_committed": current.layers_committed,
            "num_layers": num_layers,
            "balancedness_before": plan.balancedness_before if plan else None,
            "balancedness_after": plan.balancedness_after if plan else None,
            "policy_s": plan.policy_s if plan else None,
            "seconds": time.perf_counter() - current.started,
            "state": state,
        }
        self.history.append(entry)
        self.trace.emit("rearrangement", **{k: (round(v, 6) if isinstance(v, float) else v)
                                            for k, v in entry.items() if k != "state"})
        if outcome == "committed":
            log_safely(_log, "info", "eplb rearrangement committed", rank=self.rank, step=current.step,
                       moves=entry["moves"], balancedness_before=entry["balancedness_before"],
                       balancedness_after=entry["balancedness_after"])
        return entry

    def log_pass_balancedness(self, step: int, flat: torch.Tensor, models: list, world_size: int) -> None:
        """Balancedness of the current placements under this pass's (all-reduced) load.

        ``flat``: (sum_m L_m * P_m,) the models' physical load passes, concatenated. A pass with
        a NaN, infinite or negative count logs no value (a warning says why): the same step's
        planning, if due, rejects such loads as a recoverable fault (``loads_rejected``).
        """
        fault = load_fault(flat)
        if fault is not None:   # the same on every rank: flat is all-reduced
            log_safely(_log, "warning", "eplb balancedness skipped", rank=self.rank, step=step, reason=fault)
            return
        per_model: dict[str, float] = {}
        all_loads = []
        start = 0
        for entry in models:
            n = entry.num_layers * entry.num_physical
            physical = flat[start:start + n].reshape(entry.num_layers, entry.num_physical).cpu()
            start += n
            loads = rank_loads_physical(physical, world_size)
            all_loads.append(loads.double())
            per_model[entry.name] = balancedness(loads)
        value = balancedness(torch.cat(all_loads)) if all_loads else 1.0
        self.balancedness_log.append((step, value))
        self.trace.emit("balancedness", value=round(value, 6), models={k: round(v, 6) for k, v in per_model.items()},
                        tokens=float(flat.sum()))
        log_safely(_log, "info", "eplb balancedness", rank=self.rank, step=step, balancedness=round(value, 6),
                   models=per_model)
