"""Elastic EP end to end: real processes leave and join, real groups swap, nothing served wrong.

Each scenario is one launch (``simulate --scale``): 4 -> 2 -> 4 and 2 -> 3 -> 2, sync and
async. Every step checks every weight row and the output bit for bit; every scale step
checks rows, gates and maps on every member. The second scale of each scenario lands
right after a due step, so async mode must drain a rearrangement in flight first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb_fsm.cli import main
from eplb_fsm.sim.elastic import JOINER_ID, ScaleEvent, parse_scale_specs
from eplb_fsm.trace import read_trace

SHAPE = ["--layers", "2", "--experts", "8", "--hidden", "8", "--tokens", "32", "--window", "8",
         "--interval", "10", "--collective-timeout", "15", "--join-timeout", "15"]
SCENARIOS = {
    "4-2-4-sync": ["--ranks", "4", "--redundant", "8", "--steps", "30", "--scale", "12:2", "--scale", "22:4",
                   "--mode", "sync"],
    "4-2-4-async": ["--ranks", "4", "--redundant", "8", "--steps", "30", "--scale", "12:2", "--scale", "22:4",
                    "--mode", "async"],
    "2-3-2-sync": ["--ranks", "2", "--redundant", "0", "--steps", "30", "--scale", "12:3", "--scale", "22:2",
                   "--mode", "sync"],
    "2-3-2-async": ["--ranks", "2", "--redundant", "0", "--steps", "30", "--scale", "12:3", "--scale", "22:2",
                    "--mode", "async"],
}
WORLDS = {"4-2-4": (4, 2, 4), "2-3-2": (2, 3, 2)}


def _simulate(args: list[str], log_dir: Path) -> dict:
    from eplb_fsm.cli import build_parser
    from eplb_fsm.commands.simulate import build_options, run_simulation

    ns = build_parser().parse_args(["simulate", *SHAPE, *args, "--log-dir", str(log_dir), "--no-png"])
    return run_simulation(build_options(ns), progress=False, timeout=120.0, want_png=False)


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(request.param)
    return request.param, _simulate(SCENARIOS[request.param], log_dir), log_dir


def _records(log_dir: Path) -> dict[str, list[dict]]:
    return {p.name: read_trace(p)[0] for p in sorted(log_dir.glob("rank*.jsonl"))}


@pytest.mark.multiprocess
def test_every_scale_switches_and_serves_exactly(scenario):
    """Both scales switch; outputs, every weight row and the maps stay exact at every step and every scale."""
    name, report, _ = scenario
    first, middle, last = WORLDS[name[:5]]
    assert report["ok"], report
    assert report["outputs_unchanged"] and report["weights_exact"] and report["maps_agree"]
    assert report["histories_agree"]
    assert report["replay"]["verdict"] == "healthy", report["replay"]
    scalings = report["scalings"]
    assert [(s["from_ranks"], s["to_ranks"], s["outcome"]) for s in scalings] == [
        (first, middle, "switched"), (middle, last, "switched")]
    assert [s["step"] for s in scalings] == [12, 22]
    for s in scalings:
        assert s["moved_slots"] > 0 and s["seconds"] > 0 and s["agree"]
    assert report["final_ranks"] == last and report["final_states"] == ["collecting"] * last
    assert report["output_checks"] > 30 * min(WORLDS[name[:5]])


@pytest.mark.multiprocess
def test_leaving_ranks_exit_and_joiners_are_fresh_processes(scenario):
    """Leaving processes stop at the scale step; joiners are new processes that start serving at theirs."""
    name, report, log_dir = scenario
    first, middle, last = WORLDS[name[:5]]
    procs = report["processes"]
    left = [p for p in procs if p["left"]]
    joiners = [p for p in procs if p["role"] == "joiner"]
    if middle < first:  # 4 -> 2 -> 4: two leave at 12, two join at 22
        assert sorted(p["process"] for p in left) == [2, 3] and all(p["end_step"] == 12 for p in left)
        assert sorted(p["process"] for p in joiners) == [2 * JOINER_ID + 2, 2 * JOINER_ID + 3]
        assert all(p["start_step"] == 22 and p["end_step"] == 30 for p in joiners)
    else:  # 2 -> 3 -> 2: one joins at 12 and leaves again at 22
        assert [p["process"] for p in joiners] == [JOINER_ID + 2]
        assert joiners[0]["start_step"] == 12 and joiners[0]["left"] and joiners[0]["end_step"] == 22
    pids = {}
    for fname, recs in _records(log_dir).items():
        for rec in recs:
            if rec["event"] == "header":
                pids.setdefault(rec["pid"], []).append((fname, rec.get("role", "member")))
    assert sum(len(v) for v in pids.values()) == first + len(joiners)
    assert all(len(v) == 1 for v in pids.values())  # every header comes from its own process


@pytest.mark.multiprocess
def test_traces_describe_every_group_switch(scenario):
    """Each scale leaves scale_requested, group_switch (old/new group, rank, world) and a scaling summary."""
    name, report, log_dir = scenario
    recs = _records(log_dir)
    rank0 = recs["rank00000.jsonl"]
    switches = [r for r in rank0 if r["event"] == "group_switch"]
    assert [(s["old_group"], s["new_group"]) for s in switches] == [("ep", "ep@1"), ("ep@1", "ep@2")]
    assert [s["new_world"] for s in switches] == list(WORLDS[name[:5]][1:])
    triggers = [r["trigger"] for r in rank0 if r["event"] == "transition" and r["trigger"] in (
        "scale_requested", "groups_ready", "switched")]
    assert triggers == ["scale_requested", "groups_ready", "switched"] * 2
    summaries = [r for r in rank0 if r["event"] == "scaling"]
    assert [s["outcome"] for s in summaries] == ["switched", "switched"]
    for fname, rs in recs.items():
        leaves = [r for r in rs if r["event"] == "group_switch" and r["role"] == "leaving"]
        for leave in leaves:  # a leaving rank's session ends with its switch and summary
            after = rs[rs.index(leave) + 1:]
            assert [r["event"] for r in after][:1] == ["scaling"]
            # issue 12: `alive` (liveness thread) and the closing `end` record may follow at the same step
            assert all(r["event"] in ("scaling", "header", "model_added", "alive", "end")
                       or r["step"] > leave["step"]
                       for r in after)
    if name.endswith("async"):  # each scale came right after a due step: the rearrangement was drained first
        cuts = [i for i, r in enumerate(rank0) if r.get("trigger") == "scale_requested"]
        for lo, hi in zip([0] + cuts, cuts):
            assert any(r["event"] == "scale_drain" for r in rank0[lo:hi])


def _replay_knows_group_switches() -> bool:
    """Whether the replay reads group_switch records (then a swap must replay healthy, no excuse)."""
    folder = Path(__file__).resolve().parents[1] / "eplb_fsm" / "inspect"
    return any("group_switch" in p.read_text(encoding="utf-8") for p in folder.glob("*.py"))


@pytest.mark.multiprocess
def test_traces_with_group_swaps_replay_healthy(scenario):
    """eplb-fsm replay reads the traces of a run with group swaps as healthy (once it knows group_switch)."""
    pytest.importorskip("eplb_fsm.inspect.replay")
    from eplb_fsm.inspect.replay import replay_dir

    _, _, log_dir = scenario
    rep = replay_dir(log_dir)
    if rep.verdict != "healthy" and not _replay_knows_group_switches():
        pytest.xfail(f"replay does not read group_switch records yet (docs/elastic.md): {rep.summary}")
    assert rep.verdict == "healthy", rep.summary


@pytest.mark.multiprocess
def test_absent_joiner_aborts_within_the_timeout_and_keeps_serving(tmp_path, capsys):
    """A scale-up whose joiner never starts aborts after --join-timeout; the old group serves on, exactly."""
    log_dir = tmp_path / "logs"
    code = main(["simulate", *SHAPE[:-2], "--join-timeout", "2", "--ranks", "2", "--redundant", "0",
                 "--steps", "16", "--scale", "8:3:absent", "--json", "--no-png", "--no-progress",
                 "--log-dir", str(log_dir)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["ok"]
    (scale,) = report["scalings"]
    assert (scale["from_ranks"], scale["to_ranks"], scale["outcome"]) == (2, 2, "aborted")
    assert 2.0 <= scale["seconds"] < 6.0 and "not complete" in scale["reason"]
    assert report["final_ranks"] == 2 and report["outputs_unchanged"] and report["weights_exact"]
    assert report["steps"] == 16 and report["replay"]["verdict"] == "healthy"
    from eplb_fsm.inspect.replay import replay_dir

    rep = replay_dir(log_dir)
    assert rep.verdict == "healthy" and [s["outcome"] for s in rep.scales] == ["aborted"]
    rank1 = read_trace(log_dir / "rank00001.jsonl")[0]
    kinds = [r["event"] for r in rank1 if r["step"] == 8 and r["event"] in ("scale_aborted", "transition")]
    assert kinds[:3] == ["transition", "scale_aborted", "transition"]
    fault = next(r for r in rank1 if r.get("trigger") == "fault")
    assert (fault["source"], fault["dest"], fault["recoverable"]) == ("scaling", "collecting", True)
    later = {r["group"] for r in rank1 if r["event"] == "collective_start" and r["step"] > 8}
    assert later == {"ep", "ep_transfer"}  # the old group and its transfer group serve on, same names


def test_scale_specs_are_validated():
    """--scale STEP:RANKS parses, and impossible steps or sizes are ValueErrors naming --scale."""
    events = parse_scale_specs(["5:2", "9:4:absent"], 4, 20, 8, 8)
    assert events == [ScaleEvent(5, 2), ScaleEvent(9, 4, True)]
    for bad, match in (["0:2"], "STEP"), (["5:2", "5:3"], "increase"), (["5:x"], "integers"), \
            (["5:1"], "cannot hold"), (["5"], "STEP:RANKS"), (["25:2"], "STEP"):
        with pytest.raises(ValueError, match=match):
            parse_scale_specs(bad, 4, 20, 8, 8)


@pytest.mark.parametrize("specs, match", [
    (["5:4"], r"--scale 5:4: RANKS must differ from the group's size at that step \(4 ranks\)"),
    (["5:2", "9:2"], r"--scale 9:2: RANKS must differ .* \(2 ranks after --scale 5:2\)"),
    (["5:6:absent", "9:4"], r"--scale 9:4: RANKS must differ .* \(4 ranks after --scale 5:6:absent, an :absent "
                            r"or :late scale aborting\)"),
    (["5:2:absent"], r"--scale 5:2:absent: :absent and :late name a scale-up's joiners, and this is a scale-down "
                     r"\(4 -> 2 ranks\)"),
    (["6:3", "9:4:absent", "12:2:late"], r"--scale 12:2:late: :absent and :late .* scale-down \(3 -> 2 ranks"),
])
def test_scale_specs_follow_the_world_size(specs, match):
    """Sizes are followed through the specs (:absent / :late ones abort): a scale to the size the group has by
    then, or :absent / :late on a scale-down, is a ValueError naming the spec and the rule."""
    with pytest.raises(ValueError, match=match):
        parse_scale_specs(specs, 4, 20, 8, 8)


def test_scale_specs_after_an_aborting_scale_start_from_the_size_before_it():
    """5:2 then 9:4:late (aborts: the group stays at 2): 12:3 is a scale-up from 2 and parses."""
    assert parse_scale_specs(["5:2", "9:4:late", "12:3:late"], 4, 20, 8, 8)[-1] == ScaleEvent(12, 3, late=True)


def test_a_scale_to_the_current_size_exits_2_before_any_process(tmp_path, capsys):
    """simulate --ranks 2 --scale 10:2 is a usage error (exit 2) naming the spec; no rank process starts."""
    code = main(["simulate", *SHAPE, "--ranks", "2", "--redundant", "0", "--steps", "20", "--scale", "10:2",
                 "--no-png", "--no-progress", "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2 and "--scale 10:2: RANKS must differ from the group's size at that step (2 ranks)" in err, err
    assert not list(tmp_path.glob("logs/rank*"))


def _result(rank: int, scalings: list, checks: list) -> dict:
    """A first rank's result as run_elastic_rank returns it, serving every step (only what the report reads)."""
    return {"process": rank, "role": "initial", "rank": rank, "left": False, "start_step": 0, "steps": 20,
            "scalings": scalings, "checks": checks, "history": [], "mismatches": 0, "output_checks": 3,
            "weights_exact": True, "trace": None, "stop_reason": None, "final_state": "collecting"}


def test_a_skipped_scale_reports_the_same_keys_as_one_that_ran():
    """4 -> 2 aborted, so --scale 9:4 finds 4 ranks and is skipped; a scale past the run's end is not_reached.
    Their entries still carry every key of one that ran (docs/elastic.md lists each outcome)."""
    from types import SimpleNamespace

    from eplb_fsm.sim.elastic_report import elastic_report

    opts = SimpleNamespace(extra={"scale": ["5:2", "9:4", "15:2"]}, ranks=4, steps=20, experts=8, redundant=8)
    aborted = {"generation": 1, "step": 5, "kind": "scale_down", "from_ranks": 4, "to_ranks": 4,
               "requested_ranks": 2, "outcome": "aborted", "moved_slots": 0, "moved_bytes": 0, "seconds": 0.1,
               "reason": "scale-down aborted: transfer of layer 0 failed", "lost_experts": []}
    skipped = {"at": "skipped", "step": 9, "generation": 2, "reason": "already 4 ranks"}
    results = [_result(r, [dict(aborted, rank=r)], [skipped]) for r in range(4)]
    report = elastic_report(opts, results, {"maps_agree": True, "final_states": ["collecting"] * 4})
    ran, skip, late = report["scalings"]
    assert (ran["outcome"], skip["outcome"], late["outcome"]) == ("aborted", "skipped", "not_reached")
    assert set(skip) == set(late) == set(ran) | {"requested_ranks"} == set(ran)
    assert skip["reason"] == "the group already had that many ranks (an earlier scale did not switch)"
    assert (skip["kind"], skip["lost_experts"], skip["agree"]) == (None, [], True)


@pytest.mark.multiprocess
def test_a_job_that_starts_on_one_rank_scales_up_as_one_run(tmp_path):
    """1 -> 2 ranks: the joiner shares the lone rank's run id, so the run replays healthy (it was missing_ranks)."""
    from eplb_fsm.inspect import replay_dir

    result = _simulate(["--ranks", "1", "--redundant", "0", "--steps", "30", "--scale", "12:2"], tmp_path)
    assert result["ok"], result
    runs = {r["run_id"] for recs in _records(tmp_path).values() for r in recs if r["event"] == "header"}
    assert len(runs) == 1 and replay_dir(tmp_path).verdict == "healthy"


@pytest.mark.multiprocess
def test_a_joiner_that_comes_after_the_abort_is_not_joined_not_failed(tmp_path, capsys):
    """A :late joiner starts once the old ranks aborted: it ends not_joined, and the run is ok (exit 0)."""
    log_dir = tmp_path / "logs"
    code = main(["simulate", *SHAPE[:-2], "--join-timeout", "0.5", "--ranks", "2", "--redundant", "0",
                 "--steps", "12", "--scale", "6:3:late", "--json", "--no-png", "--no-progress",
                 "--log-dir", str(log_dir), "--timeout", "120"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["ok"] and not report.get("failed"), report
    (scale,) = report["scalings"]
    assert (scale["from_ranks"], scale["to_ranks"], scale["outcome"]) == (2, 2, "aborted")
    joiner = next(p for p in report["processes"] if p["process"] == JOINER_ID + 2)
    assert joiner["status"] == "not_joined" and joiner["reason"].startswith("ScaleAborted"), joiner
    assert [p["status"] for p in report["processes"] if p["role"] == "initial"] == ["finished", "finished"]
    assert report["final_ranks"] == 2 and report["steps"] == 12 and report["outputs_unchanged"]
    assert report["replay"]["verdict"] == "healthy"


def test_only_a_scale_abort_makes_a_joiner_not_joined(tmp_path, monkeypatch):
    """join's ScaleAborted (here: no handover within the timeout) is a not_joined result; any other error raises."""
    from eplb_fsm.cli import build_parser
    from eplb_fsm.commands.simulate import build_options
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.sim.elastic import NOT_JOINED, run_elastic_rank
    from eplb_fsm.transfer.groups import host_store

    ns = build_parser().parse_args(["simulate", *SHAPE[:-2], "--join-timeout", "0.3", "--ranks", "2",
                                    "--redundant", "0", "--steps", "12", "--scale", "6:3",
                                    "--log-dir", str(tmp_path), "--no-png"])
    opts = build_options(ns)
    opts.redirect_output = False  # this test's own process: keep its stdout
    store, info = host_store(timeout_s=10.0, namespace="eplb")  # nobody publishes a handover there
    join = {"index": 0, "generation": 1, "step": 6}
    result = run_elastic_rank("joiner", 2, 3, opts, info, join)
    assert (result["status"], result["process"], result["start_step"]) == (NOT_JOINED, JOINER_ID + 2, 6)
    assert result["reason"].startswith("ScaleAborted: no handover for generation 1"), result

    def broken(*args, **kwargs):
        raise RuntimeError("not a scale abort")

    monkeypatch.setattr(EplbController, "join", broken)
    with pytest.raises(RuntimeError, match="not a scale abort"):
        run_elastic_rank("joiner", 2, 3, opts, info, join)
    del store


@pytest.mark.multiprocess
def test_survivors_that_salvaged_a_killed_leaving_rank_are_not_failed(tmp_path, capsys):
    """4 -> 2, leaving rank 3 SIGKILLed mid-transfer: survivors salvage and serve on (no RankFault); the run fails."""
    log_dir = tmp_path / "logs"
    code = main(["simulate", "--layers", "3", "--experts", "4", "--redundant", "12", "--hidden", "8", "--tokens", "48",
                 "--interval", "8", "--window", "8", "--collective-timeout", "2", "--ranks", "4", "--steps", "14",
                 "--inject", "kill:rank=3,step=12,layer=1", "--scale", "12:2", "--json", "--no-png", "--no-progress",
                 "--log-dir", str(log_dir), "--timeout", "120"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and report["error"] == "ranks_failed"  # a process was killed: the run still fails
    status = {e["process"]: e["status"] for e in report["ranks"]}
    assert status[3] == "died" and 0 not in report["failed_processes"] and 1 not in report["failed_processes"]
    assert status[0] in ("finished", "stopped") and status[1] in ("finished", "stopped"), report["ranks"]
    for rank in (0, 1):
        records = read_trace(log_dir / f"rank{rank:05d}.jsonl")[0]
        triggers = [r["trigger"] for r in records if r["event"] == "transition" and r["trigger"] != "step"]
        assert triggers[triggers.index("fault"):][:3] == ["fault", "salvaged", "switched"], triggers
        assert not any("RankFault" in str(r.get("error")) for r in records if r["event"] == "end"), records[-1]


@pytest.mark.multiprocess
def test_a_layer_kill_aimed_at_a_joiner_fires_in_its_own_scale(tmp_path, capsys):
    """kill:rank=2,step=6,layer=0 with --scale 6:3 SIGKILLs the joiner before its scale's layer-0 transfer (it
    never fired: the joiner's hooks came after its scale); the report and replay name rank 2."""
    log_dir = tmp_path / "logs"
    code = main(["simulate", "--layers", "2", "--experts", "8", "--redundant", "2", "--hidden", "8", "--tokens", "32",
                 "--window", "8", "--interval", "10", "--collective-timeout", "10", "--ranks", "2", "--steps", "12",
                 # a generous --join-timeout: a loaded machine may take seconds to start the joiner process
                 # (else the join waits one collective timeout: a late joiner never reaches its layer-0 kill)
                 "--scale", "6:3", "--join-timeout", "30", "--inject", "kill:rank=2,step=6,layer=0", "--json",
                 "--no-png", "--no-progress",
                 "--log-dir", str(log_dir), "--timeout", "120"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not report.get("inject_unfired") and code == 1 and report["error"] == "ranks_failed", report
    joiner = next(e for e in report["ranks"] if e["process"] == JOINER_ID + 2)
    assert (joiner["status"], joiner["last_event"], joiner["last_step"]) == ("died", "fault_injected", 6), joiner
    assert report["replay"]["culprit_ranks"] == [2], report["replay"]
    records = read_trace(log_dir / "rank00002.g1.jsonl")[0]
    (fired,) = [r for r in records if r["event"] == "fault_injected"]
    assert (fired["at_step"], fired["layer"], fired["state_at"]) == (6, 0, "transferring"), fired
    assert not any(r["event"] == "transition" and r["trigger"] == "switched" for r in records)  # still in its scale
