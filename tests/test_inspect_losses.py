"""Replay on traces that lost records: a silence inside lost lines, the writer's ``write_errors``, a freeze's layer.

The losses happen for real: rank processes write with the real ``EventTrace`` and ``Liveness`` thread, and
their files are removed on disk (a middle rotated segment after the run, a live file while the rank writes).
The layer of a freeze is checked on a synthetic job's records with one rank's silence placed by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eplb_fsm
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose, replay_dir
from eplb_fsm.testing import SyntheticJob
from eplb_fsm.trace import read_trace

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the rank processes too

# one rank: real EventTrace (rotating at max_bytes) and Liveness (interval 1 s, alive every 0.5 s while moving);
# argv: folder rank steps max_bytes collective_every fill roll_first. It prints "ready" and waits for a line.
RANK = r'''
import sys, time
from eplb_fsm.liveness import Liveness
from eplb_fsm.trace import EventTrace
d, rank, steps, max_bytes, coll_every, fill, roll_first = sys.argv[1], *map(int, sys.argv[2:])
t = EventTrace(rank, 2, d, max_bytes=max_bytes, max_segments=10000)
t.set_context(state="collecting", step=0)
t.header({"a": 1}, run_id="lostlines0000001", mode="sync", group="ep")
while roll_first and t.rotations == 0:
    t.emit("balancedness", value=0.5, note="x" * 2000)   # fill the first segment: the live file starts after it
live = Liveness(t, 1.0, heartbeat_s=0.5).start_on(t)
print("ready", flush=True)
sys.stdin.readline()
for i in range(steps):
    t.set_context(step=i)
    t.count_step()
    if fill:
        t.emit("balancedness", value=0.5, note="x" * fill)
    if coll_every and i % coll_every == coll_every - 1:
        with t.collective("all_reduce", group="ep", shape=[4], dtype="float32"):
            pass
    time.sleep(0.01)
t.set_context(step=steps)
live.stop()
t.end("closed")
t.close()
'''


def first_last_ts(path: Path) -> tuple[float, float]:
    recs = read_trace(path, segments=False)[0]
    return recs[0]["ts"], recs[-1]["ts"]


def remove_middle_segments(folder: Path, rank: int, silence_s: float) -> tuple[float, float]:
    """Remove a run of rank ``rank``'s rotated segments from about 1 s into its trace until its kept records are
    over ``silence_s`` apart there; (last ts kept before, first ts kept after)."""
    segs = sorted(folder.glob(f"rank{rank:05d}.jsonl*"), key=lambda p: first_last_ts(p)[0])
    start = first_last_ts(segs[0])[0]
    i = next(i for i, p in enumerate(segs) if first_last_ts(p)[0] >= start + 1.0)
    before = first_last_ts(segs[i - 1])[1]
    j = i
    while j < len(segs) - 1 and first_last_ts(segs[j])[0] - before <= silence_s:
        segs[j].unlink()
        j += 1
    return before, first_last_ts(segs[j])[0]


def alive_between(folder: Path, rank: int, a: float, b: float) -> int:
    return sum(1 for r in read_trace(folder / f"rank{rank:05d}.jsonl")[0] if r["event"] == "alive" and a < r["ts"] < b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("coll_every", [0, 10])
def test_a_removed_middle_segment_is_lost_records_not_a_freeze(lossy_runs, coll_every):
    """Two healthy real ranks; rank 1's rotated segments of a 3 s stretch removed: lost_records on rank 1, never
    frozen (with collectives the gap is told once, by the collective it held; without, by the silence)."""
    folders, codes, _ = lossy_runs
    tmp_path = folders[f"segments{coll_every}"]
    assert codes[f"segments{coll_every}"] == [0, 0]
    assert replay_dir(tmp_path).verdict == "healthy"
    before, after = remove_middle_segments(tmp_path, 1, 3.0)
    assert after - before > 3.0 and alive_between(tmp_path, 0, before, after) >= 2   # a silence the others wrote in
    report = replay_dir(tmp_path)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("lost_records", [1]), text
    assert not any(f.kind == "frozen" for f in report.findings), text
    assert [f.kind for f in report.findings] == ["lost_records"], text   # one per gap
    assert "so this may be the gap, not the rank" in report.summary
    if not coll_every:
        assert report.summary.startswith("rank 1 wrote nothing readable for ")
        assert report.findings[0].details[0] == "read as it stands: frozen, culprit rank 1"


@pytest.mark.multiprocess
def test_a_live_file_deleted_and_reopened_is_lost_records_not_a_freeze(lossy_runs):
    """Rank 1's live file (all it wrote since its roll) deleted mid-run and reopened by its writer: the stretch it
    lost is lost_records with the write failure warned, not a freeze of rank 1."""
    folders, codes, rolled = lossy_runs
    tmp_path = folders["live_file"]
    live = tmp_path / "rank00001.jsonl"
    assert codes["live_file"] == [0, 0] and rolled   # rank 1 had rolled once when it started
    assert sorted(p.name for p in tmp_path.glob("rank00001.*")) == ["rank00001.jsonl", "rank00001.jsonl.1"]
    kept = read_trace(tmp_path / "rank00001.jsonl.1", segments=False)[0][-1]["ts"]
    reopened = read_trace(live, segments=False)[0]
    assert reopened[0]["event"] == "header" and reopened[0].get("continued") is True
    assert reopened[-1]["event"] == "end" and reopened[-1]["write_errors"] >= 1
    assert reopened[0]["ts"] - kept > 3.0 and alive_between(tmp_path, 0, kept, reopened[0]["ts"]) >= 2
    report = replay_dir(tmp_path)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("lost_records", [1]), text
    assert not any(f.kind == "frozen" for f in report.findings), text
    assert any(w.startswith("rank 1's writer reported ") and "records may be lost" in w for w in report.warnings)


WRITE_ERRORS = r'''
import sys, time
from eplb_fsm.trace import EventTrace
d, r = sys.argv[1], int(sys.argv[2])
t = EventTrace(r, 2, d)
t.set_context(state="collecting", step=0)
t.header({"w": 1}, run_id="writeerrors00001")
def steps(a, b):
    for i in range(a, b):
        t.set_context(step=i)
        t.count_step()
        with t.collective("all_reduce", group="ep", shape=[4], dtype="float32"):
            pass
steps(0, 10)
print("ready", flush=True)
sys.stdin.readline()
time.sleep(1.1)                      # past the writer's once-a-second look: the next record finds the file removed
steps(10, 20)
t.set_context(step=20)
t.end("closed")
t.close()
'''


# the real-process runs (rank -> (steps, max_bytes, collective_every, fill, roll_first)); each test reads one
RANK_RUNS = {
    "segments0": {0: (500, 1 << 26, 0, 0, 0), 1: (500, 16384, 0, 150, 0)},
    "segments10": {0: (500, 1 << 26, 10, 0, 0), 1: (500, 16384, 10, 150, 0)},
    "live_file": {0: (600, 1 << 26, 0, 0, 0), 1: (600, 1 << 14, 0, 0, 1)},   # rank 1 rolls once before it is ready
}


def spawn(folder: Path, script: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, str(folder), *argv], env=dict(os.environ, PYTHONPATH=ROOT),
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


@pytest.fixture(scope="module")
def lossy_runs(tmp_path_factory):
    """Every real-process run of this file, all at once (each mostly sleeps on its own clock, ~20% of a core): the
    folders and exit codes by scenario, and whether rank 1 of ``live_file`` had rolled when its live file went.
    ``write_errors``: rank 1's file removed once both wrote 10 steps; ``live_file``: rank 1's live file removed
    3.5 s into the steps (rank 1 writes into it meanwhile: all of it is lost with the file)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in (*RANK_RUNS, "write_errors")}
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for name, ranks in RANK_RUNS.items():
            procs[name] = [spawn(folders[name], RANK, [str(r), *map(str, a)]) for r, a in sorted(ranks.items())]
        procs["write_errors"] = [spawn(folders["write_errors"], WRITE_ERRORS, [str(r)]) for r in (0, 1)]
        for p in (p for ps in procs.values() for p in ps):
            assert p.stdout.readline() == "ready\n"
        (folders["write_errors"] / "rank00001.jsonl").unlink()
        for p in (p for ps in procs.values() for p in ps):
            p.stdin.write("go\n")
            p.stdin.flush()
        live = folders["live_file"] / "rank00001.jsonl"
        rolled = (folders["live_file"] / "rank00001.jsonl.1").exists() and live.exists()
        time.sleep(3.5)
        live.unlink()
        codes = {name: [p.wait(timeout=120) for p in ps] for name, ps in procs.items()}
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return folders, codes, rolled


@pytest.mark.multiprocess
def test_a_lost_file_whose_seq_shows_nothing_is_still_warned_by_write_errors(lossy_runs):
    """Rank 1's file (header and first 10 steps) removed mid-run: no seq gap is left to see, but its end record's
    write_errors is warned about (the verdict stays healthy: the job did nothing wrong the traces show)."""
    folders, codes, _ = lossy_runs
    tmp_path = folders["write_errors"]
    assert codes["write_errors"] == [0, 0]
    recs = read_trace(tmp_path / "rank00001.jsonl")[0]
    assert recs[0]["seq"] > 0 and recs[-1]["event"] == "end" and recs[-1]["write_errors"] == 1
    report = replay_dir(tmp_path)
    assert report.verdict == "healthy", format_report(report)
    assert "rank 1's writer reported 1 trace write failure(s) (`write_errors` on its alive/end records): records " \
           "may be lost" in report.warnings
    assert "writer reported" in format_report(report)


def test_the_largest_write_errors_of_a_session_is_warned(tmp_path):
    """alive records carry 1 then 3, the end 3 (a count that only grows): one warning, with 3, and the JSON's
    per-rank write_errors; none without."""
    job = SyntheticJob(world=2, num_layers=2, trace_dir=tmp_path, interval=5).run(12)
    job.close()
    records = job.records()
    for rank, recs in records.items():
        last = recs[-1]
        extra = [] if rank == 0 else [{"write_errors": 1}, {"write_errors": 3}]
        for n, fields in enumerate(extra):
            recs.append(dict(last, event="alive", seq=last["seq"] + 1 + n, interval_s=1.0, steps_seen=None,
                             waiting_on=None, **fields))
        recs.append(dict(recs[-1], event="end", seq=recs[-1]["seq"] + 1, how="closed",
                         **({"write_errors": 3} if rank else {})))
    report = diagnose(records)
    assert report.verdict == "healthy", format_report(report)
    assert [w for w in report.warnings if "writer reported" in w] == [
        "rank 1's writer reported 3 trace write failure(s) (`write_errors` on its alive/end records): records may "
        "be lost"]
    assert [r["write_errors"] for r in report.to_dict()["ranks"]] == [0, 3]   # the JSON's ranks carry it too


def test_a_freeze_names_the_layer_in_flight_when_it_began(tmp_path):
    """Rank 1 silent 6 s after layer 1's ready all-reduce, before its layer_done: frozen at layer 1 (the layer in
    flight as it froze), not layer 2 (the first collective it issued after the silence)."""
    job = SyntheticJob(world=2, num_layers=3, trace_dir=tmp_path, interval=5).run(12)
    job.close()
    records = job.records()
    one = records[1]
    at = next(i for i, r in enumerate(one) if r["event"] == "transition" and r["trigger"] == "layer_done"
              and r["layer"] == 1)
    for r in one[at:]:
        r["ts"] += 6.0                     # rank 1 wrote nothing for 6 s before it finished layer 1
    silence = (one[at - 1]["ts"], one[at]["ts"])
    zero = records[0]
    # rank 0 went on to layer 2's transfer and waited there for rank 1: alive once a second
    wait = next(i for i, r in enumerate(zero) if r["event"] == "collective_start" and r.get("layer") == 2)
    alive = [dict(zero[wait], event="alive", ts=zero[wait]["ts"] + k, interval_s=1.0, steps_seen=zero[wait]["step"],
                  waiting_on={"op": zero[wait]["op"], "group": zero[wait]["group"], "cseq": zero[wait]["cseq"]})
             for k in range(1, 6)]
    for r in zero[wait + 1:]:
        r["ts"] += 6.0
    zero[wait + 1:wait + 1] = alive
    for recs in records.values():
        recs.append(dict(recs[-1], event="end", how="closed"))
        for n, r in enumerate(recs):
            r["seq"] = n
    assert all(silence[0] < a["ts"] < silence[1] for a in alive)
    report = diagnose(records)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), text
    assert report.state == "transferring" and report.layer == 1, text
    assert ", layer 1 (SIGSTOP?)" in report.summary
