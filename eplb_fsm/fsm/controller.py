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
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import structlog
import torch

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.machine import (
    COLLECTING,
    COMMITTING,
    FAILED,
    PLANNING,
    SCALING,
    TRANSFERRING,
    EplbMachine,
    Fired,
)
from eplb_fsm.fsm.model_protocol import bytes_per_slot, validate_model
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.policy import get_policy
from eplb_fsm.policy.bounds import rank_loads
from eplb_fsm.stats import LoadWindow, aggregate_logical, rank_loads_physical
from eplb_fsm.trace import EventTrace
from eplb_fsm.transfer import (
    InProcessCommunicator,
    TorchDistCommunicator,
    TransferBuffer,
    commit_layer_from_buffer,
    moved_slots,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)

__all__ = ["EplbController", "SharedTrace", "Plan", "ModelEntry", "GROUP_NAME", "TRANSFER_GROUP_NAME"]

GROUP_NAME = "ep"                 # trace name of the EP group (the engine's)
TRANSFER_GROUP_NAME = "ep_transfer"  # trace name of the controller's own transfer group
LOCAL_GROUP_NAME = "local"        # trace name when there is no process group (world 1)

_log = structlog.get_logger("eplb_fsm")


class SharedTrace(EventTrace):
    """An EventTrace whose records may come from several threads (engine, worker, watchdog).

    One lock makes each record's ``seq`` and its line go out together.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> dict:
        with self._lock:
            return super().emit(event, **fields)


@dataclass
class ModelEntry:
    """One balanced model and what the controller keeps for it."""

    name: str
    model: Any
    index: int
    layer_offset: int            # global index of its layer 0 (models' layers are concatenated)
    num_layers: int
    num_logical: int
    num_physical: int
    num_local: int
    num_groups: int
    maps: ExpertMaps
    window: LoadWindow
    log2phy: torch.Tensor        # (L, N, K) handed to the model, updated in place
    replica_count: torch.Tensor  # (L, N) handed to the model, updated in place
    buffer: Any                  # transfer.TransferBuffer (one layer)
    slot_bytes: list[int]        # bytes of one slot's weights, per layer

    def describe(self) -> dict:
        return {
            "model": self.name,
            "layers": self.num_layers,
            "layer_offset": self.layer_offset,
            "logical": self.num_logical,
            "physical": self.num_physical,
            "local": self.num_local,
            "groups": self.num_groups,
            "slot_bytes": self.slot_bytes[0] if self.slot_bytes else 0,
        }


@dataclass
class Plan:
    """A new placement for every model, and what moving to it would cost and gain.

    Computed identically on every rank from the all-reduced load, so each field is shared.
    """

    step: int
    forced: bool
    loads: list[torch.Tensor]          # per model, (L, N) float64 planning load
    new_phy2log: list[np.ndarray]      # per model, (L, P) int64
    changed: list[bool]                # per global layer: does the row change at all
    moved: list[int]                   # per global layer: slots whose expert crosses ranks
    moves: int
    moved_bytes: int
    balancedness_before: float
    balancedness_after: float
    policy_s: float

    @property
    def gain(self) -> float:
        return self.balancedness_after - self.balancedness_before


@dataclass
class _Rearrangement:
    """Book-keeping of the rearrangement in flight (becomes a ``history`` entry)."""

    index: int
    step: int
    forced: bool
    started: float
    plan: Plan | None = None
    job: Any = None                   # async: the worker job in flight (plan or layer)
    layers_committed: int = 0


class _GroupBroken(RuntimeError):
    """A collective on the EP group failed or timed out: the group is no longer trusted."""


class EplbController:
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
    ) -> None:
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        if role not in ("member", "joiner"):
            raise ValueError(f"role must be 'member' or 'joiner', got {role!r}")
        self.role = role
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        policy_cls = get_policy(config.policy)
        # a policy with settings in the config (e.g. movement_aware's target) builds itself from it
        self.policy = policy_cls.from_config(config) if hasattr(policy_cls, "from_config") else policy_cls
        self.group, self.rank, self.world = _resolve_group(group)
        self._custom_group = self.group is not None and _is_collective_group(self.group)
        self.group_name = getattr(self.group, "trace_name", GROUP_NAME) if self.group is not None \
            else LOCAL_GROUP_NAME
        # elastic EP: the group's generation (0 until a scale) and this rank's scale requests
        self.generation = int(getattr(self.group, "generation", 0) or 0)
        self.scalings: list[dict] = []
        initial = SCALING if role == "joiner" else COLLECTING
        self._comm_device = self._collective_device()
        self.trace = SharedTrace(self.rank, self.world, trace_dir, clock=clock, keep=keep_trace)
        self.trace.set_context(state=initial, step=int(start_step))
        self.trace.header(
            config.to_dict(),
            mode="async" if config.use_async else "sync",
            device=str(self.device),
            group=self.group_name,
            transfer_group=self._transfer_base() if self.group is not None else LOCAL_GROUP_NAME,
            **({"role": role, "generation": self.generation,
                "machine": {"state": SCALING, "scale_pending": True}} if role == "joiner" else {}),
        )
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
        self._current: _Rearrangement | None = None
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
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _collective_device(self) -> torch.device:
        if self.group is None or self._custom_group:
            return torch.device("cpu")
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group)).lower()
        return self.device if backend == "nccl" else torch.device("cpu")

    @property
    def transfer_group_name(self) -> str:
        """Trace name of the current transfer group: ``ep_transfer``, then ``ep_transfer.<n>`` after resets."""
        if self.group is None:
            return LOCAL_GROUP_NAME
        gen = self._transfer_generation
        base = self._transfer_base()
        return base if gen <= 0 else f"{base}.{gen}"

    def _transfer_base(self) -> str:
        """``ep_transfer`` for the first EP group, ``ep_transfer@<g>`` for a later generation's."""
        return TRANSFER_GROUP_NAME if self.generation == 0 else f"{TRANSFER_GROUP_NAME}@{self.generation}"

    def _new_transfer_group(self) -> None:
        """(Re)create the process group the weight transfers run on (collective over the EP ranks).

        Each new group gets a new trace name, so its collective sequence (``cseq``) starts
        from 0 on every rank whatever the old group saw.
        """
        self._transfer_generation += 1
        if self.group is None:
            self._communicator = InProcessCommunicator(1, name=LOCAL_GROUP_NAME)
            return
        if self._custom_group:
            self._communicator = self.group.transfer_communicator(self._timeout)
            try:
                self._communicator.name = self.transfer_group_name
            except AttributeError:  # a communicator with a fixed name keeps it
                pass
            return
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.group)
        self.transfer_group = dist.new_group(
            ranks=ranks,
            timeout=datetime.timedelta(seconds=self._timeout),
            use_local_synchronization=True,
        )
        # no stream of its own: in async mode the worker already runs each job on its stream
        self._communicator = TorchDistCommunicator(
            self.transfer_group, timeout=self._timeout, name=self.transfer_group_name
        )

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
        shape = validate_model(model, self.world, self.config.num_redundant_experts)
        L = shape["num_moe_layers"]
        N = shape["num_logical_experts"]
        P = shape["num_physical_experts"]
        if phy2log is None:
            maps = ExpertMaps.initial(L, N, P)
        else:
            maps = ExpertMaps.from_phy2log(phy2log, N)
            if maps.phy2log.shape != (L, P):
                raise ValueError(f"phy2log must have shape ({L}, {P}), got {maps.phy2log.shape}")
        window = LoadWindow(L, P, self.config.window_size, device=self.device)
        log2phy = torch.from_numpy(maps.log2phy.copy()).to(self.device)
        replica_count = torch.from_numpy(maps.replica_count.copy()).to(self.device)
        offset = sum(entry.num_layers for entry in self.models)
        entry = ModelEntry(
            name=name,
            model=model,
            index=len(self.models),
            layer_offset=offset,
            num_layers=L,
            num_logical=N,
            num_physical=P,
            num_local=shape["num_local_physical_experts"],
            num_groups=shape["num_expert_groups"],
            maps=maps,
            window=window,
            log2phy=log2phy,
            replica_count=replica_count,
            buffer=TransferBuffer(),
            slot_bytes=[bytes_per_slot(model, layer) for layer in range(L)],
        )
        self.models.append(entry)
        self._windows.append(window)
        self.machine.num_layers = offset + L
        model.set_eplb_state(window.load_pass, log2phy, replica_count)
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

    # ------------------------------------------------------------- collectives
    def _all_reduce(self, parts: dict[str, torch.Tensor], timeout_s: float, **fields: Any) -> dict[str, torch.Tensor]:
        """Sum ``parts`` over the EP group in ONE all-reduce (float64, concatenated).

        ``fields`` go into its trace records (e.g. ``layer`` for a layer's agreement).
        Raises ``_GroupBroken`` if the collective raises or does not finish in time.
        """
        names = list(parts)
        flat = [parts[n].reshape(-1).to(device=self._comm_device, dtype=torch.float64) for n in names]
        sizes = [t.numel() for t in flat]
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        try:
            with self.trace.collective("all_reduce", group=self.group_name, shape=tuple(buf.shape),
                                       dtype=buf.dtype, parts=names, sizes=sizes, **fields):
                if self._custom_group:
                    self.group.all_reduce(buf, timeout_s)
                elif self.group is not None:
                    import torch.distributed as dist

                    work = dist.all_reduce(buf, group=self.group, async_op=True)
                    work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            raise _GroupBroken(f"all_reduce of {names} failed: {type(exc).__name__}: {exc}") from exc
        out = {}
        for name, piece in zip(names, torch.split(buf, sizes)):
            out[name] = piece.reshape(parts[name].shape)
        return out

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
            self._since = 0
            self._threshold = self.config.step_interval
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
        except _GroupBroken as exc:
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
        self._since = 0
        self._threshold = self.config.step_interval
        count = len(self.history)
        self._fire("step", extra={"forced": True}, due=True)
        self._current = self._begin(self.steps, forced=True)
        try:
            reduced = self._all_reduce({"loads": self._local_loads()}, self._timeout)
        except _GroupBroken as exc:
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
        from eplb_fsm.fsm import scaling

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
        from eplb_fsm.fsm import scaling

        return scaling.join(cls, config, models, store=store, generation=generation, rank=rank,
                            world_size=world_size, trace_dir=trace_dir, device=device, timeout_s=timeout_s,
                            keep_trace=keep_trace)

    def recover(self) -> None:
        """Leave ``failed`` once the engine has repaired the group (every rank together)."""
        if self.machine.state != FAILED:
            raise ValueError(f"recover() needs state failed, state is {self.machine.state!r}")
        self._fire("recovered")
        self._since = 0
        self._threshold = self.config.step_interval

    # -------------------------------------------------------------- profiling
    def _profile_step(self) -> None:
        """Reserve each model's transfer buffer (transfer profile mode); nothing else changes."""
        reserved = 0
        for entry in self.models:
            current = entry.maps.phy2log
            rearrange_expert_weights_inplace(
                current, current, self._wrap(entry.model.expert_weights), communicator=self._communicator,
                is_profile=True, buffer=entry.buffer,
            )
            reserved += entry.buffer.nbytes
            entry.window.load_pass.zero_()  # the profile pass's counts are not real load
        self.trace.emit("profile", buffer_bytes=reserved)

    # --------------------------------------------------------------- planning
    def _begin(self, step: int, forced: bool) -> _Rearrangement:
        self._count += 1
        return _Rearrangement(index=self._count, step=step, forced=forced, started=time.perf_counter())

    def _local_loads(self) -> torch.Tensor:
        """This rank's planning load of every model, (sum_m L_m * N_m,) float64, concatenated."""
        pieces = []
        for entry in self.models:
            window = entry.window
            if self.config.load_estimator == "window_sum":
                physical = window.physical_load().to(torch.float64)
            else:
                physical = window.estimate(self.config.load_estimator, self.config.load_decay)
            phy2log = torch.from_numpy(entry.maps.phy2log).to(physical.device)
            pieces.append(aggregate_logical(physical, phy2log, entry.num_logical).reshape(-1))
        return torch.cat(pieces)

    def _split_loads(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for entry in self.models:
            n = entry.num_layers * entry.num_logical
            out.append(flat[start:start + n].reshape(entry.num_layers, entry.num_logical).cpu())
            start += n
        return out

    def _planning(self, flat_loads: torch.Tensor) -> None:
        """Act on the all-reduced load: reject it, or plan (sync) / start the policy job (async)."""
        bad = _bad_load_reason(flat_loads)
        if bad is not None:
            self.trace.emit("loads_rejected", reason=bad)
            _log.warning("eplb loads rejected", rank=self.rank, step=self.steps - 1, reason=bad)
            self._abort(f"bad loads: {bad}", recoverable=True, kind="rejected")
            return
        loads = self._split_loads(flat_loads)
        current = self._current
        if self.worker is None:
            try:
                plan = self._make_plan(loads, current.step, current.forced)
            except Exception as exc:
                self._abort(f"policy failed: {type(exc).__name__}: {exc}", recoverable=True)
                return
            if self._accept_plan(plan):
                self._sync_transfer()
        else:
            current.job = self.worker.submit(self._make_plan, loads, current.step, current.forced, kind="plan")

    def _make_plan(self, loads: list[torch.Tensor], step: int, forced: bool) -> Plan:
        """Run the policy for every model on the shared load (pure: same input, same plan)."""
        t0 = time.perf_counter()
        new_rows: list[np.ndarray] = []
        changed: list[bool] = []
        moved: list[int] = []
        before, after = [], []
        moved_bytes = 0
        for entry, load in zip(self.models, loads):
            old = entry.maps.phy2log
            phy2log, _, _ = self.policy.rebalance_experts(
                load, entry.num_physical, entry.num_groups, self.config.num_nodes, self.world,
                old_phy2log=torch.from_numpy(old.copy()),
            )
            new = np.ascontiguousarray(np.asarray(phy2log.detach().cpu().numpy(), dtype=np.int64))
            if new.shape != old.shape:
                raise ValueError(f"policy returned phy2log of shape {new.shape} for model "
                                 f"{entry.name!r}, expected {old.shape}")
            ExpertMaps.from_phy2log(new, entry.num_logical, max_replicas=entry.maps.max_replicas)  # validates
            for layer in range(entry.num_layers):
                changed.append(not np.array_equal(old[layer], new[layer]))
                count = moved_slots(old[layer], new[layer], self.world)
                moved.append(count)
                moved_bytes += count * entry.slot_bytes[layer]
            before.append(rank_loads(old, load, self.world))
            after.append(rank_loads(new, load, self.world))
            new_rows.append(new)
        return Plan(
            step=step,
            forced=forced,
            loads=loads,
            new_phy2log=new_rows,
            changed=changed,
            moved=moved,
            moves=int(sum(moved)),
            moved_bytes=int(moved_bytes),
            balancedness_before=_balancedness(before),
            balancedness_after=_balancedness(after),
            policy_s=time.perf_counter() - t0,
        )

    def _accept_plan(self, plan: Plan) -> bool:
        """Fire ``plan_ready``; True when it leads to transferring."""
        current = self._current
        current.plan = plan
        threshold = self.config.min_balancedness_gain
        worth = plan.moves > 0 and plan.gain > threshold
        extra = {
            "balancedness_before": round(plan.balancedness_before, 6),
            "balancedness_after": round(plan.balancedness_after, 6),
            "gain": round(plan.gain, 6),
            "moved_bytes": plan.moved_bytes,
            "changed_layers": int(sum(plan.changed)),
            "policy_s": round(plan.policy_s, 6),
            "forced": plan.forced,
        }
        fired = self._fire("plan_ready", extra=extra, moves=plan.moves, worth=worth)
        if fired.dest != TRANSFERRING:
            reason = "no_moves" if plan.moves == 0 else "gain_below_threshold"
            self.trace.emit("plan_skipped", reason=reason, moves=plan.moves, gain=round(plan.gain, 6),
                            min_balancedness_gain=threshold)
            _log.info("eplb rearrangement skipped", rank=self.rank, step=plan.step, reason=reason,
                      moves=plan.moves, gain=round(plan.gain, 6), min_gain=threshold)
            self._finish("skipped", reason=reason)
            return False
        return True

    # --------------------------------------------------------------- transfer
    def _locate(self, layer: int) -> tuple[ModelEntry, int]:
        for entry in self.models:
            if layer < entry.layer_offset + entry.num_layers:
                return entry, layer - entry.layer_offset
        raise IndexError(f"layer {layer} is outside the {self.num_layers} layers")

    def _wrap(self, value: Any) -> Any:
        return [value] if getattr(self._communicator, "multi_rank", False) else value

    def _transfer_layer(self, layer: int) -> Any:
        """Move one layer's weights into its model's buffer (weights untouched); returns the pending layer."""
        entry, local = self._locate(layer)
        for hook in list(self.transfer_hooks):
            hook(layer, entry.name, local)
        new_row = self._current.plan.new_phy2log[entry.index][local]
        return transfer_layer_to_buffer(
            entry.maps.phy2log[local].copy(), new_row, self._wrap(entry.model.expert_weights[local]),
            entry.buffer, layer=layer, communicator=self._communicator, trace=self.trace,
            migration_batching=self.config.enable_migration_batching,
        )

    def _commit_layer(self, layer: int, pending: Any) -> None:
        """Write a transferred layer's weights and flip its maps, in one go."""
        entry, local = self._locate(layer)
        new_row = self._current.plan.new_phy2log[entry.index][local]
        if pending is not None:
            commit_layer_from_buffer(pending, self._wrap(entry.model.expert_weights[local]))
            old_row = entry.maps.phy2log[local].copy()
            entry.maps.replace_layer(local, new_row)
            entry.window.remap_layer(local, old_row, new_row, entry.num_logical)
            entry.log2phy[local].copy_(torch.from_numpy(entry.maps.log2phy[local]))
            entry.replica_count[local].copy_(torch.from_numpy(entry.maps.replica_count[local]))
            entry.model.set_eplb_state(entry.window.load_pass, entry.log2phy, entry.replica_count)
        self._current.layers_committed += 1
        self._fire("layer_done", extra={"model": entry.name, "model_layer": local,
                                        "moved": self._current.plan.moved[layer],
                                        "changed": self._current.plan.changed[layer]}, layer=layer)

    def _sync_transfer(self) -> None:
        """Sync mode: every layer, each transferred, agreed on by all ranks, then committed."""
        plan = self._current.plan
        for layer in range(self.machine.num_layers):
            if not plan.changed[layer]:
                self._commit_layer(layer, None)
                continue
            error: BaseException | None = None
            pending = None
            try:
                pending = self._transfer_layer(layer)
            except Exception as exc:
                error = exc
            flags = torch.tensor([0.0 if error else 1.0, 1.0 if error else 0.0, 0.0], dtype=torch.float64)
            # a peer may itself be waiting out a transfer timeout before it reaches this all-reduce
            try:
                agreed = self._all_reduce({"ready": flags}, 2 * self._timeout, layer=layer)["ready"]
            except _GroupBroken as exc:
                self._group_fault(exc)
                return
            if agreed[1] > 0:
                self._transfer_fault(layer, error, int(agreed[1]))
                return
            try:
                self._commit_layer(layer, pending)
            except Exception as exc:  # a local copy failed half-way: the weights can't be trusted
                self._abort(f"commit of layer {layer} failed: {type(exc).__name__}: {exc}", recoverable=False)
                return
        self._fire("committed", extra=self._summary_fields())
        self._finish("committed")

    # ------------------------------------------------------------------ async
    def _ready_flags(self) -> torch.Tensor:
        """This rank's [ready, failed, late] for the job in flight (summed over ranks)."""
        job = self._current.job
        if job is None:
            return torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
        if job.done():
            failed = job.error() is not None
            return torch.tensor([0.0 if failed else 1.0, 1.0 if failed else 0.0, 0.0], dtype=torch.float64)
        late = job.age() > self._timeout
        return torch.tensor([0.0, 0.0, 1.0 if late else 0.0], dtype=torch.float64)

    def _async_progress(self, flags: torch.Tensor) -> None:
        ready, failed, late = (int(round(float(v))) for v in flags)
        current = self._current
        state = self.machine.state
        if failed or late:
            error = current.job.error() if current.job is not None else None
            what = "policy" if state == PLANNING else f"transfer of layer {self.machine.layer}"
            reason = (f"{what} failed on {failed} rank(s)" if failed else
                      f"{what} ran past collective_timeout_s={self._timeout} on {late} rank(s)")
            if state == PLANNING:
                self._abort(reason + (f": {type(error).__name__}: {error}" if error else ""), recoverable=True)
            else:
                self._transfer_fault(self.machine.layer, error, failed, late=late)
            return
        if ready < self.world:
            return  # not everywhere yet: the next step asks again
        job = current.job
        current.job = None
        if state == PLANNING:
            if self._accept_plan(job.result(timeout=0)):
                self._async_advance()
            return
        job.wait_stream()
        layer = self.machine.layer
        try:
            self._commit_layer(layer, job.result(timeout=0))
        except Exception as exc:
            self._abort(f"commit of layer {layer} failed: {type(exc).__name__}: {exc}", recoverable=False)
            return
        self._async_advance()

    def _async_advance(self) -> None:
        """Commit unchanged layers at once, start the next changed layer, or finish."""
        plan = self._current.plan
        while self.machine.state == TRANSFERRING:
            layer = self.machine.layer
            if plan.changed[layer]:
                self._current.job = self.worker.submit(self._transfer_layer, layer, kind="transfer", layer=layer)
                return
            self._commit_layer(layer, None)
        if self.machine.state == COMMITTING:
            self._fire("committed", extra=self._summary_fields())
            self._finish("committed")

    # ----------------------------------------------------------------- faults
    def _transfer_fault(self, layer: int, error: BaseException | None, failed_ranks: int, late: int = 0) -> None:
        """A layer's transfer failed somewhere: abort, then give the transfers a fresh group."""
        detail = f": {type(error).__name__}: {error}" if error is not None else ""
        if late:
            reason = f"transfer of layer {layer} ran past collective_timeout_s={self._timeout} on {late} rank(s)"
        else:
            reason = f"transfer of layer {layer} failed on {failed_ranks} rank(s){detail}"
        self._abort(reason, recoverable=True, layer=layer)
        self._reset_transfers()

    def _reset_transfers(self) -> None:
        """Drain the worker and re-create the transfer group (a failed p2p leaves gloo pairs closed).

        The ranks first agree, in one all-reduce, that every worker has drained: then they
        all create the new group together (its connect phase is bounded by
        ``collective_timeout_s``, so nobody may arrive late), or all go to ``failed``.
        """
        drained = self.worker is None or self.worker.wait_idle(self._timeout + 5.0)
        if not drained:
            self.trace.emit("worker_stuck", pending=self.worker.pending)
        for entry in self.models:
            entry.buffer.generation += 1  # any stale pending layer can no longer be committed
        if self.group is None:
            if not drained:
                self._fire("fault", extra={"reason": "background worker did not finish its job"},
                           recoverable=False)
            return
        flags = torch.tensor([0.0 if drained else 1.0], dtype=torch.float64)
        try:
            # a peer may still be waiting out its transfer timeout before it gets here
            stuck = int(self._all_reduce({"reset": flags}, 2 * self._timeout + 10.0)["reset"][0])
        except _GroupBroken as exc:
            self._group_fault(exc)
            return
        if stuck:
            self._fire("fault", extra={"reason": f"background worker did not finish its job on {stuck} rank(s)"},
                       recoverable=False)
            return
        try:
            self._new_transfer_group()
        except Exception as exc:
            self._fire("fault", extra={"reason": f"could not re-create the transfer group: {exc}"},
                       recoverable=False)
            return
        self.trace.emit("transfer_group_reset", group=self.transfer_group_name)

    def _group_fault(self, exc: BaseException) -> None:
        """A collective on the EP group failed: the group is broken, the machine goes to failed."""
        _log.error("eplb collective failed", rank=self.rank, step=self.steps - 1, error=str(exc))
        if self.machine.state == FAILED:
            return
        self._abort(str(exc), recoverable=False)

    def _abort(self, reason: str, recoverable: bool, layer: int | None = None, kind: str = "aborted") -> None:
        """Fire ``fault``: committed layers stay new, the rest keep old maps and weights."""
        current = self._current
        extra = {"reason": reason}
        if current is not None:
            extra["layers_committed"] = current.layers_committed
            if current.job is not None and not current.job.done():
                extra["job_running"] = current.job.kind
            current.job = None
        if layer is not None:
            extra["failed_layer"] = layer
        if self.machine.state == FAILED:
            self.trace.emit("fault_ignored", reason=reason)
        else:
            self._fire("fault", extra=extra, recoverable=recoverable)
        _log.warning("eplb rearrangement aborted", rank=self.rank, step=self.steps - 1, reason=reason,
                     recoverable=recoverable, state=self.machine.state)
        if current is not None:
            self._finish(kind, reason=reason)

    # ----------------------------------------------------------------- ending
    def _summary_fields(self) -> dict:
        current = self._current
        plan = current.plan
        return {
            "rearrangement": current.index,
            "moves": plan.moves if plan else 0,
            "moved_bytes": plan.moved_bytes if plan else 0,
            "layers_committed": current.layers_committed,
            "steps_taken": self.steps - current.step,
            "seconds": round(time.perf_counter() - current.started, 6),
        }

    def _finish(self, outcome: str, reason: str | None = None) -> None:
        current = self._current
        if current is None:
            return
        plan = current.plan
        entry = {
            "index": current.index,
            "step": current.step,
            "end_step": max(self.steps - 1, current.step),
            "forced": current.forced,
            "outcome": outcome,
            "reason": reason,
            "moves": plan.moves if plan else 0,
            "moved_bytes": plan.moved_bytes if plan else 0,
            "changed_layers": int(sum(plan.changed)) if plan else 0,
            "layers_committed": current.layers_committed,
            "num_layers": self.machine.num_layers,
            "balancedness_before": plan.balancedness_before if plan else None,
            "balancedness_after": plan.balancedness_after if plan else None,
            "policy_s": plan.policy_s if plan else None,
            "seconds": time.perf_counter() - current.started,
            "state": self.machine.state,
        }
        self.history.append(entry)
        self.trace.emit("rearrangement", **{k: (round(v, 6) if isinstance(v, float) else v)
                                            for k, v in entry.items() if k != "state"})
        if outcome == "committed":
            _log.info("eplb rearrangement committed", rank=self.rank, step=current.step, moves=entry["moves"],
                      balancedness_before=entry["balancedness_before"],
                      balancedness_after=entry["balancedness_after"])
        self._current = None

    # ------------------------------------------------------------ balancedness
    def _log_pass_balancedness(self, step: int, flat: torch.Tensor) -> None:
        """Balancedness of the current placements under this pass's (all-reduced) load."""
        per_model: dict[str, float] = {}
        means = maxes = 0.0
        start = 0
        for entry in self.models:
            n = entry.num_layers * entry.num_physical
            physical = flat[start:start + n].reshape(entry.num_layers, entry.num_physical).cpu()
            start += n
            loads = rank_loads_physical(physical, self.world)
            mean, peak = float(loads.mean(dim=1).sum()), float(loads.max(dim=1).values.sum())
            means += mean
            maxes += peak
            per_model[entry.name] = mean / peak if peak > 0 else 1.0
        value = means / maxes if maxes > 0 else 1.0
        self.balancedness_log.append((step, value))
        self.trace.emit("balancedness", value=round(value, 6), models={k: round(v, 6) for k, v in per_model.items()},
                        tokens=float(flat.sum()))
        _log.info("eplb balancedness", rank=self.rank, step=step, balancedness=round(value, 6),
                  models=per_model)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the worker and the watchdog and close the trace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.worker is not None:
            self.worker.close(timeout=self._timeout)
        self.trace.close()

    def __enter__(self) -> "EplbController":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- helpers
def _is_collective_group(group: Any) -> bool:
    return callable(getattr(group, "all_reduce", None)) and callable(getattr(group, "transfer_communicator", None))


def _resolve_group(group: Any) -> tuple[Any, int, int]:
    if group is not None and _is_collective_group(group):
        rank, world = int(group.rank), int(group.world_size)
        if not 0 <= rank < world:
            raise ValueError(f"group: rank {rank} is outside a group of {world}")
        return group, rank, world
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        dist = None
    if group is None and dist is not None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


def _bad_load_reason(flat: torch.Tensor) -> str | None:
    """Why an all-reduced load can't be planned on (every rank sees the same tensor), or None."""
    if flat.numel() == 0:
        return "empty load"
    if bool(torch.isnan(flat).any()):
        return "NaN in the load"
    if not bool(torch.isfinite(flat).all()):
        return "infinite load"
    if bool((flat < 0).any()):
        return f"negative load (min {float(flat.min())})"
    return None


def _balancedness(rank_loads: Sequence[np.ndarray]) -> float:
    """sum(mean) / sum(max) over every layer of every model (design §2)."""
    means = sum(float(loads.mean(axis=1).sum()) for loads in rank_loads)
    maxes = sum(float(loads.max(axis=1).sum()) for loads in rank_loads)
    return means / maxes if maxes > 0 else 1.0
