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
