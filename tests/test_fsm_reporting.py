"""fsm/reporting.py: the balancedness log never stands in the way of the planning's own load check."""

from __future__ import annotations

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.sim.model import ToyMoE


def test_a_negative_count_on_a_logged_due_step_is_rejected_and_the_machine_collects_again():
    """A negative pass count on a step that logs balancedness and plans: loads_rejected, recoverable, collecting."""
    cfg = EplbConfig(window_size=4, step_interval=8, num_redundant_experts=4, log_balancedness=True,
                     log_balancedness_interval=1)
    ctl = EplbController(cfg, keep_trace=True)
    model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=0, world_size=1)
    ctl.add_model(model, "m")
    before = ctl.maps("m").phy2log.copy()
    for s in range(2):   # step 1 is the first due step (a quarter of the interval)
        model.forward(model.make_batch(s, 32), None)
        if s == 1:
            ctl.models[0].window.load_pass[0, 0] = -1000   # a host bug: bad statistics
        assert ctl.step(log_stats=True) == "collecting"
    rejected = [r for r in ctl.trace.records if r["event"] == "loads_rejected"]
    assert len(rejected) == 1 and rejected[0]["reason"].startswith("negative load")
    fault = [r for r in ctl.trace.records if r["event"] == "transition" and r["trigger"] == "fault"]
    assert [(f["source"], f["dest"], f["recoverable"]) for f in fault] == [("planning", "collecting", True)]
    assert [s for s, _ in ctl.reporter.balancedness_log] == [0]   # the bad pass logs no value
    assert (ctl.maps("m").phy2log == before).all() and ctl.history[-1]["outcome"] == "rejected"
    ctl.close()
