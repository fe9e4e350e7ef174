"""The EPLB lifecycle as a `transitions` state machine: states, events, guards. No actions.

States: collecting -> planning -> transferring[layer k] -> committing -> collecting,
with scaling for elastic EP and failed for faults that need the engine's attention.
Transferring[k] is one state plus the ``layer`` counter, advanced by a guarded
self-transition, so the diagram stays small and the replay checks the counter.

Guards read only event data and counters that every rank shares (``layer``,
``num_layers``, ``scale_pending``) and never local time, so every rank takes the same
transition at the same step, and ``eplb-fsm replay`` re-drives them from the trace.
What to do is decided by the pure functions of ``fsm.decide``, whose answers arrive here
as event data; the actions (planning, moving weights, committing maps) are executed by
the controller and its ``Rearranger``, which act on the destination ``fire()`` returns.
``committing`` is where the last layer is written and its maps flipped.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from transitions import Machine, MachineError

from eplb_fsm.maps import as_count

COLLECTING = "collecting"
PLANNING = "planning"
TRANSFERRING = "transferring"
COMMITTING = "committing"
SCALING = "scaling"
FAILED = "failed"

STATES = (COLLECTING, PLANNING, TRANSFERRING, COMMITTING, SCALING, FAILED)
INITIAL = COLLECTING

# event data each trigger takes (the trace records them so a replay can re-drive guards)
EVENT_DATA: dict[str, tuple[str, ...]] = {
    "step": ("due",),
    "plan_ready": ("moves", "worth"),
    "layer_done": ("layer",),
    "committed": (),
    "scale_requested": (),
    "groups_ready": (),
    "switched": (),
    "fault": ("recoverable",),
    "recovered": (),
    "salvaged": (),
    "resumed": (),
}
# what each datum must be: a guard that read "no" as True, 0.9 as layer 0, None as a crash or a missing
# datum as a default would take a transition the trace could not explain (numpy scalars pass, as decisions
# may hand them over). Every datum a trigger takes is required: its guards read each one.
FLAG_DATA = ("due", "worth", "recoverable")      # bool
COUNT_DATA = ("layer", "moves")                  # int >= 0, not bool

# The transition table (docs/machine.md explains every row). ``internal`` rows keep the state without exit/enter.
# Order matters within a trigger: the first row whose guards pass wins.
TRANSITIONS: tuple[dict[str, Any], ...] = (
    {"trigger": "step", "source": COLLECTING, "dest": PLANNING, "conditions": "is_due"},
    {"trigger": "step", "source": COLLECTING, "dest": None, "note": "record load pass"},
    # the engine keeps stepping while a plan or a layer is in flight (async) or groups form
    {"trigger": "step", "source": [PLANNING, TRANSFERRING, COMMITTING, SCALING, FAILED], "dest": None},
    {"trigger": "plan_ready", "source": PLANNING, "dest": TRANSFERRING,
     "conditions": "is_worth_moving", "before": "start_first_layer"},
    # a scale can't be refused: with nothing to move it goes straight on to the switch
    {"trigger": "plan_ready", "source": PLANNING, "dest": SCALING, "conditions": "is_scale_pending",
     "note": "scale with nothing to move"},
    {"trigger": "plan_ready", "source": PLANNING, "dest": COLLECTING, "note": "nothing worth moving"},
    {"trigger": "layer_done", "source": TRANSFERRING, "dest": TRANSFERRING,
     "conditions": ["is_current_layer", "has_more_layers"], "before": "advance_layer"},
    {"trigger": "layer_done", "source": TRANSFERRING, "dest": COMMITTING,
     "conditions": ["is_current_layer", "is_last_layer"]},
    {"trigger": "committed", "source": COMMITTING, "dest": SCALING, "conditions": "is_scale_pending"},
    {"trigger": "committed", "source": COMMITTING, "dest": COLLECTING},
    {"trigger": "scale_requested", "source": COLLECTING, "dest": SCALING, "before": "mark_scale_pending"},
    # a joiner starts in scaling without having seen scale_requested: groups_ready marks the
    # switch pending on every rank, so the committed -> scaling row holds for all of them
    {"trigger": "groups_ready", "source": SCALING, "dest": PLANNING, "before": "mark_scale_pending"},
    {"trigger": "switched", "source": SCALING, "dest": COLLECTING, "before": "clear_scale_pending"},
    # a fault aborts a scale too: no switch stays pending after it
    {"trigger": "fault", "source": [COLLECTING, PLANNING, TRANSFERRING, COMMITTING, SCALING],
     "dest": COLLECTING, "conditions": "is_recoverable", "before": "clear_scale_pending"},
    {"trigger": "fault", "source": [COLLECTING, PLANNING, TRANSFERRING, COMMITTING, SCALING, FAILED],
     "dest": FAILED, "before": "clear_scale_pending"},
    {"trigger": "recovered", "source": FAILED, "dest": COLLECTING},
    # the old group broke mid scale-down, but the survivors agreed on their new group that
    # every expert still has a replica among them: they go on to the switch from failed
    {"trigger": "salvaged", "source": FAILED, "dest": SCALING, "before": "mark_scale_pending"},
    # a scale-up's rearrangement stopped part-way (a recoverable fault: collecting) with the new group
    # intact, and every rank of it agreed to switch with the placement as it stands: on to the switch
    {"trigger": "resumed", "source": COLLECTING, "dest": SCALING, "before": "mark_scale_pending"},
)


class IllegalTransition(RuntimeError):
    """An event that no transition accepts in the current state; nothing changed."""

    def __init__(self, trigger: str, state: str, layer: int, data: dict) -> None:
        self.trigger, self.state, self.layer, self.data = trigger, state, layer, data
        super().__init__(
            f"event {trigger!r} is not allowed in state {state!r}"
            + (f" (layer {layer})" if state == TRANSFERRING else "")
            + (f" with {data}" if data else "")
        )


@dataclass(frozen=True)
class Fired:
    """What one event did: the trigger, source and destination states, layer after it."""

    trigger: str
    source: str
    dest: str
    layer: int
    data: dict

    @property
    def changed(self) -> bool:
        return self.source != self.dest or self.trigger == "layer_done"


class EplbMachine:
    """The model the `transitions` Machine drives: the state plus the shared counters.

    ``fire(trigger, **data)`` is the only way in: it checks the event data (every datum of
    ``EVENT_DATA`` present, of its type, counts >= 0; ``ValueError`` before anything changes),
    runs the transition and tells every listener (the trace, the watchdog) what happened.
    ``num_layers`` (>= 1) and ``layer`` (>= 0) must be ints (``ValueError`` naming them).
    """

    def __init__(self, num_layers: int, state: str = INITIAL, layer: int = 0, scale_pending: bool = False):
        num_layers = as_count(num_layers, "num_layers", minimum=1)   # 2.9 layers is an error, not 2
        layer = as_count(layer, "layer", minimum=0)
        if state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")
        self.num_layers = num_layers
        self.layer = layer
        self.scale_pending = bool(scale_pending)
        self.listeners: list[Callable[[Fired], None]] = []
        # a queued Machine's trigger() returns True even when every guard refused the event, so
        # fire() reads whether a transition ran from after_state_change, which runs only for one
        # that did. (Not from finalize_event: transitions swallows any exception raised there, so a
        # Ctrl-C or SIGTERM landing in it was lost and fire() said IllegalTransition.)
        self._accepted = False
        self.machine = Machine(
            model=self,
            states=list(STATES),
            transitions=[{k: v for k, v in row.items() if k != "note"} for row in TRANSITIONS],
            initial=state,
            auto_transitions=False,
            queued=True,
            send_event=True,
            ignore_invalid_triggers=False,
            after_state_change=self._note_accepted,
        )

    def _note_accepted(self, event) -> None:
        self._accepted = True

    # -- guards (event data and shared counters only; fire() made sure each datum is there) --
    def is_due(self, event) -> bool:
        return bool(event.kwargs["due"])

    def is_worth_moving(self, event) -> bool:
        return int(event.kwargs["moves"]) > 0 and bool(event.kwargs["worth"])

    def is_current_layer(self, event) -> bool:
        return int(event.kwargs["layer"]) == self.layer

    def has_more_layers(self, event) -> bool:
        return self.layer < self.num_layers - 1

    def is_last_layer(self, event) -> bool:
        return self.layer == self.num_layers - 1

    def is_scale_pending(self, event) -> bool:
        return self.scale_pending

    def is_recoverable(self, event) -> bool:
        return bool(event.kwargs["recoverable"])

    # -- counter updates (part of the transition, not actions) -----------
    def start_first_layer(self, event) -> None:
        self.layer = 0

    def advance_layer(self, event) -> None:
        self.layer += 1

    def mark_scale_pending(self, event) -> None:
        self.scale_pending = True

    def clear_scale_pending(self, event) -> None:
        self.scale_pending = False

    # -- driving ---------------------------------------------------------
    def fire(self, trigger: str, **data: Any) -> Fired:
        """Run one event; raise IllegalTransition (state unchanged) if none accepts it. An exception raised
        while it runs (a Ctrl-C's, a SIGTERM handler's) reaches the caller, and no event stays queued."""
        allowed = EVENT_DATA.get(trigger)
        if allowed is None:
            raise ValueError(f"unknown event {trigger!r}; events: {', '.join(EVENT_DATA)}")
        unknown = set(data) - set(allowed)
        if unknown:
            raise ValueError(f"event {trigger!r} takes {list(allowed)}, got unexpected {sorted(unknown)}")
        missing = [key for key in allowed if key not in data]
        if missing:   # a guard would read a default in its place, which the trace could not show
            raise ValueError(f"event {trigger!r} needs {', '.join(missing)} (every datum it takes: {list(allowed)})")
        check_event_data(trigger, data)
        source = self.state
        layer_before = self.layer
        self._accepted = False
        try:
            accepted = self.trigger(trigger, **data) and self._accepted
        except MachineError:
            accepted = False
        except BaseException:
            # an interrupt between the queue's append and its processing leaves this event queued: every
            # later trigger would then wait behind it, unprocessed. fire() is never nested (no callback
            # fires), so whatever is queued is this call's own.
            queue = getattr(self.machine, "_transition_queue", None)
            if queue:
                queue.clear()
            raise
        if not accepted:
            raise IllegalTransition(trigger, source, layer_before, data)
        fired = Fired(trigger, source, self.state, self.layer, dict(data))
        for listener in self.listeners:
            listener(fired)
        return fired

    def may(self, trigger: str) -> bool:
        """Whether some transition for ``trigger`` leaves the current state (guards not run)."""
        return any(_sources(row) & {self.state} for row in TRANSITIONS if row["trigger"] == trigger)

    def snapshot(self) -> dict:
        return {"state": self.state, "layer": self.layer, "num_layers": self.num_layers,
                "scale_pending": self.scale_pending}


def check_event_data(trigger: str, data: dict) -> None:
    """``ValueError`` naming the datum of ``data`` whose type its guard can't read, or a negative count
    (see ``FLAG_DATA``, ``COUNT_DATA``)."""
    for key, value in data.items():
        flag = isinstance(value, (bool, np.bool_))
        what = "of the wrong type"
        if key in FLAG_DATA and not flag:
            rule = "must be a bool"
        elif key in COUNT_DATA and (flag or not isinstance(value, numbers.Integral)):
            rule = "must be an int (not a bool)"
        elif key in COUNT_DATA and value < 0:   # no layer -1, no -3 moves: a count
            what, rule = "out of range", "must be an int >= 0"
        else:
            continue
        # the replay (inspect.model) shows this text as why the machine refused a record
        raise ValueError(f"event {trigger!r} got event data {what}: {key} {rule}, got {value!r}")


def _sources(row: dict) -> set[str]:
    src = row["source"]
    return set(src) if isinstance(src, (list, tuple)) else {src}


def check_definition(
    transitions: tuple[dict[str, Any], ...] | list[dict[str, Any]] = TRANSITIONS,
    states: tuple[str, ...] | list[str] = STATES,
    events: dict[str, tuple[str, ...]] = EVENT_DATA,
    initial: str = INITIAL,
) -> None:
    """Fail loudly if the table has an unreachable state or an event with no transition.

    Checks the module's own table by default; tests pass a broken table to prove it bites.
    """
    reachable = {initial}
    frontier = [initial]
    while frontier:
        state = frontier.pop()
        for row in transitions:
            if state in _sources(row):
                dest = row["dest"] or state
                if dest not in reachable:
                    reachable.add(dest)
                    frontier.append(dest)
    unreachable = set(states) - reachable
    if unreachable:
        raise AssertionError(f"unreachable states in the EPLB machine: {sorted(unreachable)}")
    idle = set(events) - {row["trigger"] for row in transitions}
    if idle:
        raise AssertionError(f"events without a transition: {sorted(idle)}")
    unknown = {d for row in transitions for d in [row["dest"]] if d is not None} - set(states)
    unknown |= {s for row in transitions for s in _sources(row)} - set(states)
    if unknown:
        raise AssertionError(f"transitions name unknown states: {sorted(unknown)}")


check_definition()
