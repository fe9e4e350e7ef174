"""``eplb-fsm bench step``: the per-step overhead benchmark runs and reports sane, complete figures."""

from __future__ import annotations

import json

from eplb_fsm.cli import main

SMALL = ["--layers", "4", "--slots", "16", "--experts", "12", "--window", "10", "--steps", "200", "--rounds", "2"]


def test_bench_step_json_keys_and_sanity(tmp_path, capsys):
    """The JSON has the side-by-side figures; every figure is positive and the trace saw every step."""
    code = main(["bench", "step", "--json", *SMALL, "--trace-dir", str(tmp_path)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("bare_record_pass_us", "controller_step_us", "overhead_us", "overhead_ratio",
                "full_machine_step_us", "trace_line_us", "trace_bytes_per_step", "target_overhead_us",
                "within_target", "shape", "rounds_us"):
        assert key in result
    assert result["shape"] == {"layers": 4, "slots": 16, "experts": 12, "window": 10, "world": 1}
    assert result["bare_record_pass_us"] > 0 and result["controller_step_us"] > 0
    assert result["trace_line_us"] > 0 and result["trace_bytes_per_step"] > 20
    assert abs(result["overhead_us"] - (result["controller_step_us"] - result["bare_record_pass_us"])) < 0.01
    assert len(result["rounds_us"]["bare"]) == 2 and result["state"] == "collecting"
    assert (tmp_path / "controller" / "rank00000.jsonl").is_file()


def test_bench_step_cleans_up_its_scratch_traces(capsys):
    """Without --trace-dir the traces go to a temporary directory that is removed afterwards."""
    assert main(["bench", "step", "--json", *SMALL]) == 0
    assert json.loads(capsys.readouterr().out)["trace_dir"] is None
