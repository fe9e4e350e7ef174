"""The synthetic trace builder: realistic records through the real machine and trace, faults per rank."""

from __future__ import annotations

import pytest

from eplb_fsm.testing import Faults, Stop, SyntheticJob, hang_faults, write_traces
from eplb_fsm.trace import read_trace, trace_path


def test_records_follow_the_controller_layout():
    """Header, model_added, compact steps, transitions with num_layers/layer_after, collectives in pairs."""
    job = SyntheticJob(world=2, num_layers=3, interval=5)
    job.run(10)
    recs = job.records()[1]
    assert [r["event"] for r in recs[:3]] == ["header", "model_added", "step"]
    header = recs[0]
    assert header["config"]["step_interval"] == 5 and header["group"] == "ep"
    assert header["transfer_group"] == "ep_transfer" and header["world"] == 2 and header["rank"] == 1
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    moves = [r for r in recs if r["event"] == "transition"]
    assert [(r["trigger"], r["dest"]) for r in moves[:6]] == [
        ("step", "planning"), ("plan_ready", "transferring"), ("layer_done", "transferring"),
        ("layer_done", "transferring"), ("layer_done", "committing"), ("committed", "collecting")]
    assert all(r["num_layers"] == 3 and "layer_after" in r for r in moves)
    assert [r["layer"] for r in moves if r["trigger"] == "layer_done"][:3] == [0, 1, 2]
    starts = [r for r in recs if r["event"] == "collective_start"]
    ends = [r for r in recs if r["event"] == "collective_end"]
    assert len(starts) == len(ends) and {r["group"] for r in starts} == {"ep", "ep_transfer"}


def test_a_rearrangement_writes_today_s_controller_agreements():
    """Planning all-reduces loads + maps digest; each layer and the commit agree on [ready, failed, late, broken]."""
    job = SyntheticJob(world=2, num_layers=3, num_experts=8, interval=5)
    job.run(5)
    recs = job.records()[0]
    ep = [(r["parts"], r["sizes"], r["shape"], r.get("layer"), r["state"], r["cseq"]) for r in recs
          if r["event"] == "collective_start" and r["group"] == "ep"]
    assert ep == [(["loads", "maps"], [24, 16], [40], None, "planning", 0),
                  (["ready"], [4], [4], 0, "transferring", 1), (["ready"], [4], [4], 1, "transferring", 2),
                  (["ready"], [4], [4], 2, "transferring", 3), (["ready"], [4], [4], None, "committing", 4)]
    after = [r.get("trigger", r["event"]) for r in recs if r["seq"] > max(
        x["seq"] for x in recs if x.get("cseq") == 4 and x["group"] == "ep")]
    assert after[:2] == ["committed", "rearrangement"]


def test_every_third_plan_is_skipped():
    """Rearrangement #2 finds nothing to move: plan_ready back to collecting and plan_skipped."""
    job = SyntheticJob(world=2, interval=4)
    job.run(12)
    recs = job.records()[0]
    plans = [r for r in recs if r.get("trigger") == "plan_ready"]
    assert [p["dest"] for p in plans] == ["transferring", "transferring", "collecting"]
    assert sum(1 for r in recs if r["event"] == "plan_skipped") == 1


def test_stops_end_a_rank_where_asked():
    """before_step, before_collective and in_collective end the trace at the right record."""
    job = SyntheticJob(world=3, interval=5)
    job.run(10, Faults(stop={0: Stop(4, "before_step"), 1: Stop(4, "before_collective"),
                             2: Stop(4, "in_collective")}))
    last = {r: recs[-1] for r, recs in job.records().items()}
    assert (last[0]["event"], last[0]["step"]) == ("step", 3)
    assert (last[1]["event"], last[1]["trigger"], last[1]["step"]) == ("transition", "step", 4)
    assert (last[2]["event"], last[2]["op"], last[2]["step"]) == ("collective_start", "all_reduce", 4)
    with pytest.raises(ValueError, match="where must be one of"):
        Stop(3, "mid_air")


def test_hang_faults_stop_everyone_at_the_step():
    """hang_faults: the culprit stops before its collective, every other rank inside it."""
    faults = hang_faults(4, culprit=2, step=9)
    assert faults.stop[2] == Stop(9, "before_collective")
    assert {r: s.where for r, s in faults.stop.items() if r != 2} == {r: "in_collective" for r in (0, 1, 3)}


def test_skip_count_delays_planning_by_one_step():
    """A rank whose counter misses a step enters planning one step after the others."""
    job = SyntheticJob(world=2, interval=5)
    job.run(10, Faults(skip_count={1: 2}))
    due = {r: [x["step"] for x in recs if x.get("dest") == "planning"] for r, recs in job.records().items()}
    assert due == {0: [4, 9], 1: [5]}


def test_wrong_collective_and_config_overrides():
    """wrong_collective changes the first collective of that step; config_overrides one header."""
    job = SyntheticJob(world=2, interval=5, config_overrides={1: {"window_size": 99}})
    job.run(10, Faults(wrong_collective={0: (4, {"op": "broadcast", "shape": [1]})}))
    recs = job.records()
    first = next(r for r in recs[0] if r["event"] == "collective_start")
    assert (first["op"], first["shape"]) == ("broadcast", [1])
    assert recs[0][0]["config"]["window_size"] == 5 and recs[1][0]["config"]["window_size"] == 99


def test_illegal_fault_records_a_refused_transition():
    """The illegal fault writes committed straight from transferring and the rank goes on."""
    job = SyntheticJob(world=2, interval=5)
    job.run(10, Faults(illegal={1: 4}))
    bad = [r for r in job.records()[1] if r.get("trigger") == "committed" and r["source"] == "transferring"]
    assert len(bad) == 1 and bad[0]["step"] == 4
    assert job.records()[1][-1]["step"] == 9


def test_files_and_single_rank_simulation(tmp_path):
    """trace_dir writes one JSONL file per simulated rank; ranks=[0] simulates only rank 0."""
    job = SyntheticJob(world=8, trace_dir=tmp_path / "a", ranks=[0], keep=False)
    job.run(12)
    job.close()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["rank00000.jsonl"]
    records, bad = read_trace(trace_path(tmp_path / "a", 0))
    assert bad == 0 and records[0]["world"] == 8 and records[-1]["step"] == 11
    mem = SyntheticJob(world=2)
    mem.run(6)
    paths = write_traces(mem.records(), tmp_path / "b")
    assert read_trace(paths[1])[0] == mem.records()[1]
    with pytest.raises(ValueError, match="interval"):
        SyntheticJob(interval=0)


def test_transfer_error_aborts_on_every_rank_and_resets_the_group():
    """transfer_error: no wave on the failing rank, a timed-out wave elsewhere, fault everywhere, new group."""
    job = SyntheticJob(world=3, interval=5)
    job.run(15, Faults(transfer_error={1: (4, 1)}))
    recs = job.records()
    for r, rr in recs.items():
        waves = [x for x in rr if x.get("op") == "batch_isend_irecv" and x["step"] == 4]
        kinds = [x["event"] for x in waves]
        if r == 1:
            assert kinds == ["collective_start", "collective_end"]          # layer 0 only
        else:
            assert kinds == ["collective_start", "collective_end", "collective_start", "collective_error"]
        faults = [x for x in rr if x.get("trigger") == "fault"]
        assert [(f["step"], f["dest"], f["failed_layer"]) for f in faults] == [(4, "collecting", 1)]
        assert faults[0]["reason"].startswith("transfer of layer 1 failed on 3 rank(s): ")
        resets = [x["group"] for x in rr if x["event"] == "transfer_group_reset"]
        assert resets == ["ep_transfer.1"]
        # as fsm/faults.transfer_fault: the layer's ready agreement, fault, rearrangement, the reset agreement
        tail = [x for x in rr if x["step"] == 4 and x["event"] != "collective_end"][-5:]
        assert [x.get("trigger", x["event"]) for x in tail] == [
            "collective_start", "fault", "rearrangement", "collective_start", "transfer_group_reset"]
        assert [(x["parts"], x["shape"], x.get("layer")) for x in (tail[0], tail[3])] == [
            (["ready"], [4], 1), (["reset"], [1], None)]
        assert {x["group"] for x in rr if x.get("op") == "batch_isend_irecv" and x["step"] > 4} == {"ep_transfer.1"}


def test_close_ends_every_live_rank_and_replay_sees_an_orderly_end(tmp_path):
    """close() writes end (closed) on ranks still running, none on a stopped one; replay names only the stopped."""
    from eplb_fsm.inspect import replay_dir

    job = SyntheticJob(world=3, interval=5, trace_dir=tmp_path, keep=False)
    job.run(10)
    job.close()
    job.close()
    assert [read_trace(trace_path(tmp_path, r))[0][-1]["how"] for r in range(3)] == ["closed"] * 3
    assert replay_dir(tmp_path).to_dict()["unended_ranks"] == []
    died = SyntheticJob(world=3, interval=5, trace_dir=tmp_path / "died", keep=False)
    died.run(10, Faults(stop={1: Stop(7)}))
    died.close()
    report = replay_dir(tmp_path / "died")
    assert report.verdict == "rank_died" and report.culprit_ranks == [1]


def test_a_closed_job_refuses_to_run_and_keep_false_refuses_records():
    """run()/scale() after close() raise RuntimeError; records() without keep=True is a ValueError."""
    job = SyntheticJob(world=2, interval=5)
    job.run(3)
    job.close()
    with pytest.raises(RuntimeError, match="closed"):
        job.run(3)
    with pytest.raises(RuntimeError, match="closed"):
        job.scale(1)
    with pytest.raises(ValueError, match="keep=True"):
        SyntheticJob(world=2, keep=False).records()


def test_bad_job_sizes_are_refused_before_any_file_is_opened(tmp_path):
    """world, num_layers, num_experts, interval, ranks, steps: ValueError naming the field; no trace file made."""
    for kwargs, match in [({"world": 0}, "world must be >= 1"), ({"world": True}, "world must be an integer"),
                          ({"num_layers": 0}, "num_layers"), ({"num_experts": 2.0}, "num_experts"),
                          ({"interval": "5"}, "interval"), ({"ranks": [7]}, "ranks must be distinct"),
                          ({"ranks": [0, 0]}, "ranks must be distinct"),
                          ({"config_overrides": {5: {}}}, "config_overrides")]:
        with pytest.raises(ValueError, match=match):
            SyntheticJob(trace_dir=tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="steps"):
        SyntheticJob(world=2).run(-3)
    with pytest.raises(ValueError, match="traces rank"):
        write_traces({-1: []}, tmp_path)


@pytest.mark.parametrize("kwargs, match", [
    ({"config": [1, 2]}, "config must be a mapping of config fields, got list"),
    ({"config_overrides": [1]}, "config_overrides must be a mapping rank -> config fields"),
    ({"config_overrides": {1: "x"}}, r"config_overrides\[1\] must be a mapping of config fields, got str"),
    ({"step_s": "0.05"}, "step_s must be a finite number > 0, got '0.05'"),
    ({"step_s": float("nan")}, "step_s must be a finite number > 0, got nan"),
    ({"step_s": -1.0}, "step_s must be a finite number > 0"),
    ({"step_s": 0}, "step_s must be a finite number > 0"),
    ({"step_s": True}, "step_s must be a finite number > 0"),
    ({"t0": float("inf")}, "t0 must be a finite number, got inf"),
    ({"t0": None}, "t0 must be a finite number, got None"),
])
def test_bad_config_and_clock_are_refused_before_any_file_is_created(tmp_path, kwargs, match):
    """config, config_overrides, step_s and t0: a ValueError naming the field and its rule; no trace file made."""
    with pytest.raises(ValueError, match=match):
        SyntheticJob(world=2, trace_dir=tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_world_that_does_not_divide_the_experts_gets_redundant_slots():
    """10 experts on 4 ranks: 3 slots a rank, 12 physical, 2 redundant in the header's config."""
    recs = SyntheticJob(world=4, num_experts=10).records()[0]
    added = recs[1]
    assert (added["logical"], added["physical"], added["local"]) == (10, 12, 3)
    assert recs[0]["config"]["num_redundant_experts"] == 2


def test_slots_per_rank_gives_spare_slots_that_a_joiner_keeps():
    """slots_per_rank=4, 8 experts, 4 ranks: 16 physical, 8 redundant; a joiner of 4 -> 2 -> 4 has 4 a rank too."""
    job = SyntheticJob(world=4, num_experts=8, interval=10, slots_per_rank=4)
    recs = job.records()[0]
    assert (recs[1]["logical"], recs[1]["physical"], recs[1]["local"]) == (8, 16, 4)
    assert recs[0]["config"]["num_redundant_experts"] == 8
    job.run(12)
    job.scale(2)
    assert job.records()[0][0]["config"]["num_redundant_experts"] == 8   # the first header is not rewritten
    job.scale(4)
    joiner = job.records()[3]
    header = max(i for i, r in enumerate(joiner) if r["event"] == "header")
    added = joiner[header + 1]
    assert (added["physical"], added["local"], joiner[header]["config"]["num_redundant_experts"]) == (16, 4, 8)


@pytest.mark.parametrize("value, match", [
    (1, r"slots_per_rank must be >= 2 \(world=4 ranks hold 8 experts: every expert needs a slot\), got 1"),
    (0, "slots_per_rank must be >= 1, got 0"),
    (True, "slots_per_rank must be an integer, got True"),
    (2.0, "slots_per_rank must be an integer, got 2.0"),
    ("4", "slots_per_rank must be an integer, got '4'"),
])
def test_bad_slots_per_rank_is_refused_before_any_file_is_created(tmp_path, value, match):
    """slots_per_rank that is no integer or too few for every expert: a ValueError naming it; no trace file made."""
    with pytest.raises(ValueError, match=match):
        SyntheticJob(world=4, num_experts=8, trace_dir=tmp_path, slots_per_rank=value)
    assert list(tmp_path.iterdir()) == []
