"""One session of a rank file re-driven record by record (``Walker``): last step, collectives read out of order."""

from __future__ import annotations

import json

from eplb_fsm.inspect.model import MachineOracle
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.inspect.walker import Walker
from eplb_fsm.testing import SyntheticJob


def walk(records: list[dict]) -> Walker:
    w = Walker(0, MachineOracle())
    for n, rec in enumerate(records, 1):
        w.line = n
        w.record(rec)
    return w


def base(event: str, seq: int, step: int, **fields) -> dict:
    return {"ts": 1.0 + seq / 100, "rank": 0, "world": 2, "event": event, "state": "collecting", "step": step,
            "seq": seq, **fields}


def records(n_steps: int) -> list[dict]:
    out = [base("header", 0, 0, schema=1, config={"num_layers": 2})]
    out += [base("step", s + 1, s) for s in range(n_steps)]
    return out


def test_a_last_record_with_a_damaged_step_keeps_the_step_before_it():
    """A last record's step of the wrong type is ignored: the rank's last step is the one before, not unknown."""
    recs = records(21)
    recs[-1]["step"] = "x"
    s = walk(recs).result(recs[-1])
    assert s.last_step == 19
    assert any("field 'step' is str 'x'" in w for w in s.warnings)
    runs = records(6)
    runs.append(base("steps", 7, 6, count=5))           # steps 6-10
    runs.append(base("alive", 8, "x", interval_s=1.0))
    assert walk(runs).result(runs[-1]).last_step == 10


def test_a_rearrangement_summary_stands_at_its_end_step_not_its_due_step():
    """An async summary (due at step 6, ended at 15) as the last record: the rank stands at 15, and so does a silence
    after it (a red team's frozen and killed ranks read "at step 6")."""
    recs = records(16)
    recs.append(base("rearrangement", 17, 6, end_step=15, outcome="committed", index=1))
    s = walk(recs).result(recs[-1])
    assert s.last_step == 15
    alive = base("alive", 18, 15, interval_s=1.0)
    alive["ts"] = recs[-1]["ts"] + 5.0
    s = walk(recs + [alive]).result(alive)
    assert [(silence[2], silence[3]) for silence in s.silences] == [(15, "collecting")]
    damaged = dict(recs[-1], end_step="x")   # an unusable end step: its own step is all there is
    assert walk(recs[:-1] + [damaged]).result(damaged).last_step == 6


def test_a_rank_that_died_with_a_damaged_last_step_is_still_found(tmp_path):
    """Rank 1 stops at step 20 with "step": "x" on its last line while rank 0 goes on: rank_died, not healthy."""
    job = SyntheticJob(world=2, trace_dir=str(tmp_path), keep=False)
    job.run(30)
    job.close()
    for r in (0, 1):
        path = tmp_path / f"rank{r:05d}.jsonl"
        lines = [line for line in path.read_text().splitlines() if '"event":"end"' not in line]   # killed
        if r == 1:
            cut = max(i for i, line in enumerate(lines) if '"event":"step"' in line and '"step":20,' in line)
            lines = lines[:cut + 1]
            rec = json.loads(lines[-1])
            rec["step"] = "x"
            lines[-1] = json.dumps(rec, separators=(",", ":"))
        path.write_text("\n".join(lines) + "\n")
    report = replay_dir(tmp_path)
    assert report.verdict == "rank_died" and report.culprit_ranks == [1]
    assert [r["last_step"] for r in report.ranks] == [29, 19]


def test_an_end_read_before_its_start_ends_that_collective():
    """collective_end and its collective_start swapped in the file: the collective ended, no warning, no hang."""
    recs = records(2)
    start = base("collective_start", 3, 2, op="all_reduce", group="ep", cseq=0, shape=[4])
    end = base("collective_end", 4, 2, op="all_reduce", group="ep", cseq=0, duration_s=0.5)
    recs += [end, start, base("alive", 5, 2, interval_s=1.0)]
    s = walk(recs).result(recs[-1])
    entry = s.collectives["ep"][0]
    assert (entry.status, entry.duration_s) == ("ended", 0.5)
    assert not any("without a start" in w for w in s.warnings)
    assert [d["seq"] for d in s.disorder] == [3]


def test_an_end_whose_start_never_comes_is_still_warned_about():
    """A collective_end of a collective that never started is a warning, given at the end of the session."""
    recs = records(2) + [base("collective_end", 3, 2, op="all_reduce", group="ep", cseq=7)]
    s = walk(recs).result(recs[-1])
    assert any("collective_end for ep#7 without a start (seq 3)" in w for w in s.warnings)
    assert "ep" not in s.collectives


def both_paths(recs: list[dict]):
    """The summary of ``recs`` read in memory (``summarize_rank``) and as a file's text (``summarize_text``)."""
    from eplb_fsm.inspect.summary import summarize_rank, summarize_text

    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
    return summarize_rank(recs, 0, path="rank00000.jsonl"), summarize_text(text, 0, path="rank00000.jsonl")


def test_a_copied_collective_start_does_not_reopen_it():
    """A start line copied after its end: a warning and disorder, the collective stays ended (no hang)."""
    recs = records(2)
    start = base("collective_start", 3, 2, op="all_reduce", group="ep", cseq=0, shape=[4])
    recs += [start, base("collective_end", 4, 2, op="all_reduce", group="ep", cseq=0, duration_s=0.5),
             base("alive", 5, 2, interval_s=1.0), dict(start), base("alive", 6, 2, interval_s=1.0)]
    s = walk(recs).result(recs[-1])
    assert s.collectives["ep"][0].status == "ended"
    assert any("ep#0 started twice" in w for w in s.warnings)
    assert [d["seq"] for d in s.disorder] == [3] and not s.gaps


def test_two_swapped_step_lines_are_out_of_order_in_memory_and_in_a_file():
    """Steps with seqs 6 and 7 swapped: both reading paths report disorder at the second of them, file line 8."""
    recs = records(12) + [base("alive", 13, 12, interval_s=1.0)]
    recs[6], recs[7] = recs[7], recs[6]
    for s in both_paths(recs):
        assert [(d["seq"], d["line"]) for d in s.disorder] == [(6, 8)], s.disorder
        assert not s.gaps and not s.illegal


def test_a_copied_step_line_is_out_of_order_at_its_own_line_in_both_paths():
    """The step line with seq 3 copied after seq 8 (file line 10): disorder there, nothing lost, in memory and
    in a file."""
    recs = records(12) + [base("alive", 13, 12, interval_s=1.0)]
    recs.insert(9, dict(recs[3]))
    for s in both_paths(recs):
        assert [(d["seq"], d["expected"], d["line"]) for d in s.disorder] == [(3, 9, 10)], s.disorder
        assert not s.gaps and not s.illegal


def test_lost_step_lines_are_told_by_their_own_seqs():
    """Step lines seq 5-8 lost, step lines after them: the gap is seq 5..8 between steps 3 and 8, both paths."""
    recs = [r for r in records(20) if not 5 <= r["seq"] <= 8] + [base("alive", 21, 20, interval_s=1.0)]
    for s in both_paths(recs):
        assert [(g["first"], g["last"], g["lost"], g["from_step"], g["to_step"]) for g in s.gaps] == [
            (5, 8, 4, 3, 8)], s.gaps
        assert any("4 record(s) missing by seq (lost lines), the first between seq 4 and seq 9" in w
                   for w in s.warnings), s.warnings


def test_one_wrongly_stamped_step_record_is_one_illegal_transition():
    """A step stamped 'planning' amid collecting steps: one illegal entry, the next step (rightly stamped) is fine."""
    recs = records(12)
    recs[6] = dict(recs[6], state="planning")
    for s in both_paths(recs):
        assert [(i["seq"], i["reason"]) for i in s.illegal] == [
            (6, "step record stamped 'planning' but the replayed state is 'collecting'")]
        assert s.final_state == "collecting"


def test_a_continued_header_after_lost_lines_says_where_the_machine_is():
    """Lines lost mid-transfer, then a rotated segment's header: the walk takes its `machine` layer, nothing illegal."""
    job = SyntheticJob(world=1)
    job.run(12)
    job.close()
    recs = job.records()[0]
    first = next(i for i, r in enumerate(recs) if r.get("trigger") == "layer_done")
    last = max(i for i, r in enumerate(recs) if r.get("trigger") == "layer_done")
    done = recs[last]
    assert done["layer"] > recs[first]["layer"]
    header = dict(recs[0], continued=True, segment=1, seq=done["seq"] - 1, step=done["step"], state=done["source"],
                  machine={"state": done["source"], "layer": done["layer"], "scale_pending": False})
    for s in both_paths(recs[:first] + [header] + recs[last:]):
        assert s.illegal == [] and [(g["first"], g["last"]) for g in s.gaps] == [(recs[first]["seq"], done["seq"] - 2)]
