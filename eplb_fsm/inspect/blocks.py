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
"""

from __future__ import annotations

import json
import operator
from collections import Counter
from itertools import repeat
from typing import Callable

from eplb_fsm.inspect.model import SCALE_TRIGGERS, Collective, CollectiveIndex, Transition
from eplb_fsm.inspect.records import SILENCE_S

__all__ = ["BlockReader", "MIN_BLOCK_LINES"]

MIN_BLOCK_LINES = 4       # shorter runs of non-step lines are read record by record (nothing to gain)
MAX_SHAPES = 8            # templates kept per (context, line count, field count): bounds the tries per block
# the counters a block of one shape changes; everything else must be byte for byte the template's
_VARYING = frozenset({"ts", "seq", "step", "cseq", "duration_s", "index", "rearrangement"})
# records a block may hold: the walker keeps nothing of them but counts, transitions and collectives
_BLOCK_EVENTS = frozenset({"transition", "collective_start", "collective_end", "rearrangement", "plan_skipped",
                           "balancedness", "stats", "load_stats"})
_NOT_BLOCK_TRIGGERS = SCALE_TRIGGERS | {"fault"}


def _number(token: str) -> int | float:
    """A JSON number token as ``json.loads`` reads it."""
    return float(token) if "." in token or "e" in token or "E" in token else int(token)


def _picker(indices: list[int]) -> Callable[[list], tuple]:
    """A function giving ``tuple(items[i] for i in indices)``, in C."""
    if len(indices) == 1:
        i = indices[0]
        return lambda items: (items[i],)
    return operator.itemgetter(*indices) if indices else (lambda items: ())


class _Values:
    """Where one counter sits in a block's fields (the block's lines joined by commas, split at commas):
    every piece is ``prefix`` (``"seq":``) and a number of type ``kind``; ``take`` picks its values out
    of the block's counter values (``Recipe.read``)."""

    __slots__ = ("at", "prefix", "kind", "take")

    def __init__(self, at: list[int], prefix: str, kind: type) -> None:
        self.at, self.prefix, self.kind = at, prefix, kind
        self.take: Callable[[list], tuple] = _picker([])


_HEAD = operator.itemgetter(0)
_TOKEN = operator.itemgetter(2)
_AT_COLON = operator.methodcaller("partition", ":")


class Recipe:
    """The effect of one replayed template block, to apply to a block of the same shape.

    ``fixed``: the template's fields that must recur byte for byte; the ``_Values`` read the
    counters: seq, ts and step of every record, the cseq each collective starts and ends
    with, each end's duration, and any other counter (checked to be a number, not used).
    """

    __slots__ = ("pre", "post", "n", "events", "fixed_at", "fixed", "seq", "ts", "step", "cseq_start",
                 "cseq_end", "duration", "others", "transitions", "collectives", "groups", "last_state",
                 "counters_at", "heads", "kinds")

    def __init__(self, pre: tuple, post: tuple, recs: list[dict]) -> None:
        self.pre, self.post, self.n = pre, post, len(recs)
        self.events = tuple(Counter(r["event"] for r in recs).items())
        self.last_state = recs[-1].get("state")
        self.transitions: list[tuple] = []  # (record, trigger, source, dest, layer)
        self.collectives: list[tuple] = []  # (group, start record, template collective)
        self.groups: tuple = ()
        self.duration: _Values | None = None
        self.others: list[_Values] = []

    def finish(self) -> None:
        """Index every counter: one pick, one ``json.loads`` and one type check read them all (``read``)."""
        groups = [self.seq, self.ts, self.step, self.cseq_start, self.cseq_end, self.duration, *self.others]
        groups = [g for g in groups if g is not None]
        at = sorted(i for g in groups for i in g.at)
        where = {i: n for n, i in enumerate(at)}
        prefix = {i: g.prefix for g in groups for i in g.at}
        kind = {i: g.kind for g in groups for i in g.at}
        self.counters_at = _picker(at)
        self.heads = [prefix[i][:-1] for i in at]      # each prefix ends with the colon the pieces split at
        self.kinds = [kind[i] for i in at]
        for g in groups:
            g.take = _picker([where[i] for i in g.at])

    def read(self, fields: list[str]) -> list | None:
        """The block's counter values, or None when a piece is not its key and a JSON number of the
        template's type there (what a line's parse would read, checked by one ``json.loads``)."""
        parts = list(map(_AT_COLON, self.counters_at(fields)))
        if list(map(_HEAD, parts)) != self.heads:
            return None
        try:
            values = json.loads("[" + ",".join(map(_TOKEN, parts)) + "]")
        except ValueError:
            return None
        if len(values) != len(parts) or list(map(type, values)) != self.kinds:
            return None     # a token that was no number of the template's type (or hid a comma)
        return values


def _context(w) -> tuple | None:
    """What the replay of a block depends on besides the block; None: no template applies here."""
    seqs = w.seqs
    if w.state is None or w.world is None or w.first is None or seqs.prev is None or seqs.jump is not None:
        return None
    return (w.state, w.layer, w.pending, w.num_layers)


class BlockReader:
    """Templates of one rank file's blocks and the fast path that applies them (``feed``)."""

    def __init__(self, lines: list[str], parse: Callable[[str], dict | None]) -> None:
        self.lines = lines
        self.parse = parse
        self.recipes: dict[tuple, list[Recipe]] = {}
        self.applied = 0                   # blocks applied from a recipe (for tests and profiling)
        self.learned = 0                   # templates kept

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
                if self._apply(w, recipe, fields, end):
                    self.applied += 1
                    return True
                break
        else:
            if ctx is not None and len(known) < MAX_SHAPES:
                try:
                    recs = json.loads("[" + joined + "]")
                    if not all(type(r) is dict for r in recs):
                        raise ValueError("a line is not a JSON object")
                except ValueError:
                    return [self.parse(line) for line in lines]
                if not all(r.get("event") in _BLOCK_EVENTS for r in recs):
                    return recs
                recipe = self._learn(w, recs, lines, start, ctx, fields)
                if recipe is not None:
                    self.recipes.setdefault(key, []).append(recipe)
                    self.learned += 1
                return True
        try:
            recs = json.loads("[" + joined + "]")
            if all(type(r) is dict for r in recs):
                return recs
        except ValueError:
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
        return self._recipe(w, recs, lines, ctx, fields, made, starts)

    def _recipe(self, w, recs, lines, ctx, fields, made, starts) -> Recipe | None:
        recipe = Recipe(ctx, (w.state, w.layer, w.pending, w.num_layers), recs)
        vary: dict[int, tuple[str, str, type]] = {}      # field -> (key, prefix, type)
        where: list[dict[str, int]] = []                 # per record: key -> field
        at = 0
        for rec, line in zip(recs, lines):
            mine: dict[str, int] = {}
            pieces = line.split(",")
            for key in _VARYING.intersection(rec):
                value = rec[key]
                if type(value) is not int and type(value) is not float:
                    continue
                text = json.dumps(value)    # as the writer writes it; a counter written otherwise stays fixed
                piece = f'"{key}":{text}'
                n = 0 if pieces[0] == "{" + piece else pieces.index(piece) if piece in pieces else -1
                if n < 0:
                    continue
                if pieces.count(piece) + (pieces[0] == "{" + piece) != 1:
                    return None    # the same counter twice (one in a nested value): not a block to repeat
                mine[key] = at + n
                vary[at + n] = (key, piece[:-len(text)] if n else "{" + piece[:-len(text)], type(value))
            at += line.count(",") + 1
            if not {"ts", "seq", "step"} <= mine.keys():
                return None
            where.append(mine)
        if at != len(fields):
            return None
        fixed = [i for i in range(len(fields)) if i not in vary]
        recipe.fixed_at, recipe.fixed = _picker(fixed), _picker(fixed)(fields)
        used: set[int] = set()

        def values(at_: list[int]) -> _Values | None:
            kinds = {vary[i][1:] for i in at_}
            if len(kinds) != 1:
                return None
            used.update(at_)
            prefix, kind = kinds.pop()
            return _Values(at_, prefix, kind)

        recipe.seq = values([m["seq"] for m in where])
        recipe.ts = values([m["ts"] for m in where])
        recipe.step = values([m["step"] for m in where])
        if recipe.seq is None or recipe.ts is None or recipe.step is None or recipe.seq.kind is not int \
                or recipe.step.kind is not int:
            return None
        for j, t in made:
            if t.trigger in _NOT_BLOCK_TRIGGERS or t.generation is not None:
                return None
            recipe.transitions.append((j, t.trigger, t.source, t.dest, t.layer))
        c_start, c_end, durations = [], [], []
        for j, rec in enumerate(recs):
            if rec["event"] != "collective_end":
                continue
            group, cseq = rec.get("group"), rec.get("cseq")
            js = starts.pop((group, cseq), None)
            if js is None or type(group) is not str or "cseq" not in where[j] or "cseq" not in where[js]:
                return None
            index = w.s.collectives.get(group)
            tmpl = index.one.get(cseq) if isinstance(index, CollectiveIndex) else None
            if tmpl is None or tmpl.status != "ended":
                return None
            recipe.collectives.append((group, js, tmpl))
            c_start.append(where[js]["cseq"])
            c_end.append(where[j]["cseq"])
            if "duration_s" in where[j]:
                durations.append(where[j]["duration_s"])
        events = dict(recipe.events)
        n_coll = len(recipe.collectives)
        if starts or events.get("collective_end", 0) != n_coll or events.get("collective_start", 0) != n_coll:
            return None    # a collective left open (or ended without a start): not a block to repeat
        if durations and len(durations) != n_coll:
            return None    # some ends time their collective, some not: rare, read record by record
        recipe.groups = tuple(g for g, _, _ in recipe.collectives)
        recipe.cseq_start, recipe.cseq_end = values(c_start), values(c_end)
        if n_coll and (recipe.cseq_start is None or recipe.cseq_end is None or recipe.cseq_start.kind is not int):
            return None
        recipe.duration = values(durations) if durations else None
        if durations and recipe.duration is None:
            return None
        rest: dict[tuple, list[int]] = {}
        for i in sorted(set(vary) - used):
            rest.setdefault(vary[i][1:], []).append(i)
        recipe.others = [_Values(at_, prefix, kind) for (prefix, kind), at_ in rest.items()]
        recipe.finish()
        return recipe

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
            index.one[c] = Collective(t.op, t.group, c, t.shape, t.dtype, steps[js], t.state, t.layer, first + js,
                                      t.wave, t.parts, ts[js], "ended", t.duration_s if d is None else d, t.error)
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
