"""Elastic EP scaling plan (pure): rank mappings, slot columns, resized maps and windows, lost experts.

The multi-process flows (real groups, joiners, leaving ranks) are in tests/test_sim_elastic.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.elastic import (
    default_rank_mapping,
    lost_experts,
    make_scale_plan,
    remap_columns,
    resize_window,
    slot_columns,
)
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.stats import LoadWindow, aggregate_logical


def test_default_mapping_drops_the_highest_ranks_and_keeps_numbers_on_scale_up():
    """Scale-down: ranks >= G' leave (-1); scale-up: every old rank keeps its number."""
    assert default_rank_mapping(4, 2) == {0: 0, 1: 1, 2: -1, 3: -1}
    assert default_rank_mapping(2, 3) == {0: 0, 1: 1}


def test_scale_down_plan_runs_in_the_old_group():
    """4 -> 2: transfer in the old group of 4, ranks 2-3 leave, survivors keep their numbers."""
    sp = make_scale_plan(4, 2)
    assert (sp.kind, sp.group_world, sp.leaving, sp.joiners) == ("scale_down", 4, (2, 3), ())
    assert sp.old_of_new == (0, 1)


def test_scale_up_plan_runs_in_the_new_group_with_joiners():
    """2 -> 3: transfer in the new group of 3, new rank 2 is the joiner."""
    sp = make_scale_plan(2, 3, generation=5)
    assert (sp.kind, sp.group_world, sp.joiners, sp.leaving, sp.generation) == ("scale_up", 3, (2,), (), 5)
    assert sp.old_of_new == (0, 1, -1)


def test_custom_mapping_choosing_who_leaves_and_where_joiners_go():
    """A mapping can drop rank 0 (ranks renumber densely) or put a joiner below old ranks."""
    down = make_scale_plan(3, 2, {0: -1, 1: 0, 2: 1})
    assert (down.leaving, down.old_of_new) == ((0,), (1, 2))
    up = make_scale_plan(2, 3, {0: 1, 1: 2})
    assert (up.joiners, up.old_of_new) == ((0,), (-1, 0, 1))


@pytest.mark.parametrize("old, new, mapping, match", [
    (4, 4, None, "must differ"),
    (4, 0, None, "new_world_size"),
    (4, 2, {0: 0, 1: -1, 2: -1, 3: -1}, "keeps 1 ranks"),
    (4, 2, {0: 0, 1: 0, 2: -1, 3: -1}, "same new rank"),
    (2, 3, {0: 0, 1: -1}, "would not be in it"),
    (2, 3, {0: 0, 1: 5}, r"\[0, 3\)"),
])
def test_bad_requests_are_rejected_naming_the_rule(old, new, mapping, match):
    """Impossible mappings raise ValueError before anything changes."""
    with pytest.raises(ValueError, match=match):
        make_scale_plan(old, new, mapping)


def test_slot_columns_move_whole_ranks_and_leave_new_ranks_empty():
    """Destination rank d takes source rank src[d]'s S slots; -1 gives empty columns."""
    cols = slot_columns([1, -1, 0], 2)
    assert cols.tolist() == [2, 3, -1, -1, 0, 1]
    row = np.array([[7, 8, 9, 10]])
    assert remap_columns(row, cols).tolist() == [[9, 10, -1, -1, 7, 8]]


def test_expand_then_project_round_trips_a_scale_up():
    """Old maps expanded into a bigger group (joiners empty) and projected back are unchanged."""
    sp = make_scale_plan(2, 4)
    old = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3]])
    S = 3
    grown = remap_columns(old, slot_columns(list(sp.old_of_new), S))
    assert grown.shape == (2, 12) and (grown[:, 6:] == -1).all()
    back = remap_columns(grown, slot_columns([sp.new_rank(i) for i in range(2)], S))
    assert np.array_equal(back, old)
    ExpertMaps.from_phy2log(grown, 4, allow_empty=True)  # a valid mid-scale-up placement


def test_scale_down_compaction_keeps_survivor_slots_in_new_rank_order():
    """3 -> 2 dropping rank 0: the new space is old ranks 1 then 2."""
    sp = make_scale_plan(3, 2, {0: -1, 1: 0, 2: 1})
    old_space = np.array([[-1, -1, 4, 5, 6, 7]])
    assert remap_columns(old_space, slot_columns(list(sp.old_of_new), 2)).tolist() == [[4, 5, 6, 7]]


def test_resized_window_keeps_counts_and_ring_position():
    """Moved columns keep every pass's counts; empty columns are zero; logical totals unchanged."""
    w = LoadWindow(2, 4, 3)
    for k in range(4):
        w.load_pass.copy_(torch.arange(8).reshape(2, 4) + k)
        w.record_pass()
    w.load_pass.fill_(5)
    cols = slot_columns([1, -1, 0], 2)
    new = resize_window(w, cols)
    assert (new.num_physical, new.next_index, new.filled) == (6, w.next_index, w.filled)
    assert torch.equal(new.window[:, :, 0:2], w.window[:, :, 2:4])
    assert torch.equal(new.window[:, :, 4:6], w.window[:, :, 0:2])
    assert int(new.window[:, :, 2:4].abs().sum()) == 0
    assert torch.equal(new.load_pass[:, 2:4], torch.zeros(2, 2, dtype=torch.int64))
    p2l = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    new_p2l = torch.as_tensor(remap_columns(p2l.numpy(), cols))
    assert torch.equal(aggregate_logical(w.physical_load(), p2l, 4),
                       aggregate_logical(new.physical_load(), new_p2l, 4))


def test_lost_experts_names_every_missing_layer_expert_pair():
    """Experts without any slot left are reported per layer."""
    assert lost_experts(np.array([[0, 1, -1, 1], [2, 2, 0, 1]]), 3) == [(0, 2)]
    assert lost_experts(np.array([[0, 1, 2]]), 3) == []


def test_request_scale_needs_a_store_group_and_enough_slots():
    """Without a store-built group (or with too few slots) request_scale refuses before any change."""
    model = ToyMoE(2, 8, 0, 4, 2, 0, 1)
    with EplbController(EplbConfig(window_size=4, step_interval=8)) as ctl:
        ctl.add_model(model, "main")
        with pytest.raises(ValueError, match="StoreGroup"):
            ctl.request_scale(2)
        assert ctl.state == "collecting" and ctl.scalings == []



# ---------------------------------------------------------------------------------------
# faults, with real processes: a leaving rank or a joiner dies in the middle of a scale

FAULT_TIMEOUT = 2.0
PLACEMENTS = {  # N = 4 experts, S = 2 slots per rank, 3 ranks; rank 2 leaves (or is the joiner)
    "spare": [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]],  # rank 2's experts have replicas elsewhere
    "lost": [[0, 1, 2, 0, 3, 1], [0, 1, 2, 1, 3, 0]],   # expert 3 lives only on rank 2
}


def _serve(ctl, model, steps, start):
    """Run engine steps; return how many outputs differed from the placement-free reference."""
    bad = 0
    for step in range(start, start + steps):
        x = model.make_batch(step, 16)
        out = model.forward(x, ctl.group)
        bad += int(not torch.equal(out, model.reference_forward(x)))
        ctl.step()
    return bad


def _fault_body(variant, rank, host, port, log_dir, results):
    """One process of a fault drill (top level: the forkserver imports it)."""
    import os

    from eplb_fsm.elastic import ScaleAborted
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo

    torch.set_num_threads(1)
    info = StoreInfo(host, port, namespace=variant)
    config = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=2,
                        collective_timeout_s=FAULT_TIMEOUT)
    try:
        if variant == "joiner" and rank == 2:
            model = ToyMoE(2, 4, 2, 4, 2, 2, 3)
            from eplb_fsm.fsm.transfers import LayerMover

            LayerMover.transfer = lambda self, new, layer: os._exit(3)  # dies in its first transfer
            EplbController.join(config, {"main": model}, store=info, generation=1, rank=2, world_size=3,
                                trace_dir=log_dir, timeout_s=10.0)
            results.put((variant, rank, {"outcome": "joined"}))
            return
        world = 2 if variant == "joiner" else 3
        placement = np.array(PLACEMENTS["spare" if variant == "joiner" else variant])[:, :2 * world]
        placement = placement if variant != "joiner" else np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
        model = ToyMoE(2, 4, 2 * world - 4, 4, 2, rank, world, phy2log=placement)
        cfg = config.replace(num_redundant_experts=2 * world - 4)
        ctl = EplbController(cfg, group=StoreGroup.connect(info, 0, rank, world, 10.0), trace_dir=log_dir)
        ctl.add_model(model, "main", phy2log=placement)
        bad = _serve(ctl, model, 3, 0)
        if rank == 2:
            ctl.transfer_hooks.append(lambda *a: os._exit(3))  # dies before its experts are out
        out = ctl.request_scale(3 if variant == "joiner" else 2, timeout_s=10.0)
        if ctl.state == "collecting":
            bad += _serve(ctl, model, 3, ctl.steps)
        rows = model.check_weights(ctl.models[0].maps.phy2log)
        value = {**out, "bad_outputs": bad, "bad_rows": rows, "world": ctl.world_size, "final_state": ctl.state}
        ctl.close()   # its `end` record is on disk before the fixture, told the drill is over, stops this process
        results.put((variant, rank, value))
    except ScaleAborted as exc:
        results.put((variant, rank, {"outcome": "scale_aborted", "error": str(exc)}))
    except BaseException as exc:  # reported to the test
        results.put((variant, rank, {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}))


@pytest.fixture(scope="module")
def fault_drills(tmp_path_factory):
    """Three drills in one launch: leaving rank dies (spare replicas / lost expert), joiner dies."""
    import queue as queue_mod
    import time

    from eplb_fsm.sim.launcher import process_context, stop_processes
    from eplb_fsm.transfer.groups import host_store

    ctx = process_context(None)
    master, info = host_store(timeout_s=30.0)
    results = ctx.Queue()
    log_dirs = {v: str(tmp_path_factory.mktemp(f"drill-{v}")) for v in ("spare", "lost", "joiner")}
    names = [(v, r) for v in ("spare", "lost", "joiner") for r in range(3)]
    procs = [ctx.Process(target=_fault_body, args=(v, r, info.host, info.port, log_dirs[v], results), daemon=True)
             for v, r in names]
    for p in procs:
        p.start()
    expected = {(v, r) for v in ("spare", "lost", "joiner") for r in (0, 1)}  # rank 2 dies everywhere
    got: dict = {}
    deadline = time.monotonic() + 90.0
    try:
        while not expected <= set(got) and time.monotonic() < deadline:
            try:
                v, r, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            got[(v, r)] = value
        for p in procs:   # the reporting ranks return now; stop_processes is for those that do not
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
    finally:
        stop_processes(procs)
        del master
    assert expected <= set(got), f"drills did not finish: {sorted(expected - set(got))}"
    exits = {name: p.exitcode for name, p in zip(names, procs)}
    return got, exits, log_dirs


@pytest.mark.multiprocess
def test_leaving_rank_dies_but_every_expert_survives(fault_drills):
    """The old group breaks mid scale-down; survivors hold every expert, finish on the new group, serve exactly."""
    got, exits, _ = fault_drills
    assert exits[("spare", 2)] == 3
    for rank in (0, 1):
        out = got[("spare", rank)]
        assert (out["outcome"], out["degraded"], out["world"], out["final_state"]) == ("switched", True, 2,
                                                                                        "collecting")
        assert out["bad_outputs"] == 0 and out["bad_rows"] == [] and out["rank"] == rank


@pytest.mark.multiprocess
def test_leaving_rank_dies_with_the_only_replica_fails_naming_experts(fault_drills):
    """Expert 3 lived only on the dead leaving rank: survivors go to failed and name it in every layer."""
    got, _, log_dirs = fault_drills
    for rank in (0, 1):
        out = got[("lost", rank)]
        assert (out["outcome"], out["final_state"]) == ("failed", "failed")
        assert out["lost_experts"] == [{"model": "main", "layer": 0, "expert": 3},
                                       {"model": "main", "layer": 1, "expert": 3}]
        assert "layer 0 expert 3" in out["reason"]
    recs = read_trace_records(log_dirs["lost"], 0)
    aborted = [r for r in recs if r["event"] == "scale_aborted"]
    assert aborted and aborted[-1]["lost_experts"] == got[("lost", 0)]["lost_experts"]


@pytest.mark.multiprocess
def test_joiner_dies_mid_transfer_and_the_old_group_serves_on(fault_drills):
    """The new group breaks during a scale-up: old ranks roll back onto the old group, maps and outputs exact."""
    got, exits, log_dirs = fault_drills
    assert exits[("joiner", 2)] == 3
    for rank in (0, 1):
        out = got[("joiner", rank)]
        assert (out["outcome"], out["world"], out["final_state"]) == ("aborted", 2, "collecting"), out
        assert out["bad_outputs"] == 0 and out["bad_rows"] == []
    recs = read_trace_records(log_dirs["joiner"], 0)
    phases = [r["phase"] for r in recs if r["event"] == "group_switch"]
    assert phases == ["prepare", "rollback"]
    triggers = [r["trigger"] for r in recs if r["event"] == "transition" and r["trigger"] != "step"]
    assert triggers[-2:] == ["fault", "recovered"]


def read_trace_records(log_dir, rank):
    from eplb_fsm.trace import read_trace, trace_path

    return read_trace(trace_path(log_dir, rank))[0]


@pytest.mark.multiprocess
def test_salvaged_scale_down_replays_with_the_real_events(fault_drills):
    """The survivors' salvage is traced as fault -> salvaged -> switched (no made-up event); replay finds no
    illegal transition and names the dead leaving rank as the only culprit."""
    from eplb_fsm.inspect.replay import replay_dir

    _, _, log_dirs = fault_drills
    for rank in (0, 1):
        recs = read_trace_records(log_dirs["spare"], rank)
        triggers = [r["trigger"] for r in recs if r["event"] == "transition" and r["trigger"] != "step"]
        salvage = triggers.index("salvaged")
        assert triggers[salvage - 1:salvage + 2] == ["fault", "salvaged", "switched"]
        assert "recovered" not in triggers and triggers.count("scale_requested") == 1
    rep = replay_dir(log_dirs["spare"])
    assert rep.illegal_transitions == [] and "divergence" not in rep.verdict, rep.summary
    assert (rep.verdict, rep.culprit_ranks) == ("hang", [2]), rep.summary
    from eplb_fsm.inspect.render import format_report

    assert "switched (degraded: a leaving rank died)" in format_report(rep)
