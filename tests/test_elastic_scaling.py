"""elastic/scaling.py: request_scale refuses bad requests before any change, and a scale-up that
fails after the group switch goes back to the old group, its record saying why.

A serving rank of a 1-rank group scales to 2; the new rank 1 is a stand-in thread that only
builds its part of the new group (and, in one test, answers the "go" all-reduce with 0).
The full flows with real joiners and leaving ranks are in tests/test_sim_elastic.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import eplb_fsm.elastic.scaling as scaling
from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic.handover import accepted_key
from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.testing.threads import run_threads
from eplb_fsm.transfer.groups import StoreGroup, connect_store

WAIT_S = 30.0  # every wait of these tests; only a hang reaches it
CONFIG = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=4, collective_timeout_s=1.0)


def _serving(info, config=CONFIG, models=None):
    """Rank 0 of a 1-rank group (generation 0) with its models, after one step."""
    ctl = EplbController(config, group=StoreGroup.connect(info, 0, 0, 1, WAIT_S), keep_trace=True)
    for name, model in (models or {"main": ToyMoE(2, 4, 4, 4, 2, 0, 1)}).items():
        ctl.add_model(model, name)
    ctl.step()
    return ctl


def _snapshot(ctl):
    """Everything a refused request must leave as it was."""
    return (len(ctl.trace.records), ctl.state, ctl.generation, ctl.last_generation, ctl.world_size, ctl.group_name,
            [e.maps.phy2log.tobytes() for e in ctl.models], [e.num_physical for e in ctl.models], len(ctl.scalings))


def _refused(ctl, match, *args, **kwargs):
    """``request_scale(*args, **kwargs)`` raises a ValueError matching ``match`` and changes nothing."""
    before = _snapshot(ctl)
    with pytest.raises(ValueError, match=match):
        ctl.request_scale(*args, **kwargs)
    assert _snapshot(ctl) == before
    ctl.close()


def _stand_in(info, go, errors):
    """New rank 1 of generation 1: accepts the handover as a joiner does, builds its part of the new group;
    with ``go``, adds it to the go all-reduce."""
    try:
        store = connect_store(info, WAIT_S)
        store.set(accepted_key(info.namespace, 1, 1), b"1")  # the serving rank builds only after this
        group = StoreGroup(store, 1, 1, 2, WAIT_S, namespace=info.namespace, info=info)
        comm = group.transfer_communicator(WAIT_S, WAIT_S)  # kept: a dropped one closes its pairs
        if go is not None:
            group.all_reduce(flags(go), WAIT_S)
        del comm  # only now: the serving rank is done with it
    except BaseException as exc:  # reported to the test
        errors.append(exc)


def _with_stand_in(info, go, request):
    """Run ``request()`` while the stand-in rank 1 builds the new group; the thread is joined with a timeout."""
    errors: list = []
    peer = threading.Thread(target=_stand_in, args=(info, go, errors), daemon=True)
    peer.start()
    try:
        return request()
    finally:
        peer.join(WAIT_S)
        assert not peer.is_alive() and not errors, errors


@pytest.mark.parametrize("bad", [True, "1.5", float("inf")])
def test_a_bad_timeout_is_refused_before_anything_changes(store, bad):
    """timeout_s True (not 1 s), "1.5" or inf: ValueError naming timeout_s; trace, maps, state, counter unchanged."""
    ctl = _serving(store)
    _refused(ctl, "timeout_s must be a finite number > 0", 2, timeout_s=bad)


def test_models_with_different_slots_per_rank_are_refused_before_anything_changes(store):
    """Two models with 12 and 8 slots per rank: ValueError naming both and the rule, nothing changed."""
    config = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=6, collective_timeout_s=1.0)
    models = {"a": ToyMoE(2, 6, 6, 4, 2, 0, 1), "b": ToyMoE(2, 2, 6, 4, 1, 0, 1, seed=1)}
    ctl = _serving(store, config, models)
    _refused(ctl, r"same slots per rank in every model .*, got \{'a': 12, 'b': 8\}", 2, timeout_s=1.0)


def test_a_strided_non_expert_tensor_is_refused_before_a_scale_up(store):
    """A transposed gate fails the request up front naming the model and the tensor, nothing changed."""
    model = ToyMoE(2, 4, 4, 4, 2, 0, 1)
    model.gate[1] = model.gate[1].t()
    ctl = _serving(store, models={"main": model})
    _refused(ctl, r"model 'main': non_expert_weights\[1\] must be a contiguous tensor", 2, timeout_s=1.0)


def test_a_bad_rank_mapping_is_refused_before_anything_changes(store):
    """A mapping naming an old rank 1 of a 1-rank group is a ValueError, not a scale that waits out its timeout."""
    ctl = _serving(store)
    _refused(ctl, "rank_mapping must have exactly the old ranks", 2, {0: 0, 1: 1}, timeout_s=1.0)


def test_a_handover_fault_keeps_its_reason_in_the_scaling_record(store):
    """The new rank answers "go" with 0: the scale-up is aborted in its handover phase, the record says why."""
    ctl = _serving(store)
    phy2log = ctl.models[0].maps.phy2log.copy()
    out = _with_stand_in(store, 0.0, lambda: ctl.request_scale(2, timeout_s=WAIT_S))
    assert (out["outcome"], out["phase"]) == ("aborted", "handover"), out
    assert "scale go: 1.0 of 2 ranks" in out["reason"]
    assert (ctl.state, ctl.world_size, ctl.group_name) == ("collecting", 1, "ep")
    assert (ctl.models[0].maps.phy2log == phy2log).all()
    ctl.close()


def test_an_error_after_the_group_switch_goes_back_to_the_old_group(store, monkeypatch):
    """set_space raising right after use_group: no exception escapes; old group, old maps, outcome aborted."""
    def broken(ctl, columns):
        raise RuntimeError("no room for the new maps")

    monkeypatch.setattr(scaling, "set_space", broken)
    ctl = _serving(store)
    phy2log = ctl.models[0].maps.phy2log.copy()
    out = _with_stand_in(store, None, lambda: ctl.request_scale(2, timeout_s=WAIT_S))
    assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), out
    assert "RuntimeError: no room for the new maps" in out["reason"]
    assert (ctl.state, ctl.world_size, ctl.group_name, ctl.generation) == ("collecting", 1, "ep", 0)
    assert (ctl.models[0].maps.phy2log == phy2log).all() and ctl.models[0].num_physical == phy2log.shape[1]
    assert [r["phase"] for r in ctl.trace.records if r["event"] == "group_switch"] == ["prepare", "rollback"]
    ctl.close()


def test_a_rollback_after_a_commit_fault_stays_failed_until_the_layers_are_reloaded(store, monkeypatch):
    """A commit that raised part-way in the new group: no rollback to collecting; recover(reloaded=...) clears it."""
    def commit_fault(ctl, sp, world, to_group, from_group):
        ctl.rearranger.untrusted[("main", 1)] = "RuntimeError: injected half-written row"   # as broken_commit
        ctl.rearranger.commit_fault(1)
        return ctl.state

    monkeypatch.setattr(scaling, "join_handshake", lambda ctl, sp: None)
    monkeypatch.setattr(scaling, "rearrange_for_scale", commit_fault)
    ctl = _serving(store)
    out = _with_stand_in(store, None, lambda: ctl.request_scale(2, timeout_s=WAIT_S))
    assert (out["outcome"], out["phase"]) == ("failed", "rollback"), out
    assert "a commit raised part-way" in out["reason"]
    assert (ctl.state, ctl.world_size, ctl.group_name) == ("failed", 1, "ep")
    with pytest.raises(RuntimeError, match="model 'main' layer 1"):
        ctl.recover()
    ctl.recover(reloaded=[("main", 1)])
    assert ctl.state == "collecting" and not ctl.rearranger.untrusted and not ctl.rearranger.broken_ranks
    ctl.close()


def test_a_leaving_rank_whose_old_group_broke_says_its_lost_experts_are_unknown(store, monkeypatch):
    """Scale-down 2 -> 1, old group broken: the leaving rank's scale_aborted has lost_experts null, as documented."""
    def broken(ctl, sp, world, to_group, from_group):
        ctl.rearranger.group_fault(RuntimeError("injected: the old group broke"))
        return ctl.state

    monkeypatch.setattr(scaling, "rearrange_for_scale", broken)
    outs: dict = {}
    errors: list = []

    def rank(r):
        try:
            ctl = EplbController(CONFIG, group=StoreGroup.connect(store, 0, r, 2, WAIT_S), keep_trace=True)
            ctl.add_model(ToyMoE(2, 4, 4, 4, 2, r, 2), "main")
            out = ctl.request_scale(1, timeout_s=WAIT_S)
            outs[r] = (out, [x for x in ctl.trace.records if x["event"] == "scale_aborted"])
            ctl.close()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    out, aborted = outs[1]   # rank 1 leaves
    assert (out["role"], out["outcome"], out["phase"]) == ("leaving", "failed", "transfer"), out
    # unknown, not "nothing lost": the survivors decide what is lost without this rank
    assert len(aborted) == 1 and "lost_experts" in aborted[0] and aborted[0]["lost_experts"] is None, aborted
    assert "lost_experts" in out and out["lost_experts"] is None, out   # its scaling record says the same
    doc = (Path(__file__).parent.parent / "docs" / "events.md").read_text()
    paragraph = doc[doc.index("`scale_aborted`: the scale did not complete"):]
    paragraph = paragraph[:paragraph.index("```")]
    assert "`null`" in paragraph and "leaving rank" in paragraph, paragraph


def test_a_fault_in_the_scales_transfer_names_the_scale(store):
    """2 -> 1 whose transfer raises at layer 1 on rank 0: the rearranger's fault record carries ``scale``
    (docs/events.md), like the scale's other faults, and the scale ends aborted in its transfer."""
    config = EplbConfig(window_size=4, step_interval=1000, num_redundant_experts=4, collective_timeout_s=2.0)

    def rank(r, _thread_group):   # the ranks talk over the store's gloo group, not the thread world's
        ctl = EplbController(config, group=StoreGroup.connect(store, 0, r, 2, WAIT_S), keep_trace=True)
        ctl.add_model(ToyMoE(2, 4, 4, 4, 2, r, 2), "main")
        ctl.step()
        if r == 0:
            raised: list = []

            def once(layer, name, local):
                if layer == 1 and not raised:
                    raised.append(layer)
                    raise RuntimeError("injected transfer error at layer 1")

            ctl.transfer_hooks.append(once)
        out = (ctl.request_scale(1, timeout_s=5.0), list(ctl.trace.records))
        ctl.close()
        return out

    outs = run_threads(2, rank, timeout=WAIT_S)
    for r in range(2):
        out, records = outs[r]
        assert (out["outcome"], out["phase"]) == ("aborted", "transfer"), out
        faults = [rec for rec in records if rec.get("trigger") == "fault"]
        assert faults and all(f.get("scale") == out["generation"] for f in faults), faults
        assert faults[0]["source"] == "transferring", faults[0]
    # replay lists it once, with the scales, not also as an aborted rearrangement of its own
    report = diagnose({r: outs[r][1] for r in range(2)})
    assert report.aborted == [] and [(s["generation"], s["outcome"]) for s in report.scales] == [(1, "aborted")], \
        format_report(report)
