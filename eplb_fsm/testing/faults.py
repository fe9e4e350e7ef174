"""What a :class:`~eplb_fsm.testing.job.SyntheticJob` breaks, and the check that a fault can fire.

A fault that names a rank the job does not serve, a layer the model lacks, a step where
the rank does nothing the fault could break, a step after the rank's own ``stop``, or a
point of a rearrangement that another fault's ``transfer_error`` has already aborted
would leave the trace healthy, and a test of that fault would pass for the wrong reason.
:func:`check_faults` refuses those before a ``run`` writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eplb_fsm.maps import as_count
from eplb_fsm.trace_encode import RESERVED_FIELDS

__all__ = ["STOP_POINTS", "Faults", "Stop", "check_faults", "hang_faults"]

# where a stopped rank stops within its step
STOP_POINTS = ("before_step", "before_collective", "in_collective")
# where within its step each stop point and fault acts (SyntheticJob's order): a fault at a rank's
# stop step is refused unless it acts before the stop (wrong_collective is the collective it stops in)
_ORDER = {"before_step": 0, "skip_count": 1, "before_collective": 2, "wrong_collective": 3, "in_collective": 4,
          "illegal": 5, "transfer_error": 5}


@dataclass(frozen=True)
class Stop:
    """A rank's trace ends at ``step``: before the step, before its first collective, or inside it."""

    step: int
    where: str = "before_step"

    def __post_init__(self) -> None:
        as_count(self.step, "Stop.step", minimum=0)
        if self.where not in STOP_POINTS:
            raise ValueError(f"where must be one of {', '.join(STOP_POINTS)}, got {self.where!r}")


@dataclass
class Faults:
    """What to break, keyed by rank (every field optional).

    - ``stop``: rank -> Stop (the rank's trace ends there: it died or hangs)
    - ``skip_count``: rank -> step at which the rank's interval counter misses the step,
      so it enters planning one step after the others
    - ``wrong_collective``: rank -> (step, overrides): the first collective of that step is
      issued with e.g. ``{"op": "all_gather"}`` or ``{"shape": [9, 9]}``
    - ``illegal``: rank -> step: during that step's transfer the rank records
      ``committed`` straight from transferring (a transition the machine refuses)
    - ``transfer_error``: rank -> (step, layer): that rank's transfer of the layer fails
      before it sends anything; the others' wave times out (``collective_error``), the
      ready all-reduce tells everyone, every rank fires a recoverable ``fault``, joins the
      ``reset`` agreement and re-creates the transfer group (``transfer_group_reset``), as
      the controller does

    A fault fires in the ``run`` call whose steps include its step; the same ``Faults``
    may be passed to several calls. Every fault but ``stop`` (``before_step``) and
    ``skip_count`` needs its rank to rearrange at that step, and ``illegal`` and
    ``transfer_error`` need a plan that moves something (every third plan moves nothing).
    A ``transfer_error`` aborts its rearrangement on every rank, so ranks failing at one step
    must name one layer, and an ``illegal`` at that step (which acts after layer 0) needs
    the layer to be above 0 and its rank not to be one of the failing ones.
    """

    stop: dict[int, Stop] = field(default_factory=dict)
    skip_count: dict[int, int] = field(default_factory=dict)
    wrong_collective: dict[int, tuple[int, dict]] = field(default_factory=dict)
    illegal: dict[int, int] = field(default_factory=dict)
    transfer_error: dict[int, tuple[int, int]] = field(default_factory=dict)


def hang_faults(world: int, culprit: int, step: int) -> Faults:
    """A classic hang: ``culprit`` never reaches its collective at ``step``; the others wait inside it."""
    world = as_count(world, "world")
    culprit = as_count(culprit, "culprit", minimum=0)
    if culprit >= world:
        raise ValueError(f"culprit must be a rank below world={world}, got {culprit}")
    stop = {r: Stop(step, "in_collective") for r in range(world) if r != culprit}
    stop[culprit] = Stop(step, "before_collective")
    return Faults(stop=stop)


def check_faults(job: Any, faults: Any, steps: int) -> None:
    """Refuse ``faults`` for ``job.run(steps, faults)`` (``ValueError`` naming the field) if any is malformed
    or, at a step of this run, cannot fire: nothing of the job has changed when it raises."""
    if not isinstance(faults, Faults):
        raise ValueError(f"faults must be a Faults, got {type(faults).__name__}")
    start, end = job.step_no, job.step_no + steps
    at: dict[str, dict[int, tuple[int, int | None]]] = {}   # field -> rank -> (step, layer)
    for name in ("stop", "skip_count", "wrong_collective", "illegal", "transfer_error"):
        table = getattr(faults, name)
        if not isinstance(table, dict):
            raise ValueError(f"Faults.{name} must be a dict keyed by rank, got {type(table).__name__}")
        at[name] = {}
        for rank, value in table.items():
            as_count(rank, f"Faults.{name} rank", minimum=0)
            if rank not in job.ranks:
                raise ValueError(f"Faults.{name}: rank {rank} is not a serving rank {sorted(job.ranks)}")
            at[name][rank] = _step_and_layer(name, value, job.num_layers)
    _check_preempted(at["illegal"], at["transfer_error"])
    for name, table in at.items():
        for rank, (step, layer) in table.items():
            if not start <= step < end:
                continue
            if job.ranks[rank].stopped:
                raise ValueError(f"Faults.{name}: rank {rank} has stopped; nothing of it runs at step {step}")
            stop = faults.stop.get(rank) if name != "stop" else None
            if stop is not None and start <= stop.step < end and (
                    step > stop.step or (step == stop.step and _ORDER[name] > _ORDER[stop.where])):
                raise ValueError(f"Faults.{name}: rank {rank} stops at step {stop.step} ({stop.where}, Faults.stop) "
                                 f"in this run, so its fault at step {step} could not fire: nothing of a rank runs "
                                 "after its stop")
            if name == "skip_count" or (name == "stop" and faults.stop[rank].where == "before_step"):
                continue
            due, index = _rearranges(job, rank, step, at["skip_count"].get(rank, (None, None))[0])
            if not due:
                raise ValueError(f"Faults.{name}: rank {rank} does not rearrange at step {step} (interval "
                                 f"{job.interval}), so the fault could not fire")
            if name in ("illegal", "transfer_error") and index % 3 == 2:
                raise ValueError(f"Faults.{name}: rank {rank}'s plan at step {step} moves nothing (every third "
                                 "plan), so there is no transfer to break")


def _check_preempted(illegal: dict[int, tuple[int, int | None]],
                     errors: dict[int, tuple[int, int | None]]) -> None:
    """Refuse faults another fault of the same rearrangement pre-empts, at whatever step.

    A ``transfer_error`` at (step, layer) aborts that rearrangement on every rank before the
    layer's wave, so no rank reaches a later layer (another rank's ``transfer_error`` there), and
    none reaches the end of layer 0, where ``illegal`` commits, when the layer is 0; an ``illegal``
    commit ends its rank's rearrangement after layer 0, before its own later ``transfer_error``.
    """
    layers: dict[int, dict[int, list[int]]] = {}   # step -> failed layer -> ranks
    for rank, (step, layer) in sorted(errors.items()):
        layers.setdefault(step, {}).setdefault(layer, []).append(rank)
    for step, failed in sorted(layers.items()):
        if len(failed) > 1:
            named = "; ".join(f"layer {k} on rank(s) {ranks}" for k, ranks in sorted(failed.items()))
            raise ValueError(f"Faults.transfer_error: at step {step} ranks fail different layers ({named}); the "
                             "first failed layer aborts the rearrangement on every rank, so the later ones "
                             "could not fire (give every rank failing at one step the same layer)")
    for rank, (step, _) in sorted(illegal.items()):
        failed = layers.get(step, {})
        for layer, ranks in failed.items():
            if layer == 0:
                raise ValueError(f"Faults.illegal and Faults.transfer_error: rank {rank}'s illegal commit at step "
                                 f"{step} comes after layer 0, whose transfer fails on rank(s) {ranks} and aborts "
                                 "the rearrangement on every rank first, so it could not fire")
            if rank in ranks:
                raise ValueError(f"Faults.illegal and Faults.transfer_error: rank {rank}'s illegal commit at step "
                                 f"{step} ends its rearrangement after layer 0, so its transfer_error at layer "
                                 f"{layer} could not fire")


def _step_and_layer(name: str, value: Any, num_layers: int) -> tuple[int, int | None]:
    """(step, layer) of one fault entry, checked."""
    if name == "stop":
        if not isinstance(value, Stop):
            raise ValueError(f"Faults.stop values must be Stop(step, where), got {value!r}")
        return value.step, None
    if name in ("skip_count", "illegal"):
        return as_count(value, f"Faults.{name} step", minimum=0), None
    if not isinstance(value, tuple) or len(value) != 2:
        shape = "(step, overrides)" if name == "wrong_collective" else "(step, layer)"
        raise ValueError(f"Faults.{name} values must be {shape} tuples, got {value!r}")
    step = as_count(value[0], f"Faults.{name} step", minimum=0)
    if name == "wrong_collective":
        if not isinstance(value[1], dict):
            raise ValueError(f"Faults.wrong_collective overrides must be a dict, got {value[1]!r}")
        stamped = sorted(RESERVED_FIELDS.intersection(value[1]))
        if stamped:   # the trace refuses them at the collective's record, half-way through a run: refuse them here
            raise ValueError(f"Faults.wrong_collective overrides must not name a field the trace stamps itself "
                             f"({', '.join(sorted(RESERVED_FIELDS))}), got {stamped}")
        return step, None
    layer = as_count(value[1], "Faults.transfer_error layer", minimum=0)
    if layer >= num_layers:
        raise ValueError(f"Faults.transfer_error layer must be below num_layers={num_layers}, got {layer}")
    return step, layer


def _rearranges(job: Any, rank: int, step: int, skip: int | None) -> tuple[bool, int]:
    """Whether ``rank`` is due at ``step`` of the coming run, and that rearrangement's index.

    The counter gains one a step from ``job.step_no`` on (none at the skipped step) and
    the rank is due each time it reaches the interval.
    """
    synthetic = job.ranks[rank]
    if skip == step:
        return False, -1
    counted = step - job.step_no + 1 - (1 if skip is not None and job.step_no <= skip <= step else 0)
    total = synthetic.count + counted
    return total % job.interval == 0, synthetic.rearrangements + total // job.interval - 1
