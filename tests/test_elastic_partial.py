"""A scale-up whose rearrangement stops part-way: it switches when the new group is intact, else goes back
with maps sized for the old group (elastic/partial.py, elastic/scaling.py, handover.project_back).

Real processes: old ranks 0-1 of a 2 -> 3 scale-up and the joiner (new rank 2), N = 4 experts,
S = 2 slots per rank, no redundancy before the scale. Two drills in one launch:

- ``transient``: old rank 1's transfer of layer 1 raises once (the group stays intact);
- ``joiner_dies``: the joiner exits inside its transfer of layer 1, after layer 0 committed a
  layout in which expert 1 lives only on the joiner.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.elastic.scale_plan import place_lost

N, S, LAYERS, HIDDEN = 4, 2, 2, 4
T = 2.0  # collective_timeout_s
DRILLS = ("transient", "joiner_dies")


def _reload(model, phy2log, lost):
    """What an engine does for each lost expert before recover(): its weights into the slot the maps name."""
    with torch.no_grad():
        for d in lost:
            if "slot" not in d:  # no slot named: nothing the engine could reload
                continue
            rank, row = divmod(d["slot"], S)
            if rank == model.rank:
                w, b = model.expert_weights[d["layer"]]
                ew, eb = model.expert(d["layer"], int(phy2log[d["layer"], d["slot"]]))
                w[row].copy_(ew)
                b[row].copy_(eb)


def _body(drill, pid, host, port, log_dir, results):
    """One process of a drill (top level: the forkserver imports it); pid 0-1 old ranks, 2 the joiner."""
    import os

    from eplb_fsm.config import EplbConfig
    from eplb_fsm.elastic import ScaleAborted
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.fsm.transfers import LayerMover
    from eplb_fsm.sim.model import ToyMoE
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo

    torch.set_num_threads(1)
    info = StoreInfo(host, port, namespace=drill)
    try:
        if pid == 2:
            model = ToyMoE(LAYERS, N, 3 * S - N, HIDDEN, 2, 2, 3)
            with torch.no_grad():  # what it gets must come from the old ranks
                for tensors in model.expert_weights:
                    for t in tensors:
                        t.zero_()
            if drill == "joiner_dies":
                transfer = LayerMover.transfer

                def dies_at_layer_1(self, new, layer):
                    if layer == 1:
                        os._exit(3)
                    return transfer(self, new, layer)
                LayerMover.transfer = dies_at_layer_1
            config = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=3 * S - N,
                                collective_timeout_s=T)
            ctl = EplbController.join(config, {"main": model}, store=info, generation=1, rank=2, world_size=3,
                                      trace_dir=log_dir, timeout_s=20.0)
            out = dict(ctl.scalings[-1])
        else:
            model = ToyMoE(LAYERS, N, 2 * S - N, HIDDEN, 2, pid, 2)
            config = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=2 * S - N,
                                collective_timeout_s=T)
            ctl = EplbController(config, group=StoreGroup.connect(info, 0, pid, 2, 20.0), trace_dir=log_dir)
            ctl.add_model(model, "main")
            model.serve(ctl, 3)
            if drill == "transient" and pid == 1:
                raised = []

                def once(layer, name, local):
                    if layer == 1 and not raised:
                        raised.append(layer)
                        raise RuntimeError("injected: a transient transfer error at layer 1")
                ctl.transfer_hooks.append(once)
            out = dict(ctl.request_scale(3, timeout_s=20.0))
        entry = ctl.models[0]
        out.update(final_state=ctl.state, world=ctl.world_size, maps=entry.maps.phy2log.tolist(),
                   num_physical=entry.num_physical, model_physical=model.num_physical_experts,
                   bad_rows=model.check_weights(entry.maps.phy2log))
        try:
            if ctl.state == "failed":
                _reload(model, entry.maps.phy2log, out["lost_experts"])
                ctl.recover()
                out["rows_after_reload"] = model.check_weights(entry.maps.phy2log)
            out["bad_outputs"] = model.serve(ctl, 3) if ctl.state == "collecting" else None
            if drill == "transient" and ctl.state == "collecting":  # a later rearrangement balances every layer
                out["later"] = (ctl.rearrange() or {}).get("outcome")
                out["later_maps"] = entry.maps.phy2log.tolist()
                out["bad_outputs"] += model.serve(ctl, 3)
                out["later_rows"] = model.check_weights(entry.maps.phy2log)
        except Exception as exc:  # reported with what the scale left
            out["after_error"] = f"{type(exc).__name__}: {exc}"
        ctl.close()
        results.put((drill, pid, out))
    except ScaleAborted as exc:
        results.put((drill, pid, {"outcome": "scale_aborted", "error": str(exc)}))
    except BaseException as exc:  # reported to the test
        results.put((drill, pid, {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}))


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    """Both drills in one launch; what each process reported, keyed (drill, pid)."""
    import queue as queue_mod
    import time

    from eplb_fsm.sim.launcher import process_context, stop_processes
    from eplb_fsm.transfer.groups import host_store

    ctx = process_context(None)
    master, info = host_store(timeout_s=30.0)
    results = ctx.Queue()
    log_dirs = {d: str(tmp_path_factory.mktemp(f"partial-{d}")) for d in DRILLS}
    names = [(d, pid) for d in DRILLS for pid in range(3)]
    procs = [ctx.Process(target=_body, args=(d, pid, info.host, info.port, log_dirs[d], results), daemon=True)
             for d, pid in names]
    for p in procs:
        p.start()
    expected = set(names) - {("joiner_dies", 2)}
    got: dict = {}
    give_up = time.monotonic() + 120.0  # far above a drill's bound: only a hang reaches it
    try:
        while not expected <= set(got) and time.monotonic() < give_up:
            try:
                d, pid, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            got[(d, pid)] = value
    finally:
        stop_processes(procs)
        del master
    assert expected <= set(got), f"drills did not finish: {sorted(expected - set(got))}"
    return got, log_dirs


@pytest.mark.multiprocess
def test_a_transient_transfer_error_still_switches_every_rank_with_the_placement_as_it_stands(drills):
    """Layer 1 fails once: all three ranks switch (partial, phase transfer) on one placement and serve exactly."""
    got, _ = drills
    outs = [got[("transient", pid)] for pid in range(3)]
    for pid, out in enumerate(outs):
        assert (out["outcome"], out["partial"], out["phase"], out["rank"]) == ("switched", True, "transfer", pid), out
        assert (out["final_state"], out["world"], out["layers_committed"]) == ("collecting", 3, 1), out
        assert out["num_physical"] == out["model_physical"] == 3 * S
        assert out["bad_rows"] == [] and out["bad_outputs"] == 0
        assert "rearrangement cut short" in out["reason"]
        assert (out["later"], out["later_rows"]) == ("committed", []), out
    assert all(out["maps"] == outs[0]["maps"] and out["later_maps"] == outs[0]["later_maps"] for out in outs)
    assert -1 in np.array(outs[0]["maps"])[1] and -1 not in np.array(outs[0]["later_maps"])


@pytest.mark.multiprocess
def test_a_transient_transfer_error_replays_healthy_with_the_resumed_switch(drills):
    """The traces replay healthy; each rank fires resumed, then switched, and no scale_requested but the real one."""
    from eplb_fsm.inspect import replay as rp
    from eplb_fsm.trace import read_trace, trace_path

    _, log_dirs = drills
    report = rp.replay_dir(log_dirs["transient"])
    assert report.verdict == "healthy", report.summary
    for rank in range(3):
        recs = read_trace(trace_path(log_dirs["transient"], rank, generation=1 if rank == 2 else 0))[0]
        moves = [r for r in recs if r["event"] == "transition" and r["trigger"] != "step"]
        triggers = [r["trigger"] for r in moves]
        at = triggers.index("resumed")
        assert triggers[at - 1:at + 2] == ["fault", "resumed", "switched"], moves
        assert moves[at]["generation"] == 1 and moves[at + 1]["partial"] is True
        # the request happened once, on the old ranks; a joiner never saw it
        assert triggers.count("scale_requested") == (0 if rank == 2 else 1), triggers


@pytest.mark.multiprocess
def test_a_joiner_dying_after_a_commit_leaves_old_group_maps_naming_the_slot_to_reload(drills):
    """Expert 1 lived only on the dead joiner: failed, old-sized maps name its slot; reload + recover serve exactly."""
    got, _ = drills
    outs = [got[("joiner_dies", pid)] for pid in range(2)]
    for out in outs:
        assert (out["outcome"], out["phase"], out["final_state"], out["world"]) == ("failed", "rollback", "failed", 2)
        assert out["num_physical"] == out["model_physical"] == 2 * S and np.shape(out["maps"]) == (LAYERS, 2 * S)
        assert [(d["layer"], d["expert"]) for d in out["lost_experts"]] == [(0, 1)], out
        slot = out["lost_experts"][0]["slot"]
        assert out["maps"][0][slot] == 1
        owner, row = divmod(slot, S)
        assert out["bad_rows"] == ([(0, row)] if out["rank"] == owner else []), out
        assert out["rows_after_reload"] == [] and out["bad_outputs"] == 0
    assert outs[0]["maps"] == outs[1]["maps"]


def test_place_lost_fills_an_empty_slot_first_else_a_duplicate():
    """A missing expert takes an empty slot if there is one, else the last slot of an expert held twice."""
    row = np.array([[3, 0, 2, 0], [0, -1, 2, 3]])
    assert place_lost(row, 4) == [(0, 1, 3), (1, 1, 1)]
    assert row.tolist() == [[3, 0, 2, 1], [0, 1, 2, 3]]
    assert place_lost(np.array([[0, 1, 2, 3]]), 4) == []
