"""elastic/bounds.py: one deadline per scale; a rank that stalls inside a scale is detected within it.

The arithmetic is checked with a fake clock; the drill stalls a real gloo process (it sleeps
inside the scale) and checks that the others end the scale naming the phase, with the
recorded ``deadline_s`` / ``bound_s`` of the formula, while the stalled rank still sleeps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.elastic.bounds import GRACE_S, MIN_WAIT_S, ScaleDeadline, scale_bounds
from eplb_fsm.fsm.collectives import Collectives
from eplb_fsm.trace import EventTrace


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_bounds_follow_the_documented_formula():
    """forward = T_f + 2T + 5 and bound = T_f + 4T + 10, for any timeouts."""
    assert scale_bounds(20.0, 20.0) == (65.0, 110.0)
    assert scale_bounds(4.0, 1.0) == (4.0 + 2.0 + GRACE_S, 4.0 + 4.0 + 2 * GRACE_S)
    with pytest.raises(ValueError, match="form_timeout_s must be a finite number > 0"):
        scale_bounds(0.0, 1.0)


@pytest.mark.parametrize("bad", [True, "1.5", float("inf"), None])
def test_bounds_refuse_bools_strings_and_non_finite_timeouts(bad):
    """scale_bounds names the field for a bool (True is not 1 s), a string, inf or None."""
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        scale_bounds(4.0, bad)
    with pytest.raises(ValueError, match="form_timeout_s must be a finite number > 0"):
        scale_bounds(bad, 1.0)


def test_each_wait_gets_the_time_left_before_the_deadline():
    """A wait gets min(its own timeout, time left), never less than MIN_WAIT_S; recovery waits have until bound_s."""
    clock = FakeClock()
    dl = ScaleDeadline(4.0, 1.0, clock=clock)   # forward 11 s, bound 18 s
    assert dl.left(13.0) == 11.0               # the scale_ready agreement's 2 T_f + 5 is capped
    clock.now += 10.0
    assert dl.left(13.0) == pytest.approx(1.0) and dl.left(0.5) == 0.5
    clock.now += 5.0                           # past the forward deadline
    assert dl.left(13.0) == MIN_WAIT_S
    assert dl.left(9.0, recovery=True) == pytest.approx(3.0)
    clock.now += 10.0
    assert dl.left(9.0, recovery=True) == MIN_WAIT_S
    assert dl.describe() == {"deadline_s": 11.0, "bound_s": 18.0}


def test_the_prepare_waits_leave_scale_ready_its_room_before_the_forward_deadline():
    """Answers, scale_check and builds end T + GRACE_S before the forward deadline; scale_ready gets that room."""
    clock = FakeClock()
    dl = ScaleDeadline(4.0, 1.0, clock=clock)   # forward 11 s, room 6 s: the builds end 5 s in
    assert dl.ready_room_s == 1.0 + GRACE_S
    assert dl.before_ready(4.0) == 4.0          # the answers' own T_f fits
    clock.now += 3.5                            # a late answer: the build gets what is left before 5 s
    assert dl.before_ready(4.0) == pytest.approx(1.5)
    assert dl.left(13.0) == pytest.approx(7.5)  # scale_ready after it: at least the room
    clock.now += 2.0
    assert dl.before_ready(4.0) == MIN_WAIT_S and dl.left(13.0) == pytest.approx(5.5)


class _RecordingGroup:
    """A collective-group object that records the timeout each all-reduce was given."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def all_reduce(self, tensor, timeout_s):
        self.timeouts.append(timeout_s)

    def transfer_communicator(self, timeout_s):
        raise NotImplementedError


def test_collectives_cap_every_all_reduce_and_its_views_on_other_groups():
    """With a cap set (a scale in progress) all_reduce and on(group) use the capped timeout; without, their own."""
    clock = FakeClock()
    dl = ScaleDeadline(4.0, 1.0, clock=clock)
    group, other = _RecordingGroup(), _RecordingGroup()
    coll = Collectives(group, 0, 1, EventTrace(keep=True), torch.device("cpu"), 1.0, "ep")
    coll.all_reduce({"x": torch.zeros(1)}, 13.0)
    coll.cap = dl.left
    clock.now += 8.0
    coll.all_reduce({"x": torch.zeros(1)}, 13.0)
    coll.on(other).all_reduce({"x": torch.zeros(1)}, 13.0)
    assert group.timeouts == [13.0, pytest.approx(3.0)] and other.timeouts == [pytest.approx(3.0)]


# ---------------------------------------------------------------------------------------
# the drill: real processes, one of them sleeps inside the scale

T = 1.0      # collective_timeout_s
T_FORM = 4.0  # the request's timeout_s (forming the group)
STALLED = 1   # a survivor of the 3 -> 2 scale-down
PLACEMENT = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]]  # N = 4, S = 2, 3 ranks


def _drill_body(variant, rank, host, port, log_dir, results):
    """One rank of a stall drill (top level: the forkserver imports it)."""
    import time

    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.sim.model import ToyMoE
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo

    torch.set_num_threads(1)
    info = StoreInfo(host, port, namespace=variant)
    config = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=2, collective_timeout_s=T)
    try:
        placement = np.array(PLACEMENT)
        model = ToyMoE(2, 4, 2, 4, 2, rank, 3, phy2log=placement)
        ctl = EplbController(config, group=StoreGroup.connect(info, 0, rank, 3, 10.0), trace_dir=log_dir)
        ctl.add_model(model, "main", phy2log=placement)
        for step in range(3):
            model.forward(model.make_batch(step, 16), ctl.group)
            ctl.step()
        if rank == STALLED:
            if variant == "forming":   # stalls before its part of the new group
                StoreGroup.successor = lambda *a, **k: time.sleep(3600)
            else:                      # stalls right before its first layer transfer
                ctl.transfer_hooks.append(lambda *a: time.sleep(3600))
        out = ctl.request_scale(2, timeout_s=T_FORM)
        value = {**out, "final_state": ctl.state}
        ctl.close()   # its `end` record is on disk before the fixture, told the drill is over, stops this process
        results.put((variant, rank, value))
    except BaseException as exc:  # reported to the test
        results.put((variant, rank, {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}))


@pytest.fixture(scope="module")
def stall_drills(tmp_path_factory):
    """Two drills in one launch: a survivor stalls while the group forms / inside the transfer."""
    import queue as queue_mod
    import time

    from eplb_fsm.sim.launcher import process_context, stop_processes
    from eplb_fsm.transfer.groups import host_store

    ctx = process_context(None)
    master, info = host_store(timeout_s=30.0)
    results = ctx.Queue()
    variants = ("forming", "transfer")
    log_dirs = {v: str(tmp_path_factory.mktemp(f"stall-{v}")) for v in variants}
    names = [(v, r) for v in variants for r in range(3)]
    procs = [ctx.Process(target=_drill_body, args=(v, r, info.host, info.port, log_dirs[v], results), daemon=True)
             for v, r in names]
    for p in procs:
        p.start()
    expected = {(v, r) for v in variants for r in range(3) if r != STALLED}
    got: dict = {}
    give_up = time.monotonic() + 120.0  # far above the bound: only a hang in this test reaches it
    try:
        while not expected <= set(got) and time.monotonic() < give_up:
            try:
                v, r, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            got[(v, r)] = value
        stalled_alive = {v: procs[names.index((v, STALLED))].is_alive() for v in variants}
    finally:
        stop_processes(procs)  # reaps the sleeping ranks
        del master
    assert expected <= set(got), f"drills did not finish: {sorted(expected - set(got))}"
    return got, stalled_alive, log_dirs


@pytest.mark.multiprocess
def test_a_rank_stalled_while_the_group_forms_ends_the_scale_in_its_prepare_phase(stall_drills):
    """Survivor 1 sleeps instead of joining the new group: ranks 0 and 2 fail the scale naming phase prepare."""
    got, stalled_alive, _ = stall_drills
    assert stalled_alive["forming"]  # the others finished while it still slept
    for rank in (0, 2):
        out = got[("forming", rank)]
        assert out["outcome"] in ("aborted", "failed"), out
        assert out["phase"] == "prepare", out
        assert (out["deadline_s"], out["bound_s"]) == scale_bounds(T_FORM, T)


@pytest.mark.multiprocess
def test_a_rank_stalled_inside_the_transfer_ends_the_scale_for_the_others(stall_drills):
    """Survivor 1 sleeps before its layer transfer: leaving rank 2 fails in transfer, survivor 0 in salvage."""
    got, stalled_alive, log_dirs = stall_drills
    assert stalled_alive["transfer"]
    assert (got[("transfer", 2)]["outcome"], got[("transfer", 2)]["phase"]) == ("failed", "transfer")
    out = got[("transfer", 0)]
    assert (out["outcome"], out["phase"], out["final_state"]) == ("failed", "salvage", "failed"), out
    from eplb_fsm.trace import read_trace, trace_path

    recs = read_trace(trace_path(log_dirs["transfer"], 0))[0]
    requested = [r for r in recs if r["event"] == "transition" and r["trigger"] == "scale_requested"]
    assert len(requested) == 1
    assert (requested[0]["deadline_s"], requested[0]["bound_s"]) == scale_bounds(T_FORM, T)
    assert [r["phase"] for r in recs if r["event"] == "scale_aborted"] == ["salvage"]
