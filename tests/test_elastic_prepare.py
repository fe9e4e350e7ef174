"""elastic/prepare.py: before anything is built, the old ranks agree (``scale_check``) on the joiners'
answers and on their maps, and the waits before ``scale_ready`` leave it the time to end the scale
``aborted`` on the intact old group.

Real gloo ranks as threads of this process (world <= 3): serving ranks build their
controllers on one store; joiners are stand-in threads that only write the store keys a
joiner writes (and build their part of the new group), or a real ``EplbController.join``.
The budget tests shrink ``bounds.GRACE_S`` to 1 s so that a late answer fits in seconds.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import eplb_fsm.elastic.bounds as bounds
from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic import ScaleAborted
from eplb_fsm.elastic.handover import accepted_key
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.transfer.groups import StoreGroup, connect_store

WAIT_S = 30.0  # every wait of these tests; only a hang reaches it
T = 0.5        # collective_timeout_s
CONFIG = EplbConfig(window_size=4, step_interval=1000, num_redundant_experts=4, collective_timeout_s=T)


def _run_threads(targets: list) -> None:
    """Start one daemon thread per callable, join each with a timeout, and fail on a thread left running."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank did not return"


# ---------------------------------------------------------------------------------------
# different maps

STALE = np.array([[0, 2, 1, 0, 1, 1, 0, 1, 2]])  # rank 0's view of rank 1's slots differs
TRUTH = np.array([[0, 2, 1, 2, 1, 1, 0, 1, 2]])
MAPS_CONFIG = EplbConfig(window_size=4, step_interval=1000, num_redundant_experts=6, collective_timeout_s=T)


def test_ranks_with_different_maps_abort_a_scale_down_before_anything_moves(store):
    """3 -> 2 where rank 0's phy2log differs: every rank aborted in prepare naming the model; maps, weights kept."""
    outs: dict = {}
    errors: list = []

    def rank(r):
        try:
            view = STALE if r == 0 else TRUTH
            model = ToyMoE(1, 3, 6, 4, 2, r, 3, phy2log=view)
            ctl = EplbController(MAPS_CONFIG, group=StoreGroup.connect(store, 0, r, 3, WAIT_S), keep_trace=True)
            ctl.add_model(model, "main", phy2log=view)
            out = ctl.request_scale(2, timeout_s=WAIT_S)
            kept = (ctl.models[0].maps.phy2log == view).all() and not model.check_weights(view)
            outs[r] = (out, ctl.state, ctl.world_size, ctl.group_name, kept)
            if out["outcome"] == "aborted":
                ctl.rearrange()   # the regular path refuses the same maps
                outs[r] += (ctl.state, ctl.history[-1]["outcome"])
            ctl.close()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    _run_threads([lambda r=r: rank(r) for r in range(3)])
    assert not errors, errors
    for r in range(3):
        out, state, world, group, kept = outs[r][:5]
        assert (out["outcome"], out["phase"], out["role"]) == ("aborted", "prepare", "member"), (r, out)
        assert "the ranks hold different maps: the committed maps of model 'main'" in out["reason"], out
        assert (state, world, group, kept, out["moved_slots"]) == ("collecting", 3, "ep", True, 0)
        assert outs[r][5:] == ("failed", "rejected"), outs[r]


def _placement(view: list[int]) -> np.ndarray:
    return np.array([view, view])


def test_ranks_with_different_maps_abort_a_scale_up_and_the_joiner_gives_up(store):
    """2 -> 3 where old rank 1's maps differ: both old ranks aborted in prepare, nothing built; join raises."""
    views = {0: _placement([0, 1, 2, 3, 0, 1, 2, 3]), 1: _placement([0, 1, 2, 3, 3, 2, 1, 0])}
    outs: dict = {}
    errors: list = []

    def rank(r):
        try:
            model = ToyMoE(2, 4, 4, 4, 2, r, 2, phy2log=views[r])
            ctl = EplbController(CONFIG, group=StoreGroup.connect(store, 0, r, 2, WAIT_S), keep_trace=True)
            ctl.add_model(model, "main", phy2log=views[r])
            out = ctl.request_scale(3, timeout_s=WAIT_S)
            outs[r] = (out, ctl.state, ctl.world_size, (ctl.models[0].maps.phy2log == views[r]).all())
            ctl.close()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    def joiner():
        try:
            EplbController.join(CONFIG, {"main": ToyMoE(2, 4, 8, 4, 2, 2, 3)}, store=store, generation=1, rank=2,
                                world_size=3, timeout_s=2.0)
            outs["joiner"] = "joined"
        except BaseException as exc:  # the expected end: its group never forms
            outs["joiner"] = exc

    _run_threads([lambda: rank(0), lambda: rank(1), joiner])
    assert not errors, errors
    for r in (0, 1):
        out, state, world, kept = outs[r]
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), (r, out)
        assert "different maps: the committed maps of model 'main'" in out["reason"], out
        assert (state, world, kept) == ("collecting", 2, True)
    assert isinstance(outs["joiner"], ScaleAborted), outs["joiner"]


# ---------------------------------------------------------------------------------------
# the prepare budget: a late answer, ranks that disagree on it

T_FORM = 3.0  # the request's timeout_s; forward_s = 3 + 2 * 0.5 + 1 = 5 s with GRACE_S = 1
SKEW = 0.4    # old rank 1 calls request_scale this much later than rank 0 (below T)


def _scale_up_with(info, joiner, monkeypatch) -> dict:
    """Old ranks 0 and 1 request 2 -> 3 (rank 1 SKEW s later), ``joiner(ctls, start)`` runs beside them;
    then each rank runs a rearrangement on the old group. Returns ``{rank: (scaling entry, state after)}``."""
    monkeypatch.setattr(bounds, "GRACE_S", 1.0)
    ctls: dict = {}
    outs: dict = {}
    errors: list = []
    ready = threading.Barrier(3, timeout=WAIT_S)

    def rank(r):
        try:
            ctl = EplbController(CONFIG, group=StoreGroup.connect(info, 0, r, 2, WAIT_S), keep_trace=True)
            ctl.add_model(ToyMoE(2, 4, 4, 4, 2, r, 2), "main")
            ctls[r] = ctl
            ready.wait()
            time.sleep(SKEW * r)
            out = ctl.request_scale(3, timeout_s=T_FORM)
            if ctl.state == "collecting":
                ctl.rearrange()   # the old group still works: this all-reduce needs both ranks
            outs[r] = (out, ctl.state, ctl.world_size, ctl.group_name)
            ctl.close()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    def side():
        try:
            ready.wait()
            joiner(ctls, time.monotonic())
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    _run_threads([lambda: rank(0), lambda: rank(1), side])
    assert not errors, errors
    return outs


def _accept(info) -> object:
    """Write joiner rank 2's acceptance of generation 1's handover; returns its store connection."""
    store = connect_store(info, WAIT_S)
    store.set(accepted_key(info.namespace, 1, 2), b"1")
    return store


def test_a_joiner_that_accepts_late_and_never_builds_leaves_the_old_group_serving(store, monkeypatch):
    """Accepted 2.4 s in (past forward_s - T_f = 2 s), then never builds: both old ranks aborted, not failed."""
    def late_then_silent(ctls, start):
        time.sleep(max(0.0, start + 2.4 - time.monotonic()))
        _accept(store)

    outs = _scale_up_with(store, late_then_silent, monkeypatch)
    for r in (0, 1):
        out, state, world, group = outs[r]
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), (r, out)
        assert "new group of generation 1 (3 ranks) was not complete on 2 rank(s): GroupBuildError" in out["reason"]
        assert (state, world, group) == ("collecting", 2, "ep"), (r, state)


def test_old_ranks_that_disagree_on_a_late_answer_all_abort_without_building(store, monkeypatch):
    """Rank 0's wait for the answer ends, then the joiner accepts and builds; rank 1 sees it: neither builds."""
    def after_rank0_gave_up(ctls, start):
        recs = ctls[0].trace.records
        end = time.monotonic() + WAIT_S
        # rank 0 is past its wait for the answers once it starts its next collective
        while not any(r["event"] == "collective_start" and r.get("op") == "all_reduce" for r in recs):
            assert time.monotonic() < end, "rank 0 never left its wait for the answers"
            time.sleep(0.005)
        store_conn = _accept(store)
        try:
            StoreGroup(store_conn, 1, 2, 3, T_FORM, namespace=store.namespace, info=store)
        except Exception:  # noqa: BLE001 - expected: no old rank builds with it
            return
        raise AssertionError("the new group formed although rank 0 had no answer")

    outs = _scale_up_with(store, after_rank0_gave_up, monkeypatch)
    for r in (0, 1):
        out, state, world, group = outs[r]
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), (r, out)
        assert "new group of generation 1 (3 ranks) was not complete on 1 rank(s)" in out["reason"], out
        assert "GroupBuildError" not in out["reason"], out   # agreed before building: nobody built
        assert (state, world, group) == ("collecting", 2, "ep"), (r, state)
    assert "joiner rank(s) [2] did not answer" in outs[0][0]["reason"]


# ---------------------------------------------------------------------------------------
# a refusal by a process started with a rank that is not a joiner's

@pytest.mark.parametrize("rank, world, model", [
    (0, 2, lambda: ToyMoE(2, 4, 12, 4, 2, 0, 2)),   # an old rank's number
    (2, 3, lambda: ToyMoE(2, 4, 20, 4, 2, 2, 3)),   # a rank past the new world, in a world of another size
])
def test_a_refusal_under_a_rank_that_is_not_a_joiner_ends_the_scale_at_once(store, rank, world, model):
    """1 -> 2, the joining process started as rank 0 of 2 (or 2 of 3): the serving rank quotes its refusal."""
    ctl = EplbController(CONFIG, group=StoreGroup.connect(store, 0, 0, 1, WAIT_S), keep_trace=True)
    ctl.add_model(ToyMoE(2, 4, 4, 4, 2, 0, 1), "main")
    outs: dict = {}

    def joiner():
        try:
            EplbController.join(CONFIG, {"main": model()}, store=store, generation=1, rank=rank, world_size=world,
                                timeout_s=WAIT_S)
            outs["joiner"] = "joined"
        except BaseException as exc:  # the expected end: it refuses
            outs["joiner"] = exc

    def serving():
        try:
            outs["serving"] = ctl.request_scale(2, timeout_s=10.0)
        except BaseException as exc:  # reported to the test
            outs["serving"] = exc

    try:
        _run_threads([serving, joiner])
        assert isinstance(outs["joiner"], ValueError) and "is not a joiner" in str(outs["joiner"]), outs
        out = outs["serving"]
        assert isinstance(out, dict), out
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), out
        assert f"a process joining as rank {rank} of {world} refused: rank {rank} of {world} is not a joiner of " \
               "generation 1" in out["reason"], out["reason"]
        assert "did not answer" not in out["reason"], out["reason"]
        assert (ctl.state, ctl.world_size, ctl.group_name) == ("collecting", 1, "ep")
    finally:
        ctl.close()
