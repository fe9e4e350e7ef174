"""Elastic EP in the replay: who takes part in what while ranks leave, join and are renumbered.

Rank N usually has one session (one controller). In an elastic job it can have two: a process
that left at a scale-down, then a joiner that took number N at a later scale-up, whose
``rank<N>.g<g>.jsonl`` is read as the later session, the earlier one kept in its ``previous``
(``identity.assign``; older traces appended the joiner to ``rank<N>.jsonl``). The cross-rank
stage therefore works on *participants*, keyed ``(N, session)``, never on bare ranks.

Membership follows the generations of the EP group (docs/elastic.md). Generation 0 is
the group the first ranks start in (``ep``, ``ep_transfer`` and its re-creations
``ep_transfer.<n>``): its members are the first sessions of the files, one per rank of
the world. Generation g > 0 (``ep@g``, ``ep_transfer@g``, ``ep_transfer@g.<n>``) has the
members that switched to it (``group_switch`` with ``new_group`` named ``ep@g``, keyed by
``new_rank``) and the joiners whose header names it; its size is the ``new_world`` the
switches announce, and a rank of it that nobody traced is a missing participant (labelled a
joiner only where the generation's ``scale_requested`` records list it as one). A
participant that switched away from a generation for good (or left) is no member of that
generation's collectives past the last one it issued. Collectives are matched by group
name and ``cseq`` among the members, so a rank mapping that renumbers ranks changes
nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from eplb_fsm.inspect.findings import ranks_text
from eplb_fsm.inspect.model import WORLD_GROUP, RankSummary

Key = tuple  # (file rank, session): one participant

# config fields a scale changes on purpose (slots per rank stay fixed: P - N follows the world)
SCALED_CONFIG = frozenset({"num_redundant_experts"})
# a world size or rank number at or past this is a damaged field, not a job: the replay lists every rank
# of a world, so it is ignored (with a warning) rather than believed
MAX_WORLD = 1 << 16


def group_base(name: str) -> str:
    """``ep_transfer@2.1`` -> ``ep_transfer@2``: a transfer group's re-creation belongs to its family."""
    base, dot, suffix = name.rpartition(".")
    return base if dot and suffix.isdigit() else name


def _int(value: Any, default: int | None = None) -> int | None:
    return value if type(value) is int else default


def _size(value: Any) -> int | None:
    """A world size or rank number the replay can list ranks up to, or None."""
    return value if type(value) is int and 0 <= value < MAX_WORLD else None


@dataclass
class Cast:
    """The participants of a job, their labels, and who is a member of which group."""

    parts: dict[Key, RankSummary]
    world: int                                    # generation 0's world size
    world_ranks: list[int]                        # generation 0's ranks (stray files included)
    missing: dict[Key, str] = field(default_factory=dict)          # untraced members -> label
    missing_slots: dict[tuple[int, int], Key] = field(default_factory=dict)  # (generation, group rank) -> key
    gen_members: dict[int, dict[int, Key]] = field(default_factory=dict)   # generation -> group rank -> who
    gen_world: dict[int, int] = field(default_factory=dict)
    group_gen: dict[str, int] = field(default_factory=dict)        # group name -> generation
    final_gen: dict[Key, int | None] = field(default_factory=dict)  # where each one ended (None: left)
    labels: dict[Key, str] = field(default_factory=dict)
    elastic: bool = False
    # (participant, gap index) a ``lost_records`` finding named (``lost.LostRecords``): one per gap per diagnosis
    told_gaps: set = field(default_factory=set)
    _members: dict[str, list[Key]] = field(default_factory=dict)

    # -- naming ------------------------------------------------------------
    def label(self, key: Key) -> str:
        return self.labels.get(key) or self.missing.get(key) or f"rank {key[0]}"

    def plain(self, key: Key) -> bool:
        """Whether ``rank N`` alone names this participant (the usual, non-elastic case)."""
        return self.label(key) == f"rank {key[0]}"

    def who(self, keys) -> str:
        """'rank 2', 'ranks 0-1,3' or 'ranks 0-1 and rank 2 (joiner g2)'."""
        keys = sorted(set(keys))
        plain = [k[0] for k in keys if self.plain(k)]
        named = [self.label(k) for k in keys if not self.plain(k)]
        text = ""
        if plain:
            text = ("rank " if len(plain) == 1 else "ranks ") + ranks_text(plain)
        if named:
            text = " and ".join(p for p in (text, ", ".join(named)) if p)
        return text or "-"

    def position(self, key: Key, status: str, note: str, step=None, state=None, layer=None) -> dict:
        """What one participant was doing at a finding (a row of ``ranks at this point``)."""
        pos = {"rank": key[0], "session": key[1], "status": status, "step": step, "state": state,
               "layer": layer, "note": note}
        if not self.plain(key):
            pos["label"] = self.label(key)
        return pos

    # -- membership --------------------------------------------------------
    def generation_of(self, group: str) -> int | None:
        """The generation a group name belongs to, or None for a group no header or switch names."""
        gen = self.group_gen.get(group)
        return gen if gen is not None else self.group_gen.get(group_base(group))

    def members(self, group: str) -> list[Key]:
        """Every participant that must issue ``group``'s collectives (untraced ones included)."""
        cached = self._members.get(group)
        if cached is not None:
            return cached
        users = [k for k, s in self.parts.items() if group in s.collectives]
        gen = self.generation_of(group)
        if gen is None and (group == WORLD_GROUP or self.used_by_every_first_rank(group)):
            gen = 0
        if gen is None:
            keys = users
        else:
            slots = self.gen_members.get(gen, {})
            size = self.gen_world.get(gen, 0)
            keys = [slots.get(j) or self.missing_slots.get((gen, j)) for j in range(size)]
            # a traced rank past the world (a stray file) by its number, not by listing every number up to it
            keys = [k for k in keys if k is not None] + [slots[j] for j in sorted(slots) if j >= size]
            keys += [k for k in users if k not in keys]  # used it without a switch record (salvage)
        self._members[group] = keys
        return keys

    def away(self, key: Key, group: str) -> bool:
        """Whether the participant switched away from ``group``'s generation for good (or left)."""
        s = self.parts.get(key)
        if s is None:
            return False
        if s.left is not None:
            return True
        gen = self.generation_of(group)
        return gen is not None and key in self.final_gen and self.final_gen[key] != gen

    def used_by_every_first_rank(self, group: str) -> bool:
        firsts = [s for k, s in self.parts.items() if k in self.gen_members.get(0, {}).values()]
        return bool(firsts) and all(group in s.collectives for s in firsts)


def build_cast(summaries: dict[int, RankSummary], world: int | None, warnings: list[str]) -> Cast:
    """Participants from per-file summaries (each with its ``previous`` sessions), and the groups."""
    parts: dict[Key, RankSummary] = {}
    for r, s in sorted(summaries.items()):
        for i, sess in enumerate(list(s.previous) + [s]):
            parts[(r, i)] = sess
    sessions = Counter(k[0] for k in parts)
    firsts = {k: s for k, s in parts.items() if s.role != "joiner"}
    worlds = {s.world for s in firsts.values() if isinstance(s.world, int) and s.world < MAX_WORLD}
    warnings += [f"rank {k[0]}: world {s.world} is not a plausible job size (at most {MAX_WORLD} ranks); ignored"
                 for k, s in firsts.items() if isinstance(s.world, int) and s.world >= MAX_WORLD]
    if len(worlds) > 1:
        warnings.append(f"ranks disagree on the world size: {sorted(worlds)}")
    ranks_seen = [k[0] for k in (firsts or parts) if _size(k[0]) is not None]
    if world is not None and _size(world) is None:
        warnings.append(f"a world of {world} ranks is not a plausible job (at most {MAX_WORLD}); the traces' is used")
        world = None
    if world is None:
        world = max(worlds | {max(ranks_seen, default=0) + 1})
    world_ranks = list(range(world))
    extra = sorted({k[0] for k in firsts} - set(world_ranks))
    if extra:
        warnings.append(f"trace files for ranks outside the world of {world}: {ranks_text(extra)}")
        world_ranks = sorted(set(world_ranks) | set(extra))
    cast = Cast(parts, world, world_ranks)
    cast.elastic = any(s.role == "joiner" or s.switches or s.scalings for s in parts.values()) or len(parts) > len(
        summaries)

    def add_missing(gen: int, slot: int, label: str) -> None:
        n = sessions.get(slot, 0)
        while (slot, n) in parts or (slot, n) in cast.missing:
            n += 1
        cast.missing[(slot, n)] = label
        cast.missing_slots[(gen, slot)] = (slot, n)

    # generation 0: the first session of every file, one per rank of the world
    gen0: dict[int, Key] = {}
    for key in firsts:
        gen0.setdefault(key[0], key)
    cast.gen_members[0] = gen0
    cast.gen_world[0] = world
    for r in world_ranks:
        if r not in gen0:
            add_missing(0, r, f"rank {r}")
    cast.group_gen[WORLD_GROUP] = 0
    # later generations: switches into them, joiners that started in them
    formed: set[int] = set()   # generations a serving rank moved to: the new group formed there
    for key, s in parts.items():
        header = s.header or {}
        gen_here = s.generation if s.role == "joiner" else 0
        for name in (header.get("group"), header.get("transfer_group")):
            if isinstance(name, str):
                cast.group_gen.setdefault(name, gen_here)
        if s.role == "joiner":
            slot = _size(header.get("rank"))
            slot = slot if slot is not None else _size(key[0])
            if slot is not None:
                cast.gen_members.setdefault(gen_here, {})[slot] = key
            if _size(s.world) is not None:
                cast.gen_world.setdefault(gen_here, s.world)
        for sw in s.switches:
            gen = _int(sw.get("generation"))
            if gen is None or sw.get("phase") == "rollback" or sw.get("new_group") is None:
                continue
            for name in (sw.get("new_group"), sw.get("transfer_group")):
                if isinstance(name, str):
                    cast.group_gen.setdefault(name, gen)
            new_rank = _size(sw.get("new_rank"))
            if new_rank is not None:
                cast.gen_members.setdefault(gen, {})[new_rank] = key
                if sw.get("role") != "joiner":
                    formed.add(gen)
            if _size(sw.get("new_world")) is not None:
                cast.gen_world.setdefault(gen, sw["new_world"])
    # a slot nobody traced is a joiner's only if the request named it one: an old rank that
    # never switched (a scale aborted before the switch) is no joiner
    listed: dict[int, set] = {}
    mapped: dict[int, dict[int, int]] = {}   # generation: new rank -> the old rank the request moved there
    for s in parts.values():
        for req in s.scale_requests:
            if _int(req.get("generation")) is not None and isinstance(req.get("joiners"), list):
                listed.setdefault(req["generation"], set()).update(j for j in req["joiners"] if _int(j) is not None)
            if _int(req.get("generation")) is not None and isinstance(req.get("rank_mapping"), dict):
                mapped.setdefault(req["generation"], {}).update(
                    (new, int(old)) for old, new in req["rank_mapping"].items()
                    if str(old).isdigit() and _size(new) is not None)
    # a generation no serving rank moved to never formed (the scale ended in its prepare phase, every old
    # rank's trace says so): a joiner that got as far as its header is there alone, and nobody is missing
    for gen in sorted(g for g in cast.gen_members if g > 0 and g in formed):
        slots = cast.gen_members[gen]
        for j in (j for j in range(cast.gen_world.get(gen, 0)) if j not in slots):
            old = cast.gen_members.get(gen - 1, {}).get(mapped.get(gen, {}).get(j, -1))
            if old is not None and parts[old].end is None and not any(
                    _int(sw.get("generation")) == gen for sw in parts[old].switches):
                slots[j] = old   # killed before its switch: a member whose own trace tells it, not one without any
                continue
            add_missing(gen, j, f"rank {j} (joiner g{gen})" if j in listed.get(gen, ()) else
                        f"rank {j} of g{gen} (not switched)")
    # where each participant ended up
    for key, s in parts.items():
        cur: int | None = s.generation if s.role == "joiner" else 0
        before: list[int | None] = []
        for sw in s.switches:
            if sw.get("role") == "leaving" or sw.get("new_group") is None:
                cur = None
            elif sw.get("phase") == "rollback":
                cur = before.pop() if before else cast.generation_of(str(sw.get("new_group")))
            else:
                before.append(cur)
                cur = _int(sw.get("generation"), cur)
        cast.final_gen[key] = cur
    for key, s in parts.items():
        cast.labels[key] = _label(key, s, sessions[key[0]])
    return cast


def _label(key: Key, s: RankSummary, sessions: int) -> str:
    r = key[0]
    tags = []
    if s.role == "joiner":
        tags.append(f"joiner g{s.generation}")
    if s.left is not None:
        tags.append(f"left at g{s.left.get('generation')}")
    if sessions > 1 and not tags:
        tags.append(f"session {key[1]}")
    return f"rank {r} ({', '.join(tags)})" if tags else f"rank {r}"


def transition_offsets(cast: Cast, warnings: list[str], transitions: dict | None = None) -> dict[Key, int]:
    """Where each participant's transitions start in the job's sequence of state changes.

    First ranks start at 0. A joiner of generation g starts at the ordinal of the others'
    ``groups_ready`` of generation g (its first transition is that same one), taken from
    the participants already placed, by majority. A joiner nobody can place is left out of
    the transition alignment (with a warning). ``transitions``: the state changes compared
    (``checks.kept_transitions``; default each participant's all).
    """
    trans = transitions if transitions is not None else {k: s.transitions for k, s in cast.parts.items()}
    offsets: dict[Key, int] = {k: 0 for k, s in cast.parts.items() if s.role != "joiner"}
    joiners = sorted((k for k, s in cast.parts.items() if s.role == "joiner"),
                     key=lambda k: (cast.parts[k].generation, k))
    for key in joiners:
        s = cast.parts[key]
        # its own groups_ready, whatever generation it names (a wrong one is then a divergence)
        own = next((i for i, t in enumerate(trans[key]) if t.trigger == "groups_ready"), None)
        if own is None:
            continue  # no transition to align (it never got that far): nothing to compare
        votes: Counter = Counter()
        for other, at in offsets.items():
            ts = trans[other]
            j = next((i for i, t in enumerate(ts) if t.trigger == "groups_ready" and t.generation == s.generation),
                     None)
            if j is not None:
                votes[at + j - own] += 1
        if votes:
            offsets[key] = votes.most_common(1)[0][0]
        else:
            warnings.append(f"{cast.label(key)}: no other rank took groups_ready of generation {s.generation}; "
                            "its transitions are not compared")
    return offsets


def scale_notes(cast: Cast) -> list[dict]:
    """One entry per scale request (generation), merged over the participants' ``scaling`` records."""
    by_gen: dict[Any, list[dict]] = {}
    for s in cast.parts.values():
        for sc in s.scalings:   # a generation of another type (a damaged record) is an unknown one
            by_gen.setdefault(_int(sc.get("generation")), []).append(sc)
    notes = []
    for gen, entries in sorted(by_gen.items(), key=lambda kv: (kv[0] is None, kv[0] if kv[0] is not None else 0)):
        # the scale's outcome is what the ranks that stay report (a leaving rank may fail alone)
        staying = [e for e in entries if e.get("role") != "leaving"] or entries
        outcomes = Counter(str(e.get("outcome")) for e in staying)
        if set(outcomes) <= {"switched", "left"}:
            outcome = "switched"
        elif len(outcomes) == 1:
            outcome = next(iter(outcomes))
        else:
            outcome = ", ".join(f"{o} on {n}" for o, n in sorted(outcomes.items()))
        first = entries[0]
        reason = next((e.get("reason") for e in entries if e.get("reason")), None)
        lost = next((e.get("lost_experts") for e in entries if e.get("lost_experts")), [])
        # a scale-up that switched although its rearrangement stopped part-way (elastic/partial.py)
        partial = any(e.get("partial") is True for e in staying)
        committed = [e["layers_committed"] for e in staying if type(e.get("layers_committed")) is int]
        notes.append({
            "generation": gen, "step": first.get("step"), "kind": first.get("kind"),
            "from_ranks": first.get("from_ranks"), "to_ranks": first.get("requested_ranks", first.get("to_ranks")),
            "outcome": outcome, "degraded": any(bool(e.get("degraded")) for e in entries),
            "reason": reason, "lost_experts": lost or [], "partial": partial,
            "phase": next((e.get("phase") for e in staying if e.get("phase")), None),
            "layers_committed": min(committed) if partial and committed else None,
        })
    return notes


def scale_text(note: dict) -> str:
    """'generation 1 at step 25: scale_down 4 -> 2 ranks, switched'."""
    text = (f"generation {note['generation']} at step {note['step']}: {note['kind']} {note['from_ranks']} -> "
            f"{note['to_ranks']} ranks, {note['outcome']}")
    if note.get("degraded"):
        text += " (degraded: a leaving rank died)"
    if note.get("partial"):
        text += f" (partial: {note.get('reason') or 'its rearrangement stopped part-way'})"
    elif note["outcome"] != "switched" and note.get("reason"):
        text += f" ({note['reason']})"
    return text


def config_payloads(s: RankSummary) -> tuple[dict, dict]:
    """(what every session of a job shares, what only sessions of one generation share)."""
    h = s.header or {}
    cfg = h.get("config")
    shared_cfg = {k: v for k, v in cfg.items() if k not in SCALED_CONFIG} if isinstance(cfg, dict) else cfg
    scaled_cfg = {k: v for k, v in cfg.items() if k in SCALED_CONFIG} if isinstance(cfg, dict) else {}
    shared = {"schema": h.get("schema"), "mode": h.get("mode"), "config": shared_cfg}
    per_generation = {"world": h.get("world"), "config": scaled_cfg}
    return shared, per_generation


def scale_context(cast: Cast, key: Key, step: Any, notes: list[dict]) -> str | None:
    """Why a culprit's stop matters to a scale: a leaving rank that stopped before its experts
    were out, or a joiner that stopped before the scale finished (with the scale's outcome)."""
    s = cast.parts.get(key)
    if s is None or s.ended_on_purpose:
        return None
    outcome = {n["generation"]: n for n in notes}
    for req in reversed(s.scale_requests):
        if isinstance(step, int) and isinstance(req.get("step"), int) and req["step"] > step:
            continue
        if req.get("rank") in (req.get("leaving") or []):
            gen = req.get("generation")
            note = outcome.get(gen) if type(gen) is int else None
            return (f"{cast.label(key)} was leaving in the scale to generation {gen} (requested at step "
                    f"{req.get('step')}) and stopped before its experts were out"
                    + (f"; the scale: {scale_text(note)}" if note else ""))
        break
    if s.role == "joiner" and not any(t.trigger == "switched" for t in s.transitions):
        note = outcome.get(s.generation)
        return (f"{cast.label(key)} joined in the scale to generation {s.generation} and stopped before it "
                "finished" + (f"; the scale: {scale_text(note)}" if note else ""))
    return None


def renumbered(cast: Cast, key: Key, group: str) -> str | None:
    """'rank 1 is rank 0 of ep@1' when a rank mapping gave the participant another number there."""
    gen = cast.generation_of(group)
    if gen is None:
        return None
    slot = next((j for j, k in cast.gen_members.get(gen, {}).items() if k == key), None)
    if slot is None or slot == key[0]:
        return None
    return f"{cast.label(key)} (its trace file's number) is rank {slot} of {group}: renumbered by a rank mapping"
