"""Faults inside a rearrangement on real gloo ranks: broken commits, Ctrl-C, a timed-out EP group, different maps.

Each test launches world 2 (``run_ranks``: spawned processes, a deadline on the whole run)
with the shape of tests/test_real_failures.py (3 layers, 8 + 4 slots, the first
rearrangement due at step 1). The engine's forward all-reduces on the EP group, as a real
engine's does, so a rank that faulted alone would pair its engine's all-reduce with a
peer's controller all-reduce. Commits are broken where a device error or a SIGINT would
land: after the layer's direct copies, before its buffer writes. SIGINT is a real signal
(``os.kill`` of the rank's own process, Python's default handler).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb_fsm.sim.launcher import run_ranks

pytestmark = pytest.mark.multiprocess


def _setup(rank: int, world: int, trace_dir: str, mode: str, timeout: float = 2.0, phy2log=None):
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.loads import zipf_load
    from eplb_fsm.sim.model import ToyMoE

    model = ToyMoE(num_layers=3, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=world,
                   phy2log=phy2log)
    p = zipf_load(3, 8, exponent=1.2, tokens_per_layer=100_000, rng=3).astype(float) + 1
    model.set_load_target(p / p.sum(axis=1, keepdims=True))
    config = EplbConfig(window_size=8, step_interval=8, num_redundant_experts=4, collective_timeout_s=timeout,
                        use_async=mode == "async")
    ctl = EplbController(config, group=dist.group.WORLD, trace_dir=trace_dir)
    ctl.add_model(model, "m", phy2log=phy2log)
    return ctl, model, dist.group.WORLD


def _step(ctl, model, group, s: int) -> bool:
    """One engine step (forward with its all-reduce on ``group``, then the controller's); whether it was exact."""
    x = model.make_batch(s, 48)
    exact = bool(torch.equal(model.forward(x, group), model.reference_forward(x)))
    ctl.step()
    return exact


def _break_commit(layer: int, action) -> None:
    """Run ``action()`` in this process's next commit of machine ``layer``, after its direct copies."""
    import eplb_fsm.fsm.transfers as transfers
    import eplb_fsm.transfer.execute as execute

    real_commit, real_copy = transfers.commit_layer_from_buffer, execute.copy_runs
    at = {"in": False, "calls": 0, "armed": True}

    def commit(pending, weights):
        at["in"], at["calls"] = at["armed"] and pending.layer == layer, 0
        try:
            return real_commit(pending, weights)
        finally:
            at["in"] = False

    def copy(*args):
        if at["in"]:
            at["calls"] += 1
            if at["calls"] == 2:   # the buffer writes come next
                at["armed"] = False
                action()
        return real_copy(*args)

    transfers.commit_layer_from_buffer, execute.copy_runs = commit, copy


def _sigint() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGINT)


def _take_sigint() -> None:
    """Python's own SIGINT handler on this rank (the launcher blocks the signal in its thread)."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _reload(model, phy2log: np.ndarray, layer: int) -> None:
    """What the engine does before recover(reloaded=True): this rank's rows of ``layer`` from the originals."""
    S = model.num_local_physical_experts
    w, b = model.expert_weights[layer]
    for row in range(S):
        expert = int(phy2log[layer, model.rank * S + row])
        w[row], b[row] = model.expert(layer, expert)


def _serve_on(ctl, model, group, first: int, steps: int = 20) -> dict:
    """After recovery: a new load, ``steps`` more steps (then up to 30 to end a rearrangement in flight)."""
    from eplb_fsm.sim.loads import zipf_load

    p = zipf_load(3, 8, exponent=1.5, tokens_per_layer=100_000, rng=11).astype(float) + 1
    model.set_load_target(p / p.sum(axis=1, keepdims=True))
    exact = all([_step(ctl, model, group, s) for s in range(first, first + steps)])
    s = first + steps
    while ctl.state != "collecting" and s < first + steps + 30:   # async: let a rearrangement in flight end
        exact = _step(ctl, model, group, s) and exact
        s += 1
    return {"exact": exact, "bad_rows": model.check_weights(ctl.maps("m").phy2log), "state": ctl.state,
            "outcomes": [h["outcome"] for h in ctl.history]}


def _records(trace_dir: str, rank: int, event: str) -> list[dict]:
    lines = (Path(trace_dir) / f"rank{rank:05d}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _faults(trace_dir: str, rank: int) -> list[dict]:
    return [r for r in _records(trace_dir, rank, "transition") if r["trigger"] == "fault"]


def _verdict(trace_dir: str):
    from eplb_fsm.inspect.replay import replay_dir

    return replay_dir(trace_dir)


# -- a SIGINT in the middle of a commit (both ranks: Ctrl-C reaches the process group) ------------------

def _sigint_in_commit(rank: int, world: int, trace_dir: str, mode: str) -> dict:
    _take_sigint()
    ctl, model, group = _setup(rank, world, trace_dir, mode)
    _break_commit(1, _sigint)
    out: dict = {}
    s = 0
    while "interrupted" not in out and s < 40:
        try:
            _step(ctl, model, group, s)
        except KeyboardInterrupt:
            out["interrupted"] = (ctl.state, [layer for layer, _ in model.check_weights(ctl.maps("m").phy2log)])
        s += 1
    try:
        ctl.recover()
    except RuntimeError as exc:
        out["refused"] = str(exc)
    _reload(model, ctl.maps("m").phy2log, 1)
    ctl.recover(reloaded=True)
    out.update(_serve_on(ctl, model, group, s))
    ctl.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sigint_inside_a_commit_fails_the_machine_until_the_layer_is_reloaded(tmp_path, mode):
    """Ctrl-C between a commit's copies: failed at once, traced; recover() needs reloaded=True, then all is exact."""
    for rank, out in enumerate(run_ranks(_sigint_in_commit, 2, args=(str(tmp_path), mode), timeout=120)):
        state, bad_layers = out["interrupted"]
        assert state == "failed" and set(bad_layers) <= {1}
        assert "model 'm' layer 1" in out["refused"] and "recover(reloaded=True)" in out["refused"]
        assert out["state"] == "collecting" and out["exact"] and out["bad_rows"] == []
        assert out["outcomes"][0] == "aborted" and "committed" in out["outcomes"][1:]
        broken = _records(str(tmp_path), rank, "commit_failed")
        assert [(r["layer"], r["model"], r["model_layer"], r["maps"]) for r in broken] == [(1, "m", 1, "new")]
        fault = _faults(str(tmp_path), rank)[0]
        assert fault["interrupted"] == "KeyboardInterrupt" and fault["recoverable"] is False
        recovered = [r for r in _records(str(tmp_path), rank, "transition") if r["trigger"] == "recovered"]
        assert [r["reloaded"] for r in recovered] == [[["m", 1]]]
    report = _verdict(str(tmp_path))
    assert report.illegal_transitions == [] and report.verdict == "healthy", report.summary


# -- a KeyboardInterrupt elsewhere in a rearrangement ----------------------------------------------------

def _sigint_outside_commit(rank: int, world: int, trace_dir: str, mode: str) -> dict:
    _take_sigint()
    ctl, model, group = _setup(rank, world, trace_dir, mode)
    if mode == "sync":   # in layer 1's transfer (on the engine thread in sync mode)
        ctl.transfer_hooks.append(lambda layer, name, local: _sigint() if layer == 1 and not ctl.history else None)
    else:                # as the first layer's job is handed to the worker, right after plan_ready
        jobs = ctl.rearranger.layer_jobs
        start = jobs.start

        def interrupted_start(*args):
            jobs.start = start
            _sigint()
            return start(*args)

        jobs.start = interrupted_start
    out: dict = {"errors": []}
    s = 0
    while s < 12:
        try:
            _step(ctl, model, group, s)
        except KeyboardInterrupt:
            out["interrupted"] = (ctl.state, ctl.layer)
        except Exception as exc:   # what a machine left part-way raised on later steps
            out["errors"].append(f"{type(exc).__name__}: {exc}")
        s += 1
    out["failed"] = ctl.state
    ctl.recover()   # no write was cut short: nothing to reload
    out.update(_serve_on(ctl, model, group, s))
    ctl.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sigint_inside_a_rearrangement_leaves_it_failed_never_stuck(tmp_path, mode):
    """Ctrl-C in a sync transfer or as an async layer is handed over: failed, no later error, recover() works."""
    for rank, out in enumerate(run_ranks(_sigint_outside_commit, 2, args=(str(tmp_path), mode), timeout=120)):
        assert out["interrupted"][0] == "failed" and out["failed"] == "failed" and out["errors"] == []
        assert out["state"] == "collecting" and out["exact"] and out["bad_rows"] == []
        assert out["outcomes"][0] == "aborted" and "committed" in out["outcomes"][1:]
        fault = _faults(str(tmp_path), rank)[0]
        assert fault["interrupted"] == "KeyboardInterrupt" and fault["dest"] == "failed"
        assert not _records(str(tmp_path), rank, "commit_failed")
    report = _verdict(str(tmp_path))
    assert report.illegal_transitions == [] and report.verdict == "healthy", report.summary


# -- a KeyboardInterrupt in the reset that follows a transfer fault ---------------------------------------

def _sigint_in_transfer_reset(rank: int, world: int, trace_dir: str) -> dict:
    import eplb_fsm.fsm.recovery as recovery

    _take_sigint()
    ctl, model, group = _setup(rank, world, trace_dir, "sync", timeout=1.0)

    def broken(layer, name, local):
        if rank == 0 and layer == 1 and not ctl.history:
            raise RuntimeError("injected: layer 1's transfer failed")

    ctl.transfer_hooks.append(broken)
    real_drain = recovery._drain

    def drain(r):   # a real SIGINT as the reset begins (waiting for the worker, then for its peers)
        recovery._drain = real_drain
        _sigint()
        return real_drain(r)

    recovery._drain = drain
    out: dict = {"errors": []}
    s = 0
    while "interrupted" not in out and s < 12:
        try:
            _step(ctl, model, group, s)
        except KeyboardInterrupt:
            out["interrupted"] = (ctl.state, ctl.transfer_group_name)
        except Exception as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
        s += 1
    ctl.recover()   # its reset never ran: recover() builds the fresh transfer group
    out["recovered"] = (ctl.state, ctl.transfer_group_name)
    out.update(_serve_on(ctl, model, group, s))
    ctl.close()
    return out


def test_a_sigint_in_a_transfer_faults_reset_fails_the_machine_never_leaves_it_collecting(tmp_path):
    """A real SIGINT while a transfer fault's reset drains (sync, both ranks): the recoverable fault is followed by a
    traced non-recoverable one (failed, old transfer group named), then recover() rebuilds it and serving is exact."""
    for rank, out in enumerate(run_ranks(_sigint_in_transfer_reset, 2, args=(str(tmp_path),), timeout=120)):
        assert out["interrupted"] == ("failed", "ep_transfer") and out["errors"] == []
        assert out["recovered"] == ("collecting", "ep_transfer.1")
        assert out["state"] == "collecting" and out["exact"] and out["bad_rows"] == []
        faults = _faults(str(tmp_path), rank)
        assert [(f["source"], f["dest"], f["recoverable"], f.get("interrupted")) for f in faults] == [
            ("transferring", "collecting", True, None), ("collecting", "failed", False, "KeyboardInterrupt")]
        assert "reset interrupted" in faults[1]["reason"]
    report = _verdict(str(tmp_path))
    assert report.illegal_transitions == [], report.summary


# -- a commit that raises on one rank only ----------------------------------------------------------------

def _one_rank_breaks_a_commit(rank: int, world: int, trace_dir: str, mode: str) -> dict:
    ctl, model, group = _setup(rank, world, trace_dir, mode)
    if rank == 0:
        def device_error():
            raise RuntimeError("injected: device error in the commit's copy")
        _break_commit(1, device_error)
    out: dict = {"states": []}
    s = 0
    # until the agreed fault (every rank on the same step, so all stop together): an async worker that gets little
    # CPU on a loaded machine takes more steps to reach layer 1's commit
    while "failed" not in out["states"] and s < 200:
        _step(ctl, model, group, s)
        out["states"].append(ctl.state)
        s += 1
    ep = sum(1 for r in _records(trace_dir, rank, "collective_start") if r["group"] == "ep")
    try:
        ctl.recover()
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["no_collective"] = ep == sum(1 for r in _records(trace_dir, rank, "collective_start") if r["group"] == "ep")
    if rank == 0:
        _reload(model, ctl.maps("m").phy2log, 1)
        ctl.recover(reloaded={("m", 1)})
    else:
        ctl.recover(reloaded=True)
    out.update(_serve_on(ctl, model, group, s))
    ctl.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_commit_that_raises_on_one_rank_fails_every_rank_on_the_same_step(tmp_path, mode):
    """Rank 0's commit of layer 1 raises: both ranks fault on one step, no crash; recover needs reloaded on both."""
    results = run_ranks(_one_rank_breaks_a_commit, 2, args=(str(tmp_path), mode), timeout=120)
    assert results[0]["states"] == results[1]["states"] and "failed" in results[0]["states"]
    faults = [_faults(str(tmp_path), rank)[0] for rank in (0, 1)]
    assert [(f["step"], f["source"], f["dest"], f["commit_failed_ranks"]) for f in faults] == \
        [(faults[0]["step"], faults[0]["source"], "failed", 1)] * 2
    assert "model 'm' layer 1" in faults[0]["reason"] and "here" not in faults[1]["reason"]
    assert len(_records(str(tmp_path), 0, "commit_failed")) == 1 and not _records(str(tmp_path), 1, "commit_failed")
    assert "model 'm' layer 1" in results[0]["refused"] and "1 rank(s)" in results[1]["refused"]
    for out in results:
        assert out["no_collective"] and out["state"] == "collecting" and out["exact"] and out["bad_rows"] == []
    report = _verdict(str(tmp_path))   # one rearrangement every rank aborted on the same step: no hang, no mismatch
    assert report.illegal_transitions == [] and report.verdict == "healthy", report.summary
    assert [a["step"] for a in report.aborted] == [faults[0]["step"]]


# -- a timed-out EP group: recover() onto a group the engine rebuilt ------------------------------------

def _group_times_out(rank: int, world: int, trace_dir: str) -> dict:
    import time

    import torch.distributed as dist

    ctl, model, old = _setup(rank, world, trace_dir, "sync", timeout=1.0)
    if rank == 1:   # rank 1 arrives long after rank 0's agreement on layer 1 timed out
        ctl.transfer_hooks.append(lambda layer, name, local: time.sleep(4.0) if layer == 1 and not ctl.history
                                  else None)
    _step(ctl, model, None, 0)
    _step(ctl, model, None, 1)
    out: dict = {"failed": ctl.state}
    try:
        ctl.recover(group=object())
    except ValueError as exc:
        out["bad_group"] = str(exc)
    group = dist.new_group(ranks=list(range(world)))   # the engine rebuilds its group
    ctl.recover(group=group)
    out["group"] = ctl.group_name
    out.update(_serve_on(ctl, model, group, 2))
    ctl.close()
    return out


def test_recover_adopts_a_group_rebuilt_after_a_gloo_timeout(tmp_path):
    """A timed-out gloo all-reduce fails both ranks; recover(group=new) agrees on it, and rearranging goes on exact."""
    for rank, out in enumerate(run_ranks(_group_times_out, 2, args=(str(tmp_path),), timeout=150)):
        assert out["failed"] == "failed" and "group must be" in out["bad_group"]
        assert out["group"] == "ep.1" and out["state"] == "collecting" and out["exact"] and out["bad_rows"] == []
        assert "committed" in out["outcomes"]
        assert [r["group"] for r in _records(str(tmp_path), rank, "group_adopted")] == ["ep.1"]
    assert _verdict(str(tmp_path)).illegal_transitions == []


# -- ranks that declared different placements ---------------------------------------------------------------

def _declared_apart(rank: int, world: int, trace_dir: str) -> dict:
    placement = np.tile(np.arange(12) % 8, (3, 1))
    if rank == 1:
        placement[:, [6, 7]] = placement[:, [7, 6]]
    ctl, model, group = _setup(rank, world, trace_dir, "sync", phy2log=placement)
    for s in range(3):
        _step(ctl, model, None, s)
    out = {"state": ctl.state, "maps": ctl.maps("m").phy2log.tolist(), "declared": placement.tolist(),
           "outcomes": [(h["outcome"], h["reason"]) for h in ctl.history]}
    try:
        ctl.recover()
    except RuntimeError as exc:
        out["refused"] = str(exc)
    ctl.close()
    return out


def test_ranks_that_declared_different_maps_move_nothing_and_fail_naming_the_model(tmp_path):
    """Rank 1 declares two slots swapped: the planning all-reduce finds it, every rank fails, nothing moves."""
    for rank, out in enumerate(run_ranks(_declared_apart, 2, args=(str(tmp_path),), timeout=120)):
        assert out["state"] == "failed" and out["maps"] == out["declared"]
        (outcome, reason), = out["outcomes"]
        assert outcome == "rejected" and "model 'm'" in reason and "same phy2log" in reason
        assert "disagree on the committed maps of model 'm'" in out["refused"]
        assert not [r for r in _records(str(tmp_path), rank, "collective_start") if r["op"] != "all_reduce"]
    report = _verdict(str(tmp_path))
    assert report.illegal_transitions == [] and report.verdict == "failed" and report.culprit_ranks == [0, 1]
