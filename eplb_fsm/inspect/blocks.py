"""Stage 1 of the replay, in bulk: rearrangement blocks that repeat a block already replayed.

A compact trace is mostly runs of step lines (``summary``) and, every ``step_interval``
steps, a rearrangement block: the records between two step lines (the due step, the plan's
all-reduce, one transfer and one ready all-reduce per layer, the commit). Blocks of one
shape repeat through the file with only their counters changed: ``ts``, ``seq``, ``step``,
``cseq``, ``duration_s`` and the rearrangement's ``index``. Parsing every such line with
``json.loads`` and feeding each record to ``walker.Walker`` is most of the cost of a
compact replay, so ``BlockReader`` replays the first block of each shape record by record
(the template) and, when it changed nothing but what the block always changes, keeps its
effect as a ``Recipe``. A later block is applied from the recipe without parsing it when

- its text equals the template's with only the values of those counters changed (each
  written as ``json.dumps`` writes a number of the template's type: an integer where the
  template has one), so every other field, every state stamp, every trigger, the event
  order and the layer count are the template's;
- the replayed machine is where it was before the template (state, layer, scale pending,
  layer count);
- its ``seq`` run on by one from the walker's next one, no two of its records are further
  apart in time than ``records.SILENCE_S``, each collective ends with the cseq it started
  with and no cseq of the block was seen before in its group.

Anything else is parsed and replayed record by record, exactly as without this module.
The effect of an applied block is the template's with the block's numbers: its transitions
and collectives (with their steps, seqs, times and durations), its record and event counts,
the machine state after it.

The ranks of one job write the same blocks but for their ``rank`` field: a ``TemplateStore``
shared by the files of one replay lets a file use a template another file learned. What the
walker does with a block depends only on the context above and the block's bytes (a
top-level ``rank`` is only type-checked), so a template applies to a block of another file
whose text is the template's but for the counters and the value of the top-level ``rank``
(one JSON integer per block, in the template's place, the only ``"rank":`` of its line).
"""

from __future__ import annotations

import json
import operator
from itertools import repeat
from typing import Callable

from eplb_fsm.inspect.model import Collective, CollectiveIndex, Transition
from eplb_fsm.inspect.recipes import MAX_SHAPES, Recipe, TemplateStore, build_recipe
from eplb_fsm.inspect.records import SILENCE_S

__all__ = ["BlockReader", "MIN_BLOCK_LINES", "TemplateStore"]

MIN_BLOCK_LINES = 4       # shorter runs of non-step lines are read record by record (nothing to gain)
_BLOCK_EVENTS = frozenset({"transition", "collective_start", "collective_end", "rearrangement", "plan_skipped",
                           "balancedness", "stats", "load_stats"})


def _context(w) -> tuple | None:
    """What the replay of a block depends on besides the block; None: no template applies here."""
    seqs = w.seqs
    # a state resynchronised on a damaged record (a list as a transition's dest) names no template
    if type(w.state) is not str or w.world is None or w.first is None or seqs.prev is None or seqs.jump is not None \
            or not w.layer_known:
        return None
    return (w.state, w.layer, w.pending, w.num_layers)


class BlockReader:
    """Templates of one rank file's blocks and the fast path that applies them (``feed``)."""

    def __init__(self, lines: list[str], parse: Callable[[str], dict | None],
                 store: TemplateStore | None = None) -> None:
        self.lines = lines
        self.parse = parse
        self.recipes: dict[tuple, list[Recipe]] = {}
        self.store = store                 # templates of the replay's other files
        self.applied = 0                   # blocks applied from a recipe (for tests and profiling)
        self.learned = 0                   # templates kept
        self.adopted = 0                   # templates taken from the store

    def feed(self, w, start: int, end: int) -> bool | list:
        """Account lines[start:end] (non-step, non-blank lines) to walker ``w``.

        True: done (applied from a recipe, or replayed record by record as a template).
        Otherwise the lines' parsed records (None for an unreadable line), for the caller's
        record-by-record path: the block holds something a template cannot stand for.
        """
        lines = self.lines[start:end]
        joined = ",".join(lines)
        fields = joined.split(",")
        ctx = _context(w)
        key = (ctx, end - start, len(fields))
        known = self.recipes.get(key, ()) if ctx is not None else ()
        for recipe in known:
            if recipe.fixed_at(fields) == recipe.fixed:
                break
        else:
            recipe = None
            if ctx is not None and self.store is not None and len(known) < MAX_SHAPES:
                recipe = self.store.find(key + (w.warned_layers,), fields)
                if recipe is not None:
                    self.recipes.setdefault(key, []).append(recipe)
                    self.adopted += 1
        if recipe is not None:
            if self._apply(w, recipe, fields, end):
                self.applied += 1
                return True
        else:
            if ctx is not None and len(known) < MAX_SHAPES:
                try:
                    recs = json.loads("[" + joined + "]")
                    if not all(type(r) is dict for r in recs):
                        raise ValueError("a line is not a JSON object")
                except (ValueError, RecursionError):
                    return [self.parse(line) for line in lines]
                # the event's type first: a list there is no block event, and the walker warns about it
                if not all(type(ev := r.get("event")) is str and ev in _BLOCK_EVENTS for r in recs):
                    return recs
                warned = w.warned_layers
                recipe = self._learn(w, recs, lines, start, ctx, fields)
                if recipe is not None:
                    self.recipes.setdefault(key, []).append(recipe)
                    self.learned += 1
                    if self.store is not None:
                        self.store.keep(key + (warned,), recipe)
                return True
        try:
            recs = json.loads("[" + joined + "]")
            if all(type(r) is dict for r in recs):
                return recs
        except (ValueError, RecursionError):   # a line nested past json's depth limit is read alone, as bad
            pass
        return [self.parse(line) for line in lines]

    # -- a template, replayed record by record --------------------------------
    def _learn(self, w, recs: list[dict], lines: list[str], start: int, ctx: tuple, fields: list[str]) -> Recipe | None:
        """Feed ``recs`` to the walker one by one, as the ordinary path does; the block's recipe, or
        None when the block did anything a recipe does not repeat (then it only was replayed)."""
        s = w.s
        before = (len(s.illegal), len(s.warnings), len(s.disorder), len(s.silences), w.mismatches, w.seqs.lost,
                  w.seqs.odd, s.header, len(s.faults), len(s.stuck), len(s.alive), len(s.scale_requests), w.done,
                  w.sessions, len(s.injected))
        made: list[tuple[int, object]] = []            # (record, Transition appended)
        starts: dict[tuple, int] = {}                 # (group, cseq) -> record that started it
        for j, rec in enumerate(recs):
            w.line = start + j + 1
            n_tr = len(s.transitions)
            w.record(rec)
            if len(s.transitions) > n_tr:
                made.append((j, s.transitions[-1]))
            if rec.get("event") == "collective_start":
                starts[(rec.get("group"), rec.get("cseq"))] = j
        after = (len(s.illegal), len(s.warnings), len(s.disorder), len(s.silences), w.mismatches, w.seqs.lost,
                 w.seqs.odd, s.header, len(s.faults), len(s.stuck), len(s.alive), len(s.scale_requests), w.done,
                 w.sessions, len(s.injected))
        if after != before or w.seqs.jump is not None:
            return None
        return build_recipe(w, recs, lines, ctx, fields, made, starts)

    # -- a later block, from its template's recipe ------------------------------
    def _apply(self, w, recipe: Recipe, fields: list[str], end: int) -> bool:
        n = recipe.n
        first = w.next_seq()
        values = recipe.read(fields)
        if values is None:
            return False     # not a number written as the template's: read record by record
        if list(recipe.seq.take(values)) != list(range(first, first + n)):
            return False     # lost, inserted or reordered records: the record-by-record path says which
        ts, steps = recipe.ts.take(values), recipe.step.take(values)
        seen = w.seen_at
        if (seen is not None and ts[0] - seen[0] > SILENCE_S) \
                or (n > 1 and max(map(operator.sub, ts[1:], ts[:-1])) > SILENCE_S):
            return False     # a silence inside the block: kept by the record-by-record path
        s = w.s
        cols = s.collectives
        durations: list | repeat = repeat(None)
        if recipe.collectives:
            cseqs = recipe.cseq_start.take(values)
            if cseqs != recipe.cseq_end.take(values):
                return False  # a collective ended with another cseq than it started with
            for group, c in zip(recipe.groups, cseqs):
                index = cols.get(group)
                if index is not None and c in index:
                    return False  # started twice: warned about record by record
                if w.early_ends and (group, c) in w.early_ends:
                    return False  # its end was read before its start: matched record by record
            if len(set(zip(recipe.groups, cseqs))) != len(cseqs):
                return False
            if recipe.duration is not None:
                durations = recipe.duration.take(values)
        # accepted: the template's effect with this block's numbers
        transitions = s.transitions
        for j, trig, src, dst, layer in recipe.transitions:
            transitions.append(Transition(steps[j], trig, src, dst, layer, first + j, None))
        if recipe.transitions:
            s.progress_after_stuck = True
        for (group, js, t), c, d in zip(recipe.collectives, cseqs if recipe.collectives else (), durations):
            index = cols.get(group)
            if index is None:
                index = cols[group] = CollectiveIndex()
            op, name, shape, dtype, state, layer, wave, parts, duration, error, peers = t
            index.one[c] = Collective(op, name, c, shape, dtype, steps[js], state, layer, first + js, wave, parts,
                                      ts[js], "ended", duration if d is None else d, error, peers=peers)
        events = s.events
        for ev, count in recipe.events:
            events[ev] += count
        w.records += n
        w.state, w.layer, w.pending, w.num_layers = recipe.post
        w.plain_ok = False
        w.seqs.prev, w.seqs.steps_at_prev = first + n - 1, w.n_steps
        w.seen_at = (ts[-1], steps[-1], recipe.last_state)
        w.last, w.last_line = None, self.lines[end - 1]
        w.line = end
        return True
