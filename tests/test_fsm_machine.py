"""The EPLB machine against its transition table: every legal and illegal event, guards, checks.

The expected outcome of an event is computed here from ``TRANSITIONS`` with guard and
counter semantics written out independently (``GUARD_SPEC`` / ``EFFECT_SPEC``), so the test
proves the `transitions` wiring (row order, conditions, ``before`` callbacks, queued
firing) does what the table says, and the hand-written walks pin the table docs/machine.md explains.
"""

from __future__ import annotations

import itertools

import pytest

from eplb_fsm.fsm.machine import (
    COLLECTING,
    COMMITTING,
    EVENT_DATA,
    FAILED,
    PLANNING,
    SCALING,
    STATES,
    TRANSFERRING,
    TRANSITIONS,
    EplbMachine,
    Fired,
    IllegalTransition,
    check_definition,
)

NUM_LAYERS = 3

# the event data each trigger is tried with: guards pass for some, fail for others
DATA_VARIANTS: dict[str, list[dict]] = {
    "step": [{"due": True}, {"due": False}],
    "plan_ready": [{"moves": 3, "worth": True}, {"moves": 0, "worth": True}, {"moves": 3, "worth": False},
                   {"moves": 0, "worth": False}],
    "layer_done": [{"layer": k} for k in (0, 1, 2, 7)],
    "committed": [{}],
    "scale_requested": [{}],
    "groups_ready": [{}],
    "switched": [{}],
    "fault": [{"recoverable": True}, {"recoverable": False}],
    "recovered": [{}],
    "salvaged": [{}],
    "resumed": [{}],
}

# machine context: (layer, scale_pending)
CONTEXTS = list(itertools.product(range(NUM_LAYERS), (False, True)))

GUARD_SPEC = {
    "is_due": lambda ctx, data: data["due"],
    "is_worth_moving": lambda ctx, data: data["moves"] > 0 and data["worth"],
    "is_current_layer": lambda ctx, data: data["layer"] == ctx["layer"],
    "has_more_layers": lambda ctx, data: ctx["layer"] < NUM_LAYERS - 1,
    "is_last_layer": lambda ctx, data: ctx["layer"] == NUM_LAYERS - 1,
    "is_scale_pending": lambda ctx, data: ctx["scale_pending"],
    "is_recoverable": lambda ctx, data: data["recoverable"],
}

EFFECT_SPEC = {
    "start_first_layer": lambda ctx: ctx.update(layer=0),
    "advance_layer": lambda ctx: ctx.update(layer=ctx["layer"] + 1),
    "mark_scale_pending": lambda ctx: ctx.update(scale_pending=True),
    "clear_scale_pending": lambda ctx: ctx.update(scale_pending=False),
}


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def expected_outcome(state: str, layer: int, scale_pending: bool, trigger: str, data: dict):
    """(row index, dest, layer, scale_pending) the table prescribes, or None when illegal."""
    ctx = {"layer": layer, "scale_pending": scale_pending}
    for index, row in enumerate(TRANSITIONS):
        if row["trigger"] != trigger or state not in _as_list(row["source"]):
            continue
        if all(GUARD_SPEC[g](ctx, data) for g in _as_list(row.get("conditions"))) and not any(
            GUARD_SPEC[g](ctx, data) for g in _as_list(row.get("unless"))
        ):
            for effect in _as_list(row.get("before")):
                EFFECT_SPEC[effect](ctx)
            return index, row["dest"] or state, ctx["layer"], ctx["scale_pending"]
    return None


def _cases(state: str, trigger: str):
    for (layer, pending), data in itertools.product(CONTEXTS, DATA_VARIANTS[trigger]):
        yield layer, pending, data, expected_outcome(state, layer, pending, trigger, data)


PAIRS = [(s, t) for s in STATES for t in EVENT_DATA]


def test_spec_covers_every_guard_effect_and_event():
    """The independent guard/effect spec names every guard and callback the table uses."""
    used_guards = {g for row in TRANSITIONS for key in ("conditions", "unless") for g in _as_list(row.get(key))}
    used_effects = {e for row in TRANSITIONS for e in _as_list(row.get("before"))}
    assert used_guards == set(GUARD_SPEC)
    assert used_effects == set(EFFECT_SPEC)
    assert set(DATA_VARIANTS) == set(EVENT_DATA)
    assert not any(row.get("after") or row.get("prepare") for row in TRANSITIONS), "spec has no after/prepare"


@pytest.mark.parametrize("state,trigger", PAIRS)
def test_legal_events_reach_the_table_destination(state, trigger):
    """Every event the table accepts from this state lands on the row's dest with the right layer."""
    for layer, pending, data, outcome in _cases(state, trigger):
        if outcome is None:
            continue
        _, dest, layer_after, pending_after = outcome
        machine = EplbMachine(NUM_LAYERS, state=state, layer=layer, scale_pending=pending)
        seen: list[Fired] = []
        machine.listeners.append(seen.append)
        fired = machine.fire(trigger, **data)
        where = f"{state} layer={layer} pending={pending} {trigger}({data})"
        assert machine.state == dest, where
        assert machine.layer == layer_after, where
        assert machine.scale_pending == pending_after, where
        assert fired == Fired(trigger, state, dest, layer_after, data), where
        assert seen == [fired], where


@pytest.mark.parametrize("state,trigger", PAIRS)
def test_illegal_events_raise_and_change_nothing(state, trigger):
    """Every event the table refuses raises IllegalTransition and leaves state, layer, scale_pending."""
    for layer, pending, data, outcome in _cases(state, trigger):
        if outcome is not None:
            continue
        machine = EplbMachine(NUM_LAYERS, state=state, layer=layer, scale_pending=pending)
        seen: list[Fired] = []
        machine.listeners.append(seen.append)
        before = machine.snapshot()
        with pytest.raises(IllegalTransition) as info:
            machine.fire(trigger, **data)
        assert machine.snapshot() == before
        assert seen == []
        assert (info.value.trigger, info.value.state, info.value.layer, info.value.data) == (
            trigger, state, layer, data,
        )
        # the machine is still usable afterwards: a step is legal from every state
        machine.fire("step", due=False)
        assert machine.state == state


def test_every_row_is_exercised_and_some_pairs_are_illegal():
    """The case grid hits every table row at least once and refuses some (state, event) pairs."""
    hit: set[int] = set()
    illegal_pairs = set()
    for state, trigger in PAIRS:
        for _, _, _, outcome in _cases(state, trigger):
            if outcome is None:
                illegal_pairs.add((state, trigger))
            else:
                hit.add(outcome[0])
    assert hit == set(range(len(TRANSITIONS)))
    # pairs with no row at all are illegal whatever the data
    assert (COLLECTING, "committed") in illegal_pairs
    assert (TRANSFERRING, "plan_ready") in illegal_pairs
    assert (FAILED, "layer_done") in illegal_pairs


def test_may_matches_the_table_sources():
    """may(trigger) is true exactly when some row of that trigger leaves the current state."""
    for state, trigger in PAIRS:
        machine = EplbMachine(NUM_LAYERS, state=state)
        has_row = any(r["trigger"] == trigger and state in _as_list(r["source"]) for r in TRANSITIONS)
        assert machine.may(trigger) == has_row, (state, trigger)


def test_full_rearrangement_walk_follows_design_table():
    """collecting -> planning -> transferring k=0..L-1 -> committing -> collecting, as docs/machine.md says."""
    m = EplbMachine(NUM_LAYERS)
    assert m.state == COLLECTING
    m.fire("step", due=False)
    assert m.state == COLLECTING
    m.fire("step", due=True)
    assert m.state == PLANNING
    m.fire("step", due=True)  # the engine keeps stepping while a plan is in flight
    assert m.state == PLANNING
    m.fire("plan_ready", moves=5, worth=True)
    assert (m.state, m.layer) == (TRANSFERRING, 0)
    for k in range(NUM_LAYERS - 1):
        fired = m.fire("layer_done", layer=k)
        assert (m.state, m.layer, fired.changed) == (TRANSFERRING, k + 1, True)
    m.fire("layer_done", layer=NUM_LAYERS - 1)
    assert (m.state, m.layer) == (COMMITTING, NUM_LAYERS - 1)
    m.fire("committed")
    assert m.state == COLLECTING


def test_guards_pick_the_first_passing_row():
    """plan_ready with nothing worth moving goes back to collecting; the transferring row needs both."""
    for data in ({"moves": 0, "worth": True}, {"moves": 4, "worth": False}):
        m = EplbMachine(NUM_LAYERS, state=PLANNING)
        fired = m.fire("plan_ready", **data)
        assert (fired.dest, fired.changed) == (COLLECTING, True)
    m = EplbMachine(NUM_LAYERS, state=COLLECTING)
    assert m.fire("step", due=False).changed is False


def test_layer_done_for_the_wrong_layer_is_illegal():
    """A layer_done naming a layer other than the current one (skipped or repeated) is refused."""
    m = EplbMachine(NUM_LAYERS, state=TRANSFERRING, layer=1)
    for wrong in (0, 2):
        with pytest.raises(IllegalTransition, match=r"layer 1"):
            m.fire("layer_done", layer=wrong)
    assert (m.state, m.layer) == (TRANSFERRING, 1)


def test_scale_path_sets_and_clears_scale_pending():
    """scale_requested marks a pending reconfiguration, committed honours it, switched clears it."""
    m = EplbMachine(1)
    m.fire("scale_requested")
    assert (m.state, m.scale_pending) == (SCALING, True)
    m.fire("groups_ready")
    assert m.state == PLANNING
    m.fire("plan_ready", moves=2, worth=True)
    m.fire("layer_done", layer=0)
    m.fire("committed")
    assert (m.state, m.scale_pending) == (SCALING, True)
    m.fire("switched")
    assert (m.state, m.scale_pending) == (COLLECTING, False)


def test_joiner_path_from_scaling_reaches_the_switch():
    """A joiner starts in scaling without scale_requested: groups_ready marks the switch pending."""
    m = EplbMachine(1, state=SCALING)
    m.fire("groups_ready")
    assert (m.state, m.scale_pending) == (PLANNING, True)
    m.fire("plan_ready", moves=1, worth=True)
    m.fire("layer_done", layer=0)
    m.fire("committed")
    assert m.state == SCALING
    m.fire("switched")
    assert (m.state, m.scale_pending) == (COLLECTING, False)


def test_scale_with_nothing_to_move_goes_from_planning_to_the_switch():
    """A scale's plan_ready without moves leads to scaling (no made-up event); outside a scale, to collecting."""
    m = EplbMachine(2)
    m.fire("scale_requested")
    m.fire("groups_ready")
    fired = m.fire("plan_ready", moves=0, worth=True)
    assert (fired.dest, m.scale_pending) == (SCALING, True)
    assert m.fire("switched").dest == COLLECTING
    m.fire("step", due=True)
    assert m.fire("plan_ready", moves=0, worth=True).dest == COLLECTING


@pytest.mark.parametrize("recoverable, after_fault, event",
                         [(False, FAILED, "salvaged"), (True, COLLECTING, "resumed")])
def test_a_broken_scale_goes_on_to_its_switch_through_its_own_event(recoverable, after_fault, event):
    """A scale-down broken mid-way (failed) is salvaged, a scale-up cut short (collecting) resumed: to scaling, then
    switched to collecting; neither event leads anywhere from the other's state."""
    m = EplbMachine(2)
    m.fire("scale_requested")
    m.fire("groups_ready")
    m.fire("plan_ready", moves=2, worth=True)
    m.fire("fault", recoverable=recoverable)
    assert (m.state, m.scale_pending) == (after_fault, False)
    fired = m.fire(event)
    assert (fired.source, fired.dest, m.scale_pending) == (after_fault, SCALING, True)
    assert m.fire("switched").dest == COLLECTING
    m.fire("fault", recoverable=not recoverable)
    with pytest.raises(IllegalTransition):
        m.fire(event)


@pytest.mark.parametrize("recoverable, dest", [(True, COLLECTING), (False, FAILED)])
def test_a_fault_aborts_a_pending_scale(recoverable, dest):
    """A fault during a scale clears scale_pending, so the next commit goes back to collecting."""
    m = EplbMachine(1)
    m.fire("scale_requested")
    m.fire("groups_ready")
    m.fire("fault", recoverable=recoverable)
    assert (m.state, m.scale_pending) == (dest, False)
    if dest == FAILED:
        m.fire("recovered")
    m.fire("step", due=True)
    m.fire("plan_ready", moves=1, worth=True)
    m.fire("layer_done", layer=0)
    m.fire("committed")
    assert m.state == COLLECTING


def test_faults_roll_back_or_fail_and_recover():
    """A recoverable fault returns to collecting, an unrecoverable one to failed until recovered."""
    m = EplbMachine(NUM_LAYERS, state=TRANSFERRING, layer=2)
    m.fire("fault", recoverable=True)
    assert m.state == COLLECTING
    m = EplbMachine(NUM_LAYERS, state=COMMITTING)
    m.fire("fault", recoverable=False)
    assert m.state == FAILED
    m.fire("fault", recoverable=True)  # failed only leaves through recovered
    assert m.state == FAILED
    m.fire("recovered")
    assert m.state == COLLECTING


def test_fire_rejects_unknown_events_and_data():
    """An unknown trigger or unexpected event data is a ValueError and nothing changes."""
    m = EplbMachine(NUM_LAYERS)
    with pytest.raises(ValueError, match="unknown event"):
        m.fire("explode")
    with pytest.raises(ValueError, match="unexpected"):
        m.fire("step", due=True, layer=3)
    assert m.snapshot() == {"state": COLLECTING, "layer": 0, "num_layers": NUM_LAYERS, "scale_pending": False}


def test_constructor_validates_arguments():
    """num_layers < 1 and an unknown start state are rejected with the field named."""
    with pytest.raises(ValueError, match="num_layers"):
        EplbMachine(0)
    with pytest.raises(ValueError, match="state must be one of"):
        EplbMachine(2, state="sleeping")


@pytest.mark.parametrize("kwargs, message", [
    ({"num_layers": 2.9}, "num_layers must be an integer, got 2.9"),
    ({"num_layers": True}, "num_layers must be an integer"),
    ({"num_layers": "3"}, "num_layers must be an integer"),
    ({"num_layers": 2, "layer": -7}, "layer must be >= 0, got -7"),
    ({"num_layers": 2, "layer": 1.5}, "layer must be an integer, got 1.5"),
])
def test_constructor_takes_num_layers_and_layer_only_as_counts(kwargs, message):
    """num_layers=2.9 is not truncated to 2 and layer=-7 is not kept: a ValueError naming the field and rule."""
    with pytest.raises(ValueError, match=message):
        EplbMachine(**kwargs)
    import numpy as np

    m = EplbMachine(np.int64(3), layer=np.int32(2), state=TRANSFERRING)
    assert (type(m.num_layers), type(m.layer), m.num_layers, m.layer) == (int, int, 3, 2)


@pytest.mark.parametrize("state, trigger, data, missing", [
    (COLLECTING, "step", {}, "due"),
    (PLANNING, "step", {}, "due"),
    (TRANSFERRING, "fault", {}, "recoverable"),
    (FAILED, "fault", {}, "recoverable"),
    (PLANNING, "plan_ready", {"worth": True}, "moves"),
    (PLANNING, "plan_ready", {"moves": 5}, "worth"),
    (PLANNING, "plan_ready", {}, "moves, worth"),
    (TRANSFERRING, "layer_done", {}, "layer"),
])
def test_event_data_a_guard_reads_is_required_not_defaulted(state, trigger, data, missing):
    """A fault without recoverable (once read as recoverable), plan_ready without moves or worth (once 0 and True):
    a ValueError naming what is missing, before anything changes."""
    m = EplbMachine(num_layers=NUM_LAYERS, state=state, layer=1)
    seen: list = []
    m.listeners.append(seen.append)
    before = m.snapshot()
    with pytest.raises(ValueError, match=f"event '{trigger}' needs {missing} "):
        m.fire(trigger, **data)
    assert (m.snapshot(), seen) == (before, [])


@pytest.mark.parametrize("state, trigger, data, field", [
    (PLANNING, "plan_ready", {"moves": -3, "worth": True}, "moves"),
    (PLANNING, "plan_ready", {"moves": -1, "worth": False}, "moves"),
    (TRANSFERRING, "layer_done", {"layer": -1}, "layer"),
])
def test_a_negative_count_in_event_data_is_refused_before_anything_changes(state, trigger, data, field):
    """moves=-3 (once read as nothing to move) or layer -1 is a ValueError naming the datum and the rule."""
    import numpy as np

    m = EplbMachine(num_layers=NUM_LAYERS, state=state, layer=0)
    with pytest.raises(ValueError, match=f"event data out of range: {field} must be an int >= 0, got -"):
        m.fire(trigger, **data)
    with pytest.raises(ValueError, match=f"{field} must be an int >= 0"):
        m.fire(trigger, **{k: np.int64(v) if k == field else v for k, v in data.items()})
    assert (m.state, m.layer) == (state, 0)


def test_illegal_transition_message_names_state_layer_and_data():
    """The IllegalTransition message says which event, which state, which layer and data."""
    err = IllegalTransition("layer_done", TRANSFERRING, 3, {"layer": 5})
    assert "'layer_done'" in str(err) and "'transferring'" in str(err)
    assert "layer 3" in str(err) and "'layer': 5" in str(err)
    assert "layer" not in str(IllegalTransition("committed", COLLECTING, 3, {}))


def test_check_definition_accepts_the_shipped_table():
    """The machine's own table passes the definition check."""
    check_definition()


def test_check_definition_finds_an_unreachable_state():
    """Dropping every way into scaling makes the check name scaling as unreachable."""
    broken = [r for r in TRANSITIONS if r["dest"] != SCALING]
    with pytest.raises(AssertionError, match="unreachable states.*scaling"):
        check_definition(broken)


def test_check_definition_finds_an_event_without_transition():
    """An event in EVENT_DATA with no row (here: recovered) is reported."""
    broken = [r for r in TRANSITIONS if r["trigger"] != "recovered"]
    # keep failed reachable: the fault rows still lead there
    with pytest.raises(AssertionError, match="events without a transition.*recovered"):
        check_definition(broken)


def test_check_definition_finds_unknown_state_names():
    """A row naming a state that is not declared is reported."""
    broken = list(TRANSITIONS) + [{"trigger": "switched", "source": SCALING, "dest": "limbo"}]
    with pytest.raises(AssertionError, match="unknown states.*limbo"):
        check_definition(broken)
    broken = list(TRANSITIONS) + [{"trigger": "switched", "source": "limbo", "dest": SCALING}]
    with pytest.raises(AssertionError, match="unknown states.*limbo"):
        check_definition(broken)


@pytest.mark.parametrize("state, trigger, data, field, rule", [
    (TRANSFERRING, "layer_done", {"layer": 0.9}, "layer", "must be an int"),
    (TRANSFERRING, "layer_done", {"layer": True}, "layer", "must be an int"),
    (TRANSFERRING, "layer_done", {"layer": None}, "layer", "must be an int"),
    (TRANSFERRING, "layer_done", {"layer": "0"}, "layer", "must be an int"),
    (COLLECTING, "step", {"due": "no"}, "due", "must be a bool"),
    (COLLECTING, "step", {"due": 1}, "due", "must be a bool"),
    (TRANSFERRING, "fault", {"recoverable": "False"}, "recoverable", "must be a bool"),
    (TRANSFERRING, "fault", {"recoverable": None}, "recoverable", "must be a bool"),
    (PLANNING, "plan_ready", {"moves": None, "worth": True}, "moves", "must be an int"),
    (PLANNING, "plan_ready", {"moves": 3.0, "worth": True}, "moves", "must be an int"),
    (PLANNING, "plan_ready", {"moves": 3, "worth": "false"}, "worth", "must be a bool"),
])
def test_event_data_of_the_wrong_type_is_refused_naming_it_before_anything_changes(state, trigger, data, field,
                                                                                   rule):
    """A datum a guard would coerce (0.9 as layer 0, "no" as due) is a ValueError naming it; state and layer stay."""
    m = EplbMachine(num_layers=NUM_LAYERS, state=state, layer=0)
    seen = []
    m.listeners.append(seen.append)
    with pytest.raises(ValueError, match=f"event data of the wrong type: {field} {rule}"):
        m.fire(trigger, **data)
    assert (m.state, m.layer, seen) == (state, 0, [])


def test_numpy_integers_and_bools_are_event_data_of_the_right_type():
    """What decisions may hand over (numpy scalars) is accepted as its Python counterpart."""
    import numpy as np

    m = EplbMachine(num_layers=NUM_LAYERS, state=PLANNING)
    assert m.fire("plan_ready", moves=np.int64(3), worth=np.bool_(True)).dest == TRANSFERRING
    assert m.fire("layer_done", layer=np.int32(0)).layer == 1
    assert m.fire("fault", recoverable=np.bool_(False)).dest == FAILED


def _fire_interrupted_at(n: int) -> tuple[str, int, EplbMachine]:
    """Fire a due ``step`` with a KeyboardInterrupt raised at the ``n``-th line or call it runs (as a signal
    handler raises at any bytecode boundary); (outcome, lines run, machine). transitions' own finalize block
    is left out: it swallows whatever is raised in it, and the machine no longer runs code there."""
    import inspect
    import sys

    import transitions.core as core

    lines, start = inspect.getsourcelines(core.Event._trigger)
    finally_line = start + next(i for i, line in enumerate(lines) if line.strip() == "finally:")

    def in_transitions_finalize(frame) -> bool:
        if not frame.f_code.co_filename.endswith("core.py") or "transitions" not in frame.f_code.co_filename:
            return False
        while frame is not None:
            if frame.f_code is core.Event._trigger.__code__ and frame.f_lineno > finally_line:
                return True
            frame = frame.f_back
        return False

    machine, seen = EplbMachine(2), [0]

    def tracer(frame, event, arg):
        if event in ("line", "call"):
            seen[0] += 1
            if seen[0] == n and not in_transitions_finalize(frame):
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        machine.fire("step", due=True)
        outcome = "done"
    except KeyboardInterrupt:
        outcome = "interrupted"
    except IllegalTransition:
        outcome = "illegal"
    finally:
        sys.settrace(None)
    return outcome, seen[0], machine


def test_an_interrupt_anywhere_in_fire_reaches_the_caller_and_leaves_no_event_queued():
    """A KeyboardInterrupt at each line fire() runs propagates (never swallowed into IllegalTransition), and the
    machine then takes its next event (was: lost in the finalize callback, or left queued for ever)."""
    outcomes, n = set(), 1
    while True:
        outcome, ran, machine = _fire_interrupted_at(n)
        assert outcome != "illegal", f"the interrupt at line {n} came out as IllegalTransition"
        assert machine.state in (COLLECTING, PLANNING)
        before = machine.state
        fired = machine.fire("step", due=False)   # refused only if an event were still queued
        assert (fired.source, fired.dest) == (before, before), n
        outcomes.add(outcome)
        if outcome == "done" and ran < n:
            break
        n += 1
    assert outcomes == {"interrupted", "done"} and n > 100   # the sweep reached the end of fire()
