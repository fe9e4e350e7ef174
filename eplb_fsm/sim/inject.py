"""Fault injection for ``eplb-fsm simulate --inject SPEC``: make a rank misbehave on purpose.

A spec is ``KIND:key=value,key=value`` with non-negative integer values:

``skip-step:rank=R,step=S``
    At engine step S, rank R's engine forgets to call ``controller.step()`` (the forward
    still runs). Its step counter and interval counter fall one step behind, so it reaches
    the interval one engine step after the others, and its next controller all-reduce
    meets the others' forward all-reduce of the following step.
``stall-layer:rank=R,layer=K``
    The first time rank R transfers layer K, its transfer hook blocks and never posts its
    sends or receives (it gives up only after every peer must have timed out). Peers time
    out in the transfer wave and in the agreement that follows.
``wrong-collective:rank=R,step=S``
    At step S, rank R issues a broadcast (from itself, same tensor) on the EP group instead
    of the controller's all-reduce of that step, traced as a ``broadcast``. If the
    controller has no all-reduce at step S (it all-reduces on due steps, on balancedness
    logging steps and, in async mode, on every step of a rearrangement), the first one
    after S is replaced.
``die:rank=R,step=S``
    At the start of step S, rank R's process exits at once (``os._exit``, code
    ``DIE_EXIT_CODE``): no clean-up, no further trace line.
``kill:rank=R,step=S[,layer=K]`` / ``freeze:rank=R,step=S,seconds=T[,layer=K]``
    A real SIGKILL to itself / a real SIGSTOP for T s, then SIGCONT, from a helper process
    (``sim.signals``): at the start of step S (any state), or with ``layer=K`` right before
    the first transfer of layer K at a step >= S (a rearrangement's or a scale's; a joiner's
    own scale too: ``sim/elastic.py`` starts its hooks in ``EplbController.join``'s ``setup``).

A ``die``, or a ``kill`` without ``layer``, ends rank R at the start of step S: another
fault on R at step S or later could never fire, and :func:`parse_specs` refuses it.

Every injection that fires first writes ``fault_injected`` (``kind``, ``target_rank``,
``at_step``, ``spec``) to the rank's trace (``sim/inject_report.py`` finds unfired ones).

:func:`make_injector` is the ``SimOptions.hooks`` factory (``"eplb_fsm.sim.inject:make_injector"``).
Every rank builds the same :class:`Injector` and acts on the injections naming it. While
injecting, every rank also:

- traces the engine's own forward all-reduces (group ``engine``, stamped with the engine
  step, ``moe_layer`` per layer; one more, with ``moe_layer`` null, before the first
  step so that every trace names the group), so a rank that dies or stalls outside the
  controller still leaves evidence in the others' traces; every such wait is bounded by
  ``engine_timeout_s``;
- stops at the end of the first step in which its controller fired ``fault`` (or went to
  ``failed``) by raising :class:`RankFault`, so the rank exits non-zero and the launcher
  stops the rest instead of letting them wait on a broken group. Not for a fault its scale then
  handled (``fault`` -> ``salvaged``/``switched``: the survivors of a dead leaving rank serve on in
  the new group); such a fault stays listed with ``handled``, the trigger that handled it.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = [
    "KINDS",
    "DIE_EXIT_CODE",
    "ENGINE_GROUP",
    "Injection",
    "Injector",
    "RankFault",
    "parse_spec",
    "parse_specs",
    "check_injection",
    "check_not_after_end",
    "ends_rank",
    "make_injector",
]

# kind -> the keys its spec must give (and the only keys it may give)
KINDS: dict[str, tuple[str, ...]] = {
    "skip-step": ("rank", "step"),
    "stall-layer": ("rank", "layer"),
    "wrong-collective": ("rank", "step"),
    "die": ("rank", "step"),
    "kill": ("rank", "step"),
    "freeze": ("rank", "step", "seconds"),
}
# kind -> keys its spec may add
OPTIONAL: dict[str, tuple[str, ...]] = {"kill": ("layer",), "freeze": ("layer",)}
ENDING_KINDS = ("die", "kill")  # kinds that end the rank's process (kill: at its step only without layer)
DIE_EXIT_CODE = 43
ENGINE_GROUP = "engine"   # trace name of the engine's forward all-reduces (same process group as ep)

_SPEC = re.compile(r"^\s*([A-Za-z][\w-]*)\s*:(.*)$")


@dataclass(frozen=True)
class Injection:
    """One parsed ``--inject`` spec."""

    kind: str
    rank: int
    step: int | None = None
    layer: int | None = None
    seconds: int | None = None

    @property
    def spec(self) -> str:
        keys = KINDS[self.kind] + tuple(k for k in OPTIONAL.get(self.kind, ()) if getattr(self, k) is not None)
        return f"{self.kind}:" + ",".join(f"{k}={getattr(self, k)}" for k in keys)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "step": self.step, "layer": self.layer,
                "seconds": self.seconds, "spec": self.spec}


class RankFault(RuntimeError):
    """Raised on a rank (while injecting) after its controller recorded a fault: the rank exits non-zero."""


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"--inject {spec!r}: {why}")


def parse_spec(spec: str) -> Injection:
    """Parse ``KIND:key=value,...``; a ``ValueError`` names the spec and the rule it breaks."""
    if not isinstance(spec, str):
        raise ValueError(f"--inject: a spec must be a string, got {type(spec).__name__}")
    kinds = ", ".join(KINDS)
    m = _SPEC.match(spec)
    if m is None:
        head = spec.strip()
        if head in KINDS:
            return _missing(spec, head, {})
        raise _bad(spec, f"must look like KIND:key=value,... with KIND one of {kinds}")
    kind, body = m.group(1), m.group(2)
    if kind not in KINDS:
        raise _bad(spec, f"unknown kind {kind!r}; kinds: {kinds}")
    wanted = KINDS[kind] + OPTIONAL.get(kind, ())
    values: dict[str, int] = {}
    for item in (p.strip() for p in body.split(",")):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key:
            raise _bad(spec, f"{item!r} is not key=value")
        if key not in wanted:
            raise _bad(spec, f"unknown key {key!r} for {kind}; it takes {', '.join(wanted)}")
        if key in values:
            raise _bad(spec, f"key {key!r} given twice")
        if not re.fullmatch(r"\d+", raw):
            raise _bad(spec, f"{key} must be a non-negative integer, got {raw!r}")
        values[key] = int(raw)
    return _missing(spec, kind, values)


def _missing(spec: str, kind: str, values: dict[str, int]) -> Injection:
    absent = [k for k in KINDS[kind] if k not in values]
    if absent:
        raise _bad(spec, f"missing key {', '.join(absent)}; {kind} needs "
                   + ",".join(f"{k}=N" for k in KINDS[kind]))
    return Injection(kind, **values)


def check_injection(inj: Injection, ranks: int, steps: int | None = None, layers: int | None = None) -> None:
    """Check an injection against the run's shape (rank, step and layer in range)."""
    if not 0 <= inj.rank < ranks:
        raise _bad(inj.spec, f"rank {inj.rank} is out of range: the run has {ranks} rank(s) (0..{ranks - 1})")
    if inj.step is not None and steps is not None and inj.step >= steps:
        raise _bad(inj.spec, f"step {inj.step} is out of range: the run has {steps} step(s) (0..{steps - 1})")
    if inj.seconds is not None and inj.seconds < 1:
        raise _bad(inj.spec, f"seconds must be >= 1, got {inj.seconds}")
    if inj.layer is not None and layers is not None and inj.layer >= layers:
        raise _bad(inj.spec, f"layer {inj.layer} is out of range: the model has {layers} layer(s) "
                   f"(0..{layers - 1})")


def ends_rank(inj: Injection) -> bool:
    """Whether ``inj`` ends its rank's process at the start of its step: ``die``, or ``kill`` without a layer."""
    return inj.kind in ENDING_KINDS and inj.layer is None


def check_not_after_end(injections: list[Injection]) -> None:
    """Refuse a fault on a rank at or after the step where a ``die`` or ``kill`` (no layer) ends that rank.

    Such a fault could never fire (the run would fail at the end with "never fired"). Of two
    that end one rank at the same step, the one given later is refused.
    """
    for i, inj in enumerate(injections):
        if inj.step is None:  # stall-layer: fires at a transfer, whenever that comes
            continue
        for j, end in enumerate(injections):
            if j == i or not ends_rank(end) or end.rank != inj.rank or end.step > inj.step:
                continue
            if end.step == inj.step and ends_rank(inj) and j > i:
                continue
            raise _bad(inj.spec, f"rank {inj.rank} is ended at the start of step {end.step} by --inject "
                       f"{end.spec!r}: die and kill (without layer) end a rank's process, so no other fault may "
                       f"target that rank at that step or later")


def parse_specs(specs: Iterable[str], ranks: int, steps: int | None = None,
                layers: int | None = None) -> list[Injection]:
    """Parse and check every spec; the same fault twice on one rank, or one after the rank's end, is refused."""
    out: list[Injection] = []
    for spec in specs:
        inj = parse_spec(spec)
        check_injection(inj, ranks, steps, layers)
        if inj in out:
            raise _bad(spec, "given twice")
        out.append(inj)
    check_not_after_end(out)
    return out


# --------------------------------------------------------------------------- the rank hook


class Injector:
    """The per-rank hook object (``SimHooks`` protocol) that carries out the injections.

    ``specs``: the ``--inject`` strings (parsed again on each rank). ``collective_timeout_s``:
    the controller's timeout, from which the defaults of ``engine_timeout_s`` (how long an
    engine forward all-reduce may wait: longer than any wait inside the controller) and
    ``stall_hold_s`` (how long a stalled transfer blocks before giving up: longer still)
    are derived.
    """

    def __init__(self, specs: Iterable[str], collective_timeout_s: float, engine_timeout_s: float | None = None,
                 stall_hold_s: float | None = None, trace_engine: bool = True, stop_on_fault: bool = True) -> None:
        self.injections = [parse_spec(s) for s in specs]
        timeout = float(collective_timeout_s)
        self.engine_timeout_s = float(engine_timeout_s) if engine_timeout_s else 3 * timeout + 10.0
        self.stall_hold_s = float(stall_hold_s) if stall_hold_s else self.engine_timeout_s + timeout
        self.trace_engine = trace_engine
        self.stop_on_fault = stop_on_fault
        self.mine: list[Injection] = []
        self.done: list[dict] = []          # what this rank injected, when
        self.faults: list[dict] = []        # fault transitions its controller fired
        self._scale_faults = 0              # faults fired before the scale in progress began
        self._release = threading.Event()   # ends a stalled transfer early (at the end of the run)
        self._step = 0
        self._ctx: Any = None
        self._wrong_pending: Injection | None = None

    # -- hook points -------------------------------------------------------
    def on_start(self, ctx: Any) -> None:
        self._ctx = ctx
        self.mine = [inj for inj in self.injections if inj.rank == ctx.rank]
        ctx.controller.machine.listeners.append(self._on_fired)
        if self.trace_engine and ctx.group is not None and ctx.world > 1:
            ctx.model.engine_all_reduce = self._engine_all_reduce
            # every rank joins the engine group once before the first step: its traces name the
            # group even if a rank dies before its first forward (not a joiner: the serving
            # ranks are past their first step when it starts)
            import torch

            if ctx.extra.get("role") != "joiner":
                self._engine_all_reduce(torch.zeros(1, dtype=torch.float64), ctx.group, None)
        for inj in self.mine:
            if inj.kind == "stall-layer":
                ctx.controller.transfer_hooks.append(self._stall_hook(inj))
            elif inj.kind in ("kill", "freeze") and inj.layer is not None:
                ctx.controller.transfer_hooks.append(self._signal_hook(inj))
        ctx.extra["inject"] = {"specs": [i.spec for i in self.mine], "done": self.done, "faults": self.faults}

    def before_step(self, ctx: Any, step: int) -> dict | None:
        self._step = step
        overrides: dict = {}
        for inj in self.mine:
            if inj.step != step:
                continue
            if inj.kind == "die":
                self.note(inj, "exiting the process")
                os._exit(DIE_EXIT_CODE)
            elif inj.kind in ("kill", "freeze") and inj.layer is None:
                self._send_signal(inj, f"at the start of step {step}")
            elif inj.kind == "skip-step":
                self.note(inj, "controller.step() not called")
                overrides["skip_step"] = True
            elif inj.kind == "wrong-collective":
                # armed until the controller's next all-reduce (this step's, if it has one)
                self._wrong_pending = inj
                self._patch_all_reduce(ctx.controller)
        return overrides or None

    def after_step(self, ctx: Any, step: int) -> None:
        for fault in (f for f in self.faults if f["reason"] is None):
            fault["reason"] = self._fault_reason(ctx.controller)
        pending = [f for f in self.faults if not f.get("handled")]
        if self.stop_on_fault and pending:
            first = pending[0]
            self._release.set()
            raise RankFault(f"rank {ctx.rank} stopped at step {step}: its controller fired fault at step "
                            f"{first['step']} ({first['source']} -> {first['dest']}: {first['reason']})")

    def on_finish(self, ctx: Any, result: dict) -> None:
        self._release.set()

    # -- faults seen -------------------------------------------------------
    def _on_fired(self, fired: Any) -> None:
        # called from inside the machine, before the controller writes the record: keep it short
        if fired.trigger == "fault":
            ctl = self._ctx.controller
            at = getattr(getattr(ctl, "trace", None), "step", None)   # its record's (steps - 1: early in a scale)
            self.faults.append({"step": at if type(at) is int else max(ctl.steps - 1, 0), "source": fired.source,
                                "dest": fired.dest, "recoverable": bool(fired.data.get("recoverable")), "reason": None})
        elif fired.trigger == "scale_requested":
            self._scale_faults = len(self.faults)  # a new scale (a partial switch goes on with `resumed`)
        elif fired.trigger in ("salvaged", "switched"):   # its scale handled its faults: it serves on, no stop
            for fault in self.faults[self._scale_faults:]:
                fault.setdefault("handled", fired.trigger)

    def _fault_reason(self, controller: Any) -> str:
        for entry in reversed(controller.history):
            if entry.get("outcome") != "committed" and entry.get("reason"):
                return entry["reason"]
        return "the EP group failed (see the fault record in the trace)"

    def note(self, inj: Injection, what: str, **fields: Any) -> None:
        """Remember what fired and write ``fault_injected`` (flushed: the trace writes per line)."""
        self.done.append({"spec": inj.spec, "step": self._step, "what": what})
        trace = getattr(self._ctx.controller, "trace", None) if self._ctx is not None else None
        if trace is not None:
            trace.emit("fault_injected", kind=inj.kind, target_rank=inj.rank, at_step=self._step, spec=inj.spec,
                       what=what, **fields)

    # -- kill / freeze: real signals ---------------------------------------
    def _send_signal(self, inj: Injection, where: str, layer: int | None = None) -> None:
        from eplb_fsm.sim import signals

        state = self._ctx.controller.machine.state
        if inj.kind == "kill":
            self.note(inj, f"SIGKILL {where} ({state})", layer=layer, state_at=state)
            signals.kill_self()
        else:
            self.note(inj, f"SIGSTOP for {inj.seconds} s {where} ({state})", layer=layer, state_at=state,
                       seconds=inj.seconds)
            signals.freeze_self(inj.seconds)

    def _signal_hook(self, inj: Injection):
        fired = []

        def hook(layer: int, model_name: str, model_layer: int) -> None:
            # a scale runs at the top of its step, before before_step: the loop's ctx.step is current
            self._step = max(self._step, int(getattr(self._ctx, "step", self._step) or 0))
            if layer != inj.layer or fired or self._step < inj.step:
                return
            fired.append(layer)
            self._send_signal(inj, f"before transferring layer {layer}", layer=layer)

        return hook

    # -- stall-layer -------------------------------------------------------
    def _stall_hook(self, inj: Injection):
        fired = []

        def hook(layer: int, model_name: str, model_layer: int) -> None:
            if layer != inj.layer or fired:
                return
            fired.append(layer)
            self.note(inj, f"transfer of layer {layer} blocked, no send or receive posted")
            self._release.wait(self.stall_hold_s)
            raise RuntimeError(f"injected stall: layer {layer} was never transferred on this rank")

        return hook

    # -- wrong-collective --------------------------------------------------
    def _patch_all_reduce(self, controller: Any) -> None:
        """Arm the wrong collective: the controller's collectives object is wrapped (once)."""
        from eplb_fsm.sim.wrong_collective import WrongCollective

        if not isinstance(controller.collectives, WrongCollective):
            controller.collectives = WrongCollective(controller.collectives, self)
            # the collaborators that issue all-reduces hold the collectives too
            controller.rearranger.collectives = controller.collectives

    def take_wrong(self) -> Injection | None:
        inj, self._wrong_pending = self._wrong_pending, None
        return inj

    # -- the engine's collectives -----------------------------------------
    def _engine_all_reduce(self, tensor: Any, group: Any, layer: int) -> None:
        """The forward's all-reduce (sum), traced on group ``engine`` and bounded by ``engine_timeout_s``."""
        import torch.distributed as dist

        trace = self._ctx.controller.trace
        # elastic EP: each generation's group has its own name (ep@1 -> engine@1), so its cseq starts
        # at 0 on the serving ranks and the joiners alike
        name = getattr(group, "trace_name", "ep")
        engine = ENGINE_GROUP + name[2:] if name.startswith("ep@") else ENGINE_GROUP
        with trace.collective("all_reduce", group=engine, shape=tuple(tensor.shape), dtype=tensor.dtype,
                              step=self._step, moe_layer=layer):
            if callable(getattr(group, "all_reduce", None)):  # elastic EP: the StoreGroup's own all-reduce
                group.all_reduce(tensor, self.engine_timeout_s)
                return
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.engine_timeout_s))


def make_injector(specs: Iterable[str] = (), collective_timeout_s: float = 5.0, **kwargs: Any) -> Injector:
    """``SimOptions.hooks`` factory: ``("eplb_fsm.sim.inject:make_injector", {"specs": [...], ...})``."""
    return Injector(list(specs), collective_timeout_s, **kwargs)
