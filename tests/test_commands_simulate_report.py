"""Tests for eplb_fsm.commands.simulate_report: the text of ``eplb-fsm simulate``'s report."""

from __future__ import annotations


def test_scale_lines_name_what_happened():
    """A same-size scale says the group already had that size; a switched one prints from -> to (no 'None')."""
    from eplb_fsm.commands.simulate_report import format_scalings

    report = {"config": {"ranks": 4}, "scalings": [
        {"step": 50, "requested_ranks": 4, "outcome": "skipped", "from_ranks": None, "to_ranks": None},
        {"step": 100, "requested_ranks": 2, "outcome": "switched", "from_ranks": 4, "to_ranks": 2,
         "moved_slots": 12, "seconds": 0.5},
        {"step": 150, "requested_ranks": 2, "outcome": "skipped", "from_ranks": None, "to_ranks": None},
        {"step": 390, "requested_ranks": 4, "outcome": "not_reached", "from_ranks": None, "to_ranks": None},
    ]}
    lines = format_scalings(report)
    assert lines[0] == "scale at step 50 to 4 ranks: skipped (the group already has 4 ranks)"
    assert lines[1].startswith("scale at step 100: 4 -> 2 ranks: switched")
    assert lines[2] == "scale at step 150 to 2 ranks: skipped (the group already has 2 ranks)"
    assert "not_reached (the run ended before this step)" in lines[3]
    assert not any("None" in line for line in lines)


def _failed_report(culprits):
    return {
        "failed": True, "error": "rank_failed", "failed_ranks": [0], "log_dir": "/tmp/t", "wall_s": 1.0,
        "inject": ["kill:rank=1,step=10"],
        "config": {"ranks": 2, "layers": 3, "experts": 8, "redundant": 4, "steps": 24, "interval": 8, "window": 8,
                   "mode": "sync", "load": "zipf"},
        "ranks": [{"rank": 0, "status": "failed", "last_step": 9, "last_state": "collecting", "last_event": "end",
                   "reason": "RuntimeError: Connection reset by peer"},
                  {"rank": 1, "status": "died", "last_step": 9, "last_state": "collecting",
                   "last_event": "fault_injected", "reason": "process exited with code -9"}],
        "replay": {"verdict": "hang", "summary": "rank 1 never joined all_reduce at step 10",
                   "culprit_ranks": culprits},
    }


def test_a_failed_run_leads_with_the_culprit_not_the_victims():
    """The failure headline names the rank replay blames; the ranks that merely stopped come after it."""
    from eplb_fsm.commands.simulate_report import format_report

    lines = format_report(_failed_report([1])).splitlines()
    headline = next(i for i, line in enumerate(lines) if line.startswith("the run failed"))
    assert lines[headline] == "the run failed: caused by rank(s) 1: hang: rank 1 never joined all_reduce at step 10"
    assert lines[headline + 1] == "ranks that stopped: 0"
    assert not any(line.startswith("replay:") for line in lines)  # said once, in the headline


def test_a_failed_run_without_a_culprit_lists_the_failed_ranks():
    """When replay names nobody, the headline lists the failed ranks and the replay line still ends the report."""
    from eplb_fsm.commands.simulate_report import format_report

    lines = format_report(_failed_report([])).splitlines()
    assert "the run failed: rank(s) 0" in lines
    assert lines[-1] == "replay: hang: rank 1 never joined all_reduce at step 10"


def _synthetic_run(world: int, run_id: str, into, steps: int = 12) -> None:
    """Append the traces of a healthy synthetic run of ``world`` ranks, headers carrying ``run_id``, to ``into``."""
    import tempfile
    from pathlib import Path

    from eplb_fsm.testing import SyntheticJob, write_traces

    job = SyntheticJob(world=world)
    job.run(steps)
    records = job.records()
    for recs in records.values():
        recs[0]["run_id"] = run_id
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_traces(records, tmp).values():
            with open(Path(into) / path.name, "ab") as fh:
                fh.write(path.read_bytes())


def test_replay_verdict_reads_only_this_runs_traces(tmp_path):
    """A 1-rank run into a folder a 2-rank run left: the replay takes this run's id, not MixedRuns."""
    from eplb_fsm.commands.simulate_checks import TraceDir, trace_sizes
    from eplb_fsm.commands.simulate_report import replay_verdict

    _synthetic_run(2, "a" * 16, tmp_path)
    trace_dir = TraceDir(str(tmp_path), trace_sizes(tmp_path))
    assert replay_verdict(trace_dir)["verdict"] == "unavailable"  # nothing of this run yet: no old run instead
    _synthetic_run(1, "b" * 16, tmp_path)
    verdict = replay_verdict(trace_dir)
    assert verdict["verdict"] == "healthy" and verdict["summary"].startswith("1 of 1 ranks agree"), verdict
    assert replay_verdict(str(tmp_path), run_id="a" * 16)["summary"].startswith("2 of 2 ranks agree")


def test_a_failed_report_ignores_earlier_runs_records(tmp_path):
    """A rank that wrote nothing in this run shows no trace, not the last record of an earlier run's session."""
    import json
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_checks import TraceDir, trace_sizes
    from eplb_fsm.commands.simulate_report import build_failed_report

    (tmp_path / "rank00000.jsonl").write_text(json.dumps({"event": "header", "step": 0}) + "\n" + json.dumps(
        {"event": "step", "step": 99, "state": "collecting"}) + "\n")
    opts = SimpleNamespace(ranks=1, log_dir=TraceDir(str(tmp_path), trace_sizes(tmp_path)), extra={},
                           config_dict=lambda: {})
    exc = RuntimeError("rank failed")
    exc.failures = {0: "process exited with code 43"}
    rank = build_failed_report(opts, exc, 1.0)["ranks"][0]
    assert (rank["last_step"], rank["last_event"], rank["trace"]) == (None, None, None)


def test_the_traces_line_names_the_run_in_a_reused_folder():
    """When the folder held earlier traces, the report names this run's id (for eplb-fsm replay --run-id)."""
    from eplb_fsm.commands.simulate_report import format_report

    report = dict(_failed_report([1]), run_id="c" * 16, earlier_traces=True)
    assert f"traces: /tmp/t (appended to earlier traces: this run is --run-id {'c' * 16})" in format_report(report)
    assert "traces: /tmp/t\n" in format_report(dict(report, earlier_traces=False))


def test_a_run_stopped_by_its_own_deadline_blames_no_rank():
    """--timeout's signals (replay: signalled) are the deadline's, not the ranks': the headline says so, no culprit."""
    from eplb_fsm.commands.simulate_report import format_report

    report = dict(_failed_report([0, 1]), error="timeout", deadline_s=0.3, failed_ranks=[0, 1],
                  replay={"verdict": "signalled", "summary": "ranks 0-1 were stopped by SIGTERM",
                          "culprit_ranks": [0, 1]})
    text = format_report(report)
    assert ("the run did not finish in time: the --timeout deadline (0.3 s) stopped every rank; no rank had "
            "failed before it") in text
    assert "caused by rank" not in text
    hang = dict(report, replay={"verdict": "hang", "summary": "rank 1 never joined", "culprit_ranks": [1]})
    assert "the run did not finish in time: caused by rank(s) 1: hang" in format_report(hang)


def test_a_deadline_report_does_not_blame_a_rank_the_launcher_found_running():
    """Replay reads rank_died for rank 0 (its trace stopped early) but the launcher killed it still running at
    its --timeout deadline: the deadline headline, no 'caused by rank' (was: caused by rank(s) 0: rank_died)."""
    from eplb_fsm.commands.simulate_report import format_report

    running = [{"rank": r, "status": "timed_out", "last_step": 9, "last_state": "collecting", "last_event": "end",
                "reason": "still running at the 7 s deadline (killed)"} for r in (0, 1)]
    report = dict(_failed_report([0]), error="timeout", deadline_s=7.0, failed_ranks=[0, 1], ranks=running,
                  replay={"verdict": "rank_died", "summary": "rank 0 died (SIGKILL?) at step 9 in collecting",
                          "culprit_ranks": [0]})
    text = format_report(report)
    assert ("the run did not finish in time: the --timeout deadline (7 s) stopped every rank; no rank had "
            "failed before it") in text
    assert "caused by rank" not in text
    assert "replay reads rank_died for rank(s) 0, but the launcher found them still running" in text
    # a rank the launcher saw exit before the deadline did die: it stays the cause
    died = [dict(running[0], status="died", reason="process exited with code -9"), running[1]]
    assert "caused by rank(s) 0: rank_died" in format_report(dict(report, ranks=died))


def test_a_joiner_whose_scale_aborted_is_not_joined_not_failed():
    """A not_joined joiner's result is listed as such in a failed run's report (not failed), and in the text."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_report import build_failed_report, format_report

    opts = SimpleNamespace(ranks=2, log_dir="/nonexistent-eplb-dir", extra={}, config_dict=lambda: {})
    exc = RuntimeError("rank failed")
    exc.failures = {1: "RuntimeError: Connection reset by peer"}
    exc.values = {0: {"rank": 0}, 1002: {"status": "not_joined", "reason": "ScaleAborted: no handover"}}
    report = build_failed_report(opts, exc, 1.0)
    status = {e["process"]: (e["status"], e["reason"]) for e in report["ranks"]}
    assert status == {0: ("finished", None), 1: ("failed", "RuntimeError: Connection reset by peer"),
                      1002: ("not_joined", "ScaleAborted: no handover")}
    assert report["failed_processes"] == [1]
    ok = {"config": {"ranks": 2, "layers": 2, "experts": 8, "redundant": 0, "steps": 12, "interval": 4,
                     "window": 4, "mode": "sync", "load": "zipf"}, "rearrangements": [], "moved_slots_total": 0,
          "moved_bytes_total": 0, "time_in_state_s": {}, "balancedness_first_window": 0.9,
          "balancedness_last_window": 0.9, "outputs_unchanged": True, "output_checks": 24, "weights_exact": True,
          "maps_agree": True, "final_state": "collecting", "final_states": ["collecting"] * 2, "log_dir": "/tmp/t",
          "wall_s": 1.0, "processes": [{"process": 1002, "rank": 2, "start_step": 6, "status": "not_joined",
                                        "reason": "ScaleAborted: no handover"}]}
    assert ("joiner process 1002 (rank 2, scale at step 6): not joined, its scale aborted (ScaleAborted: no "
            "handover)") in format_report(ok)


def _returned(process: int, **fields) -> dict:
    """What an elastic rank returns (eplb_fsm.sim.elastic.run_elastic_rank), less the per-step series."""
    return {"rank": process, "world": 4, "steps": 120, "start_step": 0, "role": "initial", "process": process,
            "left": False, "stop_reason": None, "final_state": "collecting", "final_layer": 0, "history": [],
            "trace": f"/nonexistent-eplb-dir/rank{process:05d}.jsonl", **fields}


def test_ranks_that_returned_on_a_failed_scale_are_failed_with_their_reason():
    """Ranks that returned at step 81 of 120 with a stop_reason and a failed machine are failed, not finished."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_report import build_failed_report, format_report

    config = {"ranks": 4, "layers": 4, "experts": 32, "redundant": 32, "steps": 120, "interval": 50, "window": 40,
              "mode": "sync", "load": "zipf"}
    opts = SimpleNamespace(ranks=4, steps=120, log_dir="/nonexistent-eplb-dir", extra={}, config_dict=lambda: config)
    lost = "experts lost with the leaving rank(s): " + ", ".join(f"main layer 1 expert {e}" for e in range(32))
    exc = RuntimeError("rank failed")
    exc.failures = {3: "process exited with code -9 without reporting"}
    exc.values = {0: _returned(0, steps=81, stop_reason=lost, final_state="failed", final_layer=1),
                  1: _returned(1, steps=81, stop_reason="the old group broke during the scale-down",
                               final_state="failed", final_layer=1),
                  2: _returned(2, steps=81, final_state="failed", final_layer=1)}
    report = build_failed_report(opts, exc, 1.0)
    status = {e["process"]: (e["status"], e["reason"]) for e in report["ranks"]}
    assert status == {0: ("failed", lost), 1: ("failed", "the old group broke during the scale-down"),
                      2: ("failed", "its state machine ended in state failed after 81 step(s)"),
                      3: ("died", "process exited with code -9 without reporting")}
    assert report["failed_ranks"] == [0, 1, 2, 3]
    report["replay"] = {"verdict": "hang", "summary": "rank 3 never joined all_reduce", "culprit_ranks": [3]}
    lines = format_report(report).splitlines()
    assert "ranks that stopped: 0, 1, 2, 3" in lines
    assert not any("finished" in line for line in lines)
    rank0 = next(line for line in lines if line.startswith("  rank 0:"))
    assert rank0.startswith("  rank 0: failed    no trace; experts lost with the leaving rank(s): main layer 1 ")
    assert rank0.endswith("main layer 1 expert 6, ... (25 more)")  # 7 of the 32 lost experts, then a count


def test_ranks_that_returned_early_or_left_are_not_finished():
    """A rank that left at its scale-down is 'left'; one that returned before the requested steps is 'stopped'."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_report import build_failed_report

    opts = SimpleNamespace(ranks=3, steps=120, log_dir="/nonexistent-eplb-dir", extra={}, config_dict=lambda: {})
    exc = RuntimeError("rank failed")
    exc.failures = {2: "process exited with code -9 without reporting"}
    exc.values = {0: _returned(0, steps=50), 1: _returned(1, steps=80, left=True)}
    status = {e["process"]: (e["status"], e["reason"]) for e in build_failed_report(opts, exc, 1.0)["ranks"]}
    assert status[0] == ("stopped", "returned after 50 of 120 steps") and status[1] == ("left", None)


def test_ranks_whose_run_ids_differ_are_reported_as_a_failed_agreement_not_a_missing_rank(tmp_path):
    """Headers with different run ids (the run-identity all-reduce failed: each rank kept its own id): the replay
    verdict says the agreement failed and names each id and its rank, and blames no rank as missing."""
    import tempfile
    from pathlib import Path

    from eplb_fsm.commands.simulate_checks import TraceDir
    from eplb_fsm.commands.simulate_report import format_report, replay_verdict
    from eplb_fsm.testing import SyntheticJob, write_traces

    job = SyntheticJob(world=2)
    job.run(4)
    records = job.records()
    records[0][0]["run_id"], records[1][0]["run_id"] = "a" * 16, "b" * 16
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_traces(records, tmp).values():
            (Path(tmp_path) / path.name).write_bytes(path.read_bytes())
    verdict = replay_verdict(TraceDir(str(tmp_path), {}))
    assert verdict["culprit_ranks"] == [] and verdict["verdict"] == "unavailable", verdict
    assert verdict["summary"].startswith("the run-identity agreement failed: this run's traces carry 2 different "
                                         f"run ids ({'a' * 16}: rank 0; {'b' * 16}: rank 1)"), verdict
    report = _failed_report([])
    report["failed_ranks"], report["replay"] = [0, 1], verdict
    text = format_report(report)
    assert "the run failed: rank(s) 0, 1" in text and "missing" not in text
    assert text.splitlines()[-1] == f"replay: unavailable: {verdict['summary']}"


def _append(path, *records) -> None:
    import json

    with open(path, "a") as fh:
        fh.writelines(json.dumps(rec) + "\n" for rec in records)


def test_a_rank_refused_its_trace_shows_no_record_of_the_run_writing_it(tmp_path):
    """Ranks refused the trace lock (another run still appending to the files) show no trace of their own,
    not the other run's last record; a rank of this run that did write shows its own last record."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_checks import TraceDir, trace_sizes
    from eplb_fsm.commands.simulate_report import build_failed_report, format_report

    other, mine = "a" * 16, "b" * 16
    for rank in (0, 1):   # run A: writing both files when this run starts
        _append(tmp_path / f"rank{rank:05d}.jsonl", {"event": "header", "run_id": other, "rank": rank, "step": 0},
                {"event": "balancedness", "step": 400, "state": "collecting"})
    trace_dir = TraceDir(str(tmp_path), trace_sizes(tmp_path))
    refused = "ValueError: trace file rank00000.jsonl is already written by another process (pid 1)"
    _append(tmp_path / "rank00000.jsonl", {"event": "balancedness", "step": 425, "state": "collecting"})
    _append(tmp_path / "rank00001.jsonl", {"event": "balancedness", "step": 425, "state": "collecting"})
    opts = SimpleNamespace(ranks=2, log_dir=trace_dir, extra={}, config_dict=lambda: {})
    exc = RuntimeError("rank failed")
    exc.failures = {0: refused, 1: refused}
    report = build_failed_report(opts, exc, 1.0)
    assert [(e["last_step"], e["last_event"], e["trace"]) for e in report["ranks"]] == [(None, None, None)] * 2
    assert report["traces"] == []
    # rank 1's file: this run's own session (after A's writer let go of it), then A's records again
    _append(tmp_path / "rank00001.jsonl", {"event": "header", "run_id": mine, "rank": 1, "step": 0},
            {"event": "step", "step": 7, "state": "collecting"},
            {"event": "header", "run_id": other, "rank": 1, "step": 425},
            {"event": "balancedness", "step": 430, "state": "collecting"})
    opts.log_dir = TraceDir(str(tmp_path), trace_dir.start)
    exc.failures = {0: refused, 1: "RuntimeError: Connection reset by peer"}
    report = build_failed_report(opts, exc, 1.0)
    assert [(e["last_step"], e["last_event"]) for e in report["ranks"]] == [(None, None), (7, "step")]
    assert report["traces"] == [str(tmp_path / "rank00001.jsonl")]
    report["config"] = {"ranks": 2, "layers": 2, "experts": 8, "redundant": 2, "steps": 60, "interval": 20,
                        "window": 40, "mode": "sync", "load": "zipf"}
    lines = format_report(report).splitlines()
    assert next(ln for ln in lines if ln.startswith("  rank 0:")).startswith("  rank 0: failed    no trace; ")
    assert next(ln for ln in lines if ln.startswith("  rank 1:")).startswith(
        "  rank 1: failed    last record: step 7, collecting (step)")
