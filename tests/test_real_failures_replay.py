"""Replay's verdict on real failures the liveness rules once got wrong, each from real rank processes.

- two ranks SIGKILLed together: their traces just stop, so they must not outvote the survivor
  that went on into the next collective (it was once named the culprit of an "extra" collective);
- a survivor SIGKILLed after a scale-down: the rank that left in the scale ended on purpose and
  earlier, and must not make the killed rank look as if it outlived its peers (it was "healthy");
- a rank that raises an engine error whose text merely says "timeout" or "NCCL", or returns from
  inside its controller's ``with`` while its peer still needs it: no longer taken for a failed
  wait, or dropped, and never "healthy";
- a freeze in ``transferring`` says which layer.

The ranks run through ``eplb-fsm simulate --inject`` (real SIGKILL / SIGSTOP) or
``eplb_fsm.sim.launcher.run_ranks`` (a hand-made engine loop: ToyMoE's forward all-reduce and
``EplbController.step``), world 2-3, every wait bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from pathlib import Path

import pytest

from eplb_fsm.cli import main
from eplb_fsm.inspect.replay import diagnose, replay_dir
from eplb_fsm.trace import read_trace

pytestmark = pytest.mark.multiprocess

BASE = ["--layers", "3", "--experts", "8", "--redundant", "4", "--hidden", "8", "--tokens", "48",
        "--interval", "8", "--window", "8", "--collective-timeout", "2", "--no-png", "--no-progress", "--json",
        "--timeout", "150"]


def simulate(log_dir: Path, ranks: int, mode: str, steps: int, *extra: str) -> dict:
    """One ``eplb-fsm simulate`` run into ``log_dir``; its JSON report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["simulate", *BASE, "--ranks", str(ranks), "--steps", str(steps), "--mode", mode,
              "--log-dir", str(log_dir), *extra])
    return json.loads(out.getvalue().strip().splitlines()[-1])


def records(log_dir: Path) -> dict[int, list[dict]]:
    return {int(p.name[4:9]): read_trace(p)[0] for p in sorted(Path(log_dir).glob("rank*.jsonl"))}


def fired(log_dir: Path) -> list[dict]:
    return [r for recs in records(log_dir).values() for r in recs if r["event"] == "fault_injected"]


# -- two ranks killed together ---------------------------------------------------------------------------------


def test_two_ranks_sigkilled_together_are_the_culprits_not_the_survivor(tmp_path):
    """Ranks 1 and 2 of 3 SIGKILLed before layer 1's transfer: replay names ranks 1-2, never rank 0 that waited."""
    simulate(tmp_path, 3, "sync", 24, "--inject", "kill:rank=1,step=9,layer=1", "--inject",
             "kill:rank=2,step=9,layer=1")
    assert sorted(r["target_rank"] for r in fired(tmp_path)) == [1, 2]
    report = replay_dir(tmp_path)
    assert report.verdict in ("hang", "rank_died") and report.culprit_ranks == [1, 2], report.summary
    assert report.step == 9 and "extra" not in report.summary
    assert any("died" in d for d in report.findings[0].details)
    assert any(c.startswith("rank 0 gave up waiting") for c in report.consequences)


def _engine_rank(rank: int, world: int, trace_dir: str, fault: dict) -> str:
    """A hand-made engine loop (sync controller): ToyMoE's forward all-reduces over the world, then
    ``ctl.step()``; it raises once its controller is ``failed``, as an engine that cannot go on would.

    ``fault``: ``{"kill": [ranks]}`` SIGKILLs those ranks before their layer-1 transfer; ``{"rank": r, "step": s,
    "raise": text}`` raises ``RuntimeError(text)`` on rank r at step s, ``"raise": None`` returns instead (a
    ``return`` inside the controller's ``with``: it closes in order while the peers still need it)."""
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    model = ToyMoE(num_layers=3, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=world)
    config = EplbConfig(window_size=4, step_interval=8, num_redundant_experts=4, collective_timeout_s=2.0)
    with EplbController(config, group=dist.group.WORLD, trace_dir=trace_dir) as ctl:
        ctl.add_model(model, "main")
        if rank in fault.get("kill", ()):
            def kill_before(layer: int, name: str, model_layer: int) -> None:
                if layer == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            ctl.transfer_hooks.append(kill_before)
        for step in range(16):
            if rank == fault.get("rank") and step == fault.get("step"):
                if fault["raise"] is None:
                    return "returned"
                raise RuntimeError(fault["raise"])
            model.forward(model.make_batch(step, 48), dist.group.WORLD)   # the engine's own collective
            ctl.step()
            if ctl.state == "failed":
                raise RuntimeError(f"controller failed at step {step}")
        return ctl.state


def _engine_run(log_dir: Path, world: int, fault: dict) -> None:
    """Run ``_engine_rank`` on ``world`` processes; the injected fault makes the run fail."""
    from eplb_fsm.sim.launcher import RankFailedError, run_ranks

    with pytest.raises(RankFailedError):
        run_ranks(_engine_rank, world, args=(str(log_dir), fault), timeout=60)


def test_two_ranks_killed_under_a_hand_made_engine_are_the_culprits(tmp_path):
    """Ranks 1-2 of 3 SIGKILL themselves before layer 1's transfer; rank 0's engine then raises "controller failed":
    replay names ranks 1-2, and rank 0's exception is a consequence of its failed wait, not a crash."""
    _engine_run(tmp_path, 3, {"kill": [1, 2]})
    recs = records(tmp_path)
    assert all(not any(r["event"] == "end" for r in recs[k]) for k in (1, 2))
    assert recs[0][-1]["event"] == "end" and recs[0][-1]["how"] in ("exception", "signal")
    report = replay_dir(tmp_path)
    assert report.verdict in ("hang", "rank_died") and report.culprit_ranks == [1, 2], report.summary
    assert all(f.kind != "crashed" for f in report.findings), [f.summary for f in report.findings]


# -- a survivor killed after a scale-down --------------------------------------------------------------------------


def _strip_engine(recs: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """The traces as a real engine leaves them: no simulator engine collectives (group engine*), no
    fault_injected records, seq renumbered so that no line reads as lost."""
    out = {}
    for rank, rs in recs.items():
        kept, seq = [], None
        for r in rs:
            if r["event"] == "header":
                seq = r["seq"]
            elif str(r.get("group", "")).startswith("engine") or r["event"] == "fault_injected":
                continue
            else:
                seq += 1
            kept.append(dict(r, seq=seq))
        out[rank] = kept
    return out


def test_a_survivor_sigkilled_later_after_a_scale_down_is_named_without_engine_records(tmp_path):
    """3 -> 2 at step 12 (sync), rank 1 SIGKILLed at step 22, traces stripped of the simulator's engine records:
    the leaving rank's early end no longer hides the death (it was "healthy")."""
    simulate(tmp_path, 3, "sync", 30, "--scale", "12:2", "--inject", "kill:rank=1,step=22")
    assert [r["target_rank"] for r in fired(tmp_path)] == [1]
    report = diagnose(_strip_engine(records(tmp_path)))
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [1]), report.summary
    assert report.step is not None and 20 <= report.step <= 22 and report.exit_code == 1
    # with the simulator's engine collectives kept, the one rank 1 never joined names it too
    full = replay_dir(tmp_path)
    assert full.verdict != "healthy" and full.culprit_ranks == [1], full.summary


# -- ends with an exception, or closed early, and no other cause ---------------------------------------------------

TIMEOUT_TEXT = "KeyError: request_timeout missing from sampling params"
NCCL_TEXT = ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error; Cuda failure: an illegal memory "
             "access was encountered")


@pytest.mark.parametrize("text", [TIMEOUT_TEXT, NCCL_TEXT], ids=["timeout-word", "nccl-word"])
def test_an_engine_error_that_only_mentions_timeout_or_nccl_is_a_crash(tmp_path, capsys, text):
    """Rank 1's engine raises an error naming "timeout" or "NCCL" at step 5: crashed rank 1, exit 1, rank 0's
    failed wait listed as a consequence (these texts once read as failed waits: "healthy", exit 0)."""
    _engine_run(tmp_path, 2, {"rank": 1, "step": 5, "raise": text})
    assert text in read_trace(tmp_path / "rank00001.jsonl")[0][-1]["error"]
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("crashed", [1]), report.summary
    assert text in report.summary and report.consequences and all("rank 0" in c for c in report.consequences)
    assert main(["replay", str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith("crashed: rank 1")


def test_a_rank_that_returns_inside_its_controller_while_its_peer_waits_left_early(tmp_path, capsys):
    """Rank 1 returns from inside ``with EplbController`` at step 5 (end how=closed) while rank 0's next engine
    all-reduce fails for want of it: left_early rank 1, exit 1, rank 0's error a consequence (it was "healthy")."""
    _engine_run(tmp_path, 2, {"rank": 1, "step": 5, "raise": None})
    recs = records(tmp_path)
    # nothing stops rank 0 from outside: the launcher waits for it until its own all-reduce fails
    assert recs[1][-1]["how"] == "closed" and recs[0][-1]["how"] == "exception"
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("left_early", [1]), report.summary
    assert any(c.startswith("rank 0 gave up waiting") for c in report.consequences)
    assert main(["replay", str(tmp_path)]) == 1
    assert "consequences (not culprits)" in capsys.readouterr().out


# -- the layer of a freeze ----------------------------------------------------------------------------------------


def test_a_freeze_in_transferring_names_its_layer(tmp_path):
    """Rank 1 SIGSTOPped 4 s before layer 1's transfer (sync): frozen rank 1 at step 9, layer 1."""
    simulate(tmp_path, 2, "sync", 24, "--inject", "freeze:rank=1,step=9,seconds=4,layer=1")
    (shot,) = fired(tmp_path)
    assert shot["layer"] == 1 and shot["state_at"] == "transferring"
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.step) == ("frozen", [1], 9), report.summary
    assert report.state == "transferring" and report.layer == 1
    assert report.to_dict()["layer"] == 1 and "layer 1" in report.summary
