"""Records whose fields JSON cannot hold: written (strict JSON), never raised into the engine; base fields reserved."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eplb_fsm.trace import EventTrace, encode_record, read_trace, record_steps, trace_path


def _strict(line: str) -> dict:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(line, parse_constant=refuse)


def _lines(folder) -> list[dict]:
    return [_strict(line) for line in trace_path(folder, 0).read_text().splitlines()]


class Exploding:
    def tolist(self):
        raise RuntimeError("no list for you")

    def __repr__(self) -> str:
        return "Exploding()"


def _cycle() -> dict:
    loop: dict = {"a": 1}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize("bad", [
    {("main", 0): 0.5},                 # a tuple key
    {np.int64(3): 1.0},                 # a numpy integer key
    _cycle(),                           # a circular reference
    Exploding(),                        # a conversion that raises
], ids=["tuple-key", "numpy-key", "cycle", "tolist-raises"])
def test_a_field_json_cannot_hold_is_written_and_keeps_the_pending_steps(tmp_path, bad):
    """emit() with an unencodable field does not raise; the steps counted before it and every seq stay on disk."""
    trace = EventTrace(0, 1, tmp_path, keep=True)
    trace.set_context(state="collecting")
    trace.header({}, run_id="r" * 16)
    for step in range(10):
        trace.step = step
        trace.count_step()
    record = trace.emit("balancedness", models=bad)
    trace.step = 10
    trace.count_step()
    trace.emit("alive", interval_s=1.0)
    trace.close()
    lines = _lines(tmp_path)
    assert [r["seq"] for r in lines] == list(range(len(lines))) == [r["seq"] for r in trace.records]
    assert sorted(s for r in lines for s in record_steps(r)) == list(range(11))
    assert record["seq"] == 2 and lines[2]["event"] == "balancedness" and "models" in lines[2]


def test_unencodable_keys_and_values_are_written_as_documented():
    """Tuple keys as str(), numpy keys as their value, a cycle as its repr, numpy arrays as lists."""
    line = _strict(encode_record({"a": {("m", 0): 1}, "b": {np.int64(7): 2}, "c": _cycle(),
                                  "d": np.array([1.5, 2.0]), "e": Exploding()}))
    assert line["a"] == {"('m', 0)": 1} and line["b"] == {"7": 2} and line["d"] == [1.5, 2.0]
    assert line["c"] == repr(_cycle()) and line["e"] == "Exploding()"


def test_non_finite_floats_are_strict_json_names():
    """NaN and the infinities (Python, numpy, inside arrays and keys) become "nan"/"inf"/"-inf": strict JSON."""
    text = encode_record({"v": math.nan, "w": np.float32("inf"), "x": np.array([1.0, -np.inf]),
                          "y": {"main": math.nan}, "z": {math.inf: 1}})
    assert "NaN" not in text and "Infinity" not in text
    line = _strict(text)
    assert (line["v"], line["w"], line["x"], line["y"], line["z"]) == ("nan", "inf", [1.0, "-inf"],
                                                                       {"main": "nan"}, {"inf": 1})
    assert math.isnan(float(line["v"])) and float(line["x"][1]) == -math.inf


def test_replay_reads_records_with_non_finite_values(tmp_path):
    """Balancedness records holding NaN and infinities, as the trace writes them, replay as a healthy run."""
    from eplb_fsm.inspect import replay_dir

    for rank in range(2):
        trace = EventTrace(rank, 2, tmp_path)
        trace.set_context(state="collecting", step=0)
        trace.header({}, run_id="r" * 16)
        for step in range(6):
            trace.step = step
            trace.count_step()
            with trace.collective("all_reduce", group="ep", shape=(4,), dtype="torch.float64"):
                pass
            value = (math.nan, math.inf, 0.5)[step % 3]
            trace.emit("balancedness", value=value, models={"main": value}, tokens=-math.inf)
        trace.end("closed")
        trace.close()
    report = replay_dir(tmp_path, jobs=1)
    assert report.verdict == "healthy" and read_trace(trace_path(tmp_path, 0))[1] == 0, report.summary


def test_a_transition_with_an_unencodable_field_changes_state_with_its_record(tmp_path):
    """transition() with a cyclic field still writes the record and moves the state (no half-done change)."""
    trace = EventTrace(0, 1, tmp_path, keep=True)
    trace.set_context(state="collecting")
    trace.header({}, run_id="r" * 16)
    trace.transition("plan", "collecting", "planning", detail=_cycle())
    trace.close()
    assert trace.state == "planning" and _lines(tmp_path)[-1]["dest"] == "planning"


@pytest.mark.parametrize("name", ["seq", "rank", "world", "ts", "event"])
def test_emit_refuses_base_field_names_before_anything_changes(tmp_path, name):
    """emit(seq=/rank=/world=/ts=/event=) is a ValueError naming the field (event=: was a TypeError, 'multiple
    values for argument'); no seq taken, pending steps not written."""
    trace = EventTrace(0, 2, tmp_path, keep=True)
    trace.set_context(state="collecting")
    trace.header({}, run_id="r" * 16)
    trace.count_step()
    before = trace_path(tmp_path, 0).read_bytes()
    with pytest.raises(ValueError, match=repr(name)):
        trace.emit("note", **{name: 0})
    with pytest.raises(ValueError, match="'seq'"):
        trace.transition("plan", "collecting", "planning", seq=3)
    with pytest.raises(ValueError, match="'rank'"):
        trace.start_collective("all_reduce", rank=1)
    assert trace.seq == 1 and trace_path(tmp_path, 0).read_bytes() == before and trace.state == "collecting"
    assert trace.cseq == {}
    trace.close()


def test_emit_still_lets_state_and_step_be_given():
    """The documented overrides (state, step) stay allowed."""
    trace = EventTrace(0, 1)
    record = trace.emit("note", state="x", step=7)
    assert (record["state"], record["step"]) == ("x", 7)
