"""EplbController: what an inference engine embeds in its step loop.

The controller owns the lifecycle machine (:mod:`eplb_fsm.fsm.machine`, states and
guards only), this rank's event trace, and per model (main model, drafter) the maps,
the load window and a one-layer transfer buffer. It performs the actions of every
transition: recording load passes, aggregating and all-reducing the load, running the
policy, moving weights layer by layer, committing maps.

The engine calls ``step()`` once per engine step, on every rank, with the same flags::

    controller = EplbController(EplbConfig(...), group=ep_group, trace_dir="logs/")
    controller.add_model(model, "main")
    controller.add_model(drafter, "drafter")   # optional: shares counters and collectives
    while serving:
        model.forward(batch)                     # adds routed tokens into load_pass
        controller.step(is_dummy=..., log_stats=...)

Rules every decision follows (so ranks can never disagree):

- whether this step rearranges comes from step counters that advance identically on
  every rank; whether a transfer finished everywhere, failed somewhere or ran past its
  deadline comes from an all-reduce every rank issues on the same step;
- a step issues at most one all-reduce of the controller's own over the EP group: it
  carries, concatenated, whatever this step needs (planning loads of every model,
  the per-pass load for balancedness logging, the all-ranks-ready flags of async mode);
  only a sync-mode rearrangement step adds one agreement per transferred layer;
- a layer's maps flip in the same call that writes its weights, so what the router
  sees (``set_eplb_state``) always matches the weights.

Sync mode plans and moves every layer inside the step that reaches the interval.
Async mode hands the policy and each layer's transfer to a background worker
(:mod:`eplb_fsm.fsm.worker`) that fills a one-layer buffer on its own process group;
layer k is committed at the first step whose all-reduce shows every rank has it.

Faults: a transfer or collective that raises or times out aborts the rearrangement.
Committed layers keep their new placement, the others keep old maps and old weights;
the machine returns to ``collecting`` (recoverable) or goes to ``failed`` when the EP
group itself can no longer be trusted. The trace schema is in docs/events.md.

This module holds the controller's state, its public API and the step loop (the hot
path). The actions live in mixins, one concern each, below it in the package:

- :mod:`~eplb_fsm.fsm.collectives`: group resolution, the single all-reduce, the transfer group;
- :mod:`~eplb_fsm.fsm.planning`: planning load, policy call, plan acceptance (``Plan``);
- :mod:`~eplb_fsm.fsm.transfers`: the sync transfer loop, async progress, layer commits;
- :mod:`~eplb_fsm.fsm.faults`: abort / rollback, transfer-group reset, broken groups;
- :mod:`~eplb_fsm.fsm.reporting`: ``history`` entries, summaries, balancedness, ``SharedTrace``;
- :mod:`~eplb_fsm.fsm.scaling` and :mod:`~eplb_fsm.fsm.joiner` (elastic EP): the flows behind
  ``request_scale`` and ``join``, functions that act on the controller.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.collectives import (
    GROUP_NAME,
    LOCAL_GROUP_NAME,
    TRANSFER_GROUP_NAME,
    CollectivesMixin,
    GroupBroken,
    is_collective_group,
    resolve_group,
)
from eplb_fsm import run_identity
from eplb_fsm.fsm import scaling
from eplb_fsm.fsm.faults import FaultsMixin
from eplb_fsm.fsm.machine import COLLECTING, FAILED, PLANNING, SCALING, TRANSFERRING, EplbMachine, Fired
from eplb_fsm.fsm.model_entry import ModelEntry, build_model_entry
from eplb_fsm.fsm.planning import Plan, PlanningMixin
from eplb_fsm.fsm.reporting import ReportingMixin, SharedTrace
from eplb_fsm.fsm.transfers import TransfersMixin
from eplb_fsm.liveness import DEFAULT_INTERVAL_S as DEFAULT_LIVENESS_S, Liveness, check_interval
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.policy import get_policy
from eplb_fsm.stats import LoadWindow
from eplb_fsm.trace import exception_text

__all__ = ["EplbController", "SharedTrace", "Plan", "ModelEntry", "GROUP_NAME", "TRANSFER_GROUP_NAME"]

# the old private name, still imported by sim.inject (its wrong-collective fault raises it)
_GroupBroken = GroupBroken


class EplbController(CollectivesMixin, PlanningMixin, TransfersMixin, FaultsMixin, ReportingMixin):
    """Drive the EPLB machine for one rank: load statistics, planning, transfers, commits.

    ``config``: an :class:`EplbConfig` (equal on every rank).

    ``group``: the EP process group (``None``: the default group if torch.distributed is
    initialized, else a single rank without collectives), or any object with ``rank``,
    ``world_size``, ``all_reduce(tensor, timeout_s)`` (sum in place, raise on timeout)
    and ``transfer_communicator(timeout_s)`` (a fresh ``eplb_fsm.transfer.Communicator``
    for this rank): an engine's own communication layer, or in-process ranks in tests.
    With a torch group the controller creates its own transfer group over the same
    ranks at construction (collective: every rank constructs its controller).

    ``device``: where the load counters and maps live (the router's device).
    ``trace_dir``: where this rank's JSONL trace goes (``None``: no file;
    ``keep_trace=True`` also keeps every record in ``trace.records``).
    ``liveness_interval_s``: seconds between ``alive`` trace records (a background thread,
    only with ``trace_dir``; ``None``/0: none). The header carries the ``run_id`` every
    rank agreed on with rank 0 and the config's hash; a rank whose config differs from
    rank 0's makes every rank raise ``run_identity.ConfigMismatch`` here (docs/events.md).
    ``role``: ``"member"`` (default) or ``"joiner"``: a process that joins a serving
    group in elastic EP starts in ``scaling``; use :meth:`join`, which sets it and
    ``start_step`` (the engine step counter to start from: the scale's step).

    Elastic EP (docs/elastic.md): with a ``transfer.groups.StoreGroup`` as ``group``,
    :meth:`request_scale` shrinks or grows the EP group while serving and
    :meth:`join` starts a new process's controller inside such a scale.

    Every rank must construct the controller, add the same models in the same order,
    and call ``step`` / ``rearrange`` / ``recover`` the same number of times.
    """

    def __init__(
        self,
        config: EplbConfig,
        group: Any = None,
        device: torch.device | str | None = None,
        trace_dir: str | None = None,
        *,
        keep_trace: bool = False,
        clock: Callable[[], float] = time.time,
        role: str = "member",
        start_step: int = 0,
        liveness_interval_s: float | None = DEFAULT_LIVENESS_S,
    ) -> None:
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        if role not in ("member", "joiner"):
            raise ValueError(f"role must be 'member' or 'joiner', got {role!r}")
        if liveness_interval_s:  # issue 12 wiring: None/0 = no liveness thread
            check_interval(liveness_interval_s)
        self.role = role
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        policy_cls = get_policy(config.policy)
        # a policy with settings in the config (e.g. movement_aware's target) builds itself from it
        self.policy = policy_cls.from_config(config) if hasattr(policy_cls, "from_config") else policy_cls
        self.group, self.rank, self.world = resolve_group(group)
        self._custom_group = self.group is not None and is_collective_group(self.group)
        self.group_name = getattr(self.group, "trace_name", GROUP_NAME) if self.group is not None \
            else LOCAL_GROUP_NAME
        # elastic EP: the group's generation (0 until a scale) and this rank's scale requests
        self.generation = int(getattr(self.group, "generation", 0) or 0)
        self.scalings: list[dict] = []
        initial = SCALING if role == "joiner" else COLLECTING
        self._comm_device = self._collective_device()
        self.trace = SharedTrace(self.rank, self.world, trace_dir, clock=clock, keep=keep_trace)
        self.trace.set_context(state=initial, step=int(start_step))
        # issue 12 wiring (eplb_fsm/run_identity.py): rank 0's run id + config check, before any collective
        identity, identity_error = run_identity.for_controller(
            self.group, self._custom_group, self.rank, self.world, config.to_dict(),
            float(config.collective_timeout_s), self._comm_device, role)
        self.trace.header(
            config.to_dict(),
            run_id=identity.run_id,
            mode="async" if config.use_async else "sync",
            device=str(self.device),
            group=self.group_name,
            transfer_group=self._transfer_base() if self.group is not None else LOCAL_GROUP_NAME,
            **({"role": role, "generation": self.generation,
                "machine": {"state": SCALING, "scale_pending": True}} if role == "joiner" else {}),
        )
        if identity_error is not None:  # issue 12 wiring: every rank fails here together
            self.trace.end("exception", error=exception_text(identity_error))
            self.trace.close()
            raise identity_error
        self.machine = EplbMachine(num_layers=1, state=initial, scale_pending=role == "joiner")
        self.models: list[ModelEntry] = []
        self._windows: list[LoadWindow] = []
        # counters every rank advances identically
        self.steps = int(start_step)        # engine steps taken (profile steps excluded)
        self._since = 0                     # steps since start / the last rearrangement began
        self._threshold = config.first_rearrangement_step
        self._log_balancedness = bool(config.log_balancedness)
        self._log_interval = config.log_balancedness_interval
        self._timeout = float(config.collective_timeout_s)
        # what happened (local, for reports)
        self.history: list[dict] = []
        self.balancedness_log: list[tuple[int, float]] = []
        self._state_seconds: dict[str, float] = {}
        self._entered = time.perf_counter()
        self._current = None                # reporting.Rearrangement in flight
        self._count = 0
        # fault injection / instrumentation: called as hook(global_layer, model_name, model_layer)
        # right before a layer's transfer, in the thread that runs it; raising = a transfer error
        self.transfer_hooks: list[Callable[[int, str, int], None]] = []
        # transfer machinery
        self.transfer_group = None
        self._communicator = None
        self._transfer_generation = -1
        self._new_transfer_group()
        self.worker = None
        if config.use_async:
            from eplb_fsm.fsm.worker import BackgroundWorker

            self.worker = BackgroundWorker(self.device, name=f"eplb-worker-r{self.rank}")
        self.watchdog = None
        if config.watchdog_deadline_s > 0:
            from eplb_fsm.fsm.watchdog import Watchdog

            self.watchdog = Watchdog(self.trace, config.watchdog_deadline_s)
            self.machine.listeners.append(self.watchdog.on_fired)
            self.watchdog.start()
        # issue 12 wiring (eplb_fsm/liveness.py): `alive` records while the trace goes to a file
        self.liveness = Liveness(self.trace, liveness_interval_s).start() \
            if liveness_interval_s and self.trace.path is not None else None
        self._closed = False

    # ------------------------------------------------------------------ setup
    def add_model(self, model: Any, name: str, phy2log: Any = None) -> ModelEntry:
        """Balance ``model`` (MoE protocol, see model_protocol) under ``name``.

        ``phy2log`` (L, P) is its current placement (default: the initial contiguous one
        the weights were loaded in). Its layers join the machine's layer sequence after
        the models added before. Only while collecting, before a rearrangement starts.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if any(entry.name == name for entry in self.models):
            raise ValueError(f"a model named {name!r} is already added")
        joining = self.role == "joiner" and self.machine.state == SCALING
        if (self.machine.state != COLLECTING and not joining) or self._current is not None:
            raise ValueError(f"models can only be added while collecting, state is {self.machine.state!r}")
        entry = build_model_entry(
            model, name, index=len(self.models), layer_offset=sum(e.num_layers for e in self.models),
            world=self.world, num_redundant=self.config.num_redundant_experts,
            window_size=self.config.window_size, device=self.device, phy2log=phy2log,
        )
        self.models.append(entry)
        self._windows.append(entry.window)
        self.machine.num_layers = entry.layer_offset + entry.num_layers
        model.set_eplb_state(entry.window.load_pass, entry.log2phy, entry.replica_count)
        self.trace.emit("model_added", num_layers=self.machine.num_layers, **entry.describe())
        return entry

    # ---------------------------------------------------------------- queries
    @property
    def state(self) -> str:
        """The machine's state: collecting, planning, transferring, committing, scaling or failed."""
        return self.machine.state

    @property
    def layer(self) -> int:
        """The machine's layer counter (the layer being transferred while transferring)."""
        return self.machine.layer

    @property
    def num_layers(self) -> int:
        return sum(entry.num_layers for entry in self.models)

    def model(self, name: str) -> ModelEntry:
        for entry in self.models:
            if entry.name == name:
                return entry
        raise KeyError(f"no model named {name!r}; models: {[e.name for e in self.models]}")

    def maps(self, name: str) -> ExpertMaps:
        """The committed maps of a model (what its router uses)."""
        return self.model(name).maps

    @property
    def state_seconds(self) -> dict[str, float]:
        """Local seconds spent in each state so far (for reports; never used for decisions)."""
        out = dict(self._state_seconds)
        state = self.machine.state
        out[state] = out.get(state, 0.0) + time.perf_counter() - self._entered
        return out

    @property
    def steps_until_due(self) -> int:
        """Steps left before the next rearrangement is due (0: due at the next collecting step)."""
        return max(0, self._threshold - self._since)

    # ------------------------------------------------------------- the machine
    def _fire(self, trigger: str, extra: dict | None = None, **data: Any) -> Fired:
        """Fire one event and write its ``transition`` record (event data + extra context)."""
        fired = self.machine.fire(trigger, **data)
        now = time.perf_counter()
        if fired.source != fired.dest:
            self._state_seconds[fired.source] = self._state_seconds.get(fired.source, 0.0) + now - self._entered
            self._entered = now
        fields = dict(data)
        layer = fields.pop("layer", fired.layer)
        if extra:
            fields.update(extra)
        self.trace.transition(
            trigger, fired.source, fired.dest, layer=layer, num_layers=self.machine.num_layers,
            layer_after=fired.layer, **fields,
        )
        return fired

    # ------------------------------------------------------------------ steps
    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> str:
        """Account one engine step (call after the forward pass, on every rank); returns the state.

        ``is_dummy``: a padding step without real tokens (counts toward the interval,
        its load does not enter the window). ``is_profile``: the engine's profile run:
        reserve transfer buffers, change no state or counter. ``log_stats``: log the
        balancedness of this pass (with ``config.log_balancedness``, at its interval).
        """
        if is_profile:
            self._profile_step()
            return self.machine.state
        step = self.steps
        self.steps = step + 1
        self._since += 1
        trace = self.trace
        trace.step = step
        state = self.machine.state
        log_now = log_stats and self._log_balancedness and step % self._log_interval == 0
        if state == COLLECTING and self._since < self._threshold and not log_now:
            # the hot path: nothing but the window and one compact trace line
            for window in self._windows:
                window.record_pass(is_dummy)
            if is_dummy:
                trace.emit("step", dummy=True)
            else:
                trace.emit("step")
            return state
        return self._slow_step(step, state, is_dummy, log_now)

    def _slow_step(self, step: int, state: str, is_dummy: bool, log_now: bool) -> str:
        parts: dict[str, torch.Tensor] = {}
        if log_now:
            parts["balancedness"] = torch.cat([w.load_pass.reshape(-1) for w in self._windows]) \
                if self._windows else torch.zeros(0)
        for window in self._windows:
            window.record_pass(is_dummy)
        due = state == COLLECTING and self._since >= self._threshold and bool(self.models)
        waiting = self.worker is not None and state in (PLANNING, TRANSFERRING) and self._current is not None
        if due:
            self._restart_interval()
            self._fire("step", extra={"dummy": True} if is_dummy else None, due=True)
            self._current = self._begin(step, forced=False)
            parts["loads"] = self._local_loads()
        else:
            if is_dummy:
                self.trace.emit("step", dummy=True)
            else:
                self.trace.emit("step")
        if waiting:
            parts["ready"] = self._ready_flags()
        if not parts:
            return self.machine.state
        try:
            reduced = self._all_reduce(parts, self._timeout)
        except GroupBroken as exc:
            self._group_fault(exc)
            return self.machine.state
        if "balancedness" in reduced:
            self._log_pass_balancedness(step, reduced["balancedness"])
        if "loads" in reduced:
            self._planning(reduced["loads"])
        elif "ready" in reduced:
            self._async_progress(reduced["ready"])
        return self.machine.state

    def rearrange(self) -> dict | None:
        """Rearrange now, on demand (every rank must call it at the same point).

        Only from ``collecting``. Sync mode plans and moves everything before returning
        (returns the history entry); async mode starts planning and later steps finish
        it (returns None). The interval restarts from here.
        """
        if self.machine.state != COLLECTING:
            raise ValueError(f"rearrange() needs state collecting, state is {self.machine.state!r}")
        if not self.models:
            raise ValueError("rearrange() needs at least one model (add_model)")
        self._restart_interval()
        count = len(self.history)
        self._fire("step", extra={"forced": True}, due=True)
        self._current = self._begin(self.steps, forced=True)
        try:
            reduced = self._all_reduce({"loads": self._local_loads()}, self._timeout)
        except GroupBroken as exc:
            self._group_fault(exc)
            return self.history[-1] if len(self.history) > count else None
        self._planning(reduced["loads"])
        if len(self.history) > count:
            return self.history[-1]
        return None

    def request_scale(
        self,
        new_world_size: int,
        rank_mapping: dict[int, int] | None = None,
        *,
        timeout_s: float | None = None,
        generation: int | None = None,
    ) -> dict:
        """Grow or shrink the EP group now (elastic EP); every rank of the current group calls it at the same point.

        ``new_world_size``: ranks after the scale (S slots per rank stay, so P' = S * G').
        ``rank_mapping``: ``{old_rank: new_rank or -1}``; default: on scale-down the highest
        ranks leave, on scale-up old ranks keep their numbers and joiners take the rest
        (they call :meth:`join`). ``timeout_s`` bounds forming the new group (joiners
        arriving; default ``collective_timeout_s``); transfers and agreements keep
        ``collective_timeout_s``.
        ``generation``: the new group's number (default: the current one + 1; every request
        uses one up, even one that aborts). The group must be a
        ``transfer.groups.StoreGroup`` (or have its ``successor``/``store``/``key``).

        Runs the whole scale before returning, in sync and async mode (async first drains
        a rearrangement in flight). Returns this rank's entry (also in ``scalings``):
        ``outcome`` is ``switched`` (serving in the new group, ``rank`` is the new rank),
        ``left`` (this rank left: its controller is closed, stop calling it), ``aborted``
        (the old group keeps serving, nothing lost) or ``failed`` (state failed; see
        ``reason`` and ``lost_experts``); plus ``moved_slots``, ``moved_bytes``, ``seconds``.
        Raises ``ValueError`` on a bad request before anything changes.
        """
        return scaling.request_scale(self, new_world_size, rank_mapping, timeout_s=timeout_s,
                                     generation=generation)

    @classmethod
    def join(
        cls,
        config: EplbConfig,
        models: Any,
        *,
        store: Any,
        generation: int,
        rank: int,
        world_size: int,
        trace_dir: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float | None = None,
        keep_trace: bool = False,
    ) -> "EplbController":
        """Start the controller of a process that joins a serving group (elastic scale-up).

        ``models``: ``{name: model}`` (or ``[(name, model), ...]``) in the order the serving
        ranks added theirs, each built for ``world_size`` ranks at ``rank`` (its expert rows
        and ``non_expert_weights`` are overwritten). ``store``: a
        ``transfer.groups.StoreInfo`` (or a connected store), ``generation``: the number
        of the group being formed. Waits at most ``timeout_s`` (default
        ``config.collective_timeout_s``) for the serving ranks' handover, receives the maps,
        counters and non-expert weights, takes part in the scale's rearrangement and returns
        the controller in ``collecting``; then call ``step()`` like every other rank.
        Raises ``fsm.scaling.ScaleAborted`` if the scale does not complete.
        """
        return scaling.join(cls, config, models, store=store, generation=generation, rank=rank,
                            world_size=world_size, trace_dir=trace_dir, device=device, timeout_s=timeout_s,
                            keep_trace=keep_trace)

    def recover(self) -> None:
        """Leave ``failed`` once the engine has repaired the group (every rank together)."""
        if self.machine.state != FAILED:
            raise ValueError(f"recover() needs state failed, state is {self.machine.state!r}")
        self._fire("recovered")
        self._restart_interval()

    def _restart_interval(self) -> None:
        """The next rearrangement is due ``step_interval`` steps from now (after one, a recovery, a scale)."""
        self._since = 0
        self._threshold = self.config.step_interval

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the worker and the watchdog and close the trace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.liveness is not None:  # issue 12 wiring
            self.liveness.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.worker is not None:
            self.worker.close(timeout=self._timeout)
        self.trace.end("closed")  # issue 12 wiring: no-op when an `end` (exception, signal) came first
        self.trace.close()

    def __enter__(self) -> "EplbController":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

