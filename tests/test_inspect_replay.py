"""Replay and hang diagnosis over synthetic traces recorded through the real machine and trace.

``SyntheticJob`` runs W ranks in lockstep (interval 10: rearrangements at steps 9, 19,
29, 39; each all-reduces the load and maps digest on group ``ep`` (shape [16 + 16]), then
per layer a p2p batch on ``ep_transfer`` and a ready all-reduce on ``ep``, then one more
ready all-reduce before the commit: ``ep`` cseq 0-3 at step 9, 4-7 at 19, 8 at 29, whose
plan moves nothing). Faults are injected per rank.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from eplb_fsm.inspect import replay as rp
from eplb_fsm.inspect.render import format_report
from eplb_fsm.testing import Faults, Stop, SyntheticJob, hang_faults, write_traces
from eplb_fsm.trace import read_trace, trace_path

WORLD = 4


def job_records(faults: Faults | None = None, steps: int = 40, world: int = WORLD, **kwargs) -> dict[int, list[dict]]:
    job = SyntheticJob(world=world, **kwargs)
    job.run(steps, faults)
    return job.records()


@pytest.fixture(scope="module")
def healthy() -> dict[int, list[dict]]:
    return job_records()


def fresh(records: dict[int, list[dict]]) -> dict[int, list[dict]]:
    return copy.deepcopy(records)


def positions(report, status: str) -> list[int]:
    return sorted(p["rank"] for p in report.at_divergence if p["status"] == status)


# --------------------------------------------------------------------------- healthy


def test_healthy_traces_are_healthy(healthy):
    """A clean lockstep run: verdict healthy, zero illegal transitions, no findings, exit 0."""
    report = rp.diagnose(healthy)
    assert report.verdict == "healthy" and report.healthy and report.exit_code == 0
    assert report.illegal_transitions == [] and report.findings == []
    assert report.culprit_ranks == [] and report.collective is None
    assert report.world == WORLD and report.missing_ranks == []
    assert [r["rearrangements"] for r in report.ranks] == [3] * WORLD
    assert all(r["illegal_transitions"] == 0 and r["open_collectives"] == [] for r in report.ranks)
    assert format_report(report).splitlines()[0].startswith("healthy: 4 of 4 ranks agree")


def test_unknown_record_kinds_are_tolerated(healthy):
    """Records of kinds the replay does not know (and missing optional fields) change nothing."""
    records = fresh(healthy)
    for r, recs in records.items():
        recs.insert(5, {"ts": 0, "rank": r, "world": WORLD, "event": "mystery", "state": "collecting",
                        "step": 3, "seq": 10_000, "payload": [1, 2]})
        recs.append({"event": "cache_flush"})
    report = rp.diagnose(records)
    assert report.verdict == "healthy", format_report(report)


# --------------------------------------------------------------------------- hangs


def test_collective_never_ended_on_one_rank_while_others_moved_on():
    """Rank 2 starts the step-19 all-reduce and never ends it; the others finish and go on."""
    report = rp.diagnose(job_records(Faults(stop={2: Stop(19, "in_collective")})))
    assert report.verdict == "hang"
    assert report.culprit_ranks == [2]
    assert (report.step, report.state, report.layer) == (19, "planning", None)
    assert report.collective == {"op": "all_reduce", "group": "ep", "cseq": 4, "shape": [32],
                                 "dtype": "torch.float64"}
    assert positions(report, "inside") == [2]
    assert positions(report, "past") == [0, 1, 3]
    # its trace stopping early is part of this hang, not a separate death
    assert not any(f.kind == "rank_died" for f in report.findings)
    assert report.exit_code == 1


def test_rank_that_never_joins_leaves_the_others_waiting_inside():
    """Classic hang: rank 1 never reaches the all-reduce that ranks 0, 2, 3 wait in."""
    report = rp.diagnose(job_records(hang_faults(WORLD, culprit=1, step=29)))
    assert report.verdict == "hang" and report.culprit_ranks == [1]
    assert (report.step, report.state) == (29, "planning")
    assert report.collective["op"] == "all_reduce" and report.collective["cseq"] == 8
    assert positions(report, "never_joined") == [1]
    assert positions(report, "inside") == [0, 2, 3]
    first = format_report(report).splitlines()[0]
    assert first.startswith("hang: rank 1 never joined all_reduce (group ep, cseq 8")


def test_every_rank_inside_the_same_collective_is_a_hang():
    """All ranks started the collective and none finished: a hang with every rank listed."""
    faults = Faults(stop={r: Stop(19, "in_collective") for r in range(WORLD)})
    report = rp.diagnose(job_records(faults))
    assert report.verdict == "hang" and report.culprit_ranks == [0, 1, 2, 3]
    assert report.collective["cseq"] == 4


def test_hang_whose_culprit_has_no_trace_names_the_missing_rank(healthy):
    """Ranks 0-2 wait inside a collective and rank 3's file is missing: rank 3 is the culprit."""
    records = job_records(hang_faults(WORLD, culprit=3, step=19))
    del records[3]
    report = rp.diagnose(records)
    assert report.verdict == "hang" and report.culprit_ranks == [3]
    assert report.missing_ranks == [3]
    assert any(f.kind == "missing_ranks" for f in report.findings)


def test_watchdog_stuck_reports_show_in_the_rank_positions():
    """A stuck record after the open collective is quoted in that rank's position."""
    job = SyntheticJob(world=WORLD)
    job.run(40, hang_faults(WORLD, culprit=0, step=19))
    for r in (1, 2, 3):
        job.ranks[r].trace.emit("stuck", state="planning", layer=0, seconds=61.0, deadline_s=60.0,
                                last_collective={"op": "all_reduce", "group": "ep", "cseq": 4})
    report = rp.diagnose(job.records())
    assert report.verdict == "hang" and report.culprit_ranks == [0]
    notes = {p["rank"]: p["note"] for p in report.at_divergence}
    assert "watchdog: stuck 61.0 s in planning" in notes[1]


# --------------------------------------------------------------------------- mismatches


def test_different_op_at_the_same_cseq():
    """Rank 3 issues all_gather where the others issue all_reduce at ep cseq 4 (step 19)."""
    report = rp.diagnose(job_records(Faults(wrong_collective={3: (19, {"op": "all_gather"})})))
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [3]
    assert (report.step, report.state) == (19, "planning")
    assert report.collective["op"] == "all_reduce" and report.collective["cseq"] == 4
    assert positions(report, "different") == [3]
    assert "issued all_gather" in report.summary


def test_different_shape_at_the_same_cseq():
    """Rank 0 all-reduces a [99] tensor where the others send [32]: a mismatch naming rank 0."""
    report = rp.diagnose(job_records(Faults(wrong_collective={0: (29, {"shape": [99]})})))
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [0]
    assert report.step == 29 and report.collective["shape"] == [32]


def test_per_rank_shapes_of_p2p_ops_are_not_a_mismatch(healthy):
    """batch_isend_irecv moves different amounts per rank; differing shapes there are fine."""
    records = fresh(healthy)
    for rec in records[2]:
        if rec.get("op") == "batch_isend_irecv":
            rec["shape"] = [7, 3]
    assert rp.diagnose(records).verdict == "healthy"


def test_p2p_batches_out_of_step_by_layer_are_a_mismatch(healthy):
    """Rank 1 lacks layer 0's p2p batch, so at ep_transfer cseq 0 it moves layer 1, the others layer 0."""
    records = fresh(healthy)
    drop = [i for i, rec in enumerate(records[1]) if rec.get("group") == "ep_transfer" and rec.get("cseq") == 0]
    for i in reversed(drop):
        del records[1][i]
    for rec in records[1]:
        if rec.get("group") == "ep_transfer":
            rec["cseq"] -= 1
    report = rp.diagnose(records)
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [1]
    assert report.collective["group"] == "ep_transfer" and report.collective["cseq"] == 0
    assert report.layer == 0 and report.step == 9


def test_rank_that_skips_a_collective_but_goes_on():
    """Rank 1 never issues the last ep_transfer batch yet its trace goes on: a mismatch, not a hang."""
    records = job_records(steps=45)
    last = max(r["cseq"] for r in records[1] if r.get("group") == "ep_transfer")
    records[1] = [r for r in records[1] if not (r.get("group") == "ep_transfer" and r.get("cseq") == last)]
    for seq, rec in enumerate(records[1], records[1][0]["seq"]):
        rec["seq"] = seq    # it never wrote them: its seq runs on (lines lost from the file are lost_records)
    report = rp.diagnose(records)
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [1]
    assert report.collective["cseq"] == last and report.step == 39
    assert positions(report, "skipped") == [1]


# --------------------------------------------------------------------------- step / decision divergence


def test_rank_that_skipped_a_step_enters_planning_one_step_later():
    """Rank 3's interval counter misses step 12, so it enters planning at step 20 instead of 19."""
    report = rp.diagnose(job_records(Faults(skip_count={3: 12})))
    assert report.verdict == "step_divergence"
    assert report.culprit_ranks == [3]
    assert (report.step, report.state, report.layer) == (19, "collecting", None)
    assert report.collective is None
    notes = {p["rank"]: p["note"] for p in report.at_divergence}
    assert notes[3] == "step: collecting -> planning at step 20"
    assert notes[0] == "step: collecting -> planning at step 19"


def test_a_rank_deciding_differently_is_a_decision_divergence(healthy):
    """Rank 1 finds its step-19 plan not worth moving while the others transfer it."""
    records = fresh(healthy)
    recs = records[1]
    i = next(i for i, r in enumerate(recs) if r.get("trigger") == "plan_ready" and r["step"] == 19)
    recs[i].update(dest="collecting", state="collecting", moves=0, worth=False, layer_after=1)
    j = next(k for k in range(i, len(recs)) if recs[k]["event"] == "rearrangement")
    del recs[i + 1:j]
    report = rp.diagnose(records)
    assert report.illegal_transitions == []
    assert report.verdict == "decision_divergence" and report.culprit_ranks == [1]
    assert (report.step, report.state) == (19, "planning")


def _mistype_step(lines: list[str], step: int) -> list[str]:
    i = next(i for i, line in enumerate(lines) if '"trigger":"step"' in line and f'"step":{step},' in line)
    rec = json.loads(lines[i])
    rec["step"] = "x"
    return lines[:i] + [json.dumps(rec)] + lines[i + 1:]


@pytest.mark.parametrize("faults, verdict, culprits", [(None, "healthy", []),
                                                        (Faults(skip_count={3: 12}), "step_divergence", [3])])
def test_a_mistyped_step_on_a_transition_is_only_a_warning(tmp_path, faults, verdict, culprits):
    """Rank 1's due transition with `"step": "x"`: a warning, never a step divergence blamed on rank 1."""
    job = SyntheticJob(world=WORLD, trace_dir=tmp_path, keep=False)
    job.run(30, faults)
    job.close()
    path = trace_path(tmp_path, 1)
    path.write_text("\n".join(_mistype_step(path.read_text().splitlines(), 19)) + "\n")
    report = rp.replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == (verdict, culprits), format_report(report)
    assert any("field 'step' is str 'x'" in w for w in report.warnings)
    assert ", :" not in format_report(report).splitlines()[0]


# --------------------------------------------------------------------------- deaths and input problems


def test_rank_whose_trace_ends_early():
    """Rank 1 stops before step 15 while the others run to 39: rank_died at its last step 14."""
    report = rp.diagnose(job_records(Faults(stop={1: Stop(15)})))
    assert report.verdict == "rank_died" and report.culprit_ranks == [1]
    assert (report.step, report.state, report.layer) == (14, "collecting", None)
    assert positions(report, "went_on") == [0, 2, 3]


def test_truncated_last_line_is_tolerated_and_reported(healthy, tmp_path):
    """A rank killed mid-write leaves half a line: skipped, warned about, the run stays healthy."""
    write_traces(healthy, tmp_path)
    path = trace_path(tmp_path, 2)
    text = path.read_text()
    path.write_text(text[: len(text) - 25])
    records, bad, truncated = rp.read_records(path)
    assert (bad, truncated) == (1, True) and len(records) == len(healthy[2]) - 1
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", format_report(report)
    assert any("rank 2" in w and "truncated" in w for w in report.warnings)
    assert report.ranks[2]["truncated"] is True


def test_unreadable_middle_line_is_counted_not_truncated(healthy, tmp_path):
    """A garbled line in the middle is skipped and counted; the file is not marked truncated."""
    write_traces(healthy, tmp_path)
    path = trace_path(tmp_path, 0)
    lines = path.read_text().splitlines()
    lines[50] = lines[50][:10]
    path.write_text("\n".join(lines) + "\n")
    records, bad, truncated = rp.read_records(path)
    assert (bad, truncated) == (1, False)
    report = rp.replay_dir(tmp_path)
    assert any("1 unreadable line" in w for w in report.warnings)


def test_a_line_with_bytes_that_are_not_utf8_is_unreadable_even_if_it_parses(healthy, tmp_path):
    """A damaged byte inside a string value (still valid JSON once decoded) makes its line unreadable, not altered."""
    write_traces(healthy, tmp_path)
    path = trace_path(tmp_path, 1)
    lines = path.read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if b'"trigger":"plan_ready"' in line)
    lines[at] = lines[at].replace(b'"plan_ready"', b'"plan_re\xffdy"')
    path.write_bytes(b"\n".join(lines))
    records, bad, truncated = rp.read_records(path)
    assert (bad, truncated) == (1, False) and len(records) == len(healthy[1]) - 1
    assert not any("\ufffd" in str(r) for r in records)
    report = rp.replay_dir(tmp_path)
    assert any("rank 1" in w and "1 unreadable line" in w for w in report.warnings), report.warnings


def test_missing_rank_file(healthy, tmp_path):
    """World 4 with rank00003.jsonl missing: verdict missing_ranks naming rank 3."""
    write_traces(healthy, tmp_path)
    trace_path(tmp_path, 3).unlink()
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "missing_ranks" and report.culprit_ranks == [3]
    assert report.world == 4 and report.missing_ranks == [3]
    assert report.step is None


def test_illegal_transition_in_one_rank():
    """Rank 0 records committed straight from transferring at step 9: illegal, with the reason."""
    report = rp.diagnose(job_records(Faults(illegal={0: 9})))
    assert report.verdict == "illegal_transition" and report.culprit_ranks == [0]
    assert (report.step, report.state, report.layer) == (9, "transferring", 0)
    assert len(report.illegal_transitions) == 1
    bad = report.illegal_transitions[0]
    assert (bad["rank"], bad["trigger"], bad["source"], bad["dest"]) == (0, "committed", "transferring", "collecting")
    assert "not allowed in state 'transferring'" in bad["reason"]
    # the divergence it causes is reported after it
    assert [f.kind for f in report.findings][:2] == ["illegal_transition", "decision_divergence"]


def test_a_dropped_transition_record_is_an_illegal_transition(healthy):
    """Without its layer-0 layer_done (never written: the seq runs on), rank 2's layer-1 layer_done fails the
    is_current_layer guard."""
    records = fresh(healthy)
    recs = records[2]
    i = next(i for i, r in enumerate(recs) if r.get("trigger") == "layer_done" and r["layer"] == 0)
    del recs[i]
    for rec in recs[i:]:    # no seq gap: a record the controller never wrote, not a line the trace lost
        rec["seq"] -= 1
    report = rp.diagnose(records)
    assert report.verdict == "illegal_transition" and report.culprit_ranks == [2]
    assert report.step == 9 and report.layer == 1
    assert "not allowed" in report.illegal_transitions[0]["reason"]
    assert len(report.illegal_transitions) == 1  # resynchronised, no cascade


def test_step_record_in_the_wrong_state_is_illegal(healthy):
    """A compact step record claiming planning while the replay is in collecting is refused."""
    records = fresh(healthy)
    rec = next(r for r in records[1] if r["event"] == "step" and r["step"] == 5)
    rec["state"] = "planning"
    report = rp.diagnose(records)
    assert report.verdict == "illegal_transition" and report.culprit_ranks == [1] and report.step == 5


def test_layer_after_disagreeing_with_the_machine_is_illegal(healthy):
    """A layer_done whose layer_after is not what the machine computes is reported."""
    records = fresh(healthy)
    rec = next(r for r in records[3] if r.get("trigger") == "layer_done" and r["layer"] == 0)
    rec["layer_after"] = 5
    report = rp.diagnose(records)
    assert report.verdict == "illegal_transition" and report.culprit_ranks == [3]
    assert "layer 1 after it, the trace says 5" in report.illegal_transitions[0]["reason"]


def test_config_mismatch():
    """Rank 2's header has step_interval 20 while the others have 10: config_mismatch on rank 2."""
    report = rp.diagnose(job_records(config_overrides={2: {"step_interval": 20}}))
    assert report.verdict == "config_mismatch" and report.culprit_ranks == [2]
    assert report.step == 0
    assert "step_interval=20 (others 10)" in report.summary


def test_failed_state_is_a_problem():
    """Every rank ending in failed after an unrecoverable fault gives verdict failed."""
    job = SyntheticJob(world=WORLD)
    job.run(12)
    for rank in job.ranks.values():
        rank.fire("fault", recoverable=False)
    report = rp.diagnose(job.records())
    assert report.verdict == "failed" and report.culprit_ranks == [0, 1, 2, 3]
    assert report.state == "failed" and report.step == 11


def test_trace_starting_mid_run_replays_from_the_first_source(healthy):
    """A rank whose file lost its beginning (no header) replays from its first transition's source."""
    records = fresh(healthy)
    cut = next(i for i, r in enumerate(records[1]) if r.get("trigger") == "layer_done")
    records[1] = records[1][cut:]
    report = rp.diagnose(records)
    assert report.illegal_transitions == []
    assert any("rank 1: no header" in w for w in report.warnings)


# --------------------------------------------------------------------------- API details


def test_diagnose_accepts_summaries_and_rejects_nothing(healthy):
    """diagnose takes rank->records or RankSummary objects; no records at all is NoTraces."""
    summaries = [rp.summarize_rank(recs, r) for r, recs in healthy.items()]
    assert rp.diagnose(summaries).verdict == "healthy"
    with pytest.raises(rp.NoTraces):
        rp.diagnose({0: [], 1: []})


@pytest.mark.parametrize("traces, message", [
    ("read_trace", r"rank 0: record 0 is list, .*read_trace\(path\) returns \(records, bad_lines\)"),
    ({0: "x"}, "rank 0 is str, expected an iterable of record dicts"),
    ({0: [1, 2]}, "rank 0: record 0 is int, expected an iterable of record dicts"),
    ({"a": []}, r"rank key 'a' \(str\) is not a rank: keys must be integers >= 0"),
    (None, "traces must be a mapping rank -> an iterable of record dicts"),
], ids=["read_trace_tuple", "str_value", "int_records", "str_key", "none"])
def test_diagnose_names_the_rank_and_the_rule_of_a_wrong_input(tmp_path, monkeypatch, traces, message):
    """read_trace's (records, bad_lines) or any wrong value is a ValueError naming the rank, before any work."""
    if traces == "read_trace":
        job = SyntheticJob(world=2, trace_dir=tmp_path, keep=False)
        job.run(10)
        job.close()
        traces = {r: read_trace(trace_path(tmp_path, r)) for r in range(2)}
    monkeypatch.setattr(rp, "summarize_rank", lambda *a, **k: pytest.fail("summarized before the input was checked"))
    with pytest.raises(ValueError, match=message):
        rp.diagnose(traces)


def test_load_dir_errors_are_no_traces(tmp_path):
    """No folder, no rank files, or only unreadable ones: NoTraces (the CLI's exit 2)."""
    with pytest.raises(rp.NoTraces, match="not a directory"):
        rp.replay_dir(tmp_path / "absent")
    with pytest.raises(rp.NoTraces, match="no rank"):
        rp.replay_dir(tmp_path)
    (tmp_path / "rank00000.jsonl").write_text("not json\n{also not\n")
    with pytest.raises(rp.NoTraces, match="no readable"):
        rp.replay_dir(tmp_path)


def test_parallel_loading_gives_the_same_report(tmp_path):
    """jobs=2 (worker processes) and jobs=1 produce the same report."""
    write_traces(job_records(hang_faults(WORLD, culprit=2, step=19)), tmp_path)
    one = rp.replay_dir(tmp_path, jobs=1).to_dict()
    two = rp.replay_dir(tmp_path, jobs=2).to_dict()
    assert one == two and one["verdict"] == "hang"


def test_report_json_has_the_documented_fields():
    """to_dict() is JSON-serialisable with verdict, culprits, step, state, layer, collective, ..."""
    report = rp.diagnose(job_records(hang_faults(WORLD, culprit=0, step=9)))
    data = json.loads(json.dumps(report.to_dict()))
    for key in ("verdict", "culprit_ranks", "step", "state", "layer", "collective", "illegal_transitions",
                "ranks", "warnings", "findings", "at_divergence", "world", "missing_ranks"):
        assert key in data
    assert set(data["collective"]) == {"op", "group", "cseq", "shape", "dtype"}


def test_ranks_text_compacts_runs():
    """Rank lists print as ranges: [0,1,2,3,7,9,10] -> 0-3,7,9-10."""
    assert rp.ranks_text([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert rp.ranks_text([5]) == "5" and rp.ranks_text([]) == "-"



def test_transfer_failure_aborted_everywhere_is_handled():
    """Rank 2's layer-1 transfer fails, every rank fires fault and goes on: healthy, with a handled note."""
    report = rp.diagnose(job_records(Faults(transfer_error={2: (19, 1)})))
    assert report.verdict == "healthy" and report.exit_code == 0
    assert len(report.handled) == 1
    note = report.handled[0]
    # rank 2 never joined the wave and issued nothing more in the group (its next wave is on a fresh group)
    assert (note.kind, note.culprits, note.step, note.collective["group"]) == ("hang", [2], 19, "ep_transfer")
    assert "handled by a fault on every rank" in report.summary
    # later rearrangements run on the fresh group and line up again
    assert all(r["rearrangements"] == 3 for r in report.ranks)


def test_a_fault_on_only_some_ranks_is_not_handled(healthy):
    """If only the failing rank aborts while the others commit, the divergence is the verdict."""
    records = job_records(Faults(transfer_error={2: (19, 1)}))
    clean = fresh(healthy)
    for r in (0, 1, 3):
        records[r] = clean[r]
    report = rp.diagnose(records)
    assert report.verdict == "decision_divergence" and report.culprit_ranks == [2]
    assert report.handled == []


def test_world_groups_include_header_groups_and_their_recreations(healthy):
    """ep and ep_transfer (from headers), ep_transfer.N and groups every rank used are world-wide."""
    summaries = {r: rp.summarize_rank(recs, r) for r, recs in healthy.items()}
    summaries[0].collectives["ep_transfer.4"] = {}
    summaries[1].collectives["side"] = {}
    wide = rp.world_groups(summaries)
    assert {"world", "ep", "ep_transfer", "ep_transfer.4"} <= wide
    assert "side" not in wide


# --------------------------------------------------------------------------- issue 14: compact runs, rotated files


def _replay_files(tmp_path, faults, compact: bool, steps: int = 40):
    job = SyntheticJob(world=WORLD, trace_dir=tmp_path, keep=False, compact_steps=compact)
    job.run(steps, faults)
    job.close()
    return rp.replay_dir(tmp_path)


@pytest.mark.parametrize("faults", [None, hang_faults(WORLD, 1, 19), Faults(skip_count={3: 12})],
                         ids=["healthy", "hang", "skip"])
def test_compact_runs_give_the_verdicts_of_per_step_records(tmp_path, faults):
    """Traces whose quiet steps are `steps` runs replay to the same verdict, culprit and step as per-step ones."""
    compact = _replay_files(tmp_path / "compact", faults, True)
    plain = _replay_files(tmp_path / "plain", faults, False)
    assert (compact.verdict, compact.culprit_ranks, compact.step) == (plain.verdict, plain.culprit_ranks, plain.step)
    assert any('"event":"steps"' in p.read_text() for p in (tmp_path / "compact").iterdir())


def test_a_skipped_step_is_found_from_compact_traces(tmp_path):
    """Rank 3 misses step 12's count; written as runs, replay still names it and the step it diverged at."""
    report = _replay_files(tmp_path, Faults(skip_count={3: 12}), True)
    assert report.verdict == "step_divergence" and report.culprit_ranks == [3] and report.step == 19


def _liveness_ranks(tmp_path, last_step: dict[int, int], world: int = 3, closed=(), **trace_kwargs) -> None:
    """Ranks written by the real EventTrace: quiet steps counted, an alive record (a flush) every 10 steps."""
    from eplb_fsm.trace import EventTrace

    for r in range(world):
        now = [1_700_000_000.0]
        trace = EventTrace(r, world, tmp_path, clock=lambda: now[0], **trace_kwargs)
        trace.set_context(state="collecting", step=0)
        trace.header({"num_layers": 2}, run_id="run-z", mode="sync", group="ep", transfer_group="ep_transfer")
        for step in range(last_step[r] + 1):
            now[0] = 1_700_000_000.0 + step * 0.1
            trace.step = step
            trace.count_step(step % 4 == 0)
            if step % 10 == 9:
                trace.alive(1.0, step - 10)
        if r in closed:
            trace.end("closed")
        trace.close()


def test_a_rank_one_step_short_is_named_from_its_runs(tmp_path):
    """Every rank closed, rank 1 counted one step fewer: step_count_mismatch names it, from the runs' counts."""
    _liveness_ranks(tmp_path, {0: 99, 1: 98, 2: 99}, closed=(0, 1, 2))
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "step_count_mismatch" and report.culprit_ranks == [1] and report.step == 98


def test_a_killed_rank_ends_at_the_last_step_of_its_last_run(tmp_path):
    """A rank whose file ends in a `steps` run (killed, no end): its last step is the run's last, not its first."""
    _liveness_ranks(tmp_path, {0: 99, 1: 99, 2: 56}, closed=(0, 1))
    summary = rp.load_dir(tmp_path).summaries[2]
    assert summary.last["event"] == "steps" and summary.last_step == 56 and summary.step_records == 57
    report = rp.replay_dir(tmp_path)
    assert report.culprit_ranks == [2], format_report(report)


def test_rotated_segments_replay_like_one_file(tmp_path):
    """Traces rolled into many segments replay to the same verdict and steps as unrotated ones."""
    last = {0: 299, 1: 298, 2: 299}
    _liveness_ranks(tmp_path / "one", last, closed=(0, 1, 2))
    _liveness_ranks(tmp_path / "rolled", last, closed=(0, 1, 2), max_bytes=4096, max_segments=1000)
    assert len(list((tmp_path / "rolled").glob("rank00000.jsonl.*"))) >= 2
    one, rolled = rp.replay_dir(tmp_path / "one"), rp.replay_dir(tmp_path / "rolled")
    assert (rolled.verdict, rolled.culprit_ranks, rolled.step) == (one.verdict, one.culprit_ranks, one.step) \
        == ("step_count_mismatch", [1], 298)
    a, b = rp.load_dir(tmp_path / "one").summaries, rp.load_dir(tmp_path / "rolled").summaries
    assert [(s.step_records, s.last_step, s.illegal) for s in a.values()] == \
        [(s.step_records, s.last_step, s.illegal) for s in b.values()]


def test_a_trace_whose_oldest_segments_were_dropped_still_replays(tmp_path):
    """With the cap reached (oldest segments deleted) each rank starts at a continued header and replays cleanly."""
    _liveness_ranks(tmp_path, {0: 299, 1: 299, 2: 299}, closed=(0, 1, 2), max_bytes=4096, max_segments=2)
    loaded = rp.load_dir(tmp_path)
    assert all(s.header["continued"] is True and s.first_step > 0 and not s.illegal for s in loaded.summaries.values())
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", format_report(report)


def _rolled_job(tmp_path, monkeypatch, max_bytes, steps: int, world: int = 2, faults: Faults | None = None,
                **job_kwargs) -> None:
    """A SyntheticJob whose ranks roll their files at ``max_bytes(rank)`` bytes, keeping two segments each."""
    import eplb_fsm.testing.ranks as ranks_mod
    from eplb_fsm.trace import EventTrace

    monkeypatch.setattr(ranks_mod, "EventTrace", lambda rank, **kw: EventTrace(
        rank=rank, max_bytes=max_bytes(rank), max_segments=2, **kw))
    job = SyntheticJob(world=world, trace_dir=tmp_path, keep=False, **job_kwargs)
    job.run(steps, faults)
    job.close()


def _oldest_header(tmp_path, rank: int) -> dict:
    from eplb_fsm.trace_segments import segment_paths

    return json.loads(segment_paths(trace_path(tmp_path, rank))[0].read_text().splitlines()[0])


def test_a_history_that_starts_mid_transfer_replays_from_the_layer_in_flight(tmp_path, monkeypatch):
    """The oldest kept segment starts in transferring at layer 1 (older ones deleted): no illegal layer_done."""
    _rolled_job(tmp_path, monkeypatch, lambda r: 5800, 300, num_layers=3)
    first = _oldest_header(tmp_path, 0)
    assert first["continued"] is True and first["state"] == "transferring" and first["machine"]["layer"] >= 1
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy" and report.illegal_transitions == [], format_report(report)


def test_an_older_continued_header_without_machine_takes_the_layer_from_the_first_transition(tmp_path, monkeypatch):
    """Headers of writers before `machine` existed: the layer in flight is the first transition's, not layer 0."""
    _rolled_job(tmp_path, monkeypatch, lambda r: 5800, 300, num_layers=3)
    for path in tmp_path.iterdir():
        lines = path.read_text().splitlines()
        old = {k: v for k, v in json.loads(lines[0]).items() if k not in ("machine", "next_cseq")}
        path.write_text("\n".join([json.dumps(old, separators=(",", ":"))] + lines[1:]) + "\n")
    assert _oldest_header(tmp_path, 0)["state"] == "transferring"
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy" and report.illegal_transitions == [], format_report(report)


@pytest.mark.parametrize("compact", [False, True], ids=["per-step", "compact"])
def test_ranks_whose_kept_histories_start_at_different_steps_agree(tmp_path, monkeypatch, compact):
    """Ranks rolled at different sizes: compared from the latest cut on, no false divergence or mismatch."""
    _rolled_job(tmp_path, monkeypatch, lambda r: 9000 + 1700 * r, 1500, world=3, compact_steps=compact)
    starts = {_oldest_header(tmp_path, r)["step"] for r in range(3)}
    assert len(starts) > 1, "the ranks' histories must start at different steps"
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", format_report(report)
    assert not [w for w in report.warnings if "without a start" in w]


def test_a_divergence_after_the_cut_is_still_found(tmp_path, monkeypatch):
    """Histories cut at different steps: rank 2's skipped step late in the run is still named, at its step."""
    # rank 0 keeps steps from 1479 on: the skip at 1484 parts the ranks at 1489 (ranks 0-1) and 1490 (rank 2)
    _rolled_job(tmp_path, monkeypatch, lambda r: 9000 + 1700 * r, 1500, world=3, faults=Faults(skip_count={2: 1484}))
    report = rp.replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.step) == ("step_divergence", [2], 1489), format_report(report)


# --------------------------------------------------------------------------- unreadable input, older runs


def deny(monkeypatch, *paths):
    """Make opening these files fail as chmod 000 would for a user (root ignores chmod)."""
    real_open, names = open, {str(p) for p in paths}

    def guarded(file, *args, **kwargs):
        if str(file) in names:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded)


def test_an_unreadable_file_is_named_in_the_missing_ranks_verdict(healthy, tmp_path, monkeypatch):
    """A rank file that exists but cannot be read: missing_ranks says 'unreadable file' and why, not 'no trace file'."""
    write_traces(healthy, tmp_path)
    deny(monkeypatch, trace_path(tmp_path, 1))
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "missing_ranks" and report.culprit_ranks == [1]
    assert "rank 1's file is unreadable" in report.summary and "Permission denied" in report.summary
    (pos,) = report.at_divergence
    assert pos["rank"] == 1 and pos["note"].startswith("unreadable file: cannot read")


def test_when_no_file_is_readable_the_first_cause_is_in_the_message(healthy, tmp_path, monkeypatch):
    """Every file unreadable: NoTraces names the first file's cause (Permission denied) and how many more failed."""
    write_traces(healthy, tmp_path)
    deny(monkeypatch, *(trace_path(tmp_path, r) for r in healthy))
    with pytest.raises(rp.NoTraces, match=r"no readable records .*rank 0: cannot read .*Permission denied "
                                          r"\(and 3 more file\(s\) without a readable record\)"):
        rp.replay_dir(tmp_path)


def test_an_unlistable_folder_is_no_traces(tmp_path, monkeypatch):
    """A folder that cannot be listed (permission) is NoTraces with the OS error, not a PermissionError."""
    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "iterdir", refuse)   # chmod 000 does not stop root
    with pytest.raises(rp.NoTraces, match="cannot list the trace files of .*Permission denied"):
        rp.replay_dir(tmp_path)


def test_run_id_picks_an_older_run_appended_to_the_files(tmp_path):
    """Rank 0's file holds run old then run new, rank 1's run old only: run_id='old' replays both ranks' old run."""
    from eplb_fsm.trace import encode_record

    old, new = job_records(steps=30, world=2), job_records(steps=5, world=1)
    for run_id, records in (("old", old), ("new", new)):
        for r, recs in records.items():
            recs[0]["run_id"] = run_id
            with open(trace_path(tmp_path, r), "a") as fh:
                fh.write("".join(encode_record(rec) + "\n" for rec in recs))
    # rank 0's file holds both runs: it is listed under both
    with pytest.raises(rp.MixedRuns, match=r"run new: rank files 0 .*run old: rank files 0-1 \(rank00000.jsonl, "
                                           r"rank00001.jsonl\)"):
        rp.replay_dir(tmp_path)
    report = rp.replay_dir(tmp_path, run_id="old")
    assert report.verdict == "healthy" and report.run_id == "old", format_report(report)
    assert [(r["rank"], r["records"]) for r in report.ranks] == [(0, len(old[0])), (1, len(old[1]))]


def test_world_mismatch_names_the_ranks_option(healthy):
    """A world given that the traces disagree with is worded with the option's name, --ranks (not its alias)."""
    report = rp.diagnose(healthy, world=2)
    (mismatch,) = [f for f in report.findings if f.kind == "world_mismatch"]
    assert mismatch.summary.startswith("--ranks 2 was given but the traces were written by a world of 4")
    assert "lie outside --ranks" in mismatch.summary


def test_docs_give_the_json_findings_cap():
    """docs/debugging-hangs.md says JSON `findings` keeps the first MAX_FINDINGS and `more_findings` the rest."""
    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "debugging-hangs.md").read_text().split())
    assert f"`findings` (the first {rp.MAX_FINDINGS} in order" in text and "`more_findings` counts" in text
    assert "`findings` (all of them" not in text


def test_the_healthy_summary_counts_ranks_not_files(tmp_path):
    """4 -> 2 -> 4 with each joiner in its own rank<N>.g2.jsonl: 6 files, 6 sessions, 4 ranks. The summary
    says "4 ranks (6 sessions)", not "4 rank files" (what it counts is rank numbers, not the files read)."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=4)   # 8 experts fit on 2 ranks
    job.run(15)
    job.scale(2)
    job.run(10)
    job.scale(4)
    job.run(10)
    for session in job.sessions:
        session.trace.flush()
        first = session.trace.records[0]
        name = trace_path(tmp_path, first["rank"], first["generation"] if first.get("role") == "joiner" else 0)
        name.write_text("".join(json.dumps(r) + "\n" for r in session.trace.records))
    assert len(list(tmp_path.glob("rank*.jsonl"))) == 6
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", report.summary
    assert report.summary.startswith("4 ranks (6 sessions) agree across 2 scale(s), world 4 -> 2 -> 4: ")
    assert "rank files" not in report.summary
