"""Elastic EP for :class:`~eplb_fsm.testing.job.SyntheticJob`: scale-down and scale-up as the controller writes them.

``scale(job, new_world)`` runs one scale request between two ``job.run`` calls, on every
serving rank, record for record as ``eplb_fsm.elastic.scaling`` traces it (sync mode, records
stamped with the step that follows the request, docs/events.md "Elastic EP"):

- scale-down: ``scale_requested``, the ``scale_check`` and ``scale_ready`` agreements on the old group,
  ``groups_ready``, the scale's rearrangement in the OLD group (loads, then per layer a
  transfer wave and a ready all-reduce, then one more ready all-reduce in committing),
  ``committed`` -> scaling; survivors then switch to ``ep@g`` (``group_switch`` phase
  switch, ``switched``); leaving ranks fire
  ``switched``, write their leaving ``group_switch`` and ``scaling`` record, and stop;
- scale-up: the same request and agreements, then old ranks move to ``ep@g`` (``group_switch``
  phase prepare) and each joiner starts a new session in the file of the rank it takes (a
  header with ``role: joiner``, ``generation`` and ``machine``: scaling, scale pending,
  then its own ``group_switch``); all members agree (``scale_go``), hand the non-expert
  weights over (a ``handover`` wave), rearrange in the NEW group and switch.

Faults: ``absent=True`` (scale-up: the joiners never answer; every old rank aborts after
``scale_check`` with a ``scale_aborted`` of phase prepare and a recoverable ``fault``), ``die={rank: layer}``
(scale-down: those leaving ranks stop before their transfer of ``layer``, one layer for
all; the old group breaks, the others fail, and the survivors salvage on the new group as
the controller does when every expert still has a replica: ``fault`` -> failed, the ``salvage`` agreement on
``ep@g``, ``salvaged`` (failed -> scaling), ``group_switch``, then ``switched`` with
``salvage: true``). A hang after the swap is an ordinary ``Faults`` passed to ``job.run``,
keyed by the new ranks.
"""

from __future__ import annotations

from typing import Any

from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic.bounds import scale_bounds
from eplb_fsm.fsm.machine import SCALING, EplbMachine
from eplb_fsm.maps import as_count
from eplb_fsm.testing.ranks import (GROUP, MAPS_FLAGS, READY_FLAGS, SLOT_BYTES, TRANSFER_GROUP, SyntheticClock,
                                    SyntheticRank)

__all__ = ["TIMEOUT_S", "scale"]

TIMEOUT_S = 20.0
# the request's digest in scale_check (elastic.prepare): new world size, rank mapping, generation, 16 each
REQUEST_FLAGS = 3 * MAPS_FLAGS


def scale(job: Any, new_world: int, *, rank_mapping: dict[int, int] | None = None, absent: bool = False,
          die: dict[int, int] | None = None) -> dict:
    """Scale ``job``'s serving ranks to ``new_world`` before its next step; returns the scale's outcome.

    ``rank_mapping``: ``{old rank: new rank or -1}`` (default: the highest ranks leave on a
    scale-down, old ranks keep their numbers on a scale-up). ``absent`` and ``die`` are the
    faults described in the module docstring. A request that could not happen as asked (a
    job that simulates only some ranks, a serving rank a fault stopped, a mapping value other
    than -1 or a new rank, ``die`` at a layer the model lacks or at more than one layer,
    ``absent`` on a scale-down, a ``new_world`` whose ``job.slots_per_rank * new_world``
    slots cannot hold the ``num_experts`` experts, which ``request_scale`` refuses too) is a
    ``ValueError`` before any record.
    """
    old_world = job.world
    new_world = as_count(new_world, "new_world")
    if new_world == old_world:
        raise ValueError(f"new_world must differ from the current world {old_world}, got {new_world}")
    if sorted(job.ranks) != list(range(old_world)):
        raise ValueError(f"scale needs every rank of the world simulated: this job simulates ranks "
                         f"{sorted(job.ranks)} of world={old_world} (SyntheticJob(ranks=...))")
    # the controller's check_request, in its words: a scale keeps the slots per rank
    slots = job.slots_per_rank * new_world
    if slots < job.num_experts:
        raise ValueError(f"new_world {new_world} gives model 'main' {slots} slots ({job.slots_per_rank} per rank) "
                         f"for {job.num_experts} experts: every expert needs a slot")
    stopped = sorted(r for r, rank in job.ranks.items() if rank.stopped)
    if stopped:
        raise ValueError(f"scale: ranks {stopped} have stopped (a fault); a scale needs every serving rank")
    mapping = dict(rank_mapping) if rank_mapping is not None else {
        r: (r if r < new_world else -1) for r in range(old_world)}
    if sorted(mapping) != sorted(job.ranks):
        raise ValueError(f"rank_mapping must map every serving rank {sorted(job.ranks)}, got {sorted(mapping)}")
    for r, n in mapping.items():
        if as_count(n, f"rank_mapping[{r}]", minimum=-1) >= new_world:
            raise ValueError(f"rank_mapping[{r}] must be -1 (leaves) or a rank below {new_world}, got {n}")
    kept = sorted(n for n in mapping.values() if n >= 0)
    if len(set(kept)) != len(kept) or any(n >= new_world for n in kept):
        raise ValueError(f"rank_mapping must send the kept ranks to distinct ranks below {new_world}")
    kind = "scale_down" if new_world < old_world else "scale_up"
    leaving = sorted(r for r, n in mapping.items() if n < 0)
    joiners = sorted(set(range(new_world)) - set(kept))
    if (kind == "scale_up" and leaving) or (kind == "scale_down" and joiners):
        raise ValueError(f"a {kind} cannot have {'leaving ranks' if leaving else 'joiners'}")
    if die and (kind != "scale_down" or not set(die) <= set(leaving)):
        raise ValueError("die names leaving ranks of a scale-down")
    for r, layer in (die or {}).items():
        if as_count(layer, f"die[{r}]", minimum=0) >= job.num_layers:
            raise ValueError(f"die[{r}] must be a layer below num_layers={job.num_layers}, got {layer}")
    if len(set((die or {}).values())) > 1:
        # the first death breaks the old group at its layer: no rank transfers a later one
        raise ValueError(f"die must name one layer for every dying rank, got {die}: the first death breaks "
                         "the old group, so no rank reaches a later layer to die at")
    if absent and kind != "scale_up":
        raise ValueError("absent=True names a scale-up's joiners; a scale-down has none")
    timeout = float(job.config.get("collective_timeout_s", EplbConfig.collective_timeout_s))
    forward_s, bound_s = scale_bounds(TIMEOUT_S, timeout)
    job.generation += 1  # used up even if the scale aborts
    gen, step = job.generation, job.step_no
    request = {"kind": kind, "generation": gen, "from_ranks": old_world, "to_ranks": new_world,
               "rank_mapping": {str(r): n for r, n in sorted(mapping.items())}, "joiners": joiners,
               "leaving": leaving, "timeout_s": TIMEOUT_S, "deadline_s": round(forward_s, 6),
               "bound_s": round(bound_s, 6)}
    old = dict(sorted(job.ranks.items()))
    for rank in old.values():
        rank.clock.at_least(job.t0 + step * job.step_s)
        rank.trace.set_context(step=step)
        rank.fire("scale_requested", extra=request)
        # scale_check: [no go-ahead, the request's digest, the model's maps digest]; absent joiners end
        # the scale after it
        check = 1 + REQUEST_FLAGS + MAPS_FLAGS
        rank.collective("all_reduce", group=rank.group, shape=[check], dtype="torch.float64",
                        parts=["scale_check"], sizes=[check])
        if not absent:
            rank.collective("all_reduce", group=rank.group, shape=[1], dtype="torch.float64",
                            parts=["scale_ready"], sizes=[1])
    if kind == "scale_down":
        return _scale_down(job, old, mapping, request, die or {})
    return _scale_up(job, old, mapping, request, absent)


def _scaling(rank: SyntheticRank, request: dict, role: str, outcome: str, old_rank: int, **extra: Any) -> None:
    """The ``scaling`` summary record of one rank, with the fields of ``elastic.records.scaling_record``."""
    fields = {"generation": request["generation"], "kind": request["kind"], "from_ranks": request["from_ranks"],
              "to_ranks": request["to_ranks"] if outcome in ("switched", "left") else
              (request["from_ranks"] if outcome == "aborted" else None),
              "requested_ranks": request["to_ranks"], "role": role, "outcome": outcome, "old_rank": old_rank,
              "moved_slots": 0, "moved_bytes": 0, "layers_committed": 0, "seconds": 0.01, "reason": None,
              "lost_experts": [], "degraded": False, "partial": False, "phase": None,
              "deadline_s": request["deadline_s"], "bound_s": request["bound_s"]}
    fields.update(extra)
    rank.trace.emit("scaling", new_rank=-1 if outcome == "left" else rank.trace.rank, **fields)


def _switch(rank: SyntheticRank, request: dict, new_rank: int, *, role: str, phase: str) -> None:
    """Move the rank's collectives to generation g's groups (``group_switch``; later records carry the new rank)."""
    gen = request["generation"]
    old_group, old_rank, old_world = rank.group, rank.rank, rank.trace.world
    rank.group = f"{GROUP}@{gen}"
    rank.transfer_base = rank.transfer_group = f"{TRANSFER_GROUP}@{gen}"
    rank.transfer_resets = 0
    rank.rank = new_rank
    rank.trace.set_world(new_rank, request["to_ranks"])
    rank.trace.emit("group_switch", generation=gen, phase=phase, role=role, kind=request["kind"],
                    old_group=old_group, new_group=rank.group, transfer_group=rank.transfer_group,
                    old_rank=old_rank, new_rank=new_rank, old_world=old_world, new_world=request["to_ranks"])


def _rearrange(job: Any, rank: SyntheticRank, request: dict, dead_at: int | None, dies: bool) -> str:
    """The scale's rearrangement on ``rank``'s current groups: ``committed``, ``dead`` (this rank
    stopped before its transfer of layer ``dead_at``) or ``broken`` (a peer did; fault -> failed)."""
    gen, kind = request["generation"], request["kind"]
    size = job.num_layers * job.num_experts
    rank.fire("groups_ready", extra={"generation": gen, "kind": kind, "group": rank.group})
    rank.collective("all_reduce", group=rank.group, shape=[size], dtype="torch.float64", parts=["loads"],
                    sizes=[size])
    moves = 2 * job.num_layers
    rank.fire("plan_ready", extra={"scale": gen, "moved_slots": moves, "moved_bytes": moves * SLOT_BYTES,
                                   "balancedness_before": 0.8, "balancedness_after": 0.95, "gain": 0.15,
                                   "changed_layers": job.num_layers, "policy_s": 0.0004, "forced": True},
              moves=moves, worth=True)
    world = rank.trace.world
    peers = sorted({(rank.rank + 1) % world, (rank.rank - 1) % world} - {rank.rank})
    for k in range(job.num_layers):
        if dead_at == k:
            if dies:
                rank.stopped = True
                return "dead"
            wave = {"group": rank.transfer_group, "layer": k, "wave": 0, "waves": 1, "sends": 2, "recvs": 2,
                    "nbytes": 2 * SLOT_BYTES, "peers": peers}
            _failing(rank, "batch_isend_irecv", wave, TimeoutError(f"layer {k}, wave 0/1: timed out"))
            _failing(rank, "all_reduce", {"group": rank.group, "shape": [READY_FLAGS], "dtype": "torch.float64",
                                          "parts": ["ready"], "sizes": [READY_FLAGS], "layer": k},
                     ConnectionError("Connection closed by peer"))
            reason = "all_reduce of ['ready'] failed: ConnectionError: Connection closed by peer"
            rank.fire("fault", extra={"reason": reason, "layers_committed": k, "failed_layer": k},
                      recoverable=False)
            rank.trace.emit("rearrangement", index=rank.rearrangements, step=job.step_no, outcome="aborted",
                            reason=reason, layers_committed=k, forced=True)
            return "broken"
        rank.collective("batch_isend_irecv", group=rank.transfer_group, layer=k, wave=0, waves=1, sends=2, recvs=2,
                        nbytes=2 * SLOT_BYTES, peers=peers)
        rank.agreement("ready", READY_FLAGS, layer=k)
        rank.fire("layer_done", extra={"model": "main", "model_layer": k, "moved": 2, "changed": True}, layer=k)
    rank.agreement("ready", READY_FLAGS)   # in committing, no layer: every rank wrote its layers whole
    rank.fire("committed", extra={"rearrangement": rank.rearrangements, "moves": moves,
                                  "layers_committed": job.num_layers})
    rank.trace.emit("rearrangement", index=rank.rearrangements, step=job.step_no, outcome="committed", moves=moves,
                    layers_committed=job.num_layers, forced=True)
    return "committed"


def _failing(rank: SyntheticRank, op: str, fields: dict, error: Exception) -> None:
    """A collective that ends in ``collective_error`` (the trace writes ``Type: message``)."""
    try:
        with rank.trace.collective(op, **fields):
            raise error
    except type(error):
        pass


def _scale_down(job: Any, old: dict[int, SyntheticRank], mapping: dict[int, int], request: dict,
                die: dict[int, int]) -> dict:
    gen = request["generation"]
    broken_at = next(iter(die.values())) if die else None   # scale() let one layer through
    survivors: dict[int, SyntheticRank] = {}
    dead: set[int] = set()
    degraded = bool(die)
    for r, rank in old.items():
        new_rank = mapping[r]
        status = _rearrange(job, rank, request, broken_at, r in die)
        if status == "dead":
            dead.add(r)
            continue
        if status == "broken":
            if new_rank < 0:  # a leaving rank has no new group to finish on
                rank.trace.emit("scale_aborted", generation=gen, phase="transfer",
                                reason="the old group broke during the scale-down", lost_experts=None)
                _scaling(rank, request, "leaving", "failed", r, reason="the old group broke during the scale-down",
                         phase="transfer")
                rank.stopped = True
                continue
            # survivors agree over the group they built and finish the switch there
            # [layers committed, losing experts, its square, 1]: elastic.scaling's salvage agreement
            rank.collective("all_reduce", group=f"{GROUP}@{gen}", shape=[4], dtype="torch.float64",
                            parts=["salvage"], sizes=[4])
            reason = ("a leaving rank died before the scale-down finished; every expert still has a replica "
                      "on a survivor")
            rank.fire("salvaged", extra={"reason": reason, "scale": gen, "generation": gen})
            _switch(rank, request, new_rank, role="survivor", phase="switch")
            rank.fire("switched", extra={"generation": gen, "role": "survivor", "salvage": True})
            _scaling(rank, request, "survivor", "switched", r, reason=reason, degraded=True, phase="salvage")
        elif new_rank < 0:
            rank.fire("switched", extra={"generation": gen, "role": "leaving"})
            rank.trace.emit("group_switch", generation=gen, phase="switch", role="leaving", kind="scale_down",
                            old_group=rank.group, new_group=None, transfer_group=None, old_rank=r, new_rank=-1,
                            old_world=request["from_ranks"], new_world=request["to_ranks"])
            rank.trace.set_world(-1, request["from_ranks"])
            _scaling(rank, request, "leaving", "left", r, moved_slots=2 * job.num_layers,
                     layers_committed=job.num_layers)
            rank.stopped = True
            continue
        else:
            _switch(rank, request, new_rank, role="survivor", phase="switch")
            rank.fire("switched", extra={"generation": gen, "role": "survivor"})
            _scaling(rank, request, "survivor", "switched", r, moved_slots=2 * job.num_layers,
                     layers_committed=job.num_layers)
        rank.count = 0
        survivors[new_rank] = rank
    for r, rank in old.items():
        if rank.stopped:
            if r not in dead:  # a leaving rank that did not die: the engine closes its controller
                rank.trace.end("closed")
            rank.trace.close()
    job.ranks = dict(sorted(survivors.items()))
    job.world = request["to_ranks"]
    return {"generation": gen, "kind": "scale_down", "outcome": "switched", "degraded": degraded,
            "leaving": sorted(r for r, n in mapping.items() if n < 0)}


def _scale_up(job: Any, old: dict[int, SyntheticRank], mapping: dict[int, int], request: dict,
              absent: bool) -> dict:
    gen, step, new_world = request["generation"], job.step_no, request["to_ranks"]
    if absent:
        reason = (f"new group of generation {gen} ({new_world} ranks) was not complete on {len(old)} rank(s): "
                  f"joiner rank(s) {request['joiners']} did not answer the handover within {TIMEOUT_S:g} s")
        for r, rank in old.items():
            rank.trace.emit("scale_aborted", generation=gen, phase="prepare", reason=reason, lost_experts=[])
            rank.fire("fault", extra={"reason": reason, "scale": gen}, recoverable=True)
            _scaling(rank, request, "member", "aborted", r, reason=reason, phase="prepare")
        return {"generation": gen, "kind": "scale_up", "outcome": "aborted", "reason": reason}
    for r, rank in old.items():
        _switch(rank, request, mapping[r], role="member", phase="prepare")
    members = {mapping[r]: rank for r, rank in old.items()}
    done = next(iter(old.values())).rearrangements
    for j in request["joiners"]:
        members[j] = _joiner(job, j, request, done)
    senders = sorted(mapping[r] for r in old)
    for j, rank in sorted(members.items()):
        joiner = j in request["joiners"]
        rank.collective("all_reduce", group=rank.group, shape=[1], dtype="torch.float64", parts=["scale_go"],
                        sizes=[1])
        nbytes = 4 * len(request["joiners"]) if not joiner else 4 * len(senders)
        rank.collective("batch_isend_irecv", group=rank.transfer_group, purpose="handover", layer=None, wave=0,
                        waves=1, sends=0 if joiner else len(request["joiners"]), recvs=len(senders) if joiner else 0,
                        nbytes=nbytes)
        rank.trace.emit("handover", generation=gen, nbytes=nbytes, senders=senders, joiners=request["joiners"])
        _rearrange(job, rank, request, None, False)
        role = "joiner" if joiner else "member"
        rank.fire("switched", extra={"generation": gen, "role": role})
        _scaling(rank, request, role, "switched", -1 if joiner else _old_rank(mapping, j),
                 moved_slots=2 * job.num_layers, layers_committed=job.num_layers)
        rank.count = 0
    job.ranks = dict(sorted(members.items()))
    job.world = new_world
    return {"generation": gen, "kind": "scale_up", "outcome": "switched", "joiners": request["joiners"],
            "step": step}


def _old_rank(mapping: dict[int, int], new_rank: int) -> int:
    return next(r for r, n in mapping.items() if n == new_rank)


def _joiner(job: Any, j: int, request: dict, rearrangements: int) -> SyntheticRank:
    """A joiner's session: appended to the file of rank ``j`` (a new file if nobody had it)."""
    gen, step, new_world = request["generation"], job.step_no, request["to_ranks"]
    clock = SyntheticClock(job.t0)
    clock.at_least(job.t0 + step * job.step_s)
    machine = EplbMachine(job.num_layers, state=SCALING, scale_pending=True)
    rank = SyntheticRank(j, new_world, job.num_layers, job.trace_dir, clock, keep=job.keep, machine=machine,
                         step=step)
    rank.group = f"{GROUP}@{gen}"
    rank.transfer_base = rank.transfer_group = f"{TRANSFER_GROUP}@{gen}"
    rank.rearrangements = rearrangements  # the handover carries the counters
    physical = job.slots_per_rank * new_world
    config = dict(job.config, num_redundant_experts=max(0, physical - job.num_experts))
    rank.trace.header(config, mode="sync", device="cpu", group=rank.group, transfer_group=rank.transfer_group,
                      role="joiner", generation=gen, machine={"state": SCALING, "scale_pending": True})
    rank.trace.emit("model_added", num_layers=job.num_layers, model="main", layers=job.num_layers, layer_offset=0,
                    logical=job.num_experts, physical=physical, local=job.slots_per_rank, groups=1,
                    slot_bytes=SLOT_BYTES)
    rank.trace.emit("group_switch", generation=gen, phase="prepare", role="joiner", kind="scale_up", old_group=None,
                    new_group=rank.group, transfer_group=rank.transfer_group, old_rank=-1, new_rank=j,
                    old_world=request["from_ranks"], new_world=new_world)
    job.sessions.append(rank)
    return rank
