"""Which injections fired, read back from the traces' ``fault_injected`` records."""

from __future__ import annotations

import json

from eplb_fsm.sim.inject_report import fired_injections, unfired_injections


def test_unfired_injections_come_from_the_traces(tmp_path):
    """An injection is fired only if some trace holds its fault_injected record."""
    rec = {"event": "fault_injected", "kind": "kill", "target_rank": 1, "at_step": 5, "spec": "kill:rank=1,step=5"}
    (tmp_path / "rank00001.jsonl").write_text(json.dumps({"event": "step"}) + "\n" + json.dumps(rec) + "\n{broken")
    (tmp_path / "rank00000.jsonl").write_text(json.dumps({"event": "step"}) + "\n")
    assert [r["spec"] for r in fired_injections(str(tmp_path))] == ["kill:rank=1,step=5"]
    assert unfired_injections(["kill:rank=1,step=5", "freeze:step=2,rank=0,seconds=1"], str(tmp_path)) == [
        "freeze:rank=0,step=2,seconds=1"]
