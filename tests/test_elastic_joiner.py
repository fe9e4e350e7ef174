"""elastic/joiner.py: join checks its arguments before any wait, and a failed handover says why.

Argument errors are ValueErrors raised at once, never ScaleAborted or GroupBuildError and
never a wait on the store. Each call runs in a thread joined with a timeout, so a call
that would wait forever fails the test instead of hanging it. A joiner whose model does
not match the serving rank's is refused before the group forms, in a real 1 -> 2 gloo
scale-up whose serving rank runs request_scale in a thread; so is the trace of a joiner
that raises once its controller exists.
"""

from __future__ import annotations

import pickle
import re
import threading

import pytest
import torch

from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic import ScaleAborted, make_scale_plan
from eplb_fsm.elastic.handover import config_for_handover, handover_state
from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.transfer.groups import StoreGroup, connect_store

WAIT_S = 30.0  # the bound on every wait of these tests; only a hang reaches it
CONFIG = EplbConfig(window_size=4, step_interval=100, num_redundant_experts=4, collective_timeout_s=1.0)
# the stand-in's own 1-rank controller: a build bounded by 1 s failed once on a loaded 2-core box
STAND_IN_CONFIG = CONFIG.replace(collective_timeout_s=WAIT_S)


def _bounded(call):
    """What ``call()`` raised (None if it returned), run in a thread joined with a timeout."""
    caught: list = []

    def run():
        try:
            call()
            caught.append(None)
        except BaseException as exc:  # reported to the test
            caught.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert caught, "join did not return: it waited instead of checking its arguments"
    return caught[0]


def _join(store, models=None, **overrides):
    args = dict(store=store, generation=1, rank=1, world_size=2, timeout_s=1.0)
    args.update(overrides)
    return EplbController.join(CONFIG, models or {"main": ToyMoE(2, 4, 12, 4, 2, 1, 2)}, **args)


@pytest.mark.parametrize("field, value, match", [
    ("rank", True, "rank must be an integer"),
    ("rank", 2, r"rank must be in \[0, world_size=2\)"),
    ("rank", -1, "rank must be >= 0"),
    ("world_size", 0, "world_size must be >= 1"),
    ("world_size", 2.0, "world_size must be an integer"),
    ("generation", True, "generation must be an integer"),
    ("generation", 0, "generation must be >= 1"),
])
def test_rank_world_size_and_generation_are_checked_before_any_wait(store, field, value, match):
    """A bool, float or out-of-range rank / world_size / generation is a ValueError naming it, at once."""
    exc = _bounded(lambda: _join(store, **{field: value}))
    assert type(exc) is ValueError and re.search(match, str(exc)), exc


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "1"])
def test_a_bad_timeout_is_a_value_error_with_a_store_or_its_info(store, raw, bad):
    """timeout_s 0, -1, inf, nan, True or "1" is a ValueError with a raw store and with a StoreInfo alike."""
    target = connect_store(store, WAIT_S) if raw else store
    exc = _bounded(lambda: _join(target, timeout_s=bad))
    assert type(exc) is ValueError and "timeout_s must be a finite number > 0" in str(exc), exc


def test_a_strided_non_expert_tensor_is_refused_before_waiting_for_the_handover(store):
    """A joiner whose gate is transposed gets a ValueError naming the tensor, without waiting for a handover."""
    model = ToyMoE(2, 4, 12, 4, 2, 1, 2)
    model.gate[0] = model.gate[0].t()
    exc = _bounded(lambda: _join(store, {"main": model}))
    assert type(exc) is ValueError and "non_expert_weights[0] must be a contiguous tensor" in str(exc), exc


def _serving_stand_in(info, errors, transfer_group, namespace=None):
    """Old rank 0 of a 1 -> 2 scale-up: publishes a real handover and forms the new group. With
    ``transfer_group`` it builds its transfer group and answers "go" with 0; without, it never builds one.
    ``namespace``: its group's store prefix on a raw store (default: the StoreInfo's own)."""
    try:
        group = StoreGroup.connect(info, 0, 0, 1, WAIT_S) if namespace is None else \
            StoreGroup(connect_store(info, WAIT_S), 0, 0, 1, WAIT_S, namespace=namespace)
        ctl = EplbController(STAND_IN_CONFIG, group=group)
        ctl.add_model(ToyMoE(2, 4, 4, 4, 2, 0, 1), "main")
        sp = make_scale_plan(1, 2, generation=1)
        state = handover_state(ctl, sp)
        state["config"] = config_for_handover(CONFIG)   # the joiner's, whose 1 s bounds what these tests time out
        ctl.group.store.set(ctl.group.key("handover", 1), pickle.dumps(state))
        group = ctl.group.successor(1, 0, 2, WAIT_S)
        comm = None
        if transfer_group:
            comm = group.transfer_communicator(WAIT_S, WAIT_S)  # kept: a dropped one closes its pairs
            group.all_reduce(flags(0.0), WAIT_S)
        else:
            threading.Event().wait(4 * CONFIG.collective_timeout_s)   # the joiner gives up on its transfer group
            group.close()
        ctl.close()
        del comm  # only now: the joiner is done with it
    except BaseException as exc:  # reported to the test
        errors.append(exc)


def _join_beside_stand_in(info, target, transfer_group=True, serving_namespace=None, **overrides):
    """What the joiner's ``join`` raised, old rank 0 played by a thread (joined with a timeout, error-free)."""
    errors: list = []
    old = threading.Thread(target=_serving_stand_in, args=(info, errors, transfer_group, serving_namespace),
                           daemon=True)
    old.start()
    try:
        return _bounded(lambda: _join(target, timeout_s=WAIT_S, **overrides))
    finally:
        old.join(WAIT_S)
        assert not old.is_alive() and not errors, errors


def test_a_failed_handshake_names_its_reason_in_scale_aborted(store):
    """The old rank answers "go" with 0: ScaleAborted names the handover phase and why it failed."""
    exc = _join_beside_stand_in(store, store, keep_trace=True)
    assert isinstance(exc, ScaleAborted), exc
    assert "handover phase: scale go: 1.0 of 2 ranks" in str(exc)


def test_a_raw_store_reaches_the_serving_group_through_its_namespace(store):
    """EplbController.join(namespace=...) with a raw store finds a handover published under that namespace."""
    exc = _join_beside_stand_in(store, connect_store(store, WAIT_S), namespace=store.namespace)
    # it got as far as the handshake, so it read the handover under the serving group's namespace
    assert isinstance(exc, ScaleAborted) and "handover phase: scale go" in str(exc), exc


def test_a_raw_store_namespace_with_a_slash_reaches_a_serving_group_built_under_it(store):
    """A serving group under 'ns/eplb' (StoreGroup accepts it): join(namespace='ns/eplb') reads its handover."""
    namespace = f"{store.namespace}/eplb"
    exc = _join_beside_stand_in(store, connect_store(store, WAIT_S), serving_namespace=namespace,
                                namespace=namespace)
    assert isinstance(exc, ScaleAborted) and "handover phase: scale go" in str(exc), exc


@pytest.mark.parametrize("bad", [None, "", 3])
def test_store_group_and_joiner_refuse_the_same_namespaces(store, bad):
    """StoreGroup refuses a None/''/3 namespace with the joiner's message, before it builds anything."""
    with pytest.raises(ValueError, match="namespace must be a non-empty string"):
        StoreGroup(connect_store(store, WAIT_S), 0, 0, 1, WAIT_S, namespace=bad)


def test_a_transfer_group_that_never_forms_is_scale_aborted(store):
    """The joiner's transfer group times out: ScaleAborted naming it (was a bare GroupBuildError)."""
    exc = _join_beside_stand_in(store, store, transfer_group=False)
    assert isinstance(exc, ScaleAborted) and "transfer group of generation 1 was not complete" in str(exc), exc


def test_a_joiner_whose_transfer_group_never_forms_ends_its_trace(store, tmp_path):
    """The header is written before the transfer group fails: the trace ends with `end` how=exception, closed."""
    from eplb_fsm.trace import read_trace, trace_path

    exc = _join_beside_stand_in(store, store, transfer_group=False, trace_dir=str(tmp_path))
    assert isinstance(exc, ScaleAborted), exc
    records = read_trace(trace_path(tmp_path, 1, generation=1))[0]   # a joiner's own file
    assert [r["event"] for r in records][0] == "header" and records[0]["role"] == "joiner"
    end = records[-1]
    assert (end["event"], end.get("how")) == ("end", "exception"), end
    assert end["error"].startswith("GroupBuildError: ") and "was not complete" in end["error"]


def test_the_wait_for_the_transfer_group_is_covered_by_liveness(tmp_path, monkeypatch):
    """The liveness thread runs while the constructor builds the transfer group (no silence a replay calls frozen)."""
    from eplb_fsm.fsm.collectives import Collectives
    from eplb_fsm.trace import read_trace, trace_path

    seen = []
    before = set(threading.enumerate())  # another test's controller may still be beating

    def build(self, *args, **kwargs):
        seen.append(any(t.name == "eplb-liveness" and t not in before for t in threading.enumerate()))
        raise RuntimeError("injected: the transfer group did not form")

    monkeypatch.setattr(Collectives, "new_transfer_group", build)
    with pytest.raises(RuntimeError, match="injected"):
        EplbController(CONFIG, trace_dir=str(tmp_path), role="joiner")
    assert seen == [True]
    end = read_trace(trace_path(tmp_path, 0))[0][-1]
    assert (end["event"], end.get("how"), end.get("error")) == (
        "end", "exception", "RuntimeError: injected: the transfer group did not form")


@pytest.mark.parametrize("label, bad", [
    ("store", dict(store="localhost:1234")),
    ("namespace", dict(raw=True, namespace=None)),
    ("namespace", dict(raw=True, namespace="")),
    ("namespace", dict(raw=True, namespace=3)),
    ("device", dict(device="bogus")),
    ("trace_dir", dict(trace_dir=5)),
    ("setup", dict(setup="hooks")),
])
def test_store_namespace_device_and_trace_dir_are_checked_before_any_wait(store, label, bad):
    """A str store, a raw store's None/''/3 namespace, a bogus device, a non-path trace_dir, a setup that is not
    callable: ValueError at once."""
    bad = dict(bad)
    target = connect_store(store, WAIT_S) if bad.pop("raw", False) else bad.pop("store", store)
    exc = _bounded(lambda: _join(target, **bad))   # a wait would end in ScaleAborted (no handover comes)
    rules = {"store": "store must be a StoreInfo or a torch.distributed.Store",
             "namespace": "namespace must be a non-empty string",
             "device": "device: 'bogus' is not a torch device",
             "trace_dir": "trace_dir must be a non-empty path",
             "setup": "setup must be None or a callable taking the joiner's controller, got 'hooks'"}
    assert type(exc) is ValueError and rules[label] in str(exc), exc


@pytest.mark.parametrize("below", [False, True])
def test_a_trace_dir_that_is_a_file_is_refused_before_any_wait(store, tmp_path, below):
    """trace_dir naming a file, or a folder below one: ValueError naming trace_dir, without waiting for a handover."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    path = blocker / "traces" if below else blocker
    exc = _bounded(lambda: _join(store, trace_dir=str(path)))
    assert type(exc) is ValueError and f"trace_dir: {path} is not a folder" in str(exc), exc


def test_a_model_that_does_not_fit_the_new_world_is_refused_before_any_wait(store):
    """A joiner model built for 2 ranks joining a group of 4: ValueError naming the model and the rule, at once."""
    exc = _bounded(lambda: _join(store, world_size=4))
    assert type(exc) is ValueError and str(exc).startswith("model 'main': model.num_local_physical_experts (8)"), exc


def _scale_up_beside(info, joiner_model, serving_model=None, **join_args):
    """A real 1 -> 2 gloo scale-up: old rank 0 runs request_scale in a thread, the joiner ``join``s here.

    Returns ``(what join raised, the serving rank's scaling entry, its controller)``; the thread is
    joined with a timeout. ``scale_timeout_s``: the serving rank's ``timeout_s`` (its wait for the joiner).
    """
    scale_timeout_s = join_args.pop("scale_timeout_s", 2.0)
    serving = EplbController(CONFIG, group=StoreGroup.connect(info, 0, 0, 1, WAIT_S), keep_trace=True,
                             trace_dir=join_args.get("trace_dir"))
    serving.add_model(serving_model or ToyMoE(2, 4, 4, 4, 2, 0, 1), "main")
    serving.step()
    outs: list = []
    thread = threading.Thread(target=lambda: outs.append(serving.request_scale(2, timeout_s=scale_timeout_s)),
                              daemon=True)
    thread.start()
    try:
        exc = _bounded(lambda: _join(info, {"main": joiner_model}, timeout_s=WAIT_S, **join_args))
    finally:
        thread.join(WAIT_S)
    assert not thread.is_alive() and outs, "request_scale did not return"
    return exc, outs[0], serving


def _float32_serving():
    """Old rank 0's model with float32 expert rows: the joiner's float64 rows would take the shorter
    float32 messages without an error from gloo."""
    model = ToyMoE(2, 4, 4, 4, 2, 0, 1)
    model.expert_weights = [[t.to(torch.float32) for t in tensors] for tensors in model.expert_weights]
    return model


def _wide_rows_joiner():
    """A joiner whose first expert tensor has (8, 8) rows where the serving rank's are (4, 4); its gates
    (the non-expert weights) match, so only the expert rows differ, and gloo would fill the larger
    rows from the shorter messages without an error."""
    model = ToyMoE(2, 4, 12, 4, 2, 1, 2)
    model.expert_weights = [[torch.zeros(8, 8, 8, dtype=torch.float64), b] for _, b in model.expert_weights]
    return model


@pytest.mark.parametrize("serving_model, joiner_model, field", [
    (_float32_serving, lambda: ToyMoE(2, 4, 12, 4, 2, 1, 2),
     "expert_weights[0][0] dtype torch.float64 differs from the serving ranks' torch.float32"),
    (lambda: None, _wide_rows_joiner, "expert_weights[0][0] row shape (8, 8) differs from the serving ranks' (4, 4)"),
])
def test_a_joiner_whose_expert_weights_differ_is_refused_and_no_rank_switches(store, serving_model, joiner_model,
                                                                              field):
    """Expert rows of another dtype or shape: the joiner refuses naming the field, the scale aborts, nobody switched."""
    exc, out, serving = _scale_up_beside(store, joiner_model(), serving_model())
    try:
        assert type(exc) is ValueError and f"model 'main': {field}" in str(exc), exc
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), out
        # the serving rank's reason carries the joiner's refusal, not just a group that never formed
        assert f"joiner rank 1 refused: model 'main': {field}" in out["reason"], out["reason"]
        assert (serving.state, serving.world_size, serving.group_name) == ("collecting", 1, "ep")
        assert not any(r["event"] == "transition" and r["trigger"] == "switched" for r in serving.trace.records)
    finally:
        serving.close()


def test_a_refusal_ends_the_serving_ranks_scale_without_waiting_out_their_timeout(store):
    """Serving timeout_s 600 s, far past the test's 30 s bound: the refusal still ends the scale, aborted in prepare."""
    exc, out, serving = _scale_up_beside(store, _wide_rows_joiner(), scale_timeout_s=600.0)
    try:
        assert type(exc) is ValueError, exc
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), out
        assert out["reason"].count("joiner rank 1 refused: model 'main': expert_weights[0][0] row shape") == 1, out
        assert serving.state == "collecting" and serving.world_size == 1
    finally:
        serving.close()


def test_a_joiner_that_raises_after_its_controller_is_built_ends_its_trace_crashed(store, tmp_path, monkeypatch):
    """An error inside join after the controller exists: `end` how=exception with the error; replay says crashed."""
    from eplb_fsm.elastic import joiner
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.trace import read_trace, trace_path

    def broken(ctl, sp):
        raise RuntimeError("injected: the handshake broke")

    monkeypatch.setattr(joiner, "join_handshake", broken)
    exc, out, serving = _scale_up_beside(store, ToyMoE(2, 4, 12, 4, 2, 1, 2), trace_dir=str(tmp_path))
    serving.close()
    assert isinstance(exc, RuntimeError) and not isinstance(exc, ScaleAborted), exc
    assert out["outcome"] == "aborted", out
    end = read_trace(trace_path(tmp_path, 1, generation=1))[0][-1]
    assert (end["event"], end.get("how"), end.get("error")) == (
        "end", "exception", "RuntimeError: injected: the handshake broke"), end
    report = replay_dir(str(tmp_path))
    assert report.verdict == "crashed" and sorted(report.culprit_ranks) == [1], report.summary
    assert "RuntimeError: injected: the handshake broke" in report.summary, report.summary


def test_setup_installs_transfer_hooks_that_run_in_the_joiners_own_scale(store):
    """join(setup=...) adds a transfer hook before the scale: it runs for each layer the scale moves to the joiner,
    in transferring, at the serving rank's step count (what --inject's step >= S compares with)."""
    calls: list = []
    joined: list = []

    def setup(ctl):
        joined.append(ctl)
        ctl.transfer_hooks.append(lambda layer, name, local: calls.append((layer, name, local, ctl.state, ctl.steps)))

    exc, out, serving = _scale_up_beside(store, ToyMoE(2, 4, 12, 4, 2, 1, 2), setup=setup)
    try:
        assert exc is None and out["outcome"] == "switched", (exc, out)
        assert calls == [(0, "main", 0, "transferring", 1), (1, "main", 1, "transferring", 1)], calls
        assert len(joined) == 1 and joined[0].state == "collecting" and joined[0].world_size == 2
    finally:
        serving.close()
        for ctl in joined:
            ctl.close()
