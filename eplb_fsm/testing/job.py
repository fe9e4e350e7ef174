"""Synthetic per-rank traces: a lockstep sync-mode job driven through the real machine.

Each :class:`~eplb_fsm.testing.ranks.SyntheticRank` pairs an ``EplbMachine`` with an ``EventTrace`` and records what
the controller records: a ``header``, a compact ``step`` record for every step that keeps
the state, a ``transition`` record for every other fired event (with ``num_layers`` and
the event data), and ``collective_start``/``collective_end`` pairs from
``EventTrace.collective``. ``SyntheticJob`` runs W such ranks step by step: every
``interval`` steps a rearrangement all-reduces the load and the maps digest, plans,
transfers every layer with one ``batch_isend_irecv`` and one ``ready`` agreement per layer,
agrees once more in ``committing`` and commits, in the controller's layout (docs/events.md,
"Reading a rearrangement"); every third plan finds nothing worth moving and logs
``plan_skipped``.

Faults (:mod:`eplb_fsm.testing.faults`, checked before a ``run`` starts) are injected per
rank, so tests, the docs and ``eplb-fsm bench replay`` get realistic broken traces: a rank
that stops (before a step, before its collective, or inside it), a rank whose interval
counter misses a step, a rank that issues a different collective, a rank that records an
illegal transition, a rank with a different config. ``close()`` ends every live rank's
trace with ``end`` as ``EplbController.close()`` does.

``SyntheticJob.scale(new_world, ...)`` adds elastic EP between two ``run`` calls: a
scale-down (leaving ranks send their experts away and stop) or a scale-up (joiners append a
session to the rank files they take over), with its faults (:mod:`eplb_fsm.testing.elastic`). ``run``'s
faults are keyed by the ranks' current numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eplb_fsm.maps import as_count, as_finite_float
from eplb_fsm.testing.elastic import scale as _scale_job
from eplb_fsm.testing.faults import STOP_POINTS, Faults, Stop, check_faults, hang_faults
from eplb_fsm.testing.ranks import (GROUP, MAPS_FLAGS, READY_FLAGS, SLOT_BYTES, TRANSFER_GROUP, SyntheticClock,
                                    SyntheticRank)
from eplb_fsm.trace import encode_record, trace_path

__all__ = ["STOP_POINTS", "Faults", "Stop", "SyntheticJob", "hang_faults", "write_traces"]  # faults' re-exported


class SyntheticJob:
    """W ranks stepping in lockstep (sync mode), with faults injected per rank.

    ``ranks`` picks which ranks are simulated (default: all of ``range(world)``); the
    benchmark simulates one and copies its file. ``config`` is the header config;
    ``config_overrides`` gives some ranks different values. ``compact_steps``: quiet steps
    are counted into ``steps`` runs as the controller's hot path does
    (``EventTrace.count_step``) instead of one ``step`` record each. ``t0`` (the first
    step's time) and ``step_s`` (> 0, seconds a step) are finite numbers. ``slots_per_rank``
    is the expert slots each rank holds: at least ``ceil(num_experts / world)``, the fewest
    that hold every expert, which is the default; the spare ones, ``slots_per_rank * world -
    num_experts``, are the default config's ``num_redundant_experts``. A scale keeps it, so
    ``scale(new_world)`` needs ``slots_per_rank * new_world >= num_experts``: give a job you
    scale down spare slots (``SyntheticJob(world=4, slots_per_rank=4)`` can go down to 2
    ranks). A bad argument is a ``ValueError`` naming it, raised before any trace file is
    created.
    """

    def __init__(
        self,
        world: int = 4,
        num_layers: int = 2,
        num_experts: int = 8,
        interval: int = 10,
        trace_dir: str | os.PathLike | None = None,
        config: dict | None = None,
        config_overrides: dict[int, dict] | None = None,
        ranks: list[int] | None = None,
        keep: bool = True,
        t0: float = 1_700_000_000.0,
        step_s: float = 0.05,
        compact_steps: bool = False,
        slots_per_rank: int | None = None,
    ) -> None:
        world = as_count(world, "world")
        num_layers = as_count(num_layers, "num_layers")
        num_experts = as_count(num_experts, "num_experts")
        interval = as_count(interval, "interval")
        chosen = list(range(world)) if ranks is None else [as_count(r, "ranks", minimum=0) for r in ranks]
        if len(set(chosen)) != len(chosen) or any(r >= world for r in chosen):
            raise ValueError(f"ranks must be distinct ranks below world={world}, got {ranks}")
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"config must be a mapping of config fields, got {type(config).__name__}")
        if config_overrides is not None and not isinstance(config_overrides, Mapping):
            raise ValueError(f"config_overrides must be a mapping rank -> config fields, "
                             f"got {type(config_overrides).__name__}")
        for r, values in (config_overrides or {}).items():
            if r not in chosen:
                raise ValueError(f"config_overrides: rank {r!r} is not one of the simulated ranks {chosen}")
            if not isinstance(values, Mapping):
                raise ValueError(f"config_overrides[{r!r}] must be a mapping of config fields, "
                                 f"got {type(values).__name__}")
        # checked here, before any trace file exists: a bad clock would only fail (or write nan) later
        step_s = as_finite_float(step_s, "step_s", "a finite number > 0")
        if step_s <= 0:
            raise ValueError(f"step_s must be a finite number > 0, got {step_s!r}")
        t0 = as_finite_float(t0, "t0")
        # every rank holds the same number of slots, so a world that does not divide the
        # experts gets redundant slots (physical >= logical), as a real placement would
        fewest = math.ceil(num_experts / world)
        slots_per_rank = fewest if slots_per_rank is None else as_count(slots_per_rank, "slots_per_rank")
        if slots_per_rank < fewest:
            raise ValueError(f"slots_per_rank must be >= {fewest} (world={world} ranks hold {num_experts} experts: "
                             f"every expert needs a slot), got {slots_per_rank}")
        self.world = world
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.interval = interval
        self.step_s = step_s
        self.t0 = t0
        self.step_no = 0
        self.compact_steps = compact_steps
        self.trace_dir = trace_dir
        self.slots_per_rank = slots_per_rank
        physical = self.slots_per_rank * world
        if config is None:
            from eplb_fsm.config import EplbConfig

            config = EplbConfig(window_size=interval, step_interval=interval,
                                num_redundant_experts=physical - num_experts).to_dict()
        self.config = dict(config)
        self.keep = keep
        self.generation = 0
        self.closed = False
        self.ranks: dict[int, SyntheticRank] = {}       # the serving ranks, by current rank
        self.sessions: list[SyntheticRank] = []        # every rank ever, in the order they started
        for r in chosen:
            clock = SyntheticClock(t0)
            rank = SyntheticRank(r, world, num_layers, trace_dir, clock, keep=keep)
            cfg = dict(config)
            cfg.update((config_overrides or {}).get(r, {}))
            # the controller's header and model registration
            rank.trace.header(cfg, mode="sync", device="cpu", group=GROUP, transfer_group=TRANSFER_GROUP)
            rank.trace.emit("model_added", num_layers=num_layers, model="main", layers=num_layers,
                            layer_offset=0, logical=num_experts, physical=physical,
                            local=self.slots_per_rank, groups=1, slot_bytes=SLOT_BYTES)
            self.ranks[r] = rank
            self.sessions.append(rank)

    # -- driving ---------------------------------------------------------
    def run(self, steps: int, faults: Faults | None = None) -> "SyntheticJob":
        """Advance every live rank by ``steps`` engine steps.

        ``faults`` is checked first (:func:`~eplb_fsm.testing.faults.check_faults`): a fault that is
        malformed, or that could not fire at a step of this run, is a ``ValueError`` before any step.
        """
        self._check_open("run")
        steps = as_count(steps, "steps", minimum=0)
        faults = Faults() if faults is None else faults
        check_faults(self, faults, steps)
        for _ in range(steps):
            step = self.step_no
            for rank in self.ranks.values():
                if not rank.stopped:
                    rank.clock.at_least(self.t0 + step * self.step_s)
                    self._rank_step(rank, step, faults)
            self.step_no += 1
        return self

    def _rank_step(self, rank: SyntheticRank, step: int, faults: Faults) -> None:
        r = rank.rank
        stop = faults.stop.get(r)
        if stop is not None and stop.step == step and stop.where == "before_step":
            rank.stopped = True
            return
        rank.trace.set_context(step=step)
        if faults.skip_count.get(r) != step:
            rank.count += 1
        due = rank.count >= self.interval
        if self.compact_steps and not due:
            rank.trace.count_step()   # the controller's hot path: the machine is not fired
            return
        rank.fire("step", due=due)
        if not due:
            return
        rank.count = 0
        index = rank.rearrangements
        rank.rearrangements += 1
        if stop is not None and stop.step == step and stop.where == "before_collective":
            rank.stopped = True
            return
        overrides: dict = {}
        wrong = faults.wrong_collective.get(r)
        if wrong is not None and wrong[0] == step:
            overrides = dict(wrong[1])
        size = self.num_layers * self.num_experts
        # the planning all-reduce: (L * E,) loads, then the one model's maps digest (Rearranger.planning_parts)
        fields = {"op": "all_reduce", "group": rank.group, "shape": [size + MAPS_FLAGS], "dtype": "torch.float64",
                  "parts": ["loads", "maps"], "sizes": [size, MAPS_FLAGS]}
        fields.update(overrides)
        finish = not (stop is not None and stop.step == step and stop.where == "in_collective")
        if not rank.collective(finish=finish, **fields):
            rank.stopped = True
            return
        moves = 0 if index % 3 == 2 else 1 + (index % 4)
        plan_extra = {"balancedness_before": 0.71, "balancedness_after": 0.93 if moves else 0.71,
                      "gain": 0.22 if moves else 0.0, "moved_bytes": moves * SLOT_BYTES * self.num_layers,
                      "changed_layers": self.num_layers if moves else 0, "policy_s": 0.0004, "forced": False}
        rank.fire("plan_ready", extra=plan_extra, moves=moves, worth=moves > 0)
        if moves == 0:
            rank.trace.emit("plan_skipped", reason="no_moves", moves=0, gain=0.0, min_balancedness_gain=0.0)
            rank.trace.emit("rearrangement", index=index, step=step, outcome="skipped", reason="no_moves")
            return
        for k in range(self.num_layers):
            peers = sorted({(r + 1) % self.world, (r - 1) % self.world} - {r})
            wave = {"group": rank.transfer_group, "layer": k, "wave": 0, "waves": 1, "sends": moves,
                    "recvs": moves, "nbytes": moves * SLOT_BYTES, "peers": peers}
            failing = sorted(f for f, at in faults.transfer_error.items() if at == (step, k))
            if failing:
                self._transfer_fault(rank, k, failing, wave, index, step)
                return
            rank.collective("batch_isend_irecv", **wave)
            rank.agreement("ready", READY_FLAGS, layer=k)
            if faults.illegal.get(r) == step:
                # a buggy controller that commits right after the first layer
                rank.trace.transition("committed", "transferring", "collecting", layer=k,
                                      num_layers=self.num_layers, layer_after=k)
                rank.force_state("collecting")
                return
            rank.fire("layer_done", extra={"model": "main", "model_layer": k, "moved": moves, "changed": True},
                      layer=k)
        rank.agreement("ready", READY_FLAGS)   # in committing, no layer: every rank wrote its layers whole
        rank.fire("committed", extra={"rearrangement": index, "moves": moves, "layers_committed": self.num_layers})
        rank.trace.emit("rearrangement", index=index, step=step, outcome="committed", moves=moves,
                        layers_committed=self.num_layers)

    def _transfer_fault(self, rank: SyntheticRank, layer: int, failing: list[int], wave: dict,
                        index: int, step: int) -> None:
        """Layer ``layer`` failed on ``failing``: the layer's agreement, a fault everywhere, then the ``reset``
        agreement and a fresh transfer group (``fsm/faults.transfer_fault``, ``fsm/recovery.reset_transfers``)."""
        if rank.rank in failing:
            error = "RuntimeError: injected transfer error"   # raised before it sent anything: no wave record
        else:
            timeout = TimeoutError(f"timed out waiting for rank {failing[0]}")
            error = f"TimeoutError: {timeout}"
            try:
                with rank.trace.collective("batch_isend_irecv", **wave):
                    raise timeout
            except TimeoutError:
                pass
        rank.agreement("ready", READY_FLAGS, layer=layer)
        # every rank's flags say failed: the failing ranks' own error, the others' timed-out wave
        reason = f"transfer of layer {layer} failed on {self.world} rank(s): {error}"
        rank.fire("fault", extra={"reason": reason, "layers_committed": layer, "failed_layer": layer},
                  recoverable=True)
        rank.trace.emit("rearrangement", index=index, step=step, outcome="aborted", reason=reason,
                        layers_committed=layer)
        rank.agreement("reset", 1)   # [workers still busy]: 0 everywhere, so every rank builds the new group
        rank.transfer_resets += 1
        rank.transfer_group = f"{rank.transfer_base}.{rank.transfer_resets}"
        rank.trace.emit("transfer_group_reset", group=rank.transfer_group)

    def scale(self, new_world: int, **kwargs: Any) -> dict:
        """Scale the serving ranks to ``new_world`` before the next step (:func:`eplb_fsm.testing.elastic.scale`)."""
        self._check_open("scale")
        return _scale_job(self, new_world, **kwargs)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: the job is closed; its traces are complete")

    # -- output ----------------------------------------------------------
    def records(self) -> dict[int, list[dict]]:
        """file rank -> its records, every session of the file in order (needs ``keep=True``).

        Steps still counted are written first (as a flush would), so runs are complete.
        """
        if not self.keep:
            raise ValueError("records() needs keep=True; with keep=False read the files with "
                             "eplb_fsm.inspect.replay_dir(trace_dir)")
        out: dict[int, list[dict]] = {}
        for rank in self.sessions:
            rank.trace.flush()
        for rank in self.sessions:
            out.setdefault(rank.file_rank, []).extend(rank.trace.records or [])
        return dict(sorted(out.items()))

    def close(self) -> None:
        """End the job as an engine closing its controllers would: every rank still running writes
        ``end`` (``how: closed``); a rank a fault stopped writes nothing more. Idempotent."""
        for rank in self.sessions:
            if not rank.stopped:
                rank.trace.end("closed")
            rank.trace.close()
        self.closed = True


def write_traces(traces: dict[int, list[dict]], trace_dir: str | os.PathLike) -> dict[int, Path]:
    """Write in-memory records as per-rank JSONL files (the layout the controller writes).

    Each file is written anew (an existing one is replaced, unlike a trace, which appends).
    """
    for r in traces:
        as_count(r, "traces rank", minimum=0)
    paths = {}
    for r, records in traces.items():
        path = trace_path(trace_dir, r)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(encode_record(rec) + "\n")
        paths[r] = path
    return paths
