"""EplbController without processes: world 1, and G ranks played by threads of this process.

The thread harness (``eplb_fsm.testing.threads.ThreadWorld``) gives the controller a group object with
``all_reduce`` / ``transfer_communicator`` (the controller's documented seam for
non-torch groups), so the sync and async paths, faults and commits run for real on
2-4 ranks in a fraction of a second. Real gloo groups are in
test_fsm_controller_multiprocess.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import structlog
import torch

from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig
from eplb_fsm.sim.loads import zipf_load
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.stats import aggregate_logical
from eplb_fsm.testing.threads import run_threads
from eplb_fsm.trace import read_trace, record_steps


def skewed_target(layers: int, experts: int, seed: int = 3) -> np.ndarray:
    p = zipf_load(layers, experts, exponent=1.2, tokens_per_layer=100_000, rng=seed).astype(float) + 1
    return p / p.sum(axis=1, keepdims=True)


def drive(ctl, model, group, steps, target, tokens=64, start=0, on_step=None, check=True):
    """Run engine steps: forward (load recorded), output check against the reference, controller.step."""
    model.set_load_target(target)
    for s in range(start, start + steps):
        x = model.make_batch(s, tokens)
        out = model.forward(x, group)
        if check:
            assert torch.equal(out, model.reference_forward(x)), f"output changed at step {s}"
        ctl.step()
        if on_step is not None:
            on_step(s)


def events(ctl, kind=None):
    recs = ctl.trace.records
    return [r for r in recs if kind is None or r["event"] == kind]


def transitions(ctl):
    return [(r["trigger"], r["source"], r["dest"]) for r in events(ctl, "transition")]


class ProtocolModel:
    """The smallest protocol model (one float per slot), for world-1 tests."""

    def __init__(self, layers=3, experts=8, redundant=4, world=1):
        self.num_moe_layers = layers
        self.num_logical_experts = experts
        self.num_redundant_experts = redundant
        self.num_physical_experts = experts + redundant
        self.num_local_physical_experts = (experts + redundant) // world
        self.num_expert_groups = 1
        self.expert_weights = [[torch.zeros(self.num_local_physical_experts, 2)] for _ in range(layers)]
        self.calls = 0

    def set_eplb_state(self, load_pass, log2phy, replica_count):
        self.load_pass, self.log2phy, self.replica_count = load_pass, log2phy, replica_count
        self.calls += 1


def cfg(**kw) -> EplbConfig:
    base = dict(window_size=8, step_interval=16, num_redundant_experts=4, collective_timeout_s=5.0)
    base.update(kw)
    return EplbConfig(**base)


# --------------------------------------------------------------------------- world 1


def test_header_first_then_model_then_steps(tmp_path):
    """The trace starts with a header holding the config, and every engine step leaves one step record."""
    ctl = EplbController(cfg(), trace_dir=str(tmp_path))
    ctl.add_model(ProtocolModel(), "main")
    for _ in range(10):
        ctl.step()
    ctl.close()
    records, bad = read_trace(ctl.trace.path)
    assert bad == 0
    assert records[0]["event"] == "header" and records[0]["config"]["step_interval"] == 16
    assert records[1]["event"] == "model_added"
    # quiet steps come as `steps` runs (issue 14): every step is still covered exactly once, in order
    per_step = [s for r in records for s in (
        [r["step"]] if r["event"] == "transition" and r["trigger"] == "step" else record_steps(r))]
    assert per_step == list(range(10))
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_a_closed_controller_refuses_every_call_that_acts(tmp_path):
    """After close() the calls that act raise RuntimeError naming themselves; the trace ends at `end`; queries work."""
    model = ProtocolModel()
    ctl = EplbController(cfg(), trace_dir=str(tmp_path))
    ctl.add_model(model, "main")
    for _ in range(5):
        ctl.step()
    ctl.close()
    ctl.close()  # idempotent
    calls = {
        "step": lambda: ctl.step(),
        "rearrange": lambda: ctl.rearrange(),
        "add_model": lambda: ctl.add_model(ProtocolModel(), "drafter"),
        "request_scale": lambda: ctl.request_scale(2),
        "recover": lambda: ctl.recover(),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"{name}\(\) on a closed EplbController"):
            call()
    assert ctl.steps == 5 and [e.name for e in ctl.models] == ["main"]
    records, bad = read_trace(ctl.trace.path)
    assert bad == 0 and records[-1]["event"] == "end" and records[-1]["how"] == "closed"
    assert ctl.state == "collecting" and ctl.maps("main").num_layers == 3
    assert set(ctl.state_seconds) == {"collecting", "planning"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"start_step": -1}, "start_step must be >= 0"),
        ({"start_step": 2.5}, "start_step must be an integer"),
        ({"device": "gpu0"}, "device: 'gpu0' is not a torch device"),
        ({"group": object()}, "group must be a torch.distributed process group"),
        ({"role": "observer"}, "role must be 'member' or 'joiner'"),
    ],
)
def test_bad_construction_arguments_are_refused_before_a_trace_exists(tmp_path, kwargs, message):
    """Each bad constructor argument is a ValueError naming it, raised before the trace file is made."""
    with pytest.raises(ValueError, match=message):
        EplbController(cfg(), trace_dir=str(tmp_path / "logs"), **kwargs)
    assert not (tmp_path / "logs").exists()


def test_a_model_whose_set_eplb_state_raises_is_not_added():
    """add_model hands the model its state before adding it: if that raises, nothing is added or traced."""
    class Refusing(ProtocolModel):
        def set_eplb_state(self, load_pass, log2phy, replica_count):
            raise RuntimeError("router not ready")

    ctl = EplbController(cfg(), keep_trace=True)
    with pytest.raises(RuntimeError, match="router not ready"):
        ctl.add_model(Refusing(), "main")
    assert ctl.models == [] and ctl.num_layers == 0 and not events(ctl, "model_added")
    model = ProtocolModel()
    ctl.add_model(model, "main")  # the name is free, and the layers start at 0
    assert ctl.model("main").layer_offset == 0 and model.calls == 1 and ctl.machine.num_layers == 3
    ctl.close()


def test_state_seconds_count_each_state_visited():
    """state_seconds holds every state entered so far, the current one included, none negative."""
    ctl = EplbController(cfg(step_interval=8), keep_trace=True)
    ctl.add_model(ProtocolModel(), "main")
    assert set(ctl.state_seconds) == {"collecting"}
    for _ in range(3):
        ctl.step()  # the second step is due: planning, then back to collecting (nothing to move at world 1)
    seconds = ctl.state_seconds
    assert set(seconds) == {"collecting", "planning"} and min(seconds.values()) >= 0.0
    ctl.close()


def test_first_rearrangement_at_quarter_interval_then_every_interval():
    """Rearrangements are due after step_interval//4 steps, then every step_interval steps."""
    ctl = EplbController(cfg(step_interval=16), keep_trace=True)
    ctl.add_model(ProtocolModel(), "main")
    for _ in range(50):
        ctl.step()
    due = [r["step"] for r in events(ctl, "transition") if r["trigger"] == "step" and r["due"]]
    assert due == [3, 19, 35]  # counts 4, 20, 36 steps
    assert ctl.steps_until_due == 16 - (50 - 36)


def test_world1_plan_moves_nothing_and_is_skipped():
    """With one rank nothing can move: plan_ready carries moves=0/worth=False and a plan_skipped says why."""
    model = ProtocolModel()
    ctl = EplbController(cfg(step_interval=8), keep_trace=True)
    ctl.add_model(model, "main")
    before = ctl.maps("main").phy2log.copy()
    for _ in range(2):
        model.load_pass[:, 0] += 50  # a very hot expert
        ctl.step()
    assert transitions(ctl)[-2:] == [("step", "collecting", "planning"), ("plan_ready", "planning", "collecting")]
    ready = events(ctl, "transition")[-1]
    assert ready["moves"] == 0 and ready["worth"] is False
    skipped = events(ctl, "plan_skipped")
    assert skipped and skipped[-1]["reason"] == "no_moves"
    assert np.array_equal(ctl.maps("main").phy2log, before)
    assert ctl.history[-1]["outcome"] == "skipped"


def test_dummy_steps_count_toward_interval_but_not_the_window():
    """Dummy steps advance the interval (ranks stay in lock-step) and leave the window untouched."""
    model = ProtocolModel()
    ctl = EplbController(cfg(step_interval=16), keep_trace=True)
    ctl.add_model(model, "main")
    for _ in range(3):
        model.load_pass[0, 0] = 7  # padding tokens a dummy pass must not count
        ctl.step(is_dummy=True)
    window = ctl.model("main").window
    assert window.filled == 0 and int(window.load_pass.sum()) == 0
    ctl.step()
    assert ctl.state == "collecting"
    assert [r["trigger"] for r in events(ctl, "transition")][:1] == ["step"]  # the 4th step was due
    assert events(ctl, "steps")[0]["dummy"] == 3 and events(ctl, "steps")[0]["count"] == 3


def test_profile_step_reserves_buffers_and_changes_nothing():
    """A profile step allocates the transfer buffer but leaves state, counters and window alone."""
    model = ProtocolModel()
    ctl = EplbController(cfg(), keep_trace=True)
    entry = ctl.add_model(model, "main")
    model.load_pass += 3
    assert ctl.step(is_profile=True) == "collecting"
    assert ctl.steps == 0 and ctl.steps_until_due == 4
    assert entry.buffer.nbytes > 0
    assert entry.window.filled == 0 and int(entry.window.load_pass.sum()) == 0
    assert events(ctl, "profile")[0]["buffer_bytes"] == entry.buffer.nbytes


def test_profile_step_is_refused_while_a_rearrangement_may_use_the_buffers():
    """is_profile during an async rearrangement raises ValueError and changes nothing; once collecting it runs."""
    model = ProtocolModel()
    ctl = EplbController(cfg(use_async=True), keep_trace=True)
    ctl.add_model(model, "main")
    ctl.rearrange()
    assert ctl.state == "planning"
    with pytest.raises(ValueError, match="is_profile needs state collecting"):
        ctl.step(is_profile=True)
    assert ctl.state == "planning" and not events(ctl, "profile")
    for _ in range(2000):  # the worker plans in the background: wait for it, at most ~10 s
        if ctl.step() == "collecting":
            break
        time.sleep(0.005)
    assert ctl.state == "collecting" and ctl.step(is_profile=True) == "collecting"
    ctl.close()


@pytest.mark.parametrize("flag", ["is_dummy", "is_profile", "log_stats"])
@pytest.mark.parametrize("value", ["False", "no", 1, 0, None, np.array(True), torch.tensor(False)])
def test_a_step_flag_that_is_not_a_bool_is_refused_before_anything_counts(flag, value):
    """step(is_profile="False") or is_dummy="no" (once read by truth value): a ValueError naming the flag, nothing
    counted, windowed or traced."""
    model = ProtocolModel()
    ctl = EplbController(cfg(log_balancedness=True), keep_trace=True)
    entry = ctl.add_model(model, "main")
    model.load_pass += 5
    records = len(ctl.trace.records)
    with pytest.raises(ValueError, match=f"step\\(\\): {flag} must be a bool"):
        ctl.step(**{flag: value})
    assert (ctl.steps, ctl.state, entry.window.filled, len(ctl.trace.records)) == (0, "collecting", 0, records)
    ctl.step()   # the refused call left nothing half-done: the next step counts as the first
    assert (ctl.steps, entry.window.filled) == (1, 1)
    ctl.close()
    assert [(r["event"], r["step"]) for r in events(ctl) if r["event"] in ("step", "steps")] == [("step", 0)]


def test_numpy_bools_are_step_flags_like_python_bools():
    """A numpy bool_ (an engine's mask reduced with .all()) is read as the bool it holds, for each flag."""
    model = ProtocolModel()
    ctl = EplbController(cfg(log_balancedness=True), keep_trace=True)
    entry = ctl.add_model(model, "main")
    assert ctl.step(is_profile=np.bool_(True)) == "collecting" and ctl.steps == 0 and events(ctl, "profile")
    model.load_pass += 5
    ctl.step(is_dummy=np.bool_(True), is_profile=np.bool_(False), log_stats=np.bool_(False))
    assert (ctl.steps, entry.window.filled, ctl.balancedness_log) == (1, 0, [])
    ctl.step(is_dummy=np.bool_(False), log_stats=np.bool_(True))
    assert (ctl.steps, entry.window.filled, [s for s, _ in ctl.balancedness_log]) == (2, 1, [1])


def test_a_failed_machine_all_reduces_no_balancedness_until_recovered():
    """In failed, steps with log_stats=True at the interval issue no all-reduce on the broken group (no
    collective_error per interval); once recovered they log again."""
    import threading

    repaired = threading.Barrier(2)

    def body(rank, group):
        model = _toy(rank, 2, layers=2)
        ctl = EplbController(cfg(step_interval=8, collective_timeout_s=0.5, log_balancedness=True,
                                 log_balancedness_interval=1), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        group.fail_all_reduce = rank == 0
        ctl.step()
        ctl.step()   # due: the planning all-reduce fails -> failed
        assert ctl.state == "failed"
        starts, errors = len(events(ctl, "collective_start")), len(events(ctl, "collective_error"))
        for _ in range(3):
            assert ctl.step(log_stats=True) == "failed"
        quiet = (len(events(ctl, "collective_start")) - starts, len(events(ctl, "collective_error")) - errors)
        repaired.wait(30)
        group.fail_all_reduce = False
        if rank == 0:
            group.w.barrier.reset()
        repaired.wait(30)
        ctl.recover()
        logged = len(ctl.balancedness_log)
        ctl.step(log_stats=True)
        return quiet, len(ctl.balancedness_log) - logged

    assert run_threads(2, body) == [((0, 0), 1), ((0, 0), 1)]


def test_negative_load_is_rejected_and_nothing_moves():
    """A negative all-reduced load becomes a recoverable fault: back to collecting, maps unchanged."""
    model = ProtocolModel()
    ctl = EplbController(cfg(step_interval=8), keep_trace=True)
    ctl.add_model(model, "main")
    before = ctl.maps("main").phy2log.copy()
    model.load_pass[1, 2] = -5
    ctl.step()
    ctl.step()
    assert ctl.state == "collecting"
    assert events(ctl, "loads_rejected")[0]["reason"].startswith("negative load")
    fault = [r for r in events(ctl, "transition") if r["trigger"] == "fault"][0]
    assert fault["recoverable"] is True and fault["source"] == "planning" and fault["dest"] == "collecting"
    assert np.array_equal(ctl.maps("main").phy2log, before)
    assert ctl.history[-1]["outcome"] == "rejected"


def test_nan_load_from_estimator_is_rejected(monkeypatch):
    """A NaN planning load (decayed estimator) is rejected the same way."""
    model = ProtocolModel()
    ctl = EplbController(cfg(step_interval=8, load_estimator="decayed_sum", load_decay=0.5), keep_trace=True)
    entry = ctl.add_model(model, "main")
    monkeypatch.setattr(entry.window, "estimate",
                        lambda *a, **k: torch.full((3, 12), float("nan"), dtype=torch.float64))
    ctl.step()
    ctl.step()
    assert ctl.state == "collecting"
    assert events(ctl, "loads_rejected")[0]["reason"] == "NaN in the load"


def test_configured_load_estimator_feeds_the_plan(monkeypatch):
    """load_estimator/load_decay reach LoadWindow.estimate, whose result is what gets all-reduced."""
    model = ProtocolModel()
    ctl = EplbController(cfg(step_interval=8, load_estimator="subwindow_max", load_decay=0.5), keep_trace=True)
    entry = ctl.add_model(model, "main")
    calls = []
    real = entry.window.estimate

    def spy(estimator="window_sum", decay=0.9, *args, **kwargs):
        calls.append((estimator, decay))
        return real(estimator, decay, *args, **kwargs)

    monkeypatch.setattr(entry.window, "estimate", spy)
    model.load_pass[0, 1] = 4
    ctl.step()
    ctl.step()
    assert calls == [("subwindow_max", 0.5)]
    assert ctl.history[-1]["outcome"] == "skipped"  # world 1: planned on it, nothing to move


def test_main_and_drafter_share_one_all_reduce():
    """With a drafter, the due step issues exactly one all-reduce: both models' logical loads and map digests."""
    ctl = EplbController(cfg(step_interval=8), keep_trace=True)
    ctl.add_model(ProtocolModel(layers=3, experts=8), "main")
    ctl.add_model(ProtocolModel(layers=1, experts=8), "drafter")
    assert ctl.machine.num_layers == 4
    ctl.step()
    ctl.step()
    starts = [r for r in events(ctl, "collective_start") if r["step"] == 1]
    assert len(starts) == 1
    assert starts[0]["op"] == "all_reduce" and starts[0]["parts"] == ["loads", "maps"]
    assert starts[0]["shape"] == [3 * 8 + 1 * 8 + 2 * 16] and starts[0]["sizes"] == [32, 32]


def test_balancedness_logged_at_its_interval():
    """log_balancedness writes a balancedness record and a structlog event every interval steps."""
    model = ProtocolModel()
    ctl = EplbController(cfg(log_balancedness=True, log_balancedness_interval=3), keep_trace=True)
    ctl.add_model(model, "main")
    with structlog.testing.capture_logs() as logs:
        for _ in range(7):
            model.load_pass += 1
            ctl.step(log_stats=True)
        ctl.step(log_stats=False)  # not asked: nothing logged
    assert [s for s, _ in ctl.balancedness_log] == [0, 3, 6]
    assert len(events(ctl, "balancedness")) == 3
    assert sum(1 for e in logs if e["event"] == "eplb balancedness") == 3


def test_add_model_rejects_a_model_breaking_the_protocol():
    """A model whose slot rows don't match S is refused with a ValueError naming the attribute."""
    ctl = EplbController(cfg())
    bad = ProtocolModel()
    bad.expert_weights[1] = [torch.zeros(5, 2)]
    with pytest.raises(ValueError, match=r"expert_weights\[1\]\[0\]"):
        ctl.add_model(bad, "main")
    wrong = ProtocolModel(redundant=2)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        ctl.add_model(wrong, "main")
    assert ctl.models == []


def test_an_estimator_error_leaves_the_machine_collecting(monkeypatch):
    """A due step whose load estimate raises changes no state: still collecting, no rearrangement open, and the
    next step retries."""
    from eplb_fsm.stats import LoadWindow

    ctl = EplbController(cfg(step_interval=8, load_estimator="decayed_sum"), keep_trace=True)
    ctl.add_model(ProtocolModel(), "main")
    ctl.step()
    estimate = LoadWindow.estimate
    monkeypatch.setattr(LoadWindow, "estimate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("off device")))
    with pytest.raises(RuntimeError, match="off device"):
        ctl.step()
    assert ctl.state == "collecting" and ctl.rearranger.current is None and ctl.history == []
    assert not transitions(ctl)
    with pytest.raises(RuntimeError, match="off device"):
        ctl.rearrange()
    assert ctl.state == "collecting" and ctl.rearranger.current is None
    monkeypatch.setattr(LoadWindow, "estimate", estimate)
    ctl.step()
    assert [h["outcome"] for h in ctl.history] == ["skipped"]
    ctl.close()


def test_config_setter_takes_only_a_config_that_changes_num_redundant_experts():
    """Replacing a running controller's config with a dict or with other fields changed is refused, naming them."""
    ctl = EplbController(cfg())
    with pytest.raises(ValueError, match="config must be an EplbConfig"):
        ctl.config = ctl.config.to_dict()
    with pytest.raises(ValueError, match="not collective_timeout_s"):
        ctl.config = ctl.config.replace(collective_timeout_s=9.0)
    ctl.config = ctl.config.replace(num_redundant_experts=8)
    assert ctl.config.num_redundant_experts == 8 and ctl.rearranger.config is ctl.config
    ctl.close()


def test_add_model_refuses_num_nodes_that_cannot_split_the_ranks():
    """With num_nodes dividing the model's expert groups but not the world size, add_model refuses up front."""
    ctl = EplbController(cfg(num_nodes=2), keep_trace=True)
    model = ProtocolModel()
    model.num_expert_groups = 2
    with pytest.raises(ValueError, match=r"config.num_nodes \(2\) must divide the EP world size \(1\)"):
        ctl.add_model(model, "main")
    assert ctl.models == [] and not events(ctl, "model_added")
    model.num_expert_groups = 1  # not divisible by num_nodes: the policy packs globally, any world size works
    ctl.add_model(model, "main")
    ctl.close()


@pytest.mark.parametrize("device, message", [("meta", "'meta' holds no data"), ("cuda", "needs CUDA")])
def test_a_device_without_data_or_hardware_is_refused_before_a_trace_exists(tmp_path, device, message):
    """device='meta', or 'cuda' where torch has no CUDA, is a ValueError naming the device, before any trace."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=f"device: .*{message}"):
        EplbController(cfg(), device=device, trace_dir=str(tmp_path / "logs"))
    assert not (tmp_path / "logs").exists()


def test_rearrange_needs_collecting_and_a_model():
    """rearrange() refuses without a model or outside collecting."""
    ctl = EplbController(cfg())
    with pytest.raises(ValueError, match="add_model"):
        ctl.rearrange()


# --------------------------------------------------------------------------- thread ranks


def _toy(rank, world, layers=3, experts=8, redundant=4, seed=0):
    return ToyMoE(num_layers=layers, num_experts=experts, num_redundant=redundant, hidden=8, top_k=2,
                  rank=rank, world_size=world, seed=seed)


def test_sync_rearrangement_end_to_end_in_one_step():
    """Sync mode: the due step goes collecting->planning->transferring(0..L-1)->committing->collecting."""
    L = 3
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        drive(ctl, model, group, 20, target)
        return ctl, model

    (c0, m0), (c1, m1) = run_threads(2, body)
    for ctl, model in ((c0, m0), (c1, m1)):
        first = [h for h in ctl.history if h["outcome"] == "committed"]
        assert first and first[0]["step"] == 3 and first[0]["end_step"] == 3
        trail = [(r["trigger"], r["dest"], r["step"]) for r in events(ctl, "transition")][:L + 3]
        assert trail[0] == ("step", "planning", 3) and trail[1] == ("plan_ready", "transferring", 3)
        assert [t[:2] for t in trail[2:2 + L]] == [("layer_done", "transferring")] * (L - 1) + [
            ("layer_done", "committing")]
        assert trail[-1] == ("committed", "collecting", 3)
        assert model.check_weights(ctl.maps("main").phy2log) == []
        assert first[0]["balancedness_after"] > first[0]["balancedness_before"]
        # the router's tensors are the committed maps
        assert torch.equal(model.log2phy, torch.from_numpy(ctl.maps("main").log2phy))
    assert np.array_equal(c0.maps("main").phy2log, c1.maps("main").phy2log)
    assert not np.array_equal(c0.maps("main").phy2log, np.tile(np.arange(12) % 8, (L, 1)))
    # every transfer wave and every all-reduce is bracketed, and collectives pair up across ranks
    for ctl in (c0, c1):
        starts = events(ctl, "collective_start")
        ends = events(ctl, "collective_end")
        assert len(starts) == len(ends) and {r["op"] for r in starts} >= {"all_reduce", "batch_isend_irecv"}
    key = lambda c: [(r["group"], r["cseq"], r["op"]) for r in events(c, "collective_start")]  # noqa: E731
    assert key(c0) == key(c1)


def test_rearrange_after_a_forward_carries_that_pass_into_the_new_placement():
    """rearrange() between a forward and step(): that pass's tokens count for the experts they went to."""
    def body(rank, group):
        ctl = EplbController(cfg(step_interval=10_000, window_size=50, num_redundant_experts=0), group=group,
                             keep_trace=True)
        model = ToyMoE(num_layers=1, num_experts=4, num_redundant=0, hidden=4, rank=rank, world_size=2)
        ctl.add_model(model, "main")
        for _ in range(5):  # experts 0 and 1, both on rank 0, hot: the plan splits them
            if rank == 0:
                model.load_pass[0] = torch.tensor([100, 100, 1, 1])
            ctl.step()
        if rank == 0:
            model.load_pass[0] = torch.tensor([0, 7, 0, 0])  # this forward: 7 tokens for expert 1 in slot 1
        old = ctl.maps("main").phy2log.copy()
        entry = ctl.rearrange()
        new = ctl.maps("main").phy2log.copy()
        ctl.step()  # records the forward's pass
        logical = aggregate_logical(ctl.model("main").window.physical_load(), torch.from_numpy(new), 4)
        ctl.close()
        return entry["outcome"], not np.array_equal(old, new), logical.tolist()

    (outcome0, moved0, logical0), (outcome1, moved1, logical1) = run_threads(2, body)
    assert outcome0 == outcome1 == "committed" and moved0 and moved1
    assert logical0 == [[500, 507, 5, 5]] and logical1 == [[0, 0, 0, 0]]


def test_window_keeps_expert_totals_after_commit():
    """After a layer's maps change, the window still sums to the same per-expert load."""
    L = 2
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16, window_size=32), group=group, keep_trace=True)
        entry = ctl.add_model(model, "main")
        drive(ctl, model, group, 3, target)
        old = torch.from_numpy(entry.maps.phy2log.copy())
        logical_before = aggregate_logical(entry.window.physical_load(), old, 8)
        drive(ctl, model, group, 1, target, start=3)  # the due step (no new pass: remap only)
        assert ctl.history[-1]["outcome"] == "committed"
        new = torch.from_numpy(entry.maps.phy2log)
        window = entry.window
        # the due step's own pass was recorded before the remap; subtract it back out
        newest = window.window[(window.next_index - 1) % window.window_size]
        after = aggregate_logical(window.physical_load() - newest, new, 8)
        before_plus = logical_before
        return before_plus, after

    for before, after in run_threads(2, body):
        assert torch.equal(before, after)


def test_async_commits_one_layer_per_step_and_outputs_never_change():
    """Async mode: policy and transfers run in the worker; layers commit on later steps, outputs stay exact."""
    L = 3
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16, use_async=True), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        seen = []
        drive(ctl, model, group, 24, target, on_step=lambda s: seen.append((s, ctl.state, ctl.layer)))
        ctl.close()
        return ctl, model, seen

    results = run_threads(2, body)
    (c0, m0, seen0), (c1, m1, seen1) = results
    assert seen0 == seen1  # both ranks in the same state at every step
    done = [r for r in events(c0, "transition") if r["trigger"] == "layer_done"][:L]
    assert [r["layer"] for r in done] == list(range(L))
    assert len({r["step"] for r in done}) >= 2  # committed over several steps, not in one
    assert any(state == "transferring" for _, state, _ in seen0)
    for ctl, model in ((c0, m0), (c1, m1)):
        assert ctl.history[0]["outcome"] == "committed" and ctl.history[0]["end_step"] > ctl.history[0]["step"]
        assert model.check_weights(ctl.maps("main").phy2log) == []
    assert np.array_equal(c0.maps("main").phy2log, c1.maps("main").phy2log)
    # every waiting step issued its ready all-reduce on the main group
    assert [r for r in events(c0, "collective_start") if r.get("parts") == ["ready"]]


def test_close_mid_paced_layer_finishes_the_queued_transfers_without_waiting_for_steps():
    """async_max_bytes_per_step: close() during a layer of many chunks ends the worker, none left pending."""
    experts = 64   # one-row chunks: a layer needs more paced waits than close() waits for

    def body(rank, group):
        model = _toy(rank, 2, experts=experts, redundant=experts // 2)
        ctl = EplbController(cfg(num_redundant_experts=experts // 2, collective_timeout_s=1.0, use_async=True,
                                 async_max_bytes_per_step=1, async_prefetch=True), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        model.set_load_target(skewed_target(3, experts))
        s = 0
        while not (ctl.state == "transferring" and max(ctl.rearranger.current.plan.chunks) > 8):
            model.forward(model.make_batch(s, 32), group)
            ctl.step()
            s += 1
            assert s < 200
        ctl.close()   # both ranks, same step: their queued jobs still pair
        return ctl.worker.alive, ctl.worker.pending, [r for r in ctl.trace.records if r["event"] == "worker_stuck"]

    assert run_threads(2, body, timeout=120) == [(False, 0, [])] * 2


def test_a_paced_layer_is_not_late_on_the_balancedness_steps_before_its_last_chunk():
    """Balancedness logged every step joins the flags of a layer paced over more steps than the timeout: it commits."""
    experts = 32

    def body(rank, group):
        model = _toy(rank, 2, experts=experts, redundant=experts // 2)
        ctl = EplbController(cfg(num_redundant_experts=experts // 2, collective_timeout_s=0.5, use_async=True,
                                 async_max_bytes_per_step=1, log_balancedness=True, log_balancedness_interval=1),
                             group=group, keep_trace=True)
        ctl.add_model(model, "main")
        model.set_load_target(skewed_target(3, experts))
        done = []
        for s in range(150):
            model.forward(model.make_batch(s, 32), group)
            ctl.step(log_stats=True)
            done = [(r["trigger"], r.get("chunks", 0) > 4) for r in events(ctl, "transition")
                    if r["trigger"] in ("layer_done", "fault")]
            if done:
                break
            time.sleep(0.15)   # a healthy engine: a one-row chunk per step, the layer's steps past the timeout
        ctl.close()
        return done[:1]

    assert run_threads(2, body, timeout=120) == [[("layer_done", True)]] * 2


def test_a_paced_layer_still_in_flight_at_its_ready_step_counts_its_timeout_from_there():
    """A paced layer that starts 0.5 s late ends a few steps after its ready step, within the timeout: it commits."""
    experts = 64

    def body(rank, group):
        model = _toy(rank, 2, experts=experts, redundant=experts // 2)
        ctl = EplbController(cfg(num_redundant_experts=experts // 2, collective_timeout_s=1.0, use_async=True,
                                 async_max_bytes_per_step=1), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        model.set_load_target(skewed_target(3, experts))
        late_start: list = []

        def hook(layer, name, local):
            if not late_start:
                late_start.append(layer)
                time.sleep(0.5)   # a worker slow to start: the layer's chunks run behind the engine's steps

        ctl.transfer_hooks.append(hook)
        done = []
        for s in range(150):
            model.forward(model.make_batch(s, 32), group)
            ctl.step()
            done = [(r["trigger"], r.get("chunks", 0) > 10) for r in events(ctl, "transition")
                    if r["trigger"] in ("layer_done", "fault")]
            if done:
                break
            time.sleep(0.15)   # the layer's chunks alone span more than the timeout
        ctl.close()
        return done[:1]

    assert run_threads(2, body, timeout=120) == [[("layer_done", True)]] * 2


def test_injected_transfer_error_on_one_rank_aborts_consistently():
    """A transfer error on one rank at layer 1: layer 0 stays new, layers 1.. keep old maps and weights."""
    L = 3
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16, collective_timeout_s=0.5), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        initial = ctl.maps("main").phy2log.copy()

        def hook(layer, name, local):
            if rank == 0 and layer == 1:
                raise RuntimeError("injected transfer error")

        ctl.transfer_hooks.append(hook)
        drive(ctl, model, group, 4, target)
        return ctl, model, initial

    results = run_threads(2, body)
    maps = []
    for ctl, model, initial in results:
        assert ctl.state == "collecting"
        h = ctl.history[-1]
        assert h["outcome"] == "aborted" and h["layers_committed"] == 1
        fault = [r for r in events(ctl, "transition") if r["trigger"] == "fault"][0]
        assert fault["recoverable"] is True and fault["failed_layer"] == 1 and fault["source"] == "transferring"
        phy = ctl.maps("main").phy2log
        assert not np.array_equal(phy[0], initial[0])   # committed layer: new placement
        assert np.array_equal(phy[1:], initial[1:])       # the rest: old
        assert model.check_weights(phy) == []             # weights match the maps everywhere
        assert torch.equal(model.log2phy, torch.from_numpy(ctl.maps("main").log2phy))
        assert events(ctl, "transfer_group_reset")
        maps.append(phy)
    assert np.array_equal(maps[0], maps[1])


def test_async_worker_error_becomes_a_shared_fault():
    """An async transfer failing on one rank is seen by every rank on the same step (all-reduced flags)."""
    L = 3
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16, use_async=True, collective_timeout_s=0.5), group=group,
                             keep_trace=True)
        ctl.add_model(model, "main")

        def hook(layer, name, local):
            if rank == 1 and layer == 2:
                raise RuntimeError("injected worker error")

        ctl.transfer_hooks.append(hook)
        drive(ctl, model, group, 30, target)
        ctl.close()
        return ctl, model

    results = run_threads(2, body)
    steps = set()
    for ctl, model in results:
        fault = [r for r in events(ctl, "transition") if r["trigger"] == "fault"][0]
        steps.add(fault["step"])
        assert fault["dest"] == "collecting" and fault["layers_committed"] == 2
        assert model.check_weights(ctl.maps("main").phy2log) == []
    assert len(steps) == 1
    assert np.array_equal(results[0][0].maps("main").phy2log, results[1][0].maps("main").phy2log)


def test_broken_group_sends_the_machine_to_failed_and_recover_returns():
    """An all-reduce that fails is not recoverable: failed; recover() brings it back to collecting."""
    import threading

    repaired = threading.Barrier(2)

    def body(rank, group):
        model = _toy(rank, 2, layers=2)
        ctl = EplbController(cfg(step_interval=8, collective_timeout_s=0.5), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        group.fail_all_reduce = rank == 0
        drive(ctl, model, None, 2, skewed_target(2, 8), check=False)  # forward without collectives
        state = ctl.state
        ctl.step()  # steps in failed still count and are traced
        repaired.wait(30)  # the engine repairs the group once every rank has failed, then recovers all
        group.fail_all_reduce = False
        if rank == 0:
            group.w.barrier.reset()
        repaired.wait(30)
        ctl.recover()  # collective: a fresh transfer group
        return state, ctl.state, ctl.history[-1]["outcome"]

    for failed_state, after, outcome in run_threads(2, body):
        assert failed_state == "failed" and after == "collecting" and outcome == "aborted"


def test_gain_below_threshold_is_skipped_with_reason():
    """A plan whose predicted gain is <= min_balancedness_gain goes back to collecting and says why."""
    target = skewed_target(2, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=2)
        ctl = EplbController(cfg(step_interval=8, min_balancedness_gain=0.999), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        before = ctl.maps("main").phy2log.copy()
        drive(ctl, model, group, 2, target)
        return ctl, before

    for ctl, before in run_threads(2, body):
        ready = [r for r in events(ctl, "transition") if r["trigger"] == "plan_ready"][0]
        assert ready["moves"] > 0 and ready["worth"] is False and ready["dest"] == "collecting"
        assert events(ctl, "plan_skipped")[0]["reason"] == "gain_below_threshold"
        assert np.array_equal(ctl.maps("main").phy2log, before)


def test_main_and_drafter_rearrange_together_on_thread_ranks():
    """Main model and drafter: one load all-reduce on the due step, both models' layers move, both exact."""
    def body(rank, group):
        main, drafter = _toy(rank, 2, layers=2), _toy(rank, 2, layers=1, seed=7)
        ctl = EplbController(cfg(step_interval=16), group=group, keep_trace=True)
        ctl.add_model(main, "main")
        ctl.add_model(drafter, "drafter")
        main.set_load_target(skewed_target(2, 8, seed=1))
        drafter.set_load_target(skewed_target(1, 8, seed=2))
        for s in range(4):
            x = main.make_batch(s, 64)
            assert torch.equal(main.forward(x, group), main.reference_forward(x))
            assert torch.equal(drafter.forward(x, group), drafter.reference_forward(x))
            ctl.step()
        return ctl, main, drafter

    for ctl, main, drafter in run_threads(2, body):
        h = ctl.history[0]
        assert h["outcome"] == "committed" and h["num_layers"] == 3
        loads = [r for r in events(ctl, "collective_start") if r["step"] == 3 and "loads" in r.get("parts", [])]
        assert len(loads) == 1 and loads[0]["sizes"] == [2 * 8 + 1 * 8, 2 * 16]
        assert main.check_weights(ctl.maps("main").phy2log) == []
        assert drafter.check_weights(ctl.maps("drafter").phy2log) == []
        done = [(r["model"], r["model_layer"]) for r in events(ctl, "transition") if r["trigger"] == "layer_done"]
        assert done == [("main", 0), ("main", 1), ("drafter", 0)]


def test_rearrange_on_demand_runs_now_and_restarts_the_interval():
    """rearrange() plans and moves at once (sync) and the next due step is a full interval later."""
    def body(rank, group):
        model = _toy(rank, 2, layers=2)
        ctl = EplbController(cfg(step_interval=16), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        drive(ctl, model, group, 2, skewed_target(2, 8))
        entry = ctl.rearrange()
        return entry, ctl.steps_until_due, model.check_weights(ctl.maps("main").phy2log)

    for entry, until, bad in run_threads(2, body):
        assert entry["outcome"] == "committed" and entry["forced"] is True
        assert until == 16 and bad == []


def test_policy_failure_in_the_async_worker_is_a_recoverable_fault():
    """A policy that raises in the worker ends planning with a recoverable fault on every rank at the same step."""
    from eplb_fsm.policy.base import AbstractEplbPolicy
    from eplb_fsm.policy.registry import register_policy

    class Exploding(AbstractEplbPolicy):
        name = "test_exploding"

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log=None):
            raise RuntimeError("policy exploded")

    register_policy("test_exploding", Exploding, replace=True)

    def body(rank, group):
        model = _toy(rank, 2, layers=2)
        ctl = EplbController(cfg(step_interval=8, use_async=True, policy="test_exploding"), group=group,
                             keep_trace=True)
        ctl.add_model(model, "main")
        # the worker runs the policy when it gets a core: step until the agreed fault (every rank sees it on the
        # same step, so all stop together), at most 200 steps
        for s in range(200):
            drive(ctl, model, group, 1, skewed_target(2, 8), start=s)
            if any(r["trigger"] == "fault" for r in events(ctl, "transition")):
                break
        ctl.close()
        fault = [r for r in events(ctl, "transition") if r["trigger"] == "fault"][0]
        return fault["step"], fault["source"], fault["dest"], "policy exploded" in fault["reason"], ctl.state

    first, second = run_threads(2, body)
    assert first == second
    assert first[1:] == ("planning", "collecting", True, "collecting")


def test_movement_aware_policy_takes_its_target_from_the_config():
    """policy='movement_aware' is built from the config, so movement_balancedness_target reaches it."""
    ctl = EplbController(cfg(policy="movement_aware", movement_balancedness_target=0.95))
    assert ctl.policy.target == 0.95
    ctl.close()


def test_movement_aware_rearrangement_keeps_weights_exact():
    """A sync rearrangement under the movement-aware policy commits agreeing maps with exact weights."""
    L = 2
    target = skewed_target(L, 8)

    def body(rank, group):
        model = _toy(rank, 2, layers=L)
        ctl = EplbController(cfg(step_interval=16, policy="movement_aware"), group=group, keep_trace=True)
        ctl.add_model(model, "main")
        drive(ctl, model, group, 20, target)
        return ctl, model

    (c0, m0), (c1, m1) = run_threads(2, body)
    assert any(h["outcome"] == "committed" for h in c0.history)
    assert np.array_equal(c0.maps("main").phy2log, c1.maps("main").phy2log)
    for ctl, model in ((c0, m0), (c1, m1)):
        assert model.check_weights(ctl.maps("main").phy2log) == []


# --------------------------------------------------------------------------- misuse refused at add_model


def test_adding_the_same_model_twice_is_refused_before_anything_changes():
    """The same model under a second name: ValueError naming both, no entry, layers, trace record or state call."""
    ctl = EplbController(cfg(), keep_trace=True)
    model = ProtocolModel()
    ctl.add_model(model, "main")
    calls, added = model.calls, len(events(ctl, "model_added"))
    with pytest.raises(ValueError, match=r"model 'again' expert_weights\[0\]\[0\] shares memory with "
                                         r"model 'main' expert_weights\[0\]\[0\]"):
        ctl.add_model(model, "again")
    assert [e.name for e in ctl.models] == ["main"] and ctl.machine.num_layers == 3
    assert model.calls == calls and len(events(ctl, "model_added")) == added
    ctl.close()


def test_a_drafter_sharing_the_main_weights_cannot_silently_corrupt_them():
    """Thread ranks: a drafter built on the main model's weight tensors is refused, so main's weights stay exact."""
    def body(rank, group):
        main = _toy(rank, 2, layers=2)
        drafter = _toy(rank, 2, layers=2, seed=7)
        drafter.expert_weights = main.expert_weights  # the misuse: two "models", one set of weights
        ctl = EplbController(cfg(step_interval=4), group=group, keep_trace=True)
        ctl.add_model(main, "main")
        with pytest.raises(ValueError, match="'drafter' expert_weights\\[0\\]\\[0\\] shares memory"):
            ctl.add_model(drafter, "drafter")
        drive(ctl, main, group, 6, skewed_target(2, 8))
        return ctl, main

    for ctl, main in run_threads(2, body):
        assert "committed" in [h["outcome"] for h in ctl.history]
        assert main.check_weights(ctl.maps("main").phy2log) == []


def test_a_phy2log_with_the_wrong_slot_count_is_refused_naming_the_rule():
    """add_model with a phy2log of P columns != S × G names phy2log and the rule; nothing is added."""
    ctl = EplbController(cfg(), keep_trace=True)
    with pytest.raises(ValueError, match=r"phy2log: must have shape \(num_moe_layers, S × G\) = \(3, 12 × 1 = 12\)"):
        ctl.add_model(ProtocolModel(), "main", phy2log=np.tile(np.arange(8), (3, 1)))
    assert ctl.models == [] and events(ctl, "model_added") == []
    ctl.close()


def test_steps_before_the_first_model_do_not_make_a_rearrangement_due():
    """100 steps without a model, then add_model: the first rearrangement comes a full first interval later."""
    ctl = EplbController(cfg(step_interval=16), keep_trace=True)
    for _ in range(100):
        ctl.step()
    model = ProtocolModel()
    ctl.add_model(model, "main")
    first = ctl.steps_until_due
    assert first == cfg(step_interval=16).first_rearrangement_step
    model.load_pass[:] = 1
    for _ in range(first - 1):
        assert ctl.step() == "collecting"
    assert not [r for r in events(ctl, "transition") if r["trigger"] == "step"]
    ctl.step()
    due = [r for r in events(ctl, "transition") if r["trigger"] == "step"]
    assert len(due) == 1 and due[0]["step"] == 100 + first - 1 and due[0]["due"] is True
    ctl.close()


def test_async_worker_nice_also_builds_the_transfer_group_niced_in_async_mode_only():
    """async_worker_nice=3: an async controller builds its transfer group niced by 3 (and niced its worker); a sync one
    by 0."""
    with EplbController(cfg(use_async=True, async_worker_nice=3)) as ctl:
        assert ctl.collectives.transfer_nice == 3 and ctl.worker.nice == 3
    with EplbController(cfg(use_async=False, async_worker_nice=3)) as ctl:
        assert ctl.collectives.transfer_nice == 0 and ctl.worker is None


def test_add_model_on_a_gloo_group_refuses_weights_off_the_cpu(one_rank_group):
    """On a real 1-rank gloo group, add_model refuses a model with meta weights and adds nothing; CPU weights are
    added."""
    with EplbController(cfg()) as ctl:
        model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=4, top_k=2, seed=0)
        model.expert_weights = [[t.to("meta") for t in layer] for layer in model.expert_weights]
        with pytest.raises(ValueError, match=r"expert_weights\[0\]\[0\]: is on meta.*\(gloo\) moves CPU tensors"):
            ctl.add_model(model, "main")
        assert ctl.models == [] and ctl.num_layers == 0
        ctl.add_model(ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=4, top_k=2, seed=0), "main")
        assert [e.name for e in ctl.models] == ["main"]


def test_a_joiners_watchdog_starts_in_scaling_and_reports_a_stalled_handover():
    """A joiner's machine starts in scaling; its watchdog knows, so a handover that hangs gets a stuck record."""
    from eplb_fsm.testing import ThreadWorld

    ctl = EplbController(cfg(watchdog_deadline_s=0.05), group=ThreadWorld(1).group(0), role="joiner",
                         keep_trace=True)
    try:
        ctl.watchdog.stop()
        assert ctl.state == ctl.watchdog.state == "scaling"
        stuck = ctl.watchdog.check(now=ctl.watchdog.since + 1.0)
        assert stuck is not None and stuck["state"] == "scaling"
    finally:
        ctl.close()


def test_close_says_so_when_the_worker_outlives_it():
    """A worker thread still running a job past close()'s wait leaves a worker_stuck record before the end."""
    ctl = EplbController(cfg(use_async=True), keep_trace=True)
    ctl.add_model(ProtocolModel(), "main")
    stop = ctl.worker.close
    ctl.worker.close = lambda timeout: False   # as if a transfer were still waiting for a peer
    ctl.close()
    stop(5.0)
    assert [r["event"] for r in ctl.trace.records][-2:] == ["worker_stuck", "end"]


def test_a_forced_rearrangement_is_stamped_with_the_next_engine_step():
    """rearrange() after 5 steps: its transition and its rearrangement record both carry step 5."""
    ctl = EplbController(cfg(step_interval=1000), keep_trace=True)
    model = ProtocolModel()
    ctl.add_model(model, "main")
    for _ in range(5):
        ctl.step()
    ctl.rearrange()
    forced = next(r for r in events(ctl, "transition") if r.get("forced"))
    done = events(ctl, "rearrangement")[-1]
    assert forced["step"] == done["step"] == ctl.steps == 5
    ctl.close()


class _LoneStoreRank:
    """Rank 0 of 1 of a store-backed group whose store went away: publishing the run id raises."""

    rank, world_size, namespace = 0, 1, "eplb"

    class store:   # noqa: N801 - stands for a TCPStore
        @staticmethod
        def set(key, value):
            raise ConnectionError("store at 127.0.0.1:1 is gone")

    def all_reduce(self, tensor, timeout_s):  # pragma: no cover - world 1: never called
        raise AssertionError("no all-reduce in a group of one")

    def transfer_communicator(self, timeout_s):  # pragma: no cover - never reached
        raise AssertionError("not reached")


def test_a_construction_failing_before_its_header_frees_the_trace_file_for_a_retry(tmp_path):
    """Publishing the run id raises (before the header): nothing written, and a new controller on that file opens."""
    with pytest.raises(ConnectionError, match="is gone"):
        EplbController(cfg(), group=_LoneStoreRank(), trace_dir=str(tmp_path), liveness_interval_s=0.05)
    path = tmp_path / "rank00000.jsonl"
    assert not path.exists() or read_trace(path)[0] == []   # no header, so no `end` of a session that never began
    EplbController(cfg(), trace_dir=str(tmp_path)).close()
    assert [r["event"] for r in read_trace(path)[0]] == ["header", "end"]


def test_a_construction_failing_after_its_header_ends_the_trace_and_frees_the_file(tmp_path, monkeypatch):
    """The async worker fails to start: the trace ends how=exception naming it, its threads stop, a retry opens."""
    import threading

    from eplb_fsm.fsm import worker

    class NoWorker:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("background worker 'w' did not start within 5 s")

    monkeypatch.setattr(worker, "BackgroundWorker", NoWorker)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="did not start"):
        EplbController(cfg(use_async=True), trace_dir=str(tmp_path), liveness_interval_s=0.05)
    records = read_trace(tmp_path / "rank00000.jsonl")[0]
    assert records[0]["event"] == "header" and records[-1]["event"] == "end"
    assert records[-1]["how"] == "exception" and "did not start" in records[-1]["error"]
    assert not [t for t in threading.enumerate() if t not in before and t.name == "eplb-liveness"]
    EplbController(cfg(), trace_dir=str(tmp_path)).close()


def test_a_controller_dropped_without_close_frees_its_trace_file_and_ends_its_threads(tmp_path):
    """Liveness and watchdog threads hold a dropped controller weakly, its async worker stops once it is collected:
    no thread outlives it, and its file opens again."""
    import gc
    import threading

    before = set(threading.enumerate())
    ctl = EplbController(cfg(watchdog_deadline_s=1.0, use_async=True), trace_dir=str(tmp_path),
                         liveness_interval_s=0.05)
    names = ("eplb-liveness", "eplb-watchdog", "eplb-worker-r0")
    threads = [t for t in threading.enumerate() if t not in before and t.name in names]
    assert len(threads) == 3
    del ctl
    gc.collect()
    again = EplbController(cfg(), trace_dir=str(tmp_path), liveness_interval_s=None)
    again.close()
    for thread in threads:
        thread.join(10.0)
    assert not any(t.is_alive() for t in threads)
    assert [r["event"] for r in read_trace(tmp_path / "rank00000.jsonl")[0]][-2:] == ["header", "end"]


def test_ranks_refused_for_a_config_mismatch_can_construct_again_in_the_same_process(tmp_path):
    """Two thread ranks with different configs raise ConfigMismatch with their traces closed; a retry opens them."""
    from eplb_fsm.run_identity import ConfigMismatch

    def differing(rank, group):
        with pytest.raises(ConfigMismatch):
            EplbController(cfg(step_interval=16 + rank), group=group, trace_dir=str(tmp_path), liveness_interval_s=0.05)

    def same(rank, group):
        EplbController(cfg(), group=group, trace_dir=str(tmp_path), liveness_interval_s=0.05).close()

    run_threads(2, differing, timeout=30.0)
    run_threads(2, same, timeout=30.0)
    for rank in (0, 1):
        ends = [r for r in read_trace(tmp_path / f"rank{rank:05d}.jsonl")[0] if r["event"] == "end"]
        assert [e["how"] for e in ends] == ["exception", "closed"]


def test_a_close_interrupted_in_its_wait_for_the_worker_still_ends_and_frees_the_trace(tmp_path):
    """Ctrl-C (a KeyboardInterrupt raised where close() waits for the worker) goes on up with the trace ended and
    closed: a second close() is a no-op and a new controller opens the same file."""
    ctl = EplbController(cfg(use_async=True), trace_dir=str(tmp_path), liveness_interval_s=0.05)
    ctl.add_model(ProtocolModel(), "main")
    stop = ctl.worker.close

    def interrupted(timeout):
        raise KeyboardInterrupt   # what Python's SIGINT handler raises in the main thread's wait

    ctl.worker.close = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            ctl.close()
        ctl.close()
        assert ctl.trace.closed
        records, bad = read_trace(tmp_path / "rank00000.jsonl")
        assert bad == 0 and records[-1]["event"] == "end" and records[-1]["how"] == "closed"
        EplbController(cfg(), trace_dir=str(tmp_path), liveness_interval_s=None).close()
    finally:
        stop(5.0)


@pytest.mark.parametrize("counters, said", [
    ({"steps": 50, "since": 7, "threshold": 9}, "count missing"),
    ({}, "steps, since, threshold, count missing"),
    ([50, 7, 9, 0], "steps, since, threshold, count missing"),
    ({"steps": -5, "since": 0, "threshold": 4, "count": 0}, r"counters\['steps'\] must be >= 0"),
    ({"steps": 5, "since": 1, "threshold": 0, "count": 0}, r"counters\['threshold'\] must be >= 1"),
    ({"steps": 5, "since": 1.5, "threshold": 4, "count": 0}, r"counters\['since'\] must be an integer"),
    ({"steps": 5, "since": 1, "threshold": 4, "count": True}, r"counters\['count'\] must be an integer"),
])
def test_restore_counters_refuses_bad_counters_naming_the_key_before_changing_any(counters, said):
    """A missing key, a negative or non-integer value: ValueError naming the key, and every counter as it was."""
    ctl = EplbController(cfg(), keep_trace=True, liveness_interval_s=None)
    before = ctl.export_counters()
    with pytest.raises(ValueError, match=said):
        ctl.restore_counters(counters)
    assert ctl.export_counters() == before
    ctl.restore_counters({"steps": np.int64(50), "since": 7, "threshold": 9, "count": 2, "models": []})
    assert ctl.export_counters() == {"steps": 50, "since": 7, "threshold": 9, "count": 2}
    ctl.close()


@pytest.mark.parametrize("raised, how, error", [
    (None, "closed", None),
    (ValueError("engine bug"), "exception", "ValueError: engine bug"),
    (SystemExit(0), "closed", None),
    (SystemExit(3), "exception", "SystemExit: 3"),
])
def test_a_with_block_ends_the_trace_as_the_block_ended(raised, how, error):
    """An exception leaving `with EplbController(...)` ends the trace how=exception (replay: crashed), else closed."""
    def body():
        with EplbController(cfg(), keep_trace=True) as ctl:
            ctl.step()
            holder.append(ctl)
            if raised is not None:
                raise raised

    holder: list = []
    if raised is None:
        body()
    else:
        with pytest.raises(type(raised)):
            body()
    end = holder[0].trace.records[-1]
    assert (end["event"], end["how"], end.get("error")) == ("end", how, error)


def test_records_close_writes_reach_the_file_before_the_end_of_a_with_block_that_raised(tmp_path):
    """A record close() writes (worker_stuck, a posted read's end) lands in the file before the `end` how=exception."""
    with pytest.raises(RuntimeError, match="engine down"):
        with EplbController(cfg(), trace_dir=str(tmp_path)) as ctl:
            ctl.step()
            real_stop = ctl.liveness.stop

            def stop_and_report():   # stands in for a record close() writes on its way out
                ctl.trace.emit("worker_stuck", pending=1)
                real_stop()

            ctl.liveness.stop = stop_and_report
            raise RuntimeError("engine down")
    records = read_trace(tmp_path / "rank00000.jsonl")[0]
    assert [r["event"] for r in records][-2:] == ["worker_stuck", "end"]
    assert (records[-1]["how"], records[-1]["error"]) == ("exception", "RuntimeError: engine down")
