"""EplbController on real gloo groups (world 2 and 4), sync and async, with a drafter and injected faults.

Spawning costs seconds on a small machine, so each world size is one launch that runs
several scenarios in sequence (each with its own controller and transfer group). Every
rank returns plain data; the parent checks that all ranks agree (maps, histories, the
state at every step, the collective sequence) and that every check inside passed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.sim.launcher import run_ranks

pytestmark = pytest.mark.multiprocess


def _target(layers: int, experts: int, seed: int) -> np.ndarray:
    from eplb_fsm.sim.loads import zipf_load

    p = zipf_load(layers, experts, exponent=1.2, tokens_per_layer=100_000, rng=seed).astype(float) + 1
    return p / p.sum(axis=1, keepdims=True)


def _scenario(rank: int, world: int, mode: str, steps: int, inject: dict | None = None,
              drafter: bool = True, timeout: float = 2.0, prefetch: bool = False) -> dict:
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    group = dist.group.WORLD
    interval = 12
    config = EplbConfig(window_size=8, step_interval=interval, num_redundant_experts=4,
                        use_async=mode == "async", collective_timeout_s=timeout, async_prefetch=prefetch)
    models = {"main": ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=world)}
    if drafter:
        models["drafter"] = ToyMoE(num_layers=1, num_experts=8, num_redundant=4, hidden=8, rank=rank,
                                   world_size=world, seed=5)
    ctl = EplbController(config, group=group, keep_trace=True)
    for name, model in models.items():
        ctl.add_model(model, name)
    if inject is not None:
        fired = []

        def hook(layer, name, local):
            if rank == inject["rank"] and layer == inject["layer"] and not fired:
                fired.append(layer)
                raise RuntimeError("injected transfer error")

        ctl.transfer_hooks.append(hook)
    mismatches, states = [], []
    step = 0
    extra = 0
    while step < steps or (ctl.state != "collecting" and extra < 30):
        if step >= steps:
            extra += 1
        phase = step // interval
        for i, (name, model) in enumerate(models.items()):
            model.set_load_target(_target(model.num_moe_layers, 8, seed=10 * phase + i))
            x = model.make_batch(step, 48)
            if not torch.equal(model.forward(x, group), model.reference_forward(x)):
                mismatches.append((name, step))
        ctl.step()
        states.append((ctl.state, ctl.layer))
        step += 1
    bad_rows = {name: model.check_weights(ctl.maps(name).phy2log) for name, model in models.items()}
    # the router's view is the committed maps
    routers_ok = all(torch.equal(m.log2phy.cpu(), torch.from_numpy(ctl.maps(n).log2phy)) for n, m in models.items())
    collectives = [(r["group"], r["cseq"], r["op"]) for r in ctl.trace.records if r["event"] == "collective_start"]
    faults = [(r["step"], r.get("failed_layer"), r["dest"]) for r in ctl.trace.records
              if r["event"] == "transition" and r["trigger"] == "fault"]
    ctl.close()
    return {
        "mode": mode,
        "history": [(h["step"], h["end_step"], h["outcome"], h["moves"], h["layers_committed"]) for h in ctl.history],
        "mismatches": mismatches,
        "bad_rows": bad_rows,
        "routers_ok": routers_ok,
        "phy2log": {name: ctl.maps(name).phy2log.tolist() for name in models},
        "states": states,
        "collectives": collectives,
        "faults": faults,
        "final_state": ctl.state,
    }


def _world_body(rank: int, world: int, scenarios: list[dict]) -> list[dict]:
    return [_scenario(rank, world, **spec) for spec in scenarios]


def _check_agreement(results: list[list[dict]], names: list[str]) -> list[dict]:
    """Every rank ran every scenario identically and correctly; returns rank 0's results."""
    first = results[0]
    for rank_results in results:
        for name, mine, ref in zip(names, rank_results, first):
            assert mine["mismatches"] == [], f"{name}: outputs changed at {mine['mismatches'][:5]}"
            assert all(not bad for bad in mine["bad_rows"].values()), f"{name}: weights wrong {mine['bad_rows']}"
            assert mine["routers_ok"], f"{name}: router maps differ from committed maps"
            for key in ("history", "phy2log", "states", "faults", "final_state"):
                assert mine[key] == ref[key], f"{name}: ranks disagree on {key}"
            # the EP group's collectives line up exactly; after an injected transfer error the
            # failing rank legitimately skipped a transfer wave the others started
            ep = [c for c in mine["collectives"] if c[0] == "ep"]
            assert ep == [c for c in ref["collectives"] if c[0] == "ep"], f"{name}: EP collectives differ"
            if not mine["faults"]:
                # per group: in async mode the worker's waves interleave with the engine thread's
                # all-reduces as the threads run, which no rank has to agree on
                transfer = [c for c in mine["collectives"] if c[0] != "ep"]
                assert transfer == [c for c in ref["collectives"] if c[0] != "ep"], \
                    f"{name}: transfer collectives differ"
            assert mine["final_state"] == "collecting"
    return first


SCENARIOS_2 = [
    {"mode": "sync", "steps": 50},
    {"mode": "async", "steps": 50},
    {"mode": "sync", "steps": 40, "inject": {"rank": 0, "layer": 1}},
    {"mode": "async", "steps": 40, "inject": {"rank": 1, "layer": 2}},
    # async_prefetch: layer 2 (the drafter's) is queued behind layer 1 (the main model's)
    {"mode": "async", "steps": 50, "prefetch": True},
    {"mode": "async", "steps": 40, "inject": {"rank": 1, "layer": 1}, "prefetch": True},
]


def test_world2_sync_async_drafter_and_injected_faults():
    """World 2: sync, async and async with prefetch, with a drafter, rearrange exactly; injected errors abort
    consistently."""
    results = run_ranks(_world_body, 2, args=(SCENARIOS_2,), timeout=200)
    names = ["sync", "async", "sync+fault", "async+fault", "prefetch", "prefetch+fault"]
    sync, async_, sync_fault, async_fault, prefetch, prefetch_fault = _check_agreement(results, names)
    for res in (sync, async_, prefetch):
        committed = [h for h in res["history"] if h[2] == "committed"]
        assert len(committed) >= 3 and not res["faults"]
    assert all(h[0] == h[1] for h in sync["history"])                          # sync: all inside one step
    assert any(h[1] > h[0] for h in async_["history"] if h[2] == "committed")  # async: spread over steps
    for res, layer in ((sync_fault, 1), (async_fault, 2), (prefetch_fault, 1)):
        aborted = [h for h in res["history"] if h[2] == "aborted"]
        assert len(aborted) == 1 and aborted[0][4] == layer       # layers before the failed one committed
        assert res["faults"][0][1:] == (layer, "collecting")
        later = [h for h in res["history"] if h[2] == "committed" and h[0] > aborted[0][0]]
        assert later, "a rearrangement after the fault (on the fresh transfer group) must commit"
    groups = {c[0] for c in sync["collectives"]}
    assert groups == {"ep", "ep_transfer"}


SCENARIOS_4 = [
    {"mode": "sync", "steps": 30, "drafter": False},
    {"mode": "async", "steps": 30, "drafter": True},
]


def test_world4_sync_and_async_agree_and_stay_exact():
    """World 4: after several rearrangements all ranks hold the same maps and every weight row is exact."""
    results = run_ranks(_world_body, 4, args=(SCENARIOS_4,), timeout=150)
    sync, async_ = _check_agreement(results, ["sync", "async"])
    for res in (sync, async_):
        assert sum(1 for h in res["history"] if h[2] == "committed") >= 2
        assert res["history"][0][3] > 0


def _first_rearrangement(rank: int, world: int, max_bytes: int, overlap: bool = True, prefetch: bool = False) -> dict:
    """Async, one forced load shift: run until the first rearrangement ends; its placement, steps and outputs."""
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    group = dist.group.WORLD
    model = ToyMoE(num_layers=3, num_experts=8, num_redundant=4, hidden=16, rank=rank, world_size=world)
    config = EplbConfig(window_size=8, step_interval=12, num_redundant_experts=4, use_async=True,
                        collective_timeout_s=5.0, async_max_bytes_per_step=max_bytes, async_overlap_poll=overlap,
                        async_prefetch=prefetch)
    ctl = EplbController(config, group=group, keep_trace=True)
    ctl.add_model(model, "main")
    model.set_load_target(_target(3, 8, seed=3))
    mismatches, step = [], 0
    while not ctl.history and step < 300:
        x = model.make_batch(step, 48)
        if not torch.equal(model.forward(x, group), model.reference_forward(x)):
            mismatches.append(step)
        ctl.step()
        step += 1
    h = ctl.history[0] if ctl.history else {}
    out = {
        "outcome": h.get("outcome"), "steps_taken": h.get("end_step", 0) - h.get("step", 0), "moves": h.get("moves"),
        "phy2log": ctl.maps("main").phy2log.tolist(), "bad_rows": model.check_weights(ctl.maps("main").phy2log),
        "mismatches": mismatches, "chunk_boundaries": ctl.mover.chunk_boundaries,
        "chunk_timeouts": ctl.mover.chunk_timeouts,
        "row_bytes": sum(t[0].numel() * t.element_size() for t in model.expert_weights[0]),
        "ready": _ready_all_reduces(ctl.trace.records), "handed_over": ctl.rearranger.layer_jobs.handed_over,
        "layers_done": [(r["step"], r.get("chunks"), r.get("ready_step")) for r in ctl.trace.records
                        if r["event"] == "transition" and r["trigger"] == "layer_done" and r.get("changed")],
        "plan_step": next((r["step"] for r in ctl.trace.records
                           if r["event"] == "transition" and r["trigger"] == "plan_ready"), None),
    }
    ctl.close()
    return out


def _ready_all_reduces(records: list[dict]) -> list[tuple]:
    """(cseq, start step, end step, posted) of each ``ready`` all-reduce on the EP group, in start order."""
    starts, ends = {}, {}
    for r in records:
        if r.get("group") == "ep" and r["event"] == "collective_start" and r.get("parts") == ["ready"]:
            starts[r["cseq"]] = (r["step"], bool(r.get("posted")))
        elif r.get("group") == "ep" and r["event"] == "collective_end" and r["cseq"] in starts:
            ends[r["cseq"]] = r["step"]
    return [(c, step, ends.get(c), posted) for c, (step, posted) in sorted(starts.items())]


def _assert_committed_alike(a: dict, b: dict) -> None:
    """Both first rearrangements committed moves, exact weights and outputs, and the same placement."""
    for res in (a, b):
        assert res["outcome"] == "committed" and res["moves"] > 0
        assert res["bad_rows"] == [] and res["mismatches"] == []
    assert a["phy2log"] == b["phy2log"]


def _posted_vs_blocking(rank: int, world: int) -> list[dict]:
    return [_first_rearrangement(rank, world, 0, overlap=True), _first_rearrangement(rank, world, 0, overlap=False)]


def test_posted_ready_flags_are_read_a_step_later_with_the_same_result():
    """World 2, async: posted ready flags end on the next step, blocking ones within it; same placement, exact."""
    results = run_ranks(_posted_vs_blocking, 2, timeout=150)
    for posted, blocking in results:
        _assert_committed_alike(posted, blocking)
        assert posted["ready"] and blocking["ready"]
        assert all(p and end == start + 1 for _, start, end, p in posted["ready"]), posted["ready"]
        assert all(not p and end == start for _, start, end, p in blocking["ready"]), blocking["ready"]
        # one posted at a time: each is read before the next is started (on the same step at most)
        assert all(a[2] <= b[1] for a, b in zip(posted["ready"], posted["ready"][1:]))
        # the posted run commits each agreement a step later, never sooner
        assert posted["steps_taken"] >= blocking["steps_taken"]
    assert results[0][0]["ready"] == results[1][0]["ready"]   # both ranks posted and read on the same steps


def _prefetch_vs_not(rank: int, world: int) -> list[dict]:
    whole = _first_rearrangement(rank, world, 0)
    return [whole, _first_rearrangement(rank, world, 0, prefetch=True),
            _first_rearrangement(rank, world, 2 * whole["row_bytes"], prefetch=True)]


def test_prefetched_layers_on_gloo_end_bit_exact_with_the_same_placement():
    """World 2, async_prefetch (whole and chunked): next layers are moved ahead, same placement, exact weights and
    outputs."""
    results = run_ranks(_prefetch_vs_not, 2, timeout=150)
    for plain, ahead, chunked in results:
        _assert_committed_alike(plain, ahead)
        _assert_committed_alike(plain, chunked)
        assert plain["handed_over"] == 0 and ahead["handed_over"] >= 1 and chunked["handed_over"] >= 1
    assert results[0][1]["ready"] == results[1][1]["ready"]   # both ranks polled on the same steps


def _chunked_vs_whole(rank: int, world: int) -> list[dict]:
    whole = _first_rearrangement(rank, world, 0)
    chunked = _first_rearrangement(rank, world, 2 * whole["row_bytes"])   # two expert rows per engine step
    return [whole, chunked]


def _one_row_chunks(rank: int, world: int) -> list[dict]:
    whole = _first_rearrangement(rank, world, 0)
    return [whole, _first_rearrangement(rank, world, whole["row_bytes"])]


def test_a_chunked_layer_is_not_polled_before_its_last_chunk_can_have_started():
    """One row per step: no ready flags are posted for a layer before job step + chunks; ranks poll alike, exact."""
    results = run_ranks(_one_row_chunks, 2, timeout=150)
    for whole, chunked in results:
        _assert_committed_alike(whole, chunked)
        assert all(chunks == 1 for _, chunks, _ in whole["layers_done"])
        assert max(chunks for _, chunks, _ in chunked["layers_done"]) >= 3   # a layer whose early polls are skipped
        last_done = chunked["layers_done"][-1][0]
        layer_polls = [start for _, start, _, _ in chunked["ready"] if chunked["plan_step"] <= start < last_done]
        assert layer_polls
        # after the last layer's commit: one poll, in committing (every rank wrote every layer whole)
        assert [start for _, start, _, _ in chunked["ready"] if start >= last_done] == [last_done]
        for start in layer_polls:
            # the layer in flight when a poll starts (after the plan) is the first one done on a later step
            ready_step = next(ready for done, _, ready in chunked["layers_done"] if done > start)
            # at the poll of trace step s the shared step count is s + 1
            assert start + 1 >= ready_step, (start, chunked["layers_done"], chunked["ready"])
    assert results[0][1]["ready"] == results[1][1]["ready"]
    assert results[0][1]["layers_done"] == results[1][1]["layers_done"]


def test_chunked_async_transfer_ends_bit_exact_with_the_same_placement():
    """World 2, async_max_bytes_per_step = 2 rows: the same placement, exact weights, outputs unchanged, a step per
    chunk."""
    results = run_ranks(_chunked_vs_whole, 2, timeout=150)
    for whole, chunked in results:
        _assert_committed_alike(whole, chunked)
        assert whole["chunk_boundaries"] == 0 and chunked["chunk_boundaries"] > 0
        # every boundary not ended by the pacer's limit waited for (or found) an engine step
        assert chunked["steps_taken"] >= chunked["chunk_boundaries"] - chunked["chunk_timeouts"]
    assert results[0][1]["phy2log"] == results[1][1]["phy2log"]


def _groups_after_close_and_faults(rank: int, world: int) -> dict:
    """Three controllers closed, each after the engine built a subgroup over ranks 0-1 beside it, then transfer
    faults that re-create the transfer group, then the engine builds one more subgroup over ranks 0-1."""
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    engine_subs = []

    def controller(timeout: float, interval: int = 16):
        config = EplbConfig(window_size=8, step_interval=interval, num_redundant_experts=4,
                            collective_timeout_s=timeout)
        ctl = EplbController(config, group=dist.group.WORLD, keep_trace=True, liveness_interval_s=None)
        model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=world)
        ctl.add_model(model, "m")
        return ctl, model

    closed = []
    for _ in range(3):
        ctl, _ = controller(5.0)
        if rank < 2:   # the engine builds a group of its own while the controller's transfer group exists
            engine_subs.append(dist.new_group(ranks=[0, 1], use_local_synchronization=True))
        ctl.close()
        closed.append(ctl.transfer_group is None)
    ctl, model = controller(1.0, interval=8)

    def broken(layer, name, local):
        if rank == 0:
            raise RuntimeError("injected transfer error")

    ctl.transfer_hooks.append(broken)
    from eplb_fsm.sim.loads import zipf_load

    resets, s = [], 0
    while len(resets) < 3 and s < 200:
        p = zipf_load(2, 8, exponent=1.2, tokens_per_layer=100_000, rng=s // 8).astype(float) + 1
        model.set_load_target(p / p.sum(axis=1, keepdims=True))
        model.forward(model.make_batch(s, 32), dist.group.WORLD)
        ctl.step()
        s += 1
        resets = [r["group"] for r in ctl.trace.records if r["event"] == "transfer_group_reset"]
    state = ctl.state
    ctl.close()
    sums = None
    if rank < 2:   # the engine's own groups still build and work: no torch group name was handed out twice
        later = dist.new_group(ranks=[0, 1], use_local_synchronization=True)
        sums = []
        for group in (*engine_subs, later):
            total = torch.ones(1)
            dist.all_reduce(total, group=group)
            sums.append(total.item())
    return {"closed": closed, "resets": resets, "state": state, "sums": sums}


def test_closing_controllers_and_transfer_faults_leave_the_engines_own_groups_working():
    """gloo world 3: controllers closed and transfer groups re-created after faults; the engine's subgroup built
    before, and one built after, both all-reduce (no transfer group is destroyed: destroying one would hand a
    later locally synchronized group the name of a live one)."""
    for rank, out in enumerate(run_ranks(_groups_after_close_and_faults, 3, timeout=240)):
        assert out["closed"] == [True] * 3 and out["state"] == "collecting", out
        assert out["resets"] == ["ep_transfer.1", "ep_transfer.2", "ep_transfer.3"], out
        assert out["sums"] == ([2.0] * 4 if rank < 2 else None), out

