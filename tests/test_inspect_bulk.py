"""The bulk reader of repeating units (a step and an all-reduce every step) agrees with the record-by-record replay."""

from __future__ import annotations

import json

import pytest

from eplb_fsm.inspect import bulk
from eplb_fsm.inspect import summary as sm
from eplb_fsm.inspect.replay import replay_dir

T0 = 1_700_000_000.0
WORLD = 4
STEPS = 900


def rank_lines(rank: int, steps: int = STEPS, alive_every: int = 50, extra_at: int | None = None,
               shape_at: int | None = None) -> list[str]:
    """One rank's JSONL lines: header, then per step a step record and an all-reduce (start, end)."""
    recs, seq, cseq = [], 0, 0

    def emit(event: str, step: int, **fields) -> None:
        nonlocal seq
        rec = {"ts": round(T0 + step * 0.05 + seq * 1e-5, 6), "rank": rank, "world": WORLD, "event": event,
               "state": "collecting", "step": step, "seq": seq}
        rec.update(fields)
        recs.append(json.dumps(rec, separators=(",", ":")))
        seq += 1

    def reduce(step: int, shape: int = 32) -> None:
        nonlocal cseq
        info = {"op": "all_reduce", "group": "ep", "cseq": cseq, "shape": [shape], "dtype": "torch.float64",
                "parts": ["balancedness"], "sizes": [shape]}
        emit("collective_start", step, **info)
        emit("collective_end", step, duration_s=0.000123, **info)
        cseq += 1

    emit("header", 0, schema=1, run_id="r", mode="sync", config={"num_layers": 4})
    for step in range(steps):
        emit("step", step)
        reduce(step, 16 if step == shape_at else 32)
        if step == extra_at:
            reduce(step)
        if step % alive_every == alive_every - 1:
            emit("alive", step, interval_s=1.0, waiting_on=None, steps_seen=step)
    emit("end", steps - 1, how="closed")
    return recs


def text_of(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def comparable(s: sm.RankSummary) -> tuple:
    colls = {g: [(c, e.op, e.shape, e.parts, e.step, e.status) for c, e in idx.items()]
             for g, idx in s.collectives.items()}
    d = s.to_dict()
    d.pop("path")
    return d, colls, dict(s.events), s.warnings, s.disorder, s.transitions


def test_stretches_are_found_between_alive_records():
    """Stretches of (step, start, end) units are found, each starting on a step line after its template unit."""
    lines = rank_lines(0)
    found = bulk.periodic_stretches(text_of(lines), len(lines) + 1)
    assert found and all(p == 3 for _, _, p in found)
    assert all('"event":"step"' in lines[a] and '"event":"step"' in lines[a - 3] for a, _, _ in found)
    covered = sum(b - a for a, b, _ in found)
    assert covered > 0.8 * len(lines)


def test_bulk_summary_equals_record_by_record_replay():
    """summarize_text with bulk stretches gives the summary parsing every record gives."""
    lines = rank_lines(1)
    fast = sm.summarize_text(text_of(lines), 1)
    slow = sm.summarize_rank([json.loads(line) for line in lines], 1)
    assert fast.collectives["ep"].runs, "the bulk path was not taken"
    assert comparable(fast) == comparable(slow)


@pytest.mark.parametrize("change", ["extra", "shape"])
def test_bulk_stretch_with_a_changed_unit_equals_record_by_record(change):
    """A unit that differs (an extra all-reduce, another shape) ends the stretch; the replay still matches."""
    lines = rank_lines(2, extra_at=400 if change == "extra" else None, shape_at=400 if change == "shape" else None)
    fast = sm.summarize_text(text_of(lines), 2)
    slow = sm.summarize_rank([json.loads(line) for line in lines], 2)
    assert comparable(fast) == comparable(slow)


def test_extra_all_reduce_in_a_bulk_file_names_its_rank(tmp_path):
    """One rank's extra all-reduce in the middle of 900 steps: that rank is the culprit."""
    for r in range(WORLD):
        (tmp_path / f"rank{r:05d}.jsonl").write_text(text_of(rank_lines(r, extra_at=400 if r == 3 else None)))
    report = replay_dir(tmp_path)
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [3]


def test_changed_shape_in_a_bulk_file_names_its_rank(tmp_path):
    """One rank all-reduces another shape at one step: a collective mismatch at that step naming it."""
    for r in range(WORLD):
        (tmp_path / f"rank{r:05d}.jsonl").write_text(text_of(rank_lines(r, shape_at=612 if r == 1 else None)))
    report = replay_dir(tmp_path)
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [1] and report.step == 612
    assert report.collective["cseq"] == 612


def test_swapped_units_inside_a_stretch_are_out_of_order(tmp_path):
    """Two lines swapped in the middle of a stretch break it; the replay reports the disorder with its line."""
    for r in range(WORLD):
        lines = rank_lines(r)
        if r == 2:
            lines[700], lines[701] = lines[701], lines[700]
        (tmp_path / f"rank{r:05d}.jsonl").write_text(text_of(lines))
    report = replay_dir(tmp_path)
    found = [f for f in report.findings if f.kind == "out_of_order"]
    assert found and found[0].culprits == [2] and "rank00002.jsonl:70" in found[0].summary


def test_a_freeze_inside_a_stretch_is_kept_with_its_own_time_and_step(tmp_path):
    """A 10 s stop between two units of a stretch: the bulk read keeps that silence exactly as record by record does."""
    from eplb_fsm.trace import EventTrace

    now = [T0]
    trace = EventTrace(0, 1, tmp_path, clock=lambda: now[0], keep=True)
    trace.set_context(state="collecting", step=0)
    trace.header({"num_layers": 4}, run_id="r", mode="sync")
    for step in range(1000):
        now[0] += 10.0 if step == 700 else 0.05    # SIGSTOPped before step 700's records
        trace.set_context(step=step)
        trace.count_step()
        with trace.collective("all_reduce", "ep", [32], "torch.float64", parts=["balancedness"]):
            pass
    trace.end("closed")
    trace.close()
    text = trace.path.read_text()
    assert bulk.periodic_stretches(text, text.count("\n") + 1), "the bulk path must be taken"
    fast = sm.summarize_text(text, 0)
    slow = sm.summarize_rank(trace.records, 0)
    assert fast.silences == slow.silences and len(fast.silences) == 1
    a, b, step, state, layer = fast.silences[0]
    assert (round(b - a, 6), step, state, layer) == (10.0, 699, "collecting", None)
