"""elastic/joiner.py: join checks its arguments before any wait, and a failed handover says why.

Argument errors are ValueErrors raised at once, never ScaleAborted or GroupBuildError and
never a wait on the store. Each call runs in a thread joined with a timeout, so a call
that would wait forever fails the test instead of hanging it.
"""

from __future__ import annotations

import pickle
import re
import threading

import pytest

from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic import ScaleAborted, make_scale_plan
from eplb_fsm.elastic.handover import handover_state
from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.transfer.groups import StoreGroup, connect_store

WAIT_S = 30.0  # the bound on every wait of these tests; only a hang reaches it
CONFIG = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=4, collective_timeout_s=1.0)


def _bounded(call):
    """What ``call()`` raised (None if it returned), run in a thread joined with a timeout."""
    caught: list = []

    def run():
        try:
            call()
            caught.append(None)
        except BaseException as exc:  # reported to the test
            caught.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert caught, "join did not return: it waited instead of checking its arguments"
    return caught[0]


def _join(store, models=None, **overrides):
    args = dict(store=store, generation=1, rank=1, world_size=2, timeout_s=1.0)
    args.update(overrides)
    return EplbController.join(CONFIG, models or {"main": ToyMoE(2, 4, 12, 4, 2, 1, 2)}, **args)


@pytest.mark.parametrize("field, value, match", [
    ("rank", True, "rank must be an integer"),
    ("rank", 2, r"rank must be in \[0, world_size=2\)"),
    ("rank", -1, "rank must be >= 0"),
    ("world_size", 0, "world_size must be >= 1"),
    ("world_size", 2.0, "world_size must be an integer"),
    ("generation", True, "generation must be an integer"),
    ("generation", 0, "generation must be >= 1"),
])
def test_rank_world_size_and_generation_are_checked_before_any_wait(store, field, value, match):
    """A bool, float or out-of-range rank / world_size / generation is a ValueError naming it, at once."""
    exc = _bounded(lambda: _join(store, **{field: value}))
    assert type(exc) is ValueError and re.search(match, str(exc)), exc


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "1"])
def test_a_bad_timeout_is_a_value_error_with_a_store_or_its_info(store, raw, bad):
    """timeout_s 0, -1, inf, nan, True or "1" is a ValueError with a raw store and with a StoreInfo alike."""
    target = connect_store(store, WAIT_S) if raw else store
    exc = _bounded(lambda: _join(target, timeout_s=bad))
    assert type(exc) is ValueError and "timeout_s must be a finite number > 0" in str(exc), exc


def test_a_strided_non_expert_tensor_is_refused_before_waiting_for_the_handover(store):
    """A joiner whose gate is transposed gets a ValueError naming the tensor, without waiting for a handover."""
    model = ToyMoE(2, 4, 12, 4, 2, 1, 2)
    model.gate[0] = model.gate[0].t()
    exc = _bounded(lambda: _join(store, {"main": model}))
    assert type(exc) is ValueError and "non_expert_weights[0] must be a contiguous tensor" in str(exc), exc


def _serving_stand_in(info, errors, transfer_group):
    """Old rank 0 of a 1 -> 2 scale-up: publishes a real handover and forms the new group. With
    ``transfer_group`` it builds its transfer group and answers "go" with 0; without, it never builds one."""
    try:
        ctl = EplbController(CONFIG, group=StoreGroup.connect(info, 0, 0, 1, WAIT_S))
        ctl.add_model(ToyMoE(2, 4, 4, 4, 2, 0, 1), "main")
        sp = make_scale_plan(1, 2, generation=1)
        ctl.group.store.set(ctl.group.key("handover", 1), pickle.dumps(handover_state(ctl, sp)))
        group = ctl.group.successor(1, 0, 2, WAIT_S)
        comm = None
        if transfer_group:
            comm = group.transfer_communicator(WAIT_S, WAIT_S)  # kept: a dropped one closes its pairs
            group.all_reduce(flags(0.0), WAIT_S)
        else:
            threading.Event().wait(4 * CONFIG.collective_timeout_s)   # the joiner gives up on its transfer group
            group.close()
        ctl.close()
        del comm  # only now: the joiner is done with it
    except BaseException as exc:  # reported to the test
        errors.append(exc)


def _join_beside_stand_in(info, target, transfer_group=True, **overrides):
    """What the joiner's ``join`` raised, old rank 0 played by a thread (joined with a timeout, error-free)."""
    errors: list = []
    old = threading.Thread(target=_serving_stand_in, args=(info, errors, transfer_group), daemon=True)
    old.start()
    try:
        return _bounded(lambda: _join(target, timeout_s=WAIT_S, **overrides))
    finally:
        old.join(WAIT_S)
        assert not old.is_alive() and not errors, errors


def test_a_failed_handshake_names_its_reason_in_scale_aborted(store):
    """The old rank answers "go" with 0: ScaleAborted names the handover phase and why it failed."""
    exc = _join_beside_stand_in(store, store, keep_trace=True)
    assert isinstance(exc, ScaleAborted), exc
    assert "handover phase: scale go: 1.0 of 2 ranks" in str(exc)


def test_a_raw_store_reaches_the_serving_group_through_its_namespace(store):
    """EplbController.join(namespace=...) with a raw store finds a handover published under that namespace."""
    exc = _join_beside_stand_in(store, connect_store(store, WAIT_S), namespace=store.namespace)
    # it got as far as the handshake, so it read the handover under the serving group's namespace
    assert isinstance(exc, ScaleAborted) and "handover phase: scale go" in str(exc), exc


def test_a_transfer_group_that_never_forms_is_scale_aborted(store):
    """The joiner's transfer group times out: ScaleAborted naming it (was a bare GroupBuildError)."""
    exc = _join_beside_stand_in(store, store, transfer_group=False)
    assert isinstance(exc, ScaleAborted) and "transfer group of generation 1 was not complete" in str(exc), exc


def test_a_joiner_whose_transfer_group_never_forms_ends_its_trace(store, tmp_path):
    """The header is written before the transfer group fails: the trace ends with `end` how=exception, closed."""
    from eplb_fsm.trace import read_trace, trace_path

    exc = _join_beside_stand_in(store, store, transfer_group=False, trace_dir=str(tmp_path))
    assert isinstance(exc, ScaleAborted), exc
    records = read_trace(trace_path(tmp_path, 1, generation=1))[0]   # a joiner's own file
    assert [r["event"] for r in records][0] == "header" and records[0]["role"] == "joiner"
    end = records[-1]
    assert (end["event"], end.get("how")) == ("end", "exception"), end
    assert end["error"].startswith("GroupBuildError: ") and "was not complete" in end["error"]


def test_the_wait_for_the_transfer_group_is_covered_by_liveness(tmp_path, monkeypatch):
    """The liveness thread runs while the constructor builds the transfer group (no silence a replay calls frozen)."""
    from eplb_fsm.fsm.collectives import Collectives
    from eplb_fsm.trace import read_trace, trace_path

    seen = []
    before = set(threading.enumerate())  # another test's controller may still be beating

    def build(self, *args, **kwargs):
        seen.append(any(t.name == "eplb-liveness" and t not in before for t in threading.enumerate()))
        raise RuntimeError("injected: the transfer group did not form")

    monkeypatch.setattr(Collectives, "new_transfer_group", build)
    with pytest.raises(RuntimeError, match="injected"):
        EplbController(CONFIG, trace_dir=str(tmp_path), role="joiner")
    assert seen == [True]
    end = read_trace(trace_path(tmp_path, 0))[0][-1]
    assert (end["event"], end.get("how"), end.get("error")) == (
        "end", "exception", "RuntimeError: injected: the transfer group did not form")
