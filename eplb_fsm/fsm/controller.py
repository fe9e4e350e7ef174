"""EplbController: what an inference engine embeds in its step loop.

The engine calls ``step()`` once per engine step, on every rank, with the same flags::

    controller = EplbController(EplbConfig(...), group=ep_group, trace_dir="logs/")
    controller.add_model(model, "main")
    controller.add_model(drafter, "drafter")   # optional: shares counters and collectives
    while serving:
        model.forward(batch)                     # adds routed tokens into load_pass
        controller.step(is_dummy=..., log_stats=...)

This module is the step loop and the actions it executes; nothing decides here (the check of ``step()``'s flags
and a step past the hot path are in :mod:`~eplb_fsm.fsm.step_flags`). What a step does comes from
:mod:`~eplb_fsm.fsm.decide` (pure functions of the shared counters and the step's all-reduced values), the
transition from :mod:`~eplb_fsm.fsm.machine`, whose guards read those decisions as event data. Collaborators:
``collectives`` (the EP group's all-reduce, the transfer group), ``mover`` (a layer into the buffer, then the
weights), ``reporter`` (``history``, seconds per state), ``rearranger`` (the rearrangement in flight), ``worker``
(async), ``watchdog``, ``counters`` (shared).

Ranks can never disagree: decisions read counters that advance identically everywhere and all-reduces every rank
issues on the same step (at most one of the controller's own per step, plus one agreement per layer and one after
the last commit in a sync rearrangement). In async mode the step's ready flags are by default *posted*: issued
without waiting and read on the next step (``async_overlap_poll``), so every rank reads the same sum on the same
step. Elastic EP (:mod:`eplb_fsm.elastic`) drives the controller through its public port (``fire``, ``rearranger``,
``switch_group``, ``restore_group``, ``export_counters`` / ``restore_counters``; see :mod:`eplb_fsm.elastic.port`).
Trace schema: docs/events.md.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch

from eplb_fsm import liveness, run_identity
from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm import faults
from eplb_fsm.fsm.collectives import (GROUP_NAME, LOCAL_GROUP_NAME, TRANSFER_GROUP_NAME, Collectives, resolve_device,
                                      resolve_group)
from eplb_fsm.fsm.decide import Counters
from eplb_fsm.fsm.machine import COLLECTING, FAILED, SCALING, EplbMachine, Fired
from eplb_fsm.fsm.model_entry import ModelEntry, build_model_entry
from eplb_fsm.fsm.planning import Plan
from eplb_fsm.fsm.rearrange import Rearranger
from eplb_fsm.fsm.reporting import Reporter, SharedTrace, abandon_trace
from eplb_fsm.fsm.step_flags import check_step_flags, decided_step, profile_step
from eplb_fsm.fsm.transfers import LayerMover
from eplb_fsm.maps import ExpertMaps, as_count
from eplb_fsm.policy import get_policy

__all__ = ["EplbController", "SharedTrace", "Plan", "ModelEntry", "GROUP_NAME", "TRANSFER_GROUP_NAME"]


class EplbController:
    """Drive the EPLB machine for one rank: load statistics, planning, transfers, commits.

    ``config``: an :class:`EplbConfig` (equal on every rank). ``group``: the EP process group (``None``: the default
    group if torch.distributed is initialized, else a single rank), or any object with ``rank``, ``world_size``,
    ``all_reduce(tensor, timeout_s)`` and ``transfer_communicator(timeout_s)`` (an engine's own communication layer,
    the elastic ``transfer.groups.StoreGroup``, in-process ranks in tests). With a torch group the controller creates
    its own transfer group at construction (collective; :meth:`close` releases it). ``device``: where the load counters
    and maps live. ``trace_dir``: where this rank's JSONL trace goes (``None``: no file; ``keep_trace=True`` keeps
    records in memory). ``role``: ``"member"`` or ``"joiner"`` (elastic EP: use :meth:`join`), ``start_step``: the
    engine step counter to start from. ``liveness_interval_s``: seconds between ``alive`` records (None: off).

    Every rank must construct the controller, add the same models in the same order,
    and call ``step`` / ``rearrange`` / ``recover`` the same number of times.
    """

    def __init__(self, config: EplbConfig, group: Any = None, device: torch.device | str | None = None,
                 trace_dir: str | None = None, *, keep_trace: bool = False, clock: Callable[[], float] = time.time,
                 role: str = "member", start_step: int = 0, liveness_interval_s: float | None = 1.0) -> None:
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        if role not in ("member", "joiner"):
            raise ValueError(f"role must be 'member' or 'joiner', got {role!r}")
        start_step = as_count(start_step, "start_step", minimum=0)
        self.liveness = liveness.Liveness(None, liveness_interval_s)  # issue 12: checked before any change
        self.role = role
        self._config = config
        self.device = resolve_device(device)
        policy_cls = get_policy(config.policy)
        # a policy with settings in the config (e.g. movement_aware's target) builds itself from it
        self.policy = policy_cls.from_config(config) if hasattr(policy_cls, "from_config") else policy_cls
        group, rank, world_size = resolve_group(group)
        name = getattr(group, "trace_name", GROUP_NAME) if group is not None else LOCAL_GROUP_NAME
        generation = int(getattr(group, "generation", 0) or 0)  # elastic EP: 0 until a scale
        self.trace = SharedTrace(rank, world_size, trace_dir, clock=clock, keep=keep_trace,
                                 generation=generation if role == "joiner" else 0)   # a joiner: a file of its own
        self.worker = self.watchdog = None
        try:
            self._start(config, group, rank, world_size, name, generation, role, start_step)
        except BaseException as exc:  # the trace holds its file (one writer per file): a retry here would be refused
            abandon_trace(self.trace, exc, self.liveness, self.worker)
            raise
        self._closed = False

    def _start(self, config: EplbConfig, group: Any, rank: int, world_size: int, name: str, generation: int,
               role: str, start_step: int) -> None:   # the construction once the trace is open
        self.collectives = Collectives(group, rank, world_size, self.trace, self.device, config.collective_timeout_s,
                                       name, generation, transfer_nice=config.use_async and config.async_worker_nice)
        self.last_generation, self.scalings = generation, []   # the last generation a scale request used up
        initial = SCALING if role == "joiner" else COLLECTING
        self.trace.set_context(state=initial, step=start_step)
        run_identity.write_header(  # issue 12: the run id agreed with rank 0, config checked, then the header
            self.trace, self.collectives, config.to_dict(), role, mode="async" if config.use_async else "sync",
            device=str(self.device), group=name, transfer_group=self.collectives.transfer_group_name,
            **({"role": role, "generation": generation,
                "machine": {"state": SCALING, "scale_pending": True}} if role == "joiner" else {}),
        )
        self.machine = EplbMachine(num_layers=1, state=initial, scale_pending=role == "joiner")
        self.models: list[ModelEntry] = []
        self.counters = Counters(steps=start_step, since=0, threshold=config.first_rearrangement_step)
        self.timeout_s = float(config.collective_timeout_s)
        self.reporter = Reporter(self.trace, rank)
        self.transfer_hooks: list[Callable[[int, str, int], None]] = []  # f(layer, model, model_layer) pre-transfer
        self.mover = LayerMover(self.models, self.collectives, self.trace, config.enable_migration_batching,
                                self.transfer_hooks, config.async_max_bytes_per_step if config.use_async else 0)
        held = weakref.ref(self.collectives)   # weakly, as the trace: the thread must not keep the groups alive
        self.liveness.group_of = lambda: getattr(held(), "group", None)   # whose ranks an engine wait is compared to
        self.liveness.start_on(self.trace)  # issue 12: `alive` records, from before the wait for the transfer group
        self.collectives.new_transfer_group(wait_all=role != "joiner")
        if config.use_async:
            from eplb_fsm.fsm.worker import BackgroundWorker
            self.worker = BackgroundWorker(self.device, f"eplb-worker-r{rank}", nice=config.async_worker_nice,
                                           owner=self)   # a controller dropped without close() still stops it
        self.rearranger = Rearranger(machine=self.machine, fire=self.fire, config=config, policy=self.policy,
                                     models=self.models, counters=self.counters, collectives=self.collectives,
                                     mover=self.mover, reporter=self.reporter, worker=self.worker, trace=self.trace)
        if config.watchdog_deadline_s > 0:
            from eplb_fsm.fsm.watchdog import Watchdog
            self.watchdog = Watchdog(self.trace, config.watchdog_deadline_s, state=self.machine.state)  # a joiner's
            self.machine.listeners.append(self.watchdog.on_fired)
            self.watchdog.start()

    def add_model(self, model: Any, name: str, phy2log: Any = None) -> ModelEntry:
        """Balance ``model`` (MoE protocol, see model_protocol) under ``name``.

        ``phy2log`` (L, P) is its current placement (default: the initial contiguous one the weights were loaded in).
        Its layers join the machine's layer sequence after the models added before. Only while collecting, before a
        rearrangement starts. Refused (``ValueError``, nothing changed) when its expert weights share memory with a
        model already added (or itself added twice), sit off the CPU while the transfer group is gloo, or ``phy2log``
        is not (L, S × G); an error from the model's own ``set_eplb_state`` propagates with nothing added. Steps before
        the first model do not count.
        """
        self._check_open("add_model")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if any(entry.name == name for entry in self.models):
            raise ValueError(f"a model named {name!r} is already added")
        joining = self.role == "joiner" and self.machine.state == SCALING
        if (self.machine.state != COLLECTING and not joining) or self.rearranger.current is not None:
            raise ValueError(f"models can only be added while collecting, state is {self.machine.state!r}")
        entry = build_model_entry(
            model, name, index=len(self.models), layer_offset=sum(e.num_layers for e in self.models),
            world_size=self.world_size, num_redundant=self.config.num_redundant_experts,
            window_size=self.config.window_size, device=self.device, phy2log=phy2log, others=self.models,
            communicator=self.collectives.communicator, num_nodes=self.config.num_nodes)
        model.set_eplb_state(entry.window.load_pass, entry.log2phy, entry.replica_count)  # may raise: add nothing
        self.models.append(entry)
        self.machine.num_layers = entry.layer_offset + entry.num_layers
        self.trace.emit("model_added", num_layers=self.machine.num_layers, **entry.describe())
        return entry

    # ---------------------------------------------------------------- queries
    @property
    def config(self) -> EplbConfig:
        return self._config

    @config.setter
    def config(self, value: EplbConfig) -> None:
        """Elastic EP sets ``num_redundant_experts`` after a resize (the only field that may change)."""
        self._config = self.rearranger.config = self._config.check_replacement(value)

    # read-only views of the collaborators' state
    state = property(lambda self: self.machine.state,
                     doc="The machine's state: collecting, planning, transferring, committing, scaling or failed.")
    layer = property(lambda self: self.machine.layer,
                     doc="The machine's layer counter (the layer being transferred while transferring).")
    num_layers = property(lambda self: sum(e.num_layers for e in self.models), doc="MoE layers of the models added.")
    steps = property(lambda self: self.counters.steps, doc="Engine steps taken (profile steps excluded).")
    steps_until_due = property(lambda self: self.counters.until_due,
                               doc="Steps left before the next rearrangement is due (0: at the next collecting step).")
    rank = property(lambda self: self.collectives.rank, doc="This rank's number in its EP group.")
    world_size = property(lambda self: self.collectives.world_size, doc="Ranks of the EP group served in.")
    group = property(lambda self: self.collectives.group, doc="The EP group (see Collectives).")
    group_name = property(lambda self: self.collectives.name, doc="Trace name of the EP group.")
    generation = property(lambda self: self.collectives.generation, doc="Elastic EP: the group's generation.")
    transfer_group = property(lambda self: self.collectives.transfer_group,
                              doc="Torch group transfers run on (None with a collective-group object, after close()).")
    transfer_group_name = property(lambda self: self.collectives.transfer_group_name, doc="Its trace name.")
    history = property(lambda self: self.reporter.history, doc="One entry per rearrangement (Reporter).")
    balancedness_log = property(lambda self: self.reporter.balancedness_log, doc="(step, value) pairs.")

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
        return self.reporter.state_seconds(self.machine.state)

    # ------------------------------------------------------------------ steps
    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> str:
        """Account one engine step (call after the forward pass, on every rank); returns the state.

        ``is_dummy``: a padding step without real tokens (counts toward the interval,
        its load does not enter the window). ``is_profile``: the engine's profile run, while
        collecting: reserve transfer buffers, change no state or counter. ``log_stats``: log the
        balancedness of this pass (with ``config.log_balancedness``, at its interval; not in ``failed``).
        Each flag must be a bool (a numpy ``bool_`` passes): ``ValueError`` naming it otherwise, nothing counted.
        """
        if self._closed:  # the hot path pays one attribute read, not a call
            self._check_open("step")
        # identity compares keep the hot path cheap; anything but False/True (a profile step too) is checked there
        if is_profile is not False or (is_dummy is not False and is_dummy is not True) or \
                (log_stats is not False and log_stats is not True):
            is_dummy, is_profile, log_stats = check_step_flags(is_dummy, is_profile, log_stats)
            if is_profile:
                return profile_step(self)
        counters = self.counters
        step = counters.steps
        counters.count_step(bool(self.models))  # the interval counts from the first add_model
        trace = self.trace
        trace.step = step
        state = self.machine.state
        config = self.config
        log_now = log_stats and config.log_balancedness and step % config.log_balancedness_interval == 0
        if state == COLLECTING and counters.since < counters.threshold and not log_now:
            # the hot path: nothing but the window and a count (written later as a `steps` run)
            for entry in self.models:
                entry.window.record_pass(is_dummy)
            trace.count_step(is_dummy)
            return state
        state = decided_step(self, step, state, is_dummy, log_now)
        self.mover.step_advanced.set()  # now, not mid-step: a paced chunk (async) starts as the engine runs on
        return state

    def rearrange(self) -> dict | None:
        """Rearrange now, on demand (every rank must call it at the same point).

        Only from ``collecting``. Sync mode plans and moves everything before returning
        (returns the history entry); async mode starts planning and later steps finish
        it (returns None). The interval restarts from here. A pass counted before the call
        (after a forward, before ``step()``) is carried into each layer's new placement.
        """
        self._check_open("rearrange")
        if self.machine.state != COLLECTING:
            raise ValueError(f"rearrange() needs state collecting, state is {self.machine.state!r}")
        if not self.models:
            raise ValueError("rearrange() needs at least one model (add_model)")
        parts = self.rearranger.planning_parts()  # first: an error here leaves the machine collecting
        self.rearranger.open_passes()
        self.restart_interval()
        count = len(self.history)
        self.trace.set_context(step=self.steps)  # as a due step's records: the index of the next engine step
        with faults.interruptible(self.rearranger, "rearrange()"):  # as a due step's, from the transition on
            self.fire("step", extra={"forced": True}, due=True)
            self.rearranger.begin(self.steps, forced=True)
            reduced = self.rearranger.all_reduce_or_fail(parts, self.timeout_s)
            if reduced is not None:
                self.rearranger.plan(reduced)
        return self.history[-1] if len(self.history) > count else None

    def request_scale(self, new_world_size: int, rank_mapping: dict[int, int] | None = None, *,
                      timeout_s: float | None = None, generation: int | None = None) -> dict:
        """Grow or shrink the EP group now (every rank of the current group, same point); see
        :func:`eplb_fsm.elastic.scaling.request_scale` and docs/elastic.md. Returns this rank's
        ``scalings`` entry (``outcome``: switched, left, aborted or failed)."""
        from eplb_fsm.elastic.scaling import request_scale
        self._check_open("request_scale")
        return request_scale(self, new_world_size, rank_mapping, timeout_s=timeout_s, generation=generation)

    @classmethod
    def join(cls, config: EplbConfig, models: Any, *, store: Any, generation: int, rank: int, world_size: int,
             trace_dir: str | None = None, device: torch.device | str | None = None, timeout_s: float | None = None,
             keep_trace: bool = False, namespace: str = "eplb", setup: Any = None) -> "EplbController":
        """Start the controller of a process joining a serving group (scale-up; :func:`eplb_fsm.elastic.joiner.join`,
        ``namespace``: the serving group's store prefix, for a raw store; ``setup(controller)``: called before the
        scale's first transfer, e.g. to add ``transfer_hooks``). ``collecting`` or ``ScaleAborted``."""
        from eplb_fsm.elastic.joiner import join
        return join(cls, config, models, store=store, generation=generation, rank=rank, world_size=world_size,
                    trace_dir=trace_dir, device=device, timeout_s=timeout_s, keep_trace=keep_trace, namespace=namespace,
                    setup=setup)

    def recover(self, reloaded: Any = False, group: Any = None) -> None:
        """Leave ``failed``, every rank together; ``reloaded``/``group``: see fsm/recovery.py (raises, if not)."""
        self._check_open("recover")
        if self.machine.state != FAILED:
            raise ValueError(f"recover() needs state failed, state is {self.machine.state!r}")
        self.rearranger.recover(reloaded=reloaded, group=group)

    def fire(self, trigger: str, extra: dict | None = None, **data: Any) -> Fired:
        """Fire one event and write its ``transition`` record (event data + ``extra`` context)."""
        fired = self.machine.fire(trigger, **data)
        self.reporter.time_transition(fired.source, fired.dest)
        fields = dict(data)
        layer = fields.pop("layer", fired.layer)
        if extra:
            fields.update(extra)
        self.trace.transition(trigger, fired.source, fired.dest, layer=layer, num_layers=self.machine.num_layers,
                              layer_after=fired.layer, **fields)
        return fired

    def restart_interval(self) -> None:
        """The next rearrangement is due ``step_interval`` steps from now (after one, a recovery, a scale)."""
        self.counters.restart(self.config.step_interval)

    # ------------------------------------------- the port elastic EP drives
    def switch_group(self, group: Any, communicator: Any, rank: int, world_size: int) -> None:
        """Move this rank's collectives and transfers to another group (the caller traces ``group_switch``)."""
        self.collectives.switch(group, communicator, rank, world_size)
        self.trace.set_world(rank, world_size)
        self.reporter.rank = rank

    def restore_group(self, saved: tuple) -> None:
        """Back onto the group ``collectives.save()`` returned (a scale-up rolled back)."""
        self.collectives.restore(saved)
        self.trace.set_world(self.collectives.rank, self.collectives.world_size)
        self.reporter.rank = self.collectives.rank

    def export_counters(self) -> dict:
        """The shared counters a process joining the group starts from (see :meth:`restore_counters`)."""
        c = self.counters
        return {"steps": c.steps, "since": c.since, "threshold": c.threshold, "count": self.reporter.count}

    def restore_counters(self, counters: dict) -> None:
        """Take the counters another rank exported (a joiner, before it adds its models); ``ValueError`` naming
        the key that is missing or not an int >= 0 (``threshold``: >= 1), before any counter changes."""
        keys = ("steps", "since", "threshold", "count")
        missing = [key for key in keys if key not in counters] if isinstance(counters, dict) else list(keys)
        if missing:
            raise ValueError(f"counters: {', '.join(missing)} missing (a dict as export_counters() returns)")
        values = [as_count(counters[k], f"counters[{k!r}]", minimum=int(k == "threshold")) for k in keys]
        self.counters.steps, self.counters.since, self.counters.threshold, self.reporter.count = values
        self.trace.set_context(step=self.counters.steps)

    def _check_open(self, call: str) -> None:
        if self._closed:  # its worker is stopped and its trace closed: nothing more would be traced
            raise RuntimeError(f"{call}() on a closed EplbController (close() ran); build a new controller")

    def close(self, error: str | None = None) -> None:
        """Stop the worker and the watchdog, drop the transfer group and close the trace (idempotent; ``error``: why
        the engine stops, the trace's ``end`` then how=exception); later ``step``, ``rearrange``, ``add_model``,
        ``request_scale`` and ``recover`` raise ``RuntimeError``. An interrupt in its waits goes on up once the
        trace is ended and closed."""
        if self._closed:
            return
        self._closed = True
        try:   # the trace holds its file (one writer per file): an interrupt must not leave it open
            self.liveness.stop()
            if self.watchdog is not None:
                self.watchdog.stop()
            self.rearranger.settle(act=False)  # a posted all-reduce still open: its end record, no action
            self.mover.stop_pacing()  # the worker's queued jobs pair with the peers': unpaced, they end in time
            if self.worker is not None and not self.worker.close(timeout=self.timeout_s + 5.0):  # its last jobs run
                self.trace.emit("worker_stuck", pending=self.worker.pending)   # its job may still use the group
            else:
                self.collectives.release_transfers()
        finally:
            self.trace.end("exception" if error else "closed", error or None)  # no-op after an `end` came first
            self.trace.close()

    def __enter__(self) -> "EplbController":
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        crashed = error is not None and not (isinstance(error, SystemExit) and error.code in (0, None))
        self.close(f"{type(error).__name__}: {error}" if crashed else None)   # replay: crashed, not closed in order
