"""Injected faults end the run in bounded time, and replay names the rank, step and layer.

Each multiprocess scenario runs ``eplb-fsm simulate`` through ``eplb_fsm.cli.main`` on 2
gloo ranks (3 layers, 8 + 4 slots, interval 8: rearrangements due at steps 1, 9, 17;
collective timeout 2 s, watchdog 1 s), then ``eplb-fsm replay --json`` on its log dir.
The fast tests at the end check the replay rules these faults rely on, on synthetic
traces.
"""

from __future__ import annotations

import json
import time

import pytest

from eplb_fsm.cli import main
from eplb_fsm.trace import read_trace, trace_path

BASE = ["--ranks", "2", "--layers", "3", "--experts", "8", "--redundant", "4", "--hidden", "8",
        "--tokens", "48", "--steps", "24", "--interval", "8", "--window", "8", "--collective-timeout", "2",
        "--no-png", "--no-progress", "--json"]


def simulate(log_dir, mode: str, *extra: str, capsys) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code = main(["simulate", *BASE, "--mode", mode, "--log-dir", str(log_dir), *extra])
    wall = time.monotonic() - t0
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1]), wall


def replay(log_dir, capsys) -> tuple[int, dict]:
    code = main(["replay", str(log_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


def records(log_dir, rank: int) -> list[dict]:
    return read_trace(trace_path(log_dir, rank))[0]


def evidence(log_dir, report: dict, world: int = 2) -> str:
    """What a failed assertion shows: each rank's status, last records and the tail of its log
    (which ends with every thread's stack when the launcher stopped it or its threads stood still)."""
    out = []
    for entry in report.get("ranks", []):
        out.append(f"rank {entry.get('rank')}: {entry.get('status')} {str(entry.get('reason'))[:200]}")
    for r in range(world):
        recs = records(log_dir, r)
        t0 = recs[0]["ts"] if recs else 0.0
        out.append(f"-- rank {r} last records:")
        out += [f"   t+{x['ts'] - t0:.2f} step {x.get('step')} {x['event']} {x.get('state')} "
                f"{x.get('op') or x.get('trigger') or x.get('waiting_on') or ''}" for x in recs[-6:]]
        log = log_dir / f"rank{r:05d}.log"
        if log.is_file():
            out.append(f"-- rank {r} log tail:")
            out += log.read_text(errors="replace").splitlines()[-40:]
    return "\n".join(out)


# (mode, spec, extra args, verdicts accepted, culprit, steps accepted, layer, collective (op, group) or None)
SCENARIOS = [
    pytest.param("sync", "die:rank=1,step=5", [], {"hang"}, [1], {5}, None, ("all_reduce", "engine"),
                 id="die-sync"),
    # async: a layer may be in flight on the transfer group when the rank dies; replay
    # names the step that collective started at, which (under load) can be a step or two
    # before the death, never after it
    pytest.param("async", "die:rank=0,step=5", [], {"hang"}, [0], {3, 4, 5}, "any", None, id="die-async"),
    # the skipped rank's next controller all-reduce is the due step 9's
    pytest.param("sync", "skip-step:rank=1,step=3", [], {"hang"}, [1], {9}, None, ("all_reduce", "ep"),
                 id="skip-step-sync"),
    # async: the rearrangement due at step 1 all-reduces its ready flags at step 2
    pytest.param("async", "skip-step:rank=0,step=2", [], {"hang"}, [0], {2}, None, ("all_reduce", "ep"),
                 id="skip-step-async"),
    pytest.param("sync", "wrong-collective:rank=0,step=9", [], {"collective_mismatch"}, [0], {9}, None,
                 ("all_reduce", "ep"), id="wrong-collective-sync"),
    pytest.param("async", "wrong-collective:rank=1,step=2", [], {"collective_mismatch"}, [1], {2}, None,
                 ("all_reduce", "ep"), id="wrong-collective-async"),
    pytest.param("sync", "stall-layer:rank=1,layer=2", [], {"hang"}, [1], {1}, 2, None, id="stall-layer-sync"),
    # async: the engine keeps stepping while layer 2 is in flight, so the run needs steps to outlast
    # the timeout; rank 1 never issues the layer's wave (nor anything later in the group) while its engine goes on:
    # a hang whether rank 0's wait failed before the ranks ended or not
    pytest.param("async", "stall-layer:rank=1,layer=2", ["--steps", "1500"], {"hang"}, [1],
                 None, 2, ("batch_isend_irecv", "ep_transfer"), id="stall-layer-async"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, spec, extra, verdicts, culprit, steps, layer, collective", SCENARIOS)
def test_injected_fault_ends_the_run_and_replay_names_it(tmp_path, capsys, mode, spec, extra, verdicts, culprit,
                                                         steps, layer, collective):
    """Each injected fault ends the run with exit 1, and the replay of its traces names the culprit and where."""
    log_dir = tmp_path / "logs"
    code, report, wall = simulate(log_dir, mode, "--inject", spec, *extra, capsys=capsys)
    rank = int(spec.split("rank=")[1].split(",")[0])
    # the run ends (non-zero) with a report; every rank left its trace for replay
    assert code == 1 and report["ok"] is False and report.get("failed") is True, report
    assert report["inject"] == [spec]
    assert wall < 45, wall
    for r in range(2):
        assert trace_path(log_dir, r).is_file()
    statuses = {e["rank"]: e["status"] for e in report["ranks"]}
    if spec.startswith("die"):
        assert statuses[rank] == "died" and "code 43" in report["ranks"][rank]["reason"]
    else:
        assert set(statuses.values()) <= {"failed", "died", "stopped"} and report["failed_ranks"]

    rcode, rep = replay(log_dir, capsys)
    assert rcode == 1
    where = f"{rep['verdict']}: {rep['summary']}\n{evidence(log_dir, report)}"
    assert rep["verdict"] in verdicts, where
    assert rep["culprit_ranks"] == culprit, where
    assert rep["illegal_transitions"] == [], where
    if steps is not None:
        assert rep["step"] in steps, where
    if layer == "any":
        pass
    elif layer is not None:
        assert rep["layer"] == layer, where
    if collective is not None:
        assert (rep["collective"]["op"], rep["collective"]["group"]) == collective, where
    # simulate's own report carries the same verdict
    assert report["replay"]["verdict"] == rep["verdict"] and report["replay"]["culprit_ranks"] == culprit

    if spec.startswith("wrong-collective"):
        assert "broadcast" in rep["summary"]
        odd = [r for r in records(log_dir, rank) if r["event"] == "collective_start" and r["op"] == "broadcast"]
        assert len(odd) == 1 and odd[0]["group"] == "ep" and odd[0]["step"] in steps
        # the ranks issued different collectives there: no aborted rearrangement blames the network for the wait
        assert not any("network" in a["text"] for a in rep["aborted_rearrangements"]), rep["aborted_rearrangements"]
    if spec.startswith("stall-layer"):
        # the watchdog logged `stuck` (state, layer, last collective) before the timeout fault
        for r in range(2):
            recs = records(log_dir, r)
            stuck = [x for x in recs if x["event"] == "stuck"]
            assert stuck and stuck[0]["state"] == "transferring" and stuck[0]["layer"] == layer
            assert stuck[0]["last_collective"] is not None
            faults = [x["seq"] for x in recs if x["event"] == "transition" and x["trigger"] == "fault"]
            if faults:
                assert stuck[0]["seq"] < faults[0]
        assert any(x["event"] == "transition" and x["trigger"] == "fault" for x in records(log_dir, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_healthy_run_replays_healthy(tmp_path, capsys, mode):
    """No injection, the watchdog on: the run is ok and replays healthy with zero illegal transitions."""
    log_dir = tmp_path / "logs"
    # async: a worker short of CPU takes ~11 steps a rearrangement (each waits for its layers), so 24 steps can end
    # inside the second one
    steps = ["--steps", "48"] if mode == "async" else []
    code, report, _ = simulate(log_dir, mode, "--watchdog", "1", *steps, capsys=capsys)
    assert code == 0 and report["ok"], report
    assert report["committed"] >= 2
    rcode, rep = replay(log_dir, capsys)
    assert (rcode, rep["verdict"], rep["illegal_transitions"], rep["culprit_ranks"]) == (0, "healthy", [], [])
    for r in range(2):
        assert not [x for x in records(log_dir, r) if x["event"] == "stuck"]


# --------------------------------------------------------------------------- replay rules (synthetic, fast)


def _synthetic(world: int, faults) -> dict[int, list[dict]]:
    from eplb_fsm.testing import SyntheticJob

    job = SyntheticJob(world=world)
    job.run(30, faults)
    return job.records()


def test_a_wait_that_timed_out_for_a_rank_that_never_came_is_a_hang():
    """Rank 1's trace stops before the step-19 all-reduce; rank 0 waited and left it with a timeout error."""
    from eplb_fsm.inspect import replay as rp
    from eplb_fsm.testing import Faults, Stop

    recs = _synthetic(2, Faults(stop={0: Stop(19, "in_collective"), 1: Stop(19, "before_collective")}))
    start = recs[0][-1]
    assert start["event"] == "collective_start"
    recs[0].append(dict(start, event="collective_error", seq=start["seq"] + 1,
                        error="RuntimeError: Operation timed out!"))
    report = rp.diagnose(recs)
    assert report.verdict == "hang" and report.culprit_ranks == [1], report.summary
    assert report.step == 19 and "gave up waiting inside it (RuntimeError: Operation timed out!)" in report.summary
    assert [p["status"] for p in sorted(report.at_divergence, key=lambda p: p["rank"])] == ["error", "never_joined"]


def test_a_one_against_one_mismatch_blames_the_op_the_group_never_runs():
    """World 2: the rank that broadcast where the group always all-reduces is the culprit, either way round."""
    from eplb_fsm.inspect import replay as rp
    from eplb_fsm.testing import Faults

    for culprit in (0, 1):
        report = rp.diagnose(_synthetic(2, Faults(wrong_collective={culprit: (19, {"op": "broadcast"})})))
        assert report.verdict == "collective_mismatch" and report.culprit_ranks == [culprit], report.summary
        assert report.collective["op"] == "all_reduce"
        assert any("appears nowhere else" in d for d in report.findings[0].details)


def test_a_rollback_that_ends_in_failed_does_not_hide_its_cause():
    """Both ranks fault into `failed` right after a mismatch: the mismatch stays the verdict, not a handled note."""
    from eplb_fsm.inspect import replay as rp
    from eplb_fsm.testing import Faults

    recs = _synthetic(2, Faults(wrong_collective={1: (19, {"op": "broadcast"})}))
    for r, rs in recs.items():
        cut = next(i for i, x in enumerate(rs) if x["event"] == "collective_start" and x["step"] == 19)
        start = rs[cut]
        kept = rs[:cut + 1]
        kept.append(dict(start, event="collective_error", seq=start["seq"] + 1, error="RuntimeError: timed out"))
        kept.append({"ts": start["ts"], "rank": r, "world": 2, "event": "transition", "state": "failed",
                     "step": 19, "seq": start["seq"] + 2, "trigger": "fault", "source": start["state"],
                     "dest": "failed", "layer": 0, "num_layers": start.get("num_layers", 2), "layer_after": 0,
                     "recoverable": False, "reason": "all_reduce failed"})
        recs[r] = kept
    report = rp.diagnose(recs)
    assert report.illegal_transitions == []
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [1], report.summary
    assert report.handled == []
    assert [f.kind for f in report.findings][:2] == ["collective_mismatch", "failed"]
