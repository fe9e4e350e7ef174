"""Tests for eplb_fsm.trace."""

import json
import time

import pytest

from eplb_fsm.trace import BASE_FIELDS, COLLECTIVE_FIELDS, EventTrace, read_trace, trace_path


def _ticks():
    t = [100.0]

    def clock():
        t[0] += 1.0
        return t[0]

    return clock


def test_every_record_has_the_base_fields_and_counts_seq(tmp_path):
    """Each line is JSON with ts, rank, world, event, state, step, seq, and seq counts up per rank."""
    with EventTrace(rank=2, world=4, trace_dir=tmp_path, clock=_ticks()) as trace:
        trace.set_context(state="collecting", step=7)
        trace.emit("step")
        trace.emit("balancedness", value=0.5)
    records, bad = read_trace(trace_path(tmp_path, 2))
    assert bad == 0 and [r["seq"] for r in records] == [0, 1]
    for r in records:
        assert set(BASE_FIELDS) <= set(r)
        assert (r["rank"], r["world"], r["state"], r["step"]) == (2, 4, "collecting", 7)
    assert records[1]["value"] == 0.5 and records[0]["ts"] == 101.0


def test_lines_are_on_disk_before_close(tmp_path):
    """Records are flushed per line, so a rank that dies mid-run leaves them readable."""
    trace = EventTrace(rank=0, world=1, trace_dir=tmp_path)
    trace.emit("transition", trigger="step")
    text = trace_path(tmp_path, 0).read_text()
    assert json.loads(text.splitlines()[0])["trigger"] == "step"
    trace.close()


def test_collective_pairs_and_per_group_counters():
    """A collective writes start/end with op, group, shape, dtype, and cseq counts per group."""
    trace = EventTrace(keep=True)
    with trace.collective("all_reduce", shape=(3, 4), dtype="torch.int64", layer=1):
        pass
    with trace.collective("batch_isend_irecv", group="transfer"):
        pass
    with trace.collective("all_reduce"):
        pass
    kinds = [(r["event"], r["group"], r["cseq"]) for r in trace.records]
    assert kinds == [
        ("collective_start", "world", 0), ("collective_end", "world", 0),
        ("collective_start", "transfer", 0), ("collective_end", "transfer", 0),
        ("collective_start", "world", 1), ("collective_end", "world", 1),
    ]
    first = trace.records[0]
    assert set(COLLECTIVE_FIELDS) <= set(first)
    assert first["shape"] == [3, 4] and first["dtype"] == "torch.int64" and first["layer"] == 1
    assert trace.last_collective["group"] == "world" and trace.last_collective["cseq"] == 1


def test_collective_error_is_recorded_and_reraised():
    """An exception inside a collective writes collective_error and propagates."""
    trace = EventTrace(keep=True)
    with pytest.raises(TimeoutError):
        with trace.collective("all_reduce"):
            raise TimeoutError("peer 3 silent")
    assert [r["event"] for r in trace.records] == ["collective_start", "collective_error"]
    assert "peer 3 silent" in trace.records[1]["error"]


def test_transition_updates_state_context():
    """A transition record carries trigger/source/dest and later records carry the new state."""
    trace = EventTrace(keep=True)
    trace.set_context(state="collecting")
    trace.transition("step", "collecting", "planning", layer=0, due=True)
    trace.emit("plan_skipped")
    assert trace.records[0]["dest"] == "planning" and trace.records[0]["due"] is True
    assert trace.records[1]["state"] == "planning"


def test_header_names_versions_and_config(tmp_path):
    """The header carries the schema, library versions and the config."""
    trace = EventTrace(keep=True)
    header = trace.header({"window_size": 3})
    assert header["event"] == "header" and header["config"] == {"window_size": 3}
    assert {"torch", "numpy", "transitions", "structlog", "eplb_fsm"} <= set(header["versions"])


def test_no_trace_dir_writes_nothing_but_counts(tmp_path):
    """Without a trace_dir nothing is written, yet seq and cseq still advance."""
    trace = EventTrace()
    trace.emit("x")
    with trace.collective("barrier"):
        pass
    assert trace.seq == 3 and trace.cseq == {"world": 1} and trace.path is None
    assert list(tmp_path.iterdir()) == []


def test_a_trace_dir_that_is_a_file_is_refused_by_name(tmp_path):
    """trace_dir naming a file (or a path under one) is a ValueError naming trace_dir, not an OS error."""
    taken = tmp_path / "taken"
    taken.write_text("")
    for bad in (taken, taken / "below"):
        with pytest.raises(ValueError, match="trace_dir: .* is not a folder"):
            EventTrace(0, 1, str(bad))


@pytest.mark.parametrize("trace_dir, keep, message", [
    (5, False, "trace_dir must be a folder path .* got int 5"),
    (b"logs", False, "trace_dir must be a folder path .* got bytes"),
    ("/proc/eplb-fsm-no-such/logs", False, "trace_dir: cannot make the folder /proc/eplb-fsm-no-such/logs: "),
    (None, "no", "keep \\(keep_trace\\) must be a bool, got str 'no'"),
    (None, 1, "keep \\(keep_trace\\) must be a bool"),
])
def test_a_bad_trace_dir_or_keep_flag_is_refused_by_name(trace_dir, keep, message):
    """A trace_dir that is no path or cannot be made, a keep flag that is no bool: a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        EventTrace(0, 1, trace_dir, keep=keep)


def test_read_trace_skips_truncated_line(tmp_path):
    """A truncated last line (a killed rank) is counted as bad, the rest is read."""
    path = tmp_path / "rank00000.jsonl"
    path.write_text('{"event": "a", "seq": 0}\n{"event": "b", "se')
    records, bad = read_trace(path)
    assert [r["event"] for r in records] == ["a"] and bad == 1


def test_read_trace_counts_lines_with_bytes_that_are_not_utf8(tmp_path):
    """Damaged bytes (not UTF-8) make a line bad, even inside a string that still parses; the rest is read."""
    path = tmp_path / "rank00000.jsonl"
    path.write_bytes(b'{"event": "a", "seq": 0}\n\xff\xfe\n{"event": "b\xc3", "seq": 1}\n{"event": "c", "seq": 2}\n')
    records, bad = read_trace(path)
    assert [r["event"] for r in records] == ["a", "c"] and bad == 2


def test_read_trace_counts_lines_that_are_no_json_object_as_bad(tmp_path):
    """A list, a string, a number, null and a line nested past json's depth limit are bad lines, not records."""
    path = tmp_path / "rank00000.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text("\n".join(['{"event": "a", "seq": 0}', "[1, 2]", '"str"', "42", "null", deep,
                               '{"event": "b", "seq": 1}']) + "\n")
    records, bad = read_trace(path)
    assert [r["event"] for r in records] == ["a", "b"] and bad == 5


def test_numpy_and_torch_values_serialise(tmp_path):
    """numpy and torch scalars/arrays in fields are written as plain JSON."""
    import numpy as np
    import torch

    with EventTrace(trace_dir=tmp_path) as trace:
        trace.emit("x", a=np.int64(3), b=torch.tensor([1, 2]), c=(4, 5))
    (record,), _ = read_trace(trace_path(tmp_path, 0))
    assert (record["a"], record["b"], record["c"]) == (3, [1, 2], [4, 5])


# -- issue 12: how a trace ends, liveness records, header identity ---------------------------------


def test_end_is_written_once_and_nothing_follows_it(tmp_path):
    """`end` is the last line of the file: a second end and later records are not written."""
    trace = EventTrace(rank=0, world=2, trace_dir=tmp_path)
    trace.emit("step")
    first = trace.end("exception", error="KeyError: 'x'")
    assert first["how"] == "exception" and first["error"] == "KeyError: 'x'"
    assert trace.end("closed") is None
    trace.emit("step")
    trace.close()
    records, _ = read_trace(trace_path(tmp_path, 0))
    assert [r["event"] for r in records] == ["step", "end"]
    assert records[-1]["how"] == "exception" and records[-1]["seq"] == 1


@pytest.mark.parametrize("how,kwargs,needle", [
    ("gone", {}, "how must be one of"),
    ("exception", {}, "needs error"),
    ("signal", {}, "needs signal"),
    ("closed", {"signal": "SIGTERM"}, "signal is only given"),
    ("closed", {"error": "E: x"}, "error is only given"),
    ("closed", {"sender": {"pid": 1, "parent": True}}, "sender is"),
    ("signal", {"signal": "SIGTERM", "sender": {"pid": "1", "parent": True}}, "sender is"),
    ("signal", {"signal": "SIGTERM", "sender": {"pid": 1, "parent": 1}}, "sender is"),
])
def test_end_fields_refuse_a_bad_combination(how, kwargs, needle):
    """A bad `end` names the field and the rule, and writes nothing."""
    from eplb_fsm.trace import end_fields

    with pytest.raises(ValueError, match=needle):
        end_fields(how, **kwargs)


def test_end_signal_record_names_the_signal(tmp_path):
    """how=signal carries the signal's name and no error."""
    with EventTrace(rank=1, world=2, trace_dir=tmp_path) as trace:
        rec = trace.end("signal", signal="SIGTERM")
    assert rec["signal"] == "SIGTERM" and "error" not in rec and "sender" not in rec


def test_end_signal_record_carries_its_sender_when_known(tmp_path):
    """how=signal with a sender: the record holds its pid and whether it is the process's parent, nothing more."""
    with EventTrace(rank=1, world=2, trace_dir=tmp_path) as trace:
        rec = trace.end("signal", signal="SIGTERM", sender={"pid": 77, "parent": False, "extra": 1})
    assert rec["sender"] == {"pid": 77, "parent": False}


def test_alive_reports_the_open_collective_and_the_previous_step():
    """An alive record inside a collective names it; after the collective ends waiting_on is null."""
    trace = EventTrace(rank=0, world=2, keep=True)
    trace.set_context(state="collecting", step=5)
    with trace.collective("all_reduce", group="ep"):
        inside = trace.alive(0.5, steps_seen=3)
    after = trace.alive(0.5, steps_seen=5)
    assert inside["waiting_on"] == {"op": "all_reduce", "group": "ep", "cseq": 0}
    assert (inside["step"], inside["steps_seen"], inside["interval_s"]) == (5, 3, 0.5)
    assert after["waiting_on"] is None


def test_collective_error_clears_the_open_collective():
    """A collective that raises is no longer what the rank waits on."""
    trace = EventTrace(keep=True)
    with pytest.raises(TimeoutError):
        with trace.collective("barrier", group="x"):
            raise TimeoutError("late")
    assert trace.waiting_on() is None


def test_an_open_collective_spans_other_records_until_it_is_closed():
    """open_collective/close_collective: the start, then other records, then the end with the start's fields."""
    trace = EventTrace(rank=0, world=2, keep=True)
    trace.set_context(state="transferring", step=9)
    opened = trace.open_collective("all_reduce", group="ep", shape=(3,), dtype="torch.float64", posted=True)
    trace.set_context(step=10)
    trace.emit("transition", trigger="layer_done")
    mid = trace.alive(0.5, steps_seen=10)
    trace.close_collective(opened)
    start, _, _, end = trace.records
    assert mid["waiting_on"] == {"op": "all_reduce", "group": "ep", "cseq": 0}
    assert (start["event"], start["step"], start["posted"]) == ("collective_start", 9, True)
    assert (end["event"], end["step"], end["cseq"], end["posted"]) == ("collective_end", 10, 0, True)
    assert end["duration_s"] >= 0 and trace.waiting_on() is None


def test_closing_an_open_collective_with_an_error_writes_collective_error():
    """close_collective(error) writes collective_error naming the error, and the rank waits on nothing."""
    trace = EventTrace(keep=True)
    opened = trace.open_collective("all_reduce", group="ep")
    trace.close_collective(opened, TimeoutError("peer 1 silent"))
    assert [r["event"] for r in trace.records] == ["collective_start", "collective_error"]
    assert "peer 1 silent" in trace.records[1]["error"] and trace.waiting_on() is None


def test_header_carries_run_id_and_config_hash(tmp_path):
    """The header has run_id and the config's 16-hex hash, equal for equal configs, different otherwise."""
    from eplb_fsm.trace import config_hash

    with EventTrace(rank=0, world=1, trace_dir=tmp_path) as trace:
        rec = trace.header({"b": 2, "a": 1}, run_id="0123456789abcdef")
    assert rec["run_id"] == "0123456789abcdef"
    assert rec["config_hash"] == config_hash({"a": 1, "b": 2}) != config_hash({"a": 1, "b": 3})
    assert len(rec["config_hash"]) == 16 and int(rec["config_hash"], 16) >= 0


def test_end_open_traces_ends_every_open_file_once(tmp_path):
    """A signal handler's ending: every open trace gets `end how=signal`; closed or ended ones are skipped."""
    import gc

    from eplb_fsm.trace import end_open_traces

    gc.collect()   # traces of earlier tests that are garbage but not yet collected are not open ones
    a, b, c = (EventTrace(rank=r, world=3, trace_dir=tmp_path) for r in range(3))
    b.end("closed")
    c.close()
    assert end_open_traces("signal", signal="SIGTERM") == 1
    assert end_open_traces("signal", signal="SIGTERM") == 0
    a.close()
    b.close()
    last = {r: read_trace(trace_path(tmp_path, r))[0] for r in range(3)}
    assert last[0][-1]["how"] == "signal" and last[0][-1]["signal"] == "SIGTERM"
    assert last[1][-1]["how"] == "closed" and last[2] == []


# -- issue 14: quiet steps counted into runs, flush points, rotation ---------------------------------


def _collecting(trace: EventTrace, step: int = 0) -> EventTrace:
    trace.set_context(state="collecting", step=step)
    return trace


def _count(trace: EventTrace, steps, dummy=()) -> None:
    for s in steps:
        trace.step = s
        trace.count_step(s in dummy)


def test_counted_steps_become_one_run_with_exact_counts():
    """Counted steps are written as one `steps` record (first step, count, dummies) right before the next record."""
    trace = _collecting(EventTrace(rank=1, world=2, keep=True))
    _count(trace, range(10, 17), dummy={11, 15})
    assert trace.records == []              # counting writes nothing
    trace.emit("balancedness", value=0.5)
    run, other = trace.records
    assert (run["event"], run["step"], run["count"], run["dummy"], run["state"]) == ("steps", 10, 7, 2, "collecting")
    assert (run["seq"], other["seq"]) == (0, 1) and set(BASE_FIELDS) <= set(run)


def test_a_run_ends_where_the_steps_stop_following_on():
    """A skipped step number or another state starts a new run; a one-step run is a plain `step` record."""
    trace = _collecting(EventTrace(keep=True))
    _count(trace, [0, 1, 2, 5, 6])           # 3 and 4 never counted
    trace.set_context(state="transferring")
    _count(trace, [7], dummy={7})
    trace.flush()
    got = [(r["event"], r["step"], r.get("count"), r.get("dummy"), r["state"]) for r in trace.records]
    assert got == [("steps", 0, 3, 0, "collecting"), ("steps", 5, 2, 0, "collecting"),
                   ("step", 7, None, True, "transferring")]


def test_buffered_steps_reach_the_file_at_each_flush_point(tmp_path):
    """Counted steps are not on disk until a flush point: flush(), any other record, end; close writes the rest."""
    path = trace_path(tmp_path, 0)
    trace = _collecting(EventTrace(rank=0, world=1, trace_dir=tmp_path))
    _count(trace, range(5))
    assert path.read_text() == ""
    assert trace.flush()["count"] == 5 and trace.flush() is None
    _count(trace, range(5, 8))
    with trace.collective("all_reduce"):
        assert [r["event"] for r in read_trace(path)[0]] == ["steps", "steps", "collective_start"]
    _count(trace, range(8, 12))
    trace.end("closed")
    records = read_trace(path)[0]
    assert [(r["event"], r["step"], r.get("count")) for r in records][-2:] == [("steps", 8, 4), ("end", 11, None)]
    assert [r["seq"] for r in records] == list(range(len(records)))
    trace.close()


def test_close_writes_the_pending_run(tmp_path):
    """A trace closed without `end` still writes the steps it counted."""
    with _collecting(EventTrace(rank=0, world=1, trace_dir=tmp_path)) as trace:
        _count(trace, range(3))
    assert [(r["event"], r["count"]) for r in read_trace(trace_path(tmp_path, 0))[0]] == [("steps", 3)]


def test_a_long_run_is_written_every_max_run_steps_without_a_flusher(tmp_path, monkeypatch):
    """With no flusher, a run is written once it holds MAX_RUN steps: a killed rank loses at most that many."""
    import eplb_fsm.trace as trace_module

    monkeypatch.setattr(trace_module, "MAX_RUN", 4)
    trace = _collecting(EventTrace(rank=0, world=1, trace_dir=tmp_path))
    _count(trace, range(10))
    on_disk = read_trace(trace_path(tmp_path, 0))[0]
    assert [(r["step"], r["count"]) for r in on_disk] == [(0, 4), (4, 4)]
    trace.close()


def test_counts_stay_exact_while_another_thread_flushes(tmp_path):
    """The lock-free step path loses and duplicates no step while a liveness-like thread flushes and writes alive."""
    import threading

    trace = _collecting(EventTrace(rank=0, world=1, trace_dir=tmp_path))
    n, chunk = 60_000, 10_000
    dummy = set(range(0, n, 3))
    done = threading.Event()
    flushes = [0]

    def flusher():
        while not done.is_set():
            trace.flush()
            trace.alive(0.001, None)
            flushes[0] += 1

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for start in range(0, n, chunk):
            _count(trace, range(start, start + chunk), dummy=dummy)
            # a busy box may not schedule the flusher while a chunk is counted: wait (bounded)
            # until it has flushed twice since, so at least one flush saw this chunk's steps
            seen = flushes[0]
            deadline = time.monotonic() + 10.0
            while flushes[0] < seen + 2 and time.monotonic() < deadline and thread.is_alive():
                time.sleep(0.001)
            assert flushes[0] >= seen + 2, "the flusher thread did not run"
    finally:
        done.set()
        thread.join(10)
    trace.close()
    records = read_trace(trace_path(tmp_path, 0))[0]
    runs = [r for r in records if r["event"] in ("step", "steps")]
    assert len(runs) > 1 and sum(r.get("count", 1) for r in runs) == n
    assert sum(r["dummy"] if r["event"] == "steps" else int(r.get("dummy", False)) for r in runs) == len(range(0, n, 3))
    assert [r["step"] for r in runs] == [0] + [a["step"] + a.get("count", 1) for a in runs[:-1]]
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_rotation_keeps_at_most_max_segments_each_starting_with_a_continued_header(tmp_path):
    """Past max_bytes the file rolls; at most max_segments files remain, each new one opens with the header."""
    from eplb_fsm.trace_segments import segment_paths

    trace = _collecting(EventTrace(rank=3, world=4, trace_dir=tmp_path, max_bytes=2048, max_segments=3))
    trace.header({"window_size": 3}, run_id="r1")
    for i in range(200):
        trace.emit("balancedness", value=i / 200)
    trace.close()
    paths = segment_paths(trace_path(tmp_path, 3))
    assert [p.name for p in paths] == ["rank00003.jsonl.2", "rank00003.jsonl.1", "rank00003.jsonl"]
    assert trace.rotations > 3 and not (tmp_path / "rank00003.jsonl.3").exists()
    for p in paths:
        first = json.loads(p.read_text().splitlines()[0])
        assert first["event"] == "header" and first["continued"] is True and first["run_id"] == "r1"
        assert p.stat().st_size <= 2048 + 400     # one write past the cap at most
    records, bad = read_trace(trace_path(tmp_path, 3))
    seqs = [r["seq"] for r in records]
    assert bad == 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))    # oldest segment first, in order
    assert records[-1]["value"] == 199 / 200


def test_a_continued_header_says_where_the_machine_is(tmp_path):
    """A roll mid-transfer repeats the layer in flight, the scale flag and each group's next cseq on the new header."""
    trace = _collecting(EventTrace(rank=0, world=2, trace_dir=tmp_path, max_bytes=2048, max_segments=2))
    trace.header({"num_layers": 3}, run_id="r1")
    trace.transition("step", "collecting", "planning", layer=0, layer_after=0, due=True)
    with trace.collective("all_reduce", "ep", [16]):
        pass
    trace.transition("plan_ready", "planning", "transferring", layer=0, layer_after=0)
    trace.transition("layer_done", "transferring", "transferring", layer=0, layer_after=1)
    while trace.rotations == 0:
        trace.emit("balancedness", value=0.5)
    trace.close()
    first = json.loads(trace_path(tmp_path, 0).read_text().splitlines()[0])
    assert first["continued"] is True and first["state"] == "transferring"
    assert first["machine"] == {"state": "transferring", "layer": 1, "scale_pending": False}
    assert first["next_cseq"] == {"ep": 1}


def test_the_writer_tracks_scale_pending_as_the_machine_does():
    """scale_requested, groups_ready, salvaged set the flag, switched and fault clear it, as the machine's table."""
    from eplb_fsm.fsm.machine import TRANSITIONS
    from eplb_fsm.trace_fields import PENDING_CLEARED, PENDING_SET, machine_after

    marks = {row["trigger"] for row in TRANSITIONS if row.get("before") == "mark_scale_pending"}
    clears = {row["trigger"] for row in TRANSITIONS if row.get("before") == "clear_scale_pending"}
    assert (PENDING_SET, PENDING_CLEARED) == (marks, clears)
    after = machine_after({"layer": 0, "scale_pending": False}, "scale_requested", "scaling", {"layer": 0})
    assert after == {"state": "scaling", "layer": 0, "scale_pending": True}
    assert machine_after(after, "switched", "collecting", {"layer_after": 0})["scale_pending"] is False


def test_rotation_settings_are_checked_before_anything_is_written(tmp_path):
    """A bad max_bytes / max_segments names the field and creates no file."""
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1024"):
        EventTrace(trace_dir=tmp_path, max_bytes=10)
    with pytest.raises(ValueError, match="max_segments must be an int >= 1"):
        EventTrace(trace_dir=tmp_path, max_segments=0)
    assert list(tmp_path.iterdir()) == []


def test_a_sigkilled_process_loses_no_step_older_than_the_flush_interval(tmp_path):
    """A real process counts steps, then blocks; SIGKILLed after two liveness intervals, every step is on disk."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = (
        "import sys, time\n"
        "from eplb_fsm.fsm.reporting import SharedTrace\n"
        "from eplb_fsm.liveness import Liveness\n"
        f"t = SharedTrace(0, 1, {str(tmp_path)!r})\n"
        "t.set_context(state='collecting')\n"
        "Liveness(t, 0.2).start()\n"
        "for s in range(5000):\n"
        "    t.step = s\n"
        "    t.count_step(s % 10 == 0)\n"
        "print('counted', flush=True)\n"
        "time.sleep(120)\n"       # a hung engine: only the liveness thread runs
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "counted"
        deadline = time.monotonic() + 30
        while sum(r.get("count", 0) for r in read_trace(trace_path(tmp_path, 0))[0]) < 5000:
            assert time.monotonic() < deadline, "the liveness thread did not flush within 30 s"
            time.sleep(0.2)
        time.sleep(0.5)   # more than two intervals: alive records keep coming, no step is written twice
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    records, bad = read_trace(trace_path(tmp_path, 0))
    runs = [r for r in records if r["event"] == "steps"]
    assert sum(r["count"] for r in runs) == 5000 and sum(r["dummy"] for r in runs) == 500
    assert any(r["event"] == "alive" for r in records) and not any(r["event"] == "end" for r in records)


def test_trace_closed_is_true_only_after_close(tmp_path):
    """EventTrace.closed: False while the file is open (and for a trace without a file), True after close()."""
    trace = EventTrace(rank=0, world=1, trace_dir=tmp_path)
    assert not trace.closed and not EventTrace().closed
    trace.close()
    assert trace.closed


def test_a_joiner_writes_a_file_of_its_own(tmp_path):
    """A joiner of generation g writes rank<N>.g<g>.jsonl: never the file of the process that had rank N first,
    which may still be writing it under another number (a scale-up whose rank mapping renumbers old ranks)."""
    assert trace_path(tmp_path, 1).name == "rank00001.jsonl"
    assert trace_path(tmp_path, 1, generation=2).name == "rank00001.g2.jsonl"
    first, joiner = EventTrace(1, 2, tmp_path), EventTrace(1, 3, tmp_path, generation=2)
    first.emit("alive"), joiner.emit("alive")
    first.close(), joiner.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank00001.g2.jsonl", "rank00001.jsonl"]


FORK_CHILD = r'''
import json, os, sys, threading, time
from eplb_fsm.liveness import Liveness
from eplb_fsm.trace import EventTrace, end_open_traces
trace = EventTrace(0, 1, sys.argv[1])
trace.set_context(state="collecting", step=0)
trace.header({"a": 1}, run_id="r")
live = Liveness(trace, 0.05).start()          # the parent's flusher thread: the child does not have it
for s in range(5):
    trace.set_context(step=s)
    trace.count_step()
held, release = threading.Event(), threading.Event()
def hold():                                   # a parent thread inside a write while the process forks
    with trace._lock:
        held.set()
        release.wait(30)
threading.Thread(target=hold, daemon=True).start()
held.wait(30)
pid = os.fork()
if pid == 0:                                  # a worker forked from the rank, with the SIGTERM handler docs suggest
    try:
        ended = end_open_traces("signal", signal="SIGTERM")
        trace.emit("from_child")
        trace.set_context(step=5)
        trace.count_step()
        trace.flush()
        trace.end("signal", signal="SIGTERM")
        trace.close()
        os._exit(0 if ended == 0 else 3)
    except BaseException:
        os._exit(4)
release.set()
deadline = time.monotonic() + 30
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.monotonic() > deadline:           # the child hangs (on the parent's lock): stop it, report it
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = -1
        break
    time.sleep(0.01)
trace.emit("after_fork")
live.stop()
print(json.dumps({"child": status, "ended_here": end_open_traces("closed")}))
trace.close()
'''


def test_a_forked_child_writes_nothing_to_its_parents_trace(tmp_path):
    """A real fork while a parent thread holds the trace: the child's end_open_traces, records, end and close
    write nothing to the parent's file, and never block; the parent's trace stays open and its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", FORK_CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"child": 0, "ended_here": 1}    # the child ended nothing; the parent's trace was still open
    records, bad = read_trace(trace_path(tmp_path, 0))
    events = [r["event"] for r in records]
    assert bad == 0 and "from_child" not in events and events.count("end") == 1
    assert records[-1]["event"] == "end" and records[-1]["how"] == "closed" and "after_fork" in events
    assert {r["pid"] for r in records if r["event"] == "header"} != {os.getpid()}
    steps = [s for r in records if r["event"] in ("step", "steps") for s in range(r["step"], r["step"] +
                                                                                    r.get("count", 1))]
    assert steps == [0, 1, 2, 3, 4]                   # the child's step 5 never reached the file
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(len(seqs)))             # one writer: no seq counted twice


def test_a_second_open_trace_of_one_file_is_refused_until_the_first_is_closed(tmp_path):
    """Same rank and trace_dir (also by a symlinked name) in one process: ValueError naming the file and the rule,
    nothing written by the refused one; another rank or a joiner's file is fine; close() frees the file."""
    first = EventTrace(0, 2, tmp_path)
    first.emit("first")
    size = trace_path(tmp_path, 0).stat().st_size
    path = str(trace_path(tmp_path.resolve(), 0))
    with pytest.raises(ValueError, match="one open EventTrace per rank file and process") as refused:
        EventTrace(0, 2, tmp_path)
    assert path in str(refused.value)
    link = tmp_path.parent / (tmp_path.name + "-link")
    link.symlink_to(tmp_path)
    with pytest.raises(ValueError, match="already open in this process"):
        EventTrace(0, 2, link)                          # the same file by another name
    others = [EventTrace(1, 2, tmp_path), EventTrace(0, 3, tmp_path, generation=1)]
    first.end("closed")
    with pytest.raises(ValueError, match="already open in this process"):
        EventTrace(0, 2, tmp_path)                      # ended, but its file is still open
    assert trace_path(tmp_path, 0).stat().st_size > size and len(read_trace(trace_path(tmp_path, 0))[0]) == 2
    first.close()
    again = EventTrace(0, 2, tmp_path)                  # closed: the file is free again
    again.emit("again")
    for trace in [again, *others]:
        trace.close()
    assert [r["event"] for r in read_trace(trace_path(tmp_path, 0))[0]] == ["first", "end", "again"]


def test_a_trace_nothing_refers_to_does_not_hold_its_file(tmp_path):
    """A trace dropped without close() inside a reference cycle can never write again: a new one may open the file."""
    dropped = EventTrace(0, 1, tmp_path)
    dropped.me = dropped                                # freed only by the garbage collector
    del dropped
    trace = EventTrace(0, 1, tmp_path)
    trace.close()


def test_steps_counted_while_the_file_rolls_follow_the_new_segments_header(tmp_path, monkeypatch):
    """The engine counts steps lock-free while a record rolls the file: each new segment still starts with
    its continued header, the steps follow it, every step is kept and seq stays in order."""
    from eplb_fsm import trace_segments
    from eplb_fsm.trace_segments import segment_paths

    trace = _collecting(EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=100))
    trace.header({"x": 1}, run_id="r")
    counted = []

    def count_one() -> None:
        trace.set_context(step=len(counted))
        trace.count_step()
        counted.append(len(counted))

    real_rotate = trace_segments.rotate

    def rotate(path, max_segments):
        real_rotate(path, max_segments)
        for _ in range(3):   # the engine thread's count_step, between the rename and the new header
            count_one()

    monkeypatch.setattr(trace_segments, "rotate", rotate)
    count_one()
    for i in range(60):
        trace.emit("stuck", seconds=1.0, pad="x" * 100)
        count_one()
    trace.close()
    paths = segment_paths(trace_path(tmp_path, 0))
    assert trace.rotations >= 5 and len(paths) == trace.rotations + 1
    for p in paths:
        first = json.loads(p.read_text().splitlines()[0])
        assert first["event"] == "header", (p.name, first)
    records, bad = read_trace(trace_path(tmp_path, 0))
    seqs = [r["seq"] for r in records]
    assert bad == 0 and seqs == list(range(len(seqs)))
    assert [s for r in records if r["event"] in ("step", "steps")
            for s in range(r["step"], r["step"] + r.get("count", 1))] == counted


def test_every_segment_starts_with_its_header_while_threads_count_and_roll(tmp_path):
    """Real threads: an engine counting steps (lock-free) and another writing records that roll the file; no
    rotated segment starts with anything but its continued header."""
    import threading

    from eplb_fsm.trace_segments import segment_paths

    trace = _collecting(EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=300))
    trace.header({"x": 1}, run_id="r")
    stop = threading.Event()

    def engine() -> None:
        step = 0
        while not stop.is_set():
            trace.set_context(step=step)
            trace.count_step()
            step += 1
            if step % 16 == 0:
                time.sleep(0)   # lets the writer in often: the test is about interleaving, not throughput

    runner = threading.Thread(target=engine)
    runner.start()
    try:
        for _ in range(600):
            trace.emit("stuck", seconds=1.0, pad="x" * 200)
    finally:
        stop.set()
        runner.join(30)
    trace.close()
    paths = segment_paths(trace_path(tmp_path, 0))
    assert not runner.is_alive() and len(paths) > 50
    firsts = [json.loads(p.read_text().splitlines()[0])["event"] for p in paths]
    assert [p.name for p, e in zip(paths, firsts) if e != "header"] == []


def test_a_live_file_opened_again_starts_with_its_header_before_the_pending_steps(tmp_path, monkeypatch):
    """The live file is removed; at the next check the new file's first line is the continued header, then the
    steps counted before it (with a later seq)."""
    import os

    from eplb_fsm import trace_file

    now = [0.0]
    monkeypatch.setattr(trace_file, "clock", lambda: now[0])
    trace = _collecting(EventTrace(0, 2, tmp_path))
    trace.header({"a": 1}, run_id="r1")
    _count(trace, range(5))
    trace.flush()
    _count(trace, range(5, 9))
    os.unlink(trace.path)                 # the live file is lost
    now[0] = 5.0                          # the next check is due
    trace.flush()                         # the liveness thread's flush
    trace.close()
    lines = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert [r["event"] for r in lines] == ["header", "steps"] and lines[0]["continued"] is True
    assert (lines[1]["step"], lines[1]["count"]) == (5, 4) and lines[1]["seq"] == lines[0]["seq"] + 1
