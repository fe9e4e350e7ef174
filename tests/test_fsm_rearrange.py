"""The Rearranger on a real single-rank controller: a scale's rearrangement with nothing to move, or a failing one."""

from __future__ import annotations

import pytest

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.fsm.machine import COLLECTING, FAILED, SCALING
from eplb_fsm.fsm.planning import plan_placements
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.trace import read_trace, trace_path


class KeepPlacement:
    """A policy that keeps the current placement (so a plan changes no slot at all)."""

    @staticmethod
    def rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks, old_phy2log=None):
        return old_phy2log.clone(), None, None


def _scale_with_nothing_to_move(tmp_path):
    ctl = EplbController(EplbConfig(window_size=2, step_interval=4, num_redundant_experts=2),
                         trace_dir=str(tmp_path), keep_trace=True)
    model = ToyMoE(num_layers=2, num_experts=4, num_redundant=2, hidden=8, top_k=2, rank=0, world_size=1)
    ctl.add_model(model, "main")
    for _ in range(2):
        ctl.step()
    ctl.fire("scale_requested", extra={"kind": "scale_up", "generation": 1, "from_ranks": 1, "to_ranks": 1,
                                       "rank_mapping": {"0": 0}, "joiners": [], "leaving": []})
    ctl.fire("groups_ready", extra={"generation": 1, "kind": "scale_up", "group": ctl.group_name})
    before = ctl.models[0].maps.phy2log.copy()
    dest = ctl.rearranger.run_forced(
        lambda loads: plan_placements(KeepPlacement, ctl.models, loads, num_nodes=1, world_size=1, step=ctl.steps,
                                      forced=True), {"scale": 1}, 1)
    return ctl, dest, before


def test_a_scale_with_nothing_to_move_goes_on_to_the_switch_with_real_events(tmp_path):
    """plan_ready (moves 0) leads from planning to scaling; the record says skipped/no_moves; no made-up event."""
    ctl, dest, before = _scale_with_nothing_to_move(tmp_path)
    try:
        assert dest == SCALING and ctl.state == SCALING
        assert (ctl.history[-1]["outcome"], ctl.history[-1]["reason"]) == ("skipped", "no_moves")
        assert (ctl.models[0].maps.phy2log == before).all()
        assert ctl.fire("switched", extra={"generation": 1, "role": "member"}).dest == COLLECTING
        triggers = [(r["trigger"], r["source"], r["dest"]) for r in ctl.trace.records
                    if r["event"] == "transition" and r["trigger"] != "step"]
        assert triggers[-4:] == [("scale_requested", "collecting", "scaling"), ("groups_ready", "scaling", "planning"),
                            ("plan_ready", "planning", "scaling"), ("switched", "scaling", "collecting")]
    finally:
        ctl.close()


def test_a_scale_with_nothing_to_move_replays_without_illegal_transitions(tmp_path):
    """The replay re-drives every transition of that trace through the machine and finds none illegal."""
    from eplb_fsm.inspect.replay import replay_dir

    ctl, _, _ = _scale_with_nothing_to_move(tmp_path)
    ctl.fire("switched", extra={"generation": 1, "role": "member"})
    for _ in range(3):
        ctl.step()
    ctl.close()
    records, _ = read_trace(trace_path(str(tmp_path), 0))
    assert any(r.get("trigger") == "plan_ready" and r.get("dest") == SCALING for r in records)
    report = replay_dir(str(tmp_path))
    assert report.illegal_transitions == [], report.summary
    assert report.verdict == "healthy", report.summary


def test_a_log_line_that_cannot_be_written_never_stops_the_engine(tmp_path):
    """stdout (structlog's default sink) on /dev/full: rearrangements commit or skip, their log lines fail, step() goes
    on."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from eplb_fsm.config import EplbConfig\n"
        "from eplb_fsm.fsm.controller import EplbController\n"
        "from eplb_fsm.sim.model import ToyMoE\n"
        "ctl = EplbController(EplbConfig(window_size=2, step_interval=4, num_redundant_experts=2),\n"
        f"                     trace_dir={str(tmp_path)!r}, liveness_interval_s=None)\n"
        "model = ToyMoE(num_layers=2, num_experts=4, num_redundant=2, hidden=8, top_k=2, rank=0, world_size=1)\n"
        "ctl.add_model(model, 'main')\n"
        "model.set_load_target([[8.0, 1.0, 1.0, 1.0]] * 2)\n"
        "x = torch.randn(32, 8, dtype=model.gate[0].dtype)\n"
        "for _ in range(40):\n"
        "    model.forward(x)\n"
        "    ctl.step()\n"
        "sys.stderr.write(f'{len(ctl.history)} {ctl.machine.state}')\n"
    )
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-c", script], stdout=full, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    assert out.returncode == 0, out.stderr
    rearrangements, state = out.stderr.split()
    assert int(rearrangements) >= 2 and state == "collecting"


def _scale_whose_policy_raises(tmp_path, error: BaseException):
    ctl, _, _ = _scale_with_nothing_to_move(tmp_path)
    ctl.fire("switched", extra={"generation": 1, "role": "member"})
    ctl.fire("scale_requested", extra={"kind": "scale_up", "generation": 2})
    ctl.fire("groups_ready", extra={"generation": 2, "kind": "scale_up", "group": ctl.group_name})

    def make_plan(loads):
        raise error

    return ctl, lambda: ctl.rearranger.run_forced(make_plan, {"scale": 2}, 2)


def test_a_scale_policy_error_stays_recoverable_but_an_interrupt_fails_the_machine(tmp_path):
    """run_forced: a policy that raises is a recoverable fault; a KeyboardInterrupt there faults to failed,
    re-raised."""
    ctl, run = _scale_whose_policy_raises(tmp_path / "error", ValueError("no plan"))
    try:
        assert run() == COLLECTING and ctl.history[-1]["reason"] == "scale policy failed: ValueError: no plan"
    finally:
        ctl.close()
    ctl, run = _scale_whose_policy_raises(tmp_path / "interrupt", KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            run()
        fault = [r for r in ctl.trace.records if r.get("trigger") == "fault"][-1]
        assert ctl.state == FAILED and (fault["source"], fault["interrupted"]) == ("planning", "KeyboardInterrupt")
    finally:
        ctl.close()
