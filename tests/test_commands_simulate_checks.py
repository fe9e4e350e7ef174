"""Tests for eplb_fsm.commands.simulate_checks: output-path checks and the note on a load of another shape."""

from __future__ import annotations

import pytest

from eplb_fsm.commands.simulate_checks import check_png_path, prepare_trace_dir


def test_load_of_another_shape_is_announced():
    """A load file or the ESFT traces of another shape are fitted, and the note says how; a fitting one has none."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_checks import load_note
    from eplb_fsm.sim.loads import EXAMPLE_LOAD

    note = load_note(SimpleNamespace(load=str(EXAMPLE_LOAD), layers=4, experts=32))
    assert "26 layers x 64 experts" in note and "4 x 32" in note and "first 4 layers" in note and "mod 32" in note
    note = load_note(SimpleNamespace(load="esft", layers=30, experts=128))
    assert "ESFT" in note and "l mod 26" in note and "expert e mod 64" in note
    assert load_note(SimpleNamespace(load=str(EXAMPLE_LOAD), layers=26, experts=64)) is None
    assert load_note(SimpleNamespace(load="zipf", layers=4, experts=32)) is None


def test_a_load_file_that_cannot_be_read_is_an_error_naming_load(tmp_path):
    """A missing or malformed --load file is refused with a message that starts with --load: and names the file."""
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_checks import load_note

    with pytest.raises(ValueError, match=r"^--load: .*nosuch\.npy: no such file"):
        load_note(SimpleNamespace(load=str(tmp_path / "nosuch.npy"), layers=4, experts=32))
    (tmp_path / "bad.npy").write_text("not an array")
    with pytest.raises(ValueError, match=r"^--load: "):
        load_note(SimpleNamespace(load=str(tmp_path / "bad.npy"), layers=4, experts=32))


def test_trace_dir_is_created_or_refused(tmp_path):
    """A missing trace folder is created (with parents); a file, or a folder under one, is refused (--trace-dir)."""
    made = prepare_trace_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir() and made == str(tmp_path / "a" / "b")
    # the write check leaves nothing behind; the ranks' progress folder is made up front
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["progress"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="^--trace-dir: .* exists and is not a directory"):
        prepare_trace_dir(str(tmp_path / "f"))
    with pytest.raises(ValueError, match="^--trace-dir: cannot create"):
        prepare_trace_dir(str(tmp_path / "f" / "sub"))
    assert prepare_trace_dir(None)  # a fresh temp folder


def test_a_progress_entry_that_is_not_a_folder_is_refused(tmp_path, capsys):
    """A file named progress in --trace-dir is a usage error naming --trace-dir (exit 2), not a crash of every rank."""
    from eplb_fsm.cli import main

    (tmp_path / "progress").write_text("x")
    with pytest.raises(ValueError, match=r"^--trace-dir: .*progress exists and is not a directory; the ranks write"):
        prepare_trace_dir(str(tmp_path))
    argv = ["simulate", "--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "2", "--steps", "5",
            "--no-progress", "--no-png", "--trace-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm simulate: error: --trace-dir: ") and err.count("\n") == 1, err
    assert not list(tmp_path.glob("*.jsonl"))


def test_png_path_rules(tmp_path):
    """--png must be a .png file in an existing folder; None passes; each refusal names --png and the rule."""
    check_png_path(None)
    check_png_path(str(tmp_path / "b.png"))
    check_png_path(str(tmp_path / "B.PNG"))
    for png, rule in ((tmp_path, "is a directory"), (tmp_path / "b.jpg", "must end in .png"),
                      (tmp_path / "no" / "b.png", "does not exist")):
        with pytest.raises(ValueError, match=f"^--png: .*{rule}"):
            check_png_path(str(png))
    with pytest.raises(ValueError, match="--no-png"):
        check_png_path(str(tmp_path / "b.png"), no_png=True)


def test_a_reused_trace_dir_knows_where_this_run_starts(tmp_path):
    """A folder holding traces is kept; the TraceDir finds this run's id past the old bytes, even after pickling."""
    import json
    import pickle

    old = json.dumps({"event": "header", "rank": 0, "run_id": "0ld0000000000000"}) + "\n"
    (tmp_path / "rank00000.jsonl").write_text(old + json.dumps({"event": "step", "step": 7}) + "\n")
    (tmp_path / "rank00001.jsonl").write_text(old)
    trace_dir = prepare_trace_dir(str(tmp_path))
    assert trace_dir == str(tmp_path) and trace_dir.start == {
        "rank00000.jsonl": (tmp_path / "rank00000.jsonl").stat().st_size, "rank00001.jsonl": len(old)}
    assert trace_dir.run_id is None  # this run has written nothing yet: never an earlier run's id
    copy = pickle.loads(pickle.dumps(trace_dir))  # what the rank processes get inside SimOptions
    assert copy == str(tmp_path) and copy.start == trace_dir.start
    for rank, rid in ((1, "0ther000000000000"), (0, "fe11000000000000")):  # rank 0's file speaks first
        with open(tmp_path / f"rank0000{rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "header", "rank": rank, "run_id": rid}) + "\n")
    assert trace_dir.run_id == "fe11000000000000" and copy.run_id == "fe11000000000000"


def test_a_reused_trace_dir_loses_only_the_earlier_runs_progress_files(tmp_path):
    """The live line reads every progress/rank*.json: an earlier run's are removed, its traces and logs kept."""
    from eplb_fsm.commands.simulate_progress import Progress
    from eplb_fsm.sim.run import progress_path

    for rank in (0, 1, 5):  # rank 5: a joiner of the earlier run
        path = progress_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"state": "collecting", "step": 400, "rearrangements": 4}')
    (tmp_path / "rank00000.jsonl").write_text("{}\n")
    (tmp_path / "rank00000.log").write_text("old stacks\n")
    trace_dir = prepare_trace_dir(str(tmp_path))
    assert not list(progress_path(tmp_path, 0).parent.glob("rank*.json"))
    assert (tmp_path / "rank00000.jsonl").read_text() == "{}\n" and (tmp_path / "rank00000.log").is_file()
    import io
    from types import SimpleNamespace

    line = Progress(SimpleNamespace(ranks=2, steps=10, log_dir=trace_dir), io.StringIO()).line()
    assert line == "simulate step -/10 | r0:starting r1:starting | rearrangements 0"


def _events(*specs):
    from eplb_fsm.sim.elastic import parse_scale_specs

    return parse_scale_specs(list(specs), 2, 40, 8, 8)


def test_serving_spans_follow_the_scales():
    """Leaving ranks end at their scale's step, joiners start at theirs, an absent scale-up stops the run there."""
    from eplb_fsm.commands.simulate_checks import serving_spans

    assert serving_spans(2, 40, _events("10:1", "20:3")) == ({0: [(0, 39)], 1: [(0, 10), (20, 39)], 2: [(20, 39)]},
                                                             None)
    # engine steps: a leaving rank leaves at the start of its scale's step, before its engine step
    assert serving_spans(2, 40, _events("10:1", "20:3"), engine=True) == (
        {0: [(0, 39)], 1: [(0, 9), (20, 39)], 2: [(20, 39)]}, None)
    assert serving_spans(2, 40, _events("10:1", "12:2", "15:3:absent", "20:4")) == (
        {0: [(0, 15)], 1: [(0, 10), (12, 15)]}, 15)
    assert serving_spans(2, 40, _events("15:3:late", "20:4")) == ({0: [(0, 15)], 1: [(0, 15)]}, 15)


def test_a_late_scale_parses_and_prints_back():
    """STEP:RANKS:late is a scale whose joiners start after the abort; any other suffix is refused."""
    from eplb_fsm.sim.elastic import ScaleEvent

    (late,) = _events("15:3:late")
    assert late == ScaleEvent(15, 3, absent=False, late=True) and late.spec == "15:3:late"
    with pytest.raises(ValueError, match="STEP:RANKS:late"):
        _events("15:3:soon")


@pytest.mark.parametrize("scale, spec, rule", [
    (["20:3"], "skip-step:rank=2,step=19", "rank 2 .* may run steps 20-39 only, so the fault at step 19 cannot fire"),
    (["10:1"], "die:rank=1,step=11", "rank 1 .* may run steps 0-9 only"),
    # a leaving rank leaves at the start of its scale's step: no engine step there for a fault without layer=
    (["10:1"], "die:rank=1,step=10", r"rank 1 .* may run steps 0-9 only \(it leaves at the start of its scale's "
                                     r"step, before that step's engine step, where a fault without layer= acts\)"),
    (["10:1"], "skip-step:rank=1,step=10", "rank 1 .* may run steps 0-9 only"),
    (["10:1"], "freeze:rank=1,step=10,seconds=1", "rank 1 .* may run steps 0-9 only"),
    (["1:1"], "kill:rank=1,step=1", "rank 1 .* may run steps 0-0 only"),
    (["10:1"], "kill:rank=1,step=11,layer=0", "with layer= the fault fires at a transfer at step 11 or later"),
    (["10:1", "20:2"], "freeze:rank=1,step=15,seconds=1", "may run steps 0-9 and 20-39 only, so"),
    (["10:3:absent"], "skip-step:rank=0,step=11", "the run stops at the end of step 10: its :absent scale-up"),
    (["10:3:absent"], "stall-layer:rank=2,layer=0", "rank 2 .* never runs"),
    (["10:3:late"], "skip-step:rank=0,step=11", "the run stops at the end of step 10: its :late scale-up"),
    (["10:3:late"], "kill:rank=2,step=10,layer=0", "rank 2 .* never runs"),  # a late joiner never serves
])
def test_a_fault_on_a_rank_that_does_not_run_then_is_refused(scale, spec, rule):
    """With --scale, a fault at a step its rank provably does not run is a ValueError naming --inject and why."""
    from eplb_fsm.commands.simulate_checks import check_injections_serve
    from eplb_fsm.sim.inject import parse_specs

    import re

    with pytest.raises(ValueError, match=f"^--inject {re.escape(repr(spec))}: with --scale, .*{rule}"):
        check_injections_serve(parse_specs([spec], 4, 40, 2), 2, 40, _events(*scale))


@pytest.mark.parametrize("scale, spec", [
    (["20:3"], "skip-step:rank=2,step=20"),             # a joiner runs its scale's step
    (["20:3"], "kill:rank=2,step=5,layer=1"),           # fires at a transfer after it joined
    (["10:1"], "die:rank=1,step=9"),                    # its last engine step before it leaves
    (["10:1"], "kill:rank=1,step=10,layer=0"),          # the scale-down's own transfer
    (["1:1"], "freeze:rank=1,step=1,seconds=1,layer=1"),
    (["10:1", "20:2"], "skip-step:rank=1,step=25"),     # the rank came back as a joiner
    (["10:3:absent"], "skip-step:rank=1,step=10"),      # before the run stops
    (["10:1"], "stall-layer:rank=1,layer=1"),
])
def test_a_fault_that_may_fire_under_scale_is_accepted(scale, spec):
    """Only what provably cannot fire is refused: layer-bound faults wait for a later transfer."""
    from eplb_fsm.commands.simulate_checks import check_injections_serve
    from eplb_fsm.sim.inject import parse_specs

    check_injections_serve(parse_specs([spec], 4, 40, 2), 2, 40, _events(*scale))
