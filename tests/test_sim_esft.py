"""ESFT trace folders and summary.json with out-of-range expert ids: a ValueError naming file:line and the rule."""

from __future__ import annotations

import json

import pytest

from eplb_fsm.cli import main
from eplb_fsm.sim.esft import MAX_EXPERT_ID, esft_sequence_loads
from eplb_fsm.sim.loads import load_matrix

RULE = r"expert ids must be 0\.\.16383"


def _trace(folder, ids_line: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "expert_weights_1.txt").write_text("0\t1\t\t0.5\t0.5\n" + ids_line + "\t\t0.5\t0.5\n")


def test_the_limit_is_the_slots_plan_allows():
    """The largest expert id is one below plan's MAX_SLOTS: a layer of more experts could not be planned."""
    from eplb_fsm.commands.plan import MAX_SLOTS

    assert MAX_EXPERT_ID == MAX_SLOTS - 1


@pytest.mark.parametrize("ids, why", [
    ("3\t1000000000000", "expert id 1000000000000 is too large"),      # fits int64: sized the counts (7 TiB)
    ("99999999999999999999\t3", "an expert id does not fit in 64 bits"),  # past int64: OverflowError
    (f"{MAX_EXPERT_ID + 1}", f"expert id {MAX_EXPERT_ID + 1} is too large"),
])
def test_a_trace_line_with_an_expert_id_over_the_limit_names_file_and_line(tmp_path, ids, why):
    """An id over the limit, or too big for int64, is a ValueError naming the file, line 2 and the rule."""
    _trace(tmp_path, ids)
    for read in (esft_sequence_loads, load_matrix):
        with pytest.raises(ValueError, match=f"expert_weights_1.txt:2: {why}; {RULE}"):
            read(tmp_path)


def test_the_largest_allowed_id_is_read(tmp_path):
    """An id at the limit is a valid expert: the counts get MAX_EXPERT_ID + 1 columns."""
    _trace(tmp_path, str(MAX_EXPERT_ID))
    counts = esft_sequence_loads(tmp_path)
    assert counts.shape == (2, 1, MAX_EXPERT_ID + 1) and counts[1, 0, MAX_EXPERT_ID] == 1


def test_a_summary_json_with_an_expert_id_over_the_limit_is_refused(tmp_path):
    """token_scores naming expert 5e12 is a ValueError naming the file, the layer and the rule, not a MemoryError."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"token_scores": {"1": {"0": 0.5}, "7": {"5000000000000": 0.5, "0": 0.5}}}))
    with pytest.raises(ValueError, match=f"summary.json: malformed token_scores: layer 7: expert id 5000000000000 "
                                         f"is too large; {RULE}"):
        load_matrix(path)


@pytest.mark.parametrize("verb", [
    ["simulate", "--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "2", "--steps", "5",
     "--no-progress", "--no-png"],
    ["plan", "--ranks", "2", "--redundant", "2"],
])
def test_commands_give_a_usage_error_for_a_trace_over_the_limit(tmp_path, capsys, verb):
    """simulate --load and plan --load on such a folder exit 2 with one line naming --load, file:line and the rule."""
    _trace(tmp_path / "t", "99999999999999999999")
    argv = [*verb, "--load", str(tmp_path / "t")]
    if verb[0] == "simulate":
        argv += ["--trace-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm {verb[0]}: error: --load: ") and err.count("\n") == 1, err
    assert "expert_weights_1.txt:2: an expert id does not fit in 64 bits; expert ids must be 0..16383" in err
    assert not (tmp_path / "out").exists()


def test_a_trace_folder_whose_counts_would_pass_the_cell_limit_is_refused(tmp_path, monkeypatch):
    """Sequences x layers x experts past MAX_COUNT_CELLS: a ValueError naming the sizes, before the array is made."""
    from eplb_fsm.sim import esft

    monkeypatch.setattr(esft, "MAX_COUNT_CELLS", 100)
    folder = tmp_path / "t"
    folder.mkdir()
    # 3 sequences x 1 layer x 64 experts (the largest id names 63) = 192 cells > 100
    (folder / "expert_weights_1.txt").write_text("0\t63\t\t0.5\t0.5\n1\t2\t\t0.5\t0.5\n4\t5\t\t0.5\t0.5\n")
    with pytest.raises(ValueError, match=r"3 sequences x 1 layers x 64 experts is 192 counts; at most 100"):
        esft_sequence_loads(folder)
    monkeypatch.setattr(esft, "MAX_COUNT_CELLS", 192)
    assert esft_sequence_loads(folder).shape == (3, 1, 64)
