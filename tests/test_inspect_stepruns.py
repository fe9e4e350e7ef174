"""Runs of compact step lines checked in bulk (shapes and seqs from StepLines) read as the record-by-record replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb_fsm.inspect import stepruns
from eplb_fsm.inspect import summary as sm
from eplb_fsm.testing import SyntheticJob
from eplb_fsm.trace import trace_path

STEPS = 1500


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> list[str]:
    """A compact trace long enough for StepLines (over summary.MIN_KNOWN_LINES lines)."""
    folder = tmp_path_factory.mktemp("steps")
    job = SyntheticJob(world=2, num_layers=2, interval=100, trace_dir=folder, ranks=[0], keep=False)
    job.run(STEPS)
    job.close()
    out = Path(trace_path(folder, 0)).read_text(encoding="utf-8").rstrip("\n").split("\n")
    assert len(out) >= sm.MIN_KNOWN_LINES
    return out


@pytest.fixture
def follows(monkeypatch) -> list[bool]:
    """What each StepLines.follow call answered."""
    seen: list[bool] = []
    real = stepruns.StepLines.follow

    def spy(self, *args):
        out = real(self, *args)
        seen.append(out)
        return out

    monkeypatch.setattr(stepruns.StepLines, "follow", spy)
    return seen


def comparable(s: sm.RankSummary) -> tuple:
    d = s.to_dict()
    d.pop("path")
    return d, dict(s.events), s.warnings, s.disorder, s.transitions, s.silences, s.illegal, s.bad_lines


def both(lines: list[str]) -> tuple[sm.RankSummary, sm.RankSummary]:
    fast = sm.summarize_text("\n".join(lines) + "\n", 0)
    good = [json.loads(line) for line in lines if _readable(line)]
    slow = sm.summarize_rank(good, 0, bad_lines=len(lines) - len(good))
    return fast, slow


def _readable(line: str) -> bool:
    try:
        return type(json.loads(line)) is dict
    except ValueError:
        return False


def step_line_at(lines: list[str], n: int) -> int:
    """Index of the n-th step line after the first rearrangement (inside a long run)."""
    first_block = next(i for i, line in enumerate(lines) if '"trigger":"plan_ready"' in line)
    steps = [i for i in range(first_block, len(lines)) if '"event":"step"' in lines[i]]
    return steps[n]


def test_shapes_and_seqs_of_lines():
    """StepLines cuts digit runs to one 0 and reads the number before each line's last byte."""
    text = ('{"ts":12.5,"rank":3,"world":4,"event":"step","state":"collecting","step":70,"seq":123}\n'
            '{"a":1}\nno number here\n{"ts":1.0,"seq":9}')
    known = stepruns.StepLines(text)
    assert known.tail.tolist() == [123, 1, 0, 9]
    assert known.shape.split(b"\n")[0] == known.step_shape("collecting")
    assert known.follow(0, 1, "collecting", 123) and not known.follow(0, 1, "collecting", 124)
    assert not known.follow(0, 1, "planning", None)


def test_step_lines_of_a_file_but_its_other_lines_answer_as_over_the_whole_file(lines):
    """StepLines.of_lines (the other records left out) answers follow() for every span of file lines as
    StepLines over the whole text does, in file line numbers; a span holding a left-out line never follows."""
    other = [i for i, line in enumerate(lines) if '"event":"step"' not in line]
    whole = stepruns.StepLines("\n".join(lines))
    part = stepruns.StepLines.of_lines(lines, other)
    runs, a = [], 0
    for b in other + [len(lines)]:
        if b > a:
            runs.append((a, b))
        a = b + 1
    assert len(runs) > 5
    for a, b in runs:
        for start, end in ((a, b), (a + 1, b), (a, b - 1), (a + 2, a + 3)):
            if start < end:
                for first in (None, whole.tail[start].item(), whole.tail[start].item() + 1):
                    assert part.follow(start, end, "collecting", first) == whole.follow(start, end, "collecting", first)
    assert any(part.follow(a, b, "collecting", None) for a, b in runs)
    a, b = runs[1]
    assert not part.follow(a, b + 2, "collecting", None), "a span across a left-out line"


def test_clean_runs_pass_by_shape(lines, follows):
    """On a clean long file every step run passes the StepLines check; the summary is the slow path's."""
    fast, slow = both(lines)
    assert comparable(fast) == comparable(slow)
    assert follows and all(follows)


def swap(lines, i):
    lines[i], lines[i + 1] = lines[i + 1], lines[i]


def drop(lines, i):
    del lines[i]


def dummy(lines, i):
    lines[i] = lines[i][:-1] + ',"dummy":true}'


def negative_step(lines, i):
    rec = json.loads(lines[i])
    lines[i] = lines[i].replace(f'"step":{rec["step"]},', '"step":-1,')


def carriage_return(lines, i):
    lines[i] += "\r"


def other_state(lines, i):
    lines[i] = lines[i].replace('"state":"collecting"', '"state":"planning"')


def broken(lines, i):
    lines[i] = lines[i][:-1]


def float_seq(lines, i):
    rec = json.loads(lines[i])
    lines[i] = lines[i].replace(f'"seq":{rec["seq"]}}}', f'"seq":{rec["seq"]}.0}}')


@pytest.mark.parametrize("change", [drop, dummy, negative_step, carriage_return, other_state, broken, float_seq])
def test_a_changed_step_line_reads_as_before(lines, follows, monkeypatch, change):
    """One step line changed (loss, flag, sign, blank, state, syntax, type): the run holding it does not pass
    by shape, and the summary is the one the regex path alone gives."""
    changed = list(lines)
    change(changed, step_line_at(changed, 30))
    text = "\n".join(changed) + "\n"
    fast = sm.summarize_text(text, 0)
    assert not all(follows)
    monkeypatch.setattr(sm, "MIN_KNOWN_LINES", 10 ** 9)   # StepLines off: the regex path of before
    assert comparable(sm.summarize_text(text, 0)) == comparable(fast)


def test_swapped_step_lines_are_out_of_order(lines, monkeypatch):
    """Two step lines written in the wrong order: a disorder entry with its file line, as with the regex alone."""
    changed = list(lines)
    i = step_line_at(changed, 30)
    swap(changed, i)
    text = "\n".join(changed) + "\n"
    fast = sm.summarize_text(text, 0)
    assert fast.disorder and fast.disorder[0]["line"] == i + 2
    monkeypatch.setattr(sm, "MIN_KNOWN_LINES", 10 ** 9)   # StepLines off: the regex path of before
    assert comparable(sm.summarize_text(text, 0)) == comparable(fast)


def test_a_silence_inside_a_step_run_is_kept_where_it_was(lines):
    """Ten seconds between two step lines of a run: one silence, from the line before to the line after."""
    changed = list(lines)
    i = step_line_at(changed, 30)
    for j in range(i + 1, len(changed)):
        rec = json.loads(changed[j])
        rec["ts"] = round(rec["ts"] + 10.0, 6)
        changed[j] = json.dumps(rec, separators=(",", ":"))
    fast, slow = both(changed)
    assert comparable(fast) == comparable(slow)
    before, after = json.loads(changed[i]), json.loads(changed[i + 1])
    assert fast.silences == [(before["ts"], after["ts"], before["step"], before["state"], None)]


def _late_after_steps() -> list[dict]:
    """Rank 0 of a healthy job with its seqs 4..7 made liveness records, 4..6 lost and 6 written late after two
    step lines (file order 0, 1, 2, 3, 7, 8, 9, 6, 10, ...)."""
    job = SyntheticJob(world=1)
    job.run(30)
    recs = job.records()[0]
    for r in recs:
        if r["event"] == "step" and 4 <= r["seq"] <= 7:
            r.update(event="alive", interval_s=1.0, steps_seen=r["step"] - 1, waiting_on=None)
    by_seq = {r["seq"]: r for r in recs}
    order = [r["seq"] for r in recs if r["seq"] not in (4, 5, 6)]
    order.insert(order.index(10), 6)
    return [by_seq[s] for s in order]


@pytest.mark.parametrize("known_lines", [None, 0])
def test_a_late_line_after_a_step_run_past_a_jump_reads_as_in_memory(tmp_path, monkeypatch, known_lines):
    """A late line after step lines that follow a seq jump: the file and in-memory replays agree (gaps, findings)."""
    from eplb_fsm.inspect import diagnose, replay_dir

    if known_lines is not None:
        monkeypatch.setattr(sm, "MIN_KNOWN_LINES", known_lines)   # StepLines on even for this short file
    recs = _late_after_steps()
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
    fast, slow = sm.summarize_text(text, 0), sm.summarize_rank(recs, 0)
    assert fast.warnings == slow.warnings
    assert [(g["first"], g["last"], g["lost"]) for g in fast.gaps] == [(4, 5, 2)]
    assert [(g["first"], g["last"], g["lost"]) for g in slow.gaps] == [(4, 5, 2)]
    assert [(d["seq"], d["expected"]) for d in fast.disorder] == [(6, 10)]
    Path(trace_path(tmp_path, 0)).write_text(text, encoding="utf-8")
    on_disk, in_memory = replay_dir(tmp_path), diagnose({0: recs})
    assert on_disk.warnings == in_memory.warnings
    assert [(f.kind, f.culprits) for f in on_disk.findings] == [(f.kind, f.culprits) for f in in_memory.findings]
