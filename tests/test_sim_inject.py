"""``--inject`` specs: parsing, the errors bad specs get, and how simulate wires injection in."""

from __future__ import annotations

import pytest

from eplb_fsm.cli import build_parser, main
from eplb_fsm.sim.inject import KINDS, Injection, Injector, check_injection, parse_spec, parse_specs

SMALL = ["--ranks", "2", "--layers", "3", "--experts", "8", "--redundant", "4", "--hidden", "8",
         "--tokens", "48", "--steps", "24", "--interval", "8", "--window", "8", "--no-png", "--no-progress"]


@pytest.mark.parametrize("spec, expected", [
    ("skip-step:rank=1,step=3", Injection("skip-step", 1, step=3)),
    ("stall-layer:rank=0,layer=2", Injection("stall-layer", 0, layer=2)),
    ("wrong-collective:rank=1,step=9", Injection("wrong-collective", 1, step=9)),
    ("die:rank=3,step=0", Injection("die", 3, step=0)),
    (" die : step=5 , rank=1 ", Injection("die", 1, step=5)),  # spaces and key order do not matter
])
def test_good_specs_parse(spec, expected):
    """A good spec parses to its Injection, and its canonical form parses back to the same one."""
    inj = parse_spec(spec)
    assert inj == expected
    assert parse_spec(inj.spec) == inj  # the canonical form parses back to the same injection


def test_every_kind_has_a_canonical_spec():
    """Every kind's spec with all its keys is its own canonical form."""
    for kind, keys in KINDS.items():
        spec = f"{kind}:" + ",".join(f"{k}=1" for k in keys)
        assert parse_spec(spec).spec == spec


@pytest.mark.parametrize("spec, words", [
    ("explode:rank=1,step=2", ["unknown kind 'explode'", "skip-step", "stall-layer", "wrong-collective", "die"]),
    ("die:rank=1", ["missing key step", "die needs rank=N,step=N"]),
    ("die", ["missing key rank, step"]),
    ("stall-layer:rank=1,step=2", ["unknown key 'step' for stall-layer", "rank, layer"]),
    ("die:rank=1,step=2,layer=0", ["unknown key 'layer' for die"]),
    ("die:rank=one,step=2", ["rank must be a non-negative integer", "'one'"]),
    ("die:rank=-1,step=2", ["rank must be a non-negative integer", "'-1'"]),
    ("die:rank=1,rank=0,step=2", ["key 'rank' given twice"]),
    ("die:rank,step=2", ["'rank' is not key=value"]),
    ("rank=1,step=2", ["must look like KIND:key=value"]),
    ("", ["must look like KIND:key=value"]),
])
def test_bad_specs_name_the_spec_and_the_rule(spec, words):
    """A bad spec is a ValueError that starts with --inject and the spec, then says the rule it breaks."""
    with pytest.raises(ValueError) as err:
        parse_spec(spec)
    text = str(err.value)
    assert text.startswith(f"--inject {spec!r}: ")
    for word in words:
        assert word in text


def test_range_checks_against_the_run():
    """Rank, step and layer must lie in the run's shape; the same injection twice is refused."""
    with pytest.raises(ValueError, match=r"rank 2 is out of range: the run has 2 rank\(s\) \(0\.\.1\)"):
        parse_specs(["die:rank=2,step=1"], ranks=2)
    with pytest.raises(ValueError, match=r"step 24 is out of range: the run has 24 step\(s\)"):
        parse_specs(["skip-step:rank=0,step=24"], ranks=2, steps=24)
    with pytest.raises(ValueError, match=r"layer 3 is out of range: the model has 3 layer\(s\)"):
        parse_specs(["stall-layer:rank=0,layer=3"], ranks=2, layers=3)
    with pytest.raises(ValueError, match="given twice"):
        parse_specs(["die:rank=0,step=1", "die:step=1,rank=0"], ranks=2)
    check_injection(parse_spec("stall-layer:rank=1,layer=2"), ranks=2, steps=5, layers=3)  # fine
    assert len(parse_specs(["die:rank=0,step=3", "skip-step:rank=1,step=2"], ranks=2, steps=24)) == 2


@pytest.mark.parametrize("spec, word", [
    ("die:rank=5,step=1", "rank 5 is out of range"),
    ("boom:rank=0", "unknown kind 'boom'"),
    ("stall-layer:rank=0", "missing key layer"),
    ("skip-step:rank=0,step=3,layer=1", "unknown key 'layer'"),
])
def test_simulate_refuses_bad_specs_with_exit_2(spec, word, capsys):
    """Bad specs stop simulate before any process starts: exit 2 and a message naming the spec."""
    code = main(["simulate", *SMALL, "--inject", spec])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--inject {spec!r}" in err and word in err


def test_simulate_help_documents_inject_and_watchdog():
    """simulate --help lists every --inject kind and the watchdog."""
    text = build_parser()._subparsers._group_actions[0].choices["simulate"].format_help()
    flat = " ".join(text.split())
    for word in ("--inject SPEC", "skip-step:rank=R,step=S", "stall-layer:rank=R,layer=K",
                 "wrong-collective:rank=R,step=S", "die:rank=R,step=S", "--watchdog S", "stuck"):
        assert word in flat, word


def test_inject_shortens_timeouts_and_turns_the_watchdog_on(tmp_path):
    """--inject: collective timeout 5 s and watchdog at half of it, unless given; the hook is added."""
    from eplb_fsm.commands.simulate import build_options

    parser = build_parser()
    plain = build_options(parser.parse_args(["simulate", *SMALL, "--log-dir", str(tmp_path / "a")]))
    assert (plain.collective_timeout_s, plain.watchdog_deadline_s, plain.hooks) == (20.0, 0.0, ())
    opts = build_options(parser.parse_args(["simulate", *SMALL, "--log-dir", str(tmp_path / "b"),
                                            "--inject", "die:rank=1,step=4", "--inject", "skip-step:rank=0,step=2"]))
    assert (opts.collective_timeout_s, opts.watchdog_deadline_s) == (5.0, 2.5)
    assert opts.extra["inject"] == ["die:rank=1,step=4", "skip-step:rank=0,step=2"]
    assert opts.hooks == (("eplb_fsm.sim.inject:make_injector",
                           {"specs": ["die:rank=1,step=4", "skip-step:rank=0,step=2"], "collective_timeout_s": 5.0}),)
    given = build_options(parser.parse_args(["simulate", *SMALL, "--log-dir", str(tmp_path / "c"),
                                             "--inject", "die:rank=1,step=4", "--collective-timeout", "3",
                                             "--watchdog", "0"]))
    assert (given.collective_timeout_s, given.watchdog_deadline_s) == (3.0, 0.0)
    watched = build_options(parser.parse_args(["simulate", *SMALL, "--log-dir", str(tmp_path / "d"),
                                               "--watchdog", "1.5"]))
    assert watched.watchdog_deadline_s == 1.5
    with pytest.raises(ValueError, match="--watchdog must be"):
        build_options(parser.parse_args(["simulate", *SMALL, "--watchdog", "-1"]))


class _Machine:
    def __init__(self) -> None:
        self.listeners = []


class _Controller:
    """Just enough of EplbController for the hook's bookkeeping."""

    def __init__(self) -> None:
        self.machine = _Machine()
        self.transfer_hooks = []
        self.history = []
        self.steps = 0


class _Ctx:
    def __init__(self, rank: int) -> None:
        self.rank, self.world, self.group = rank, 2, None
        self.controller = _Controller()
        self.model = object()
        self.extra: dict = {}


def test_injector_acts_only_on_its_rank():
    """Each rank gets the same hook; only the named rank skips, stalls or misbehaves."""
    inj = Injector(["skip-step:rank=1,step=3", "stall-layer:rank=1,layer=0"], collective_timeout_s=2.0)
    assert inj.engine_timeout_s == 16.0 and inj.stall_hold_s == 18.0
    other, mine = _Ctx(0), _Ctx(1)
    inj.on_start(other)
    assert other.controller.transfer_hooks == [] and inj.before_step(other, 3) is None
    inj1 = Injector(["skip-step:rank=1,step=3", "stall-layer:rank=1,layer=0"], collective_timeout_s=2.0)
    inj1.on_start(mine)
    assert len(mine.controller.transfer_hooks) == 1
    assert inj1.before_step(mine, 2) is None
    assert inj1.before_step(mine, 3) == {"skip_step": True}
    assert mine.extra["inject"]["done"] == [{"spec": "skip-step:rank=1,step=3", "step": 3,
                                            "what": "controller.step() not called"}]
    # the stall hook ignores other layers and, released at the end of the run, gives up with an error
    hook = mine.controller.transfer_hooks[0]
    hook(1, "main", 1)
    inj1.on_finish(mine, {})
    with pytest.raises(RuntimeError, match="injected stall: layer 0 was never transferred"):
        hook(0, "main", 0)
    hook(0, "main", 0)  # once only


def test_injector_stops_the_rank_after_a_fault():
    """A fault transition makes the rank raise RankFault at the end of that step (exit non-zero)."""
    from eplb_fsm.fsm.machine import Fired
    from eplb_fsm.sim.inject import RankFault

    ctx = _Ctx(0)
    inj = Injector([], collective_timeout_s=2.0)
    inj.on_start(ctx)
    inj.after_step(ctx, 0)  # nothing happened
    ctx.controller.steps = 5
    for listener in ctx.controller.machine.listeners:
        listener(Fired("fault", "transferring", "failed", 1, {"recoverable": False}))
    ctx.controller.history.append({"outcome": "aborted", "reason": "all_reduce of ['ready'] failed"})
    with pytest.raises(RankFault, match=r"rank 0 stopped at step 4: its controller fired fault at step 4 "
                                        r"\(transferring -> failed: all_reduce of \['ready'\] failed\)"):
        inj.after_step(ctx, 4)


def test_wrong_collective_wraps_the_collectives_object_for_one_all_reduce():
    """Armed at its step, the next all-reduce becomes a broadcast; every other call reaches the wrapped object."""
    from types import SimpleNamespace

    import torch

    class Inner:
        name, rank = "ep", 1

        def __init__(self) -> None:
            self.calls = []

        def all_reduce(self, parts, timeout_s, **fields):
            self.calls.append(list(parts))
            return parts

    ctx, inner = _Ctx(1), Inner()
    ctx.controller.collectives = inner
    ctx.controller.rearranger = SimpleNamespace(collectives=inner)
    inj = Injector(["wrong-collective:rank=1,step=3"], collective_timeout_s=2.0)
    inj.on_start(ctx)
    inj.before_step(ctx, 2)
    assert ctx.controller.collectives is inner
    inj.before_step(ctx, 3)
    wrapped = ctx.controller.collectives
    assert wrapped is not inner and ctx.controller.rearranger.collectives is wrapped and wrapped.name == "ep"
    sent = []
    wrapped.broadcast = lambda parts, timeout_s: sent.append(list(parts)) or parts
    wrapped.all_reduce({"loads": torch.zeros(2)}, 1.0)
    wrapped.all_reduce({"ready": torch.zeros(3)}, 1.0)
    assert sent == [["loads"]] and inner.calls == [["ready"]]
    assert ctx.extra["inject"]["done"][-1]["what"] == "broadcast instead of the all-reduce of ['loads']"


# -- issue 12: kill / freeze (real signals), fired and unfired injections ---------------------------


@pytest.mark.parametrize("spec, expected", [
    ("kill:rank=1,step=5", Injection("kill", 1, step=5)),
    ("kill:rank=0,step=9,layer=2", Injection("kill", 0, step=9, layer=2)),
    ("freeze:rank=1,step=5,seconds=3", Injection("freeze", 1, step=5, seconds=3)),
    ("freeze:layer=1,seconds=4,step=9,rank=1", Injection("freeze", 1, step=9, layer=1, seconds=4)),
])
def test_kill_and_freeze_specs_parse(spec, expected):
    """kill/freeze parse with the optional layer; the canonical form parses back."""
    inj = parse_spec(spec)
    assert inj == expected and parse_spec(inj.spec) == inj


@pytest.mark.parametrize("spec, words", [
    ("freeze:rank=1,step=5", ["missing key seconds", "freeze needs rank=N,step=N,seconds=N"]),
    ("kill:rank=1,step=5,seconds=2", ["unknown key 'seconds' for kill"]),
    ("kill:rank=1,layer=0", ["missing key step"]),
])
def test_bad_kill_and_freeze_specs(spec, words):
    """A bad kill/freeze spec names the spec and the rule."""
    with pytest.raises(ValueError) as err:
        parse_spec(spec)
    assert all(word in str(err.value) for word in words)


def test_freeze_needs_at_least_a_second():
    """seconds=0 would not freeze anything: refused, naming the field."""
    with pytest.raises(ValueError, match="seconds must be >= 1"):
        parse_specs(["freeze:rank=0,step=1,seconds=0"], ranks=2)


def test_scale_and_inject_combine_except_wrong_collective(tmp_path):
    """--scale with --inject is accepted (a joiner's rank may be named); wrong-collective with --scale is not."""
    from eplb_fsm.commands.simulate import build_options

    args = build_parser().parse_args(["simulate", *SMALL, "--scale", "8:3", "--inject", "kill:rank=2,step=9",
                                      "--log-dir", str(tmp_path)])
    opts = build_options(args)
    assert opts.extra["inject"] == ["kill:rank=2,step=9"] and opts.extra["scale"] == ["8:3"]
    args = build_parser().parse_args(["simulate", *SMALL, "--scale", "8:3", "--inject",
                                      "wrong-collective:rank=0,step=9", "--log-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="wrong-collective cannot be combined with --scale"):
        build_options(args)


def test_a_fault_after_die_or_kill_ended_the_rank_is_refused():
    """A fault at or after the step a die / kill (no layer) ends its rank is refused naming both; others pass."""
    for specs, refused, ender in (
        (["die:rank=0,step=1", "die:rank=0,step=2"], "die:rank=0,step=2", "die:rank=0,step=1"),
        (["die:rank=0,step=2", "die:rank=0,step=1"], "die:rank=0,step=2", "die:rank=0,step=1"),  # any order
        (["skip-step:rank=1,step=5", "kill:rank=1,step=3"], "skip-step:rank=1,step=5", "kill:rank=1,step=3"),
        (["die:rank=0,step=3", "kill:rank=0,step=3"], "kill:rank=0,step=3", "die:rank=0,step=3"),  # same step
        (["kill:rank=0,step=2", "freeze:rank=0,step=4,seconds=1,layer=1"],
         "freeze:rank=0,step=4,seconds=1,layer=1", "kill:rank=0,step=2"),
    ):
        with pytest.raises(ValueError) as info:
            parse_specs(specs, ranks=2, steps=24, layers=3)
        msg = str(info.value)
        assert msg.startswith(f"--inject {refused!r}: ") and f"--inject {ender!r}" in msg, msg
        assert "die and kill (without layer) end a rank's process" in msg
    # earlier faults, other ranks, stall-layer (no step), a layer-kill (fires at a transfer): can still fire
    for specs in (["skip-step:rank=0,step=2", "die:rank=0,step=5"], ["die:rank=0,step=1", "die:rank=1,step=2"],
                  ["die:rank=0,step=1", "stall-layer:rank=0,layer=2"],
                  ["kill:rank=0,step=1,layer=2", "skip-step:rank=0,step=9"]):
        assert len(parse_specs(specs, ranks=2, steps=24, layers=3)) == 2, specs


def test_simulate_refuses_a_second_fault_on_an_ended_rank_with_exit_2(tmp_path, capsys):
    """`--inject die:...,step=1 --inject die:...,step=2` stops before any process: exit 2, one line, no folder."""
    code = main(["simulate", *SMALL, "--inject", "die:rank=0,step=1", "--inject", "die:rank=0,step=2",
                 "--trace-dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "--inject 'die:rank=0,step=2': rank 0 is ended at the start of step 1 by --inject 'die:rank=0,step=1'" in err
    assert not (tmp_path / "t").exists()


def _fire(ctx, trigger: str, source: str, dest: str, **data) -> None:
    from eplb_fsm.fsm.machine import Fired

    for listener in ctx.controller.machine.listeners:
        listener(Fired(trigger, source, dest, 0, data))


def test_a_fault_its_scale_salvaged_or_switched_does_not_stop_the_rank():
    """fault -> salvaged -> switched within one scale is handled (no RankFault); a later fault still stops it."""
    from eplb_fsm.sim.inject import RankFault

    ctx = _Ctx(0)
    inj = Injector([], collective_timeout_s=2.0)
    inj.on_start(ctx)
    ctx.controller.steps = 13
    _fire(ctx, "scale_requested", "collecting", "scaling")
    _fire(ctx, "fault", "transferring", "failed", recoverable=False)
    _fire(ctx, "salvaged", "failed", "scaling")
    _fire(ctx, "switched", "scaling", "collecting")
    inj.after_step(ctx, 12)  # served on in the new group
    assert [f["handled"] for f in ctx.extra["inject"]["faults"]] == ["salvaged"]
    _fire(ctx, "fault", "transferring", "collecting", recoverable=True)  # a later rearrangement's
    with pytest.raises(RankFault, match="rank 0 stopped at step 13: its controller fired fault at step 12 "
                                        r"\(transferring -> collecting"):
        inj.after_step(ctx, 13)


def test_a_scale_that_aborted_after_its_fault_still_stops_the_rank():
    """A scale's fault with no salvaged/switched after it (an abort) is a fault: the rank stops (as :absent does)."""
    from eplb_fsm.sim.inject import RankFault

    ctx = _Ctx(1)
    inj = Injector([], collective_timeout_s=2.0)
    inj.on_start(ctx)
    _fire(ctx, "fault", "collecting", "failed", recoverable=False)  # before the scale: not the scale's
    _fire(ctx, "scale_requested", "collecting", "scaling")
    _fire(ctx, "switched", "scaling", "collecting")
    with pytest.raises(RankFault):
        inj.after_step(ctx, 5)
    ctx2 = _Ctx(0)
    inj2 = Injector([], collective_timeout_s=2.0)
    inj2.on_start(ctx2)
    _fire(ctx2, "scale_requested", "collecting", "scaling")
    _fire(ctx2, "fault", "scaling", "collecting", recoverable=True)
    with pytest.raises(RankFault, match="scaling -> collecting"):
        inj2.after_step(ctx2, 8)


def test_a_fault_between_steps_is_dated_by_its_record_not_one_step_early():
    """A fault fired inside request_scale() (between steps, the trace stamping the next step, 30): the RankFault
    names step 30, as the fault's record does (was: 29, steps - 1, a red team's killed joiner)."""
    from types import SimpleNamespace

    from eplb_fsm.sim.inject import RankFault

    ctx = _Ctx(0)
    inj = Injector([], collective_timeout_s=2.0)
    inj.on_start(ctx)
    ctx.controller.steps = 30
    ctx.controller.trace = SimpleNamespace(step=30)
    _fire(ctx, "scale_requested", "collecting", "scaling")
    _fire(ctx, "fault", "scaling", "collecting", recoverable=True)
    _fire(ctx, "recovered", "failed", "collecting")   # a rolled-back scale-up is no handling
    with pytest.raises(RankFault, match="rank 0 stopped at step 30: its controller fired fault at step 30 "):
        inj.after_step(ctx, 30)
