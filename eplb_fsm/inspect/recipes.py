"""What a replayed template block does, to apply to later blocks of the same shape (``blocks``).

A ``Recipe`` holds where a block's counters sit among its comma-separated fields (``ts``,
``seq``, ``step``, ``cseq``, ``duration_s``, the rearrangement index), the fields that must
recur byte for byte, and the template's effect: its transitions, its collectives, its event
counts and the machine state after it. ``build_recipe`` makes one from a block the walker
has just replayed record by record; ``TemplateStore`` shares recipes between the files of one
replay (the ranks of a job write the same blocks but for their ``rank`` field).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections import Counter
from typing import Callable

from eplb_fsm.inspect.model import SCALE_TRIGGERS, CollectiveIndex

__all__ = ["MAX_SHAPES", "Recipe", "TemplateStore", "build_recipe"]

MAX_SHAPES = 8            # templates kept per (context, line count, field count): bounds the tries per block
# the counters a block of one shape changes; everything else must be byte for byte the template's
_VARYING = frozenset({"ts", "seq", "step", "cseq", "duration_s", "index", "rearrangement"})
_NOT_BLOCK_TRIGGERS = SCALE_TRIGGERS | {"fault"}
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")    # a JSON integer, as a rank is written

def _dumped(value: int | float) -> str:
    """``json.dumps(value)`` for an int or a float (their ``repr``, but for the non-finite floats)."""
    return repr(value) if type(value) is int or math.isfinite(value) else json.dumps(value)


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
                 "counters_at", "heads", "kinds", "loose_at", "loose", "rank_at", "rank_heads")

    def __init__(self, pre: tuple, post: tuple, recs: list[dict]) -> None:
        self.pre, self.post, self.n = pre, post, len(recs)
        self.events = tuple(Counter(r["event"] for r in recs).items())
        self.last_state = recs[-1].get("state")
        self.transitions: list[tuple] = []  # (record, trigger, source, dest, layer)
        self.collectives: list[tuple] = []  # (group, start record, template collective's fields)
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
        except (ValueError, RecursionError):
            return None
        if len(values) != len(parts) or list(map(type, values)) != self.kinds:
            return None     # a token that was no number of the template's type (or hid a comma)
        return values

    def adopt(self, fields: list[str]) -> "Recipe | None":
        """This recipe for a block of another file (``TemplateStore``): a copy whose fixed text is the
        block's, or None when the block differs from the template in more than the counters and the
        value of its top-level ``rank`` (one JSON integer, the same on every line)."""
        if self.loose_at(fields) != self.loose:
            return None
        parts = list(map(_AT_COLON, self.rank_at(fields)))
        if list(map(_HEAD, parts)) != self.rank_heads:
            return None
        tokens = set(map(_TOKEN, parts))
        if len(tokens) > 1 or not all(map(_INT.fullmatch, tokens)):
            return None
        copy = object.__new__(Recipe)
        for name in Recipe.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.fixed = self.fixed_at(fields)
        return copy


class TemplateStore:
    """Recipes learned on the files of one replay so far, for the blocks of the next files.

    Keyed by everything a block's replay depends on besides its bytes (``_context``, whether the
    walker already warned about missing layer counts, the line and field counts); at most
    ``MAX_SHAPES`` per key. One store serves one replay (one machine definition).
    """

    def __init__(self) -> None:
        self.recipes: dict[tuple, list[Recipe]] = {}

    def find(self, key: tuple, fields: list[str]) -> Recipe | None:
        for recipe in self.recipes.get(key, ()):
            mine = recipe.adopt(fields)
            if mine is not None:
                return mine
        return None

    def keep(self, key: tuple, recipe: Recipe) -> None:
        known = self.recipes.setdefault(key, [])
        if len(known) < MAX_SHAPES:
            known.append(recipe)


def build_recipe(w, recs: list[dict], lines: list[str], ctx: tuple, fields: list[str], made: list[tuple],
                 starts: dict[tuple, int]) -> Recipe | None:
    """The recipe of a template block just replayed by walker ``w`` (``recs``, its ``lines``, split into
    ``fields``): where its counters sit, what stays fixed, the transitions (``made``: record, Transition)
    and collectives (``starts``: (group, cseq) -> record) it makes; None when it is no block to repeat."""
    recipe = Recipe(ctx, (w.state, w.layer, w.pending, w.num_layers), recs)
    vary: dict[int, tuple[str, str, type]] = {}      # field -> (key, prefix, type)
    where: list[dict[str, int]] = []                 # per record: key -> field
    ranks: dict[int, str] = {}                       # field -> its top-level rank piece's head
    at = 0
    for rec, line in zip(recs, lines):
        mine: dict[str, int] = {}
        pieces = line.split(",")
        rank = rec.get("rank")
        if type(rank) is int and line.count('"rank":') == 1:   # only then is the one piece the top level's
            piece = f'"rank":{rank}'
            n = 0 if pieces[0] == "{" + piece else pieces.index(piece) if piece in pieces else -1
            if n >= 0:
                ranks[at + n] = pieces[n].partition(":")[0]
        for key in _VARYING.intersection(rec):
            value = rec[key]
            if type(value) is not int and type(value) is not float:
                continue
            text = _dumped(value)    # as the writer writes it; a counter written otherwise stays fixed
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
    rank_at = sorted(ranks)
    recipe.loose_at = _picker([i for i in fixed if i not in ranks])
    recipe.loose, recipe.rank_at, recipe.rank_heads = recipe.loose_at(fields), _picker(rank_at), \
        [ranks[i] for i in rank_at]
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
        # its fields now: a later record of this file may still change the template's status or error
        recipe.collectives.append((group, js, (tmpl.op, tmpl.group, tmpl.shape, tmpl.dtype, tmpl.state,
                                               tmpl.layer, tmpl.wave, tmpl.parts, tmpl.duration_s,
                                               tmpl.error, tmpl.peers)))
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
