"""Replay of elastic-EP traces: group swaps, joiner sessions, leaving ranks, renumbered ranks.

The traces come from ``SyntheticJob.scale`` (``eplb_fsm.testing.elastic``), which writes a scale
record for record as the controller does; interval 10, 2 layers, 8 experts. A job that scales
down to 2 ranks holds ``SPARE`` (4) slots a rank, so its 8 experts fit there as ``request_scale``
requires. Faults after a swap are ordinary ``Faults`` keyed by the ranks' new numbers.
"""

from __future__ import annotations

import json

import pytest

from eplb_fsm.inspect import replay as rp
from eplb_fsm.inspect.elastic import build_cast, group_base
from eplb_fsm.inspect.render import format_report
from eplb_fsm.testing import Faults, SyntheticJob, hang_faults, write_traces

SPARE = 4   # slots a rank: 8 experts fit on 2 ranks (the default 8 / world leaves none spare for a scale-down)


def down_up(faults: Faults | None = None, steps_after: int = 10, **kwargs) -> SyntheticJob:
    """4 ranks, scale-down to 2 at step 15, scale-up back to 4 at step 25 (joiners take ranks 2, 3)."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE, **kwargs)
    job.run(15)
    job.scale(2)
    job.run(10)
    job.scale(4)
    job.run(steps_after, faults)
    return job


@pytest.fixture(scope="module")
def healthy_down_up() -> dict[int, list[dict]]:
    return down_up().records()


def test_scale_down_then_up_replays_healthy(healthy_down_up):
    """4 -> 2 -> 4: healthy, no illegal transition, both scales listed as switched."""
    report = rp.diagnose(healthy_down_up)
    assert report.verdict == "healthy", report.summary
    assert report.illegal_transitions == [] and report.findings == [] and report.warnings == []
    assert [(s["generation"], s["kind"], s["from_ranks"], s["to_ranks"], s["outcome"]) for s in report.scales] == [
        (1, "scale_down", 4, 2, "switched"), (2, "scale_up", 2, 4, "switched")]
    assert "world 4 -> 2 -> 4" in report.summary and report.world == 4
    assert [(r["rank"], r["session"], r["role"]) for r in report.ranks] == [
        (0, 0, "member"), (1, 0, "member"), (2, 0, "member"), (2, 1, "joiner"), (3, 0, "member"), (3, 1, "joiner")]
    assert [r["left_step"] for r in report.ranks if r["rank"] >= 2] == [15, None, 15, None]


def test_uneven_sizes_with_a_joiner_that_leaves_again_replay_healthy():
    """2 -> 3 -> 2: the joiner's header has another world and num_redundant_experts, which is not a mismatch."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    job.scale(3)
    job.run(10)
    job.scale(2)
    job.run(8)
    records = job.records()
    joiner_header = records[2][0]
    assert (joiner_header["world"], joiner_header["config"]["num_redundant_experts"]) == (3, 4)
    report = rp.diagnose(records)
    assert report.verdict == "healthy", report.summary
    assert [s["outcome"] for s in report.scales] == ["switched", "switched"]
    assert "world 2 -> 3 -> 2" in report.summary


def test_files_with_two_sessions_replay_like_records(tmp_path, healthy_down_up):
    """Written to rank files (a leaving rank's session, then a joiner's), replay_dir agrees with diagnose."""
    write_traces(healthy_down_up, tmp_path)
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy" and len(report.ranks) == 6
    text = format_report(report)
    assert "traces: 4 of world 4 (6 sessions)" in text
    assert "generation 2 at step 25: scale_up 2 -> 4 ranks, switched" in text


def test_aborted_scale_up_is_healthy_with_the_abort_noted():
    """A joiner that never arrives: every old rank aborts with a fault, the old group serves on; healthy."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    assert job.scale(3, absent=True)["outcome"] == "aborted"
    job.run(15)
    report = rp.diagnose(job.records())
    assert report.verdict == "healthy", report.summary
    (scale,) = report.scales
    assert (scale["generation"], scale["outcome"], scale["to_ranks"]) == (1, "aborted", 3)
    assert "aborted" in report.summary and "did not answer the handover" in report.summary


def test_leaving_rank_that_dies_before_its_experts_are_out_is_named():
    """Leaving rank 3 stops before layer 1's transfer: hang naming rank 3, and why it matters."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2, die={3: 1})
    job.run(10)
    report = rp.diagnose(job.records())
    assert report.verdict == "hang" and report.culprit_ranks == [3], report.summary
    assert report.step == 12 and report.layer == 1 and report.collective["group"] == "ep"
    assert any("rank 3 was leaving in the scale to generation 1" in d for d in report.findings[0].details)
    # the other leaving rank ended failed with the broken group on purpose; the survivors salvaged
    assert {f.kind for f in report.findings} == {"hang"} and report.illegal_transitions == []
    assert report.scales[0]["outcome"] == "switched" and report.scales[0]["degraded"]
    for r in (0, 1):  # the survivors' salvage replays as the controller fires it: failed --salvaged--> scaling
        moves = [(t.trigger, t.source, t.dest) for t in rp.summarize_rank(job.records()[r], r).transitions]
        assert moves[moves.index(("fault", "transferring", "failed")) + 1:][:2] == [
            ("salvaged", "failed", "scaling"), ("switched", "scaling", "collecting")], moves


def test_hang_inside_the_new_group_after_a_scale_up_names_the_joiner():
    """Joiner rank 3 never reaches ep@2's load all-reduce at step 34: the culprit is it, among ep@2's members."""
    report = rp.diagnose(down_up(hang_faults(4, culprit=3, step=34), steps_after=20).records())
    assert report.verdict == "hang" and report.culprit_ranks == [3]
    assert report.findings[0].sessions == [[3, 1]]
    assert report.collective["group"] == "ep@2" and report.step == 34
    where = {(p["rank"], p["session"]): p["status"] for p in report.at_divergence}
    assert where == {(0, 0): "inside", (1, 0): "inside", (2, 1): "inside", (3, 1): "never_joined"}
    assert report.summary.startswith("rank 3 (joiner g2) never joined all_reduce (group ep@2")


def test_hang_inside_the_survivors_group_after_a_scale_down():
    """After 4 -> 2, rank 1 never reaches ep@1's all-reduce: culprit rank 1; the ranks that left are not members."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(15)
    job.scale(2)
    job.run(20, hang_faults(2, culprit=1, step=24))
    report = rp.diagnose(job.records())
    assert report.verdict == "hang" and report.culprit_ranks == [1] and report.collective["group"] == "ep@1"
    assert sorted(p["rank"] for p in report.at_divergence) == [0, 1]
    assert not any(f.kind == "rank_died" for f in report.findings)


def test_renumbered_ranks_match_by_group_and_cseq():
    """Mapping {0: -1, 1: 0, 2: 1}: healthy; a hang of ep@1's rank 0 names file rank 1 and says it was renumbered."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2, rank_mapping={0: -1, 1: 0, 2: 1})
    job.run(6)
    assert rp.diagnose(job.records()).verdict == "healthy"
    job.run(10, hang_faults(2, culprit=0, step=21))
    report = rp.diagnose(job.records())
    assert report.verdict == "hang" and report.culprit_ranks == [1] and report.collective["group"] == "ep@1"
    assert any("is rank 0 of ep@1" in d for d in report.findings[0].details)


def test_joiner_taking_the_file_of_a_rank_still_writing(tmp_path):
    """A renumbered rank keeps writing rank00002.jsonl while a joiner appends there too: both sessions replay."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, trace_dir=tmp_path, keep=False, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2, rank_mapping={0: -1, 1: 0, 2: 1})  # old rank 2 is now rank 1, still in rank00002.jsonl
    job.run(10)
    job.scale(3)                                      # the joiner takes rank 2: the same file
    job.run(10)
    job.close()
    headers = [json.loads(line) for line in (tmp_path / "rank00002.jsonl").read_text().splitlines()]
    assert [h.get("role") for h in headers if h["event"] == "header"] == [None, "joiner"]
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", report.summary
    assert [(r["rank"], r["session"], r["role"]) for r in report.ranks if r["rank"] == 2] == [
        (2, 0, "member"), (2, 1, "joiner")]


def test_a_joiner_with_a_different_setting_is_a_config_mismatch():
    """Fields a scale does not change must still agree: a joiner with another step_interval is named."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    job.config = dict(job.config, step_interval=99)
    job.scale(3)
    job.run(5)
    report = rp.diagnose(job.records())
    assert report.verdict == "config_mismatch" and report.findings[0].sessions == [[2, 0]]
    assert "step_interval=99 (others 10)" in report.summary
    assert "world" not in report.summary and "num_redundant_experts" not in report.summary


def scaled_up_records(to_ranks: int, before: int, after: int) -> dict[int, list[dict]]:
    """The records of a 2-rank job scaled up to ``to_ranks`` after ``before`` steps, then run ``after`` more."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(before)
    job.scale(to_ranks)
    job.run(after)
    return job.records()


def test_a_joiner_with_no_trace_is_a_missing_rank():
    """The old ranks switched to a group of 3 but rank 2 (the joiner) left no file: it is missing."""
    records = scaled_up_records(3, before=12, after=5)
    del records[2]
    report = rp.diagnose(records)
    assert report.verdict == "missing_ranks" and report.missing_ranks == [2]
    assert "joiner g1" in report.summary


def test_a_leaving_rank_that_stops_early_is_not_a_death(healthy_down_up):
    """A leaving rank's trace ends with its group_switch on purpose; without those last records it is rank_died."""
    assert not any(f.kind == "rank_died" for f in rp.diagnose(healthy_down_up).findings)
    recs = healthy_down_up[3]
    cut = next(i for i, rec in enumerate(recs) if rec.get("trigger") == "switched")
    joiner = next(i for i, rec in enumerate(recs) if rec.get("role") == "joiner")
    report = rp.diagnose({**healthy_down_up, 3: recs[:cut] + recs[joiner:]})
    died = [f for f in report.findings if f.kind == "rank_died"]
    assert died and died[0].sessions == [[3, 0]] and died[0].step == 15


def test_joiner_transitions_line_up_from_groups_ready(healthy_down_up):
    """A joiner's first transition is groups_ready of its generation; a joiner deciding differently is named."""
    records = {r: [dict(rec) for rec in recs] for r, recs in healthy_down_up.items()}
    joiner = records[2][next(i for i, rec in enumerate(records[2]) if rec.get("role") == "joiner"):]
    ready = next(rec for rec in joiner if rec.get("trigger") == "groups_ready")
    ready["generation"] = 7
    report = rp.diagnose(records)
    assert report.verdict == "decision_divergence" and report.findings[0].sessions == [[2, 1]]


def test_group_names_map_to_generations(healthy_down_up):
    """ep/ep_transfer(.n) are generation 0, ep@g/ep_transfer@g(.n) generation g; members follow the switches."""
    summaries = {r: rp.summarize_rank(recs, r) for r, recs in healthy_down_up.items()}
    cast = build_cast(summaries, None, [])
    assert group_base("ep_transfer@2.1") == "ep_transfer@2" and group_base("ep") == "ep"
    assert [cast.generation_of(g) for g in ("ep", "ep_transfer.3", "ep@1", "ep_transfer@2.1", "side")] == [
        0, 0, 1, 2, None]
    assert cast.members("ep") == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert cast.members("ep@1") == [(0, 0), (1, 0)]
    assert cast.members("ep_transfer@2") == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert cast.away((2, 0), "ep") and cast.away((0, 0), "ep") and not cast.away((0, 0), "ep@2")


def test_a_scale_up_aborted_in_prepare_after_its_joiner_wrote_its_header_misses_nobody():
    """A scale-up aborted in prepare after its joiner started: no old rank moved to g1, so g1 never formed and
    slots 0-1 of it are nobody's (every old rank's trace says it aborted there); the joiner is there alone."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    assert job.scale(3, absent=True)["outcome"] == "aborted"
    job.run(5)
    records = job.records()
    served = SyntheticJob(world=2, num_layers=2, interval=10)
    served.run(12)
    served.scale(3)
    header = served.records()[2][0]   # the joiner of g1 wrote its header; its transfer group never formed:
    end = {k: header[k] for k in ("ts", "rank", "world", "state", "step")}
    records[2] = [header, {**end, "event": "end", "seq": 1, "how": "exception",   # it ends its trace (joiner.py)
                           "error": "GroupBuildError: group 'eplb/g1/transfer0' (rank 2 of 3) was not complete "
                                    "within 3 s: DistStoreError: wait timeout after 3000ms"}]
    cast = build_cast({r: rp.summarize_rank(recs, r) for r, recs in records.items()}, None, [])
    assert cast.missing == {}
    assert cast.label((2, 0)) == "rank 2 (joiner g1)"
    report = rp.diagnose(records)
    assert report.verdict == "healthy", report.summary
    assert [s["outcome"] for s in report.scales] == ["aborted"]


def test_a_scale_up_that_switched_part_way_says_so():
    """`scaling` records with partial true: the scale note keeps partial, phase and layers; the text says why."""
    records = scaled_up_records(4, before=15, after=10)
    reason = "rearrangement cut short at layer 1 (TransferError: peer gone)"
    for recs in records.values():   # what elastic/records.py scaling_record writes for a partial switch
        for rec in recs:
            if rec["event"] == "scaling":
                rec.update(partial=True, phase="transfer", layers_committed=1, reason=reason)
    report = rp.diagnose(records)
    assert report.verdict == "healthy", report.summary
    (scale,) = report.to_dict()["scales"]
    assert (scale["outcome"], scale["partial"], scale["phase"], scale["layers_committed"]) == (
        "switched", True, "transfer", 1)
    assert f"scale_up 2 -> 4 ranks, switched (partial: {reason})" in format_report(report)
    assert f"(partial: {reason})" in report.summary


def test_a_clean_switch_is_not_partial(healthy_down_up):
    """A scale that switched whole says partial false and no phase."""
    assert [(s["partial"], s["phase"]) for s in rp.diagnose(healthy_down_up).scales] == [(False, None)] * 2


def test_an_implausible_world_is_ignored_with_a_warning(healthy_down_up):
    """--ranks or a header world of 10**20 is warned about and ignored; the replay lists the traced world."""
    records = {r: [dict(rec) for rec in recs] for r, recs in healthy_down_up.items()}
    records[1][0]["world"] = 10**20
    report = rp.diagnose(records, world=10**20)
    assert report.world == 4
    assert any("a world of 100000000000000000000 ranks is not a plausible job" in w for w in report.warnings)
    assert any("rank 1: world 100000000000000000000 is not a plausible job size" in w for w in report.warnings)


@pytest.mark.parametrize("generation", ["x", [1]])
def test_a_wrong_typed_scale_generation_is_an_unknown_one(healthy_down_up, generation):
    """A `scaling` record whose generation is a string or a list is listed under an unknown generation, no crash."""
    records = {r: [dict(rec) for rec in recs] for r, recs in healthy_down_up.items()}
    next(rec for rec in records[0] if rec["event"] == "scaling")["generation"] = generation
    report = rp.diagnose(records)
    assert [s["generation"] for s in report.scales] == [1, 2, None]
    assert "generation None" in format_report(report)


def test_a_joiner_in_a_file_of_its_own_is_a_later_session_of_its_rank(tmp_path):
    """2 -> 3 with mapping {0: 0, 1: 2}: old rank 1 goes on (as rank 2) writing rank00001.jsonl while the joiner
    that takes rank 1 writes rank00001.g1.jsonl; the replay reads both as sessions of rank 1, healthy."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    job.scale(3, rank_mapping={0: 0, 1: 2})
    job.run(8)
    first0, first1, joiner = job.sessions
    for trace, name in ((first0.trace, "rank00000.jsonl"), (first1.trace, "rank00001.jsonl"),
                        (joiner.trace, "rank00001.g1.jsonl")):
        trace.flush()
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in trace.records))
    report = rp.replay_dir(tmp_path)
    assert report.verdict == "healthy", report.summary
    assert report.findings == [] and "(3 sessions)" in report.summary
