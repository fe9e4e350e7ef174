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


def test_only_this_runs_sessions_count(tmp_path):
    """In a folder several runs appended to, only the records of the sessions with this run's id count."""
    from eplb_fsm.commands.simulate_checks import TraceDir, trace_sizes

    spec = "wrong-collective:rank=0,step=9"
    fired = {"event": "fault_injected", "kind": "wrong-collective", "target_rank": 0, "at_step": 9, "spec": spec}
    path = tmp_path / "rank00000.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"event": "header", "run_id": "a" * 16}, fired)))
    trace_dir = TraceDir(str(tmp_path), trace_sizes(tmp_path))
    assert unfired_injections([spec], trace_dir) == [spec]  # this run has written nothing yet
    with open(path, "a") as fh:
        fh.write(json.dumps({"event": "header", "run_id": "b" * 16}) + "\n" + json.dumps({"event": "step"}) + "\n")
    assert unfired_injections([spec], str(tmp_path), run_id="b" * 16) == [spec]
    assert unfired_injections([spec], str(tmp_path), run_id="a" * 16) == []
    assert unfired_injections([spec], trace_dir) == [spec]  # the TraceDir knows its run: b
    assert unfired_injections([spec], str(tmp_path)) == []  # a plain path: every record in the folder
