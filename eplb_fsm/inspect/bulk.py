"""Stage 1 of the replay, in bulk: stretches of a rank file where the same few records repeat every step.

A job that all-reduces every step (``log_balancedness`` at interval 1) writes, per step, a
step record and the all-reduce's start and end records: a unit of ``p`` lines that repeats
between two other records (an ``alive`` record, a rearrangement). Parsing each line with
``json.loads`` and indexing each collective on its own is most of the cost of replaying
such a file, so the reader finds these stretches without parsing them and checks them in
bulk:

- ``periodic_stretches``: the file's lines with their digits deleted (one C pass over the
  bytes) are compared with the lines ``p`` further on; a stretch where they agree repeats
  one unit of ``p`` lines up to the numbers in them.
- ``feed_units``: the unit just before the stretch is read record by record (it is the
  template); the stretch is then accepted when every number that matters follows from it:
  the exact text of each collective (op, group, shape, dtype, parts, layer, wave) occurs
  once per unit, ``seq`` runs on from the walker's next one to the last line, the step
  and each group's ``cseq`` advance by one per unit from the template's (checked on the
  first and last unit), and no two of its lines are further apart in time than
  ``records.SILENCE_S`` (a freeze inside is read line by line, with its step). Then the
  walker counts the steps and records, and each group gets one ``CollRun`` for the stretch.
  A stretch that fails a check is read line by line.
"""

from __future__ import annotations

import operator
import re
from collections import Counter

from eplb_fsm.inspect.model import CollRun, CollectiveIndex
from eplb_fsm.inspect.stepruns import calm_lines, step_of

MIN_LINES = 2000          # smaller files are read line by line: nothing to gain
MIN_UNITS = 4             # a stretch shorter than this is read line by line
MAX_PERIOD = 12
_DIGITS = b"0123456789"
_STEP = b'"event":"step"'
# the records a unit may hold besides its step: collectives that end, and records the
# replay only counts (anything the walker acts on is read record by record)
_BULK_EVENTS = frozenset({"step", "collective_start", "collective_end", "balancedness", "stats", "load_stats"})
_SEQ = re.compile(r'"seq":(\d+)')
_CSEQ = re.compile(r'"cseq":(\d+)')


def periodic_stretches(text: str, n_lines: int) -> list[tuple[int, int, int]]:
    """(first line, end line, period) of each stretch to read in bulk; the unit before each is its template.

    Lines are 0-based indices into ``text.split("\\n")``; a stretch starts on a step line.
    """
    if n_lines < MIN_LINES or 2 * text.count('"event":"collective_end"') < text.count('"event":"step"'):
        return []  # fewer collectives than one every other step (the compact case): the step runs do it
    sk = text.encode("utf-8", "surrogateescape").translate(None, _DIGITS).split(b"\n")
    if len(sk) != n_lines:
        return []
    steps = [i for i in range(min(n_lines, 4000)) if _STEP in sk[i]]
    gaps = Counter(b - a for a, b in zip(steps, steps[1:]))
    if not gaps:
        return []
    p = gaps.most_common(1)[0][0]
    if p < 2 or p > MAX_PERIOD:
        return []  # steps only: the step-run reader handles it
    eq = bytes(map(operator.eq, sk[p:], sk[:-p]))
    out = []
    pos = 0
    while True:
        s0 = eq.find(b"\x01", pos)
        if s0 < 0:
            break
        e0 = eq.find(b"\x00", s0)
        if e0 < 0:
            e0 = len(eq)
        pos = e0
        # lines s0 .. e0 + p - 1 repeat with period p; start units on a step line
        a = next((i for i in range(s0, min(s0 + p, e0)) if _STEP in sk[i]), None)
        if a is None:
            continue
        units = (e0 + p - a) // p
        if units - 1 >= MIN_UNITS:
            out.append((a + p, a + units * p, p))
    return out


def _num(pattern: re.Pattern, line: str) -> int | None:
    m = pattern.search(line)
    return int(m.group(1)) if m else None


def feed_units(w, lines: list[str], start: int, end: int, p: int, parse) -> bool:
    """Account lines[start:end] (whole units of ``p`` lines) to walker ``w`` in bulk; False: not
    provably a repetition of the unit before it (the caller reads it line by line)."""
    units = (end - start) // p
    if start < p or units < 1 or w.state is None:
        return False
    tmpl = lines[start - p:start]
    recs = [parse(line) for line in tmpl]
    if any(r is None or r.get("event") not in _BULK_EVENTS or r.get("state") != w.state for r in recs):
        return False
    step_at = [j for j, r in enumerate(recs) if r["event"] == "step"]
    if len(step_at) != 1 or recs[step_at[0]].get("due") or type(recs[step_at[0]].get("step")) is not int:
        return False
    if not w.plain_ok and not w.steps_keep_state(False):
        return False
    s = w.s
    need: Counter = Counter()
    starts: dict[str, tuple[int, int]] = {}   # group -> (template line, cseq)
    ended: set = set()
    for j, (line, r) in enumerate(zip(tmpl, recs)):
        ev = r["event"]
        if ev not in ("collective_start", "collective_end"):
            continue
        g, c = r.get("group"), r.get("cseq")
        if type(g) is not str or type(c) is not int:
            return False
        k = line.find('"op":')
        m = _CSEQ.search(line, k)
        if k < 0 or m is None:
            return False
        need[line[k:m.start() + 7]] += 1       # op, group: everything up to the cseq digits
        need[line[m.end():]] += 1              # shape, dtype, parts, layer, wave: all after them
        if ev == "collective_start":
            if g in starts:
                return False                   # two of one group per unit: cseq steps by 2
            starts[g] = (j, c)
        elif starts.get(g, (None, None))[1] == c:
            ended.add(g)
    if set(starts) != ended:
        return False
    region = "\n".join(lines[start:end])
    if any(region.count(frag) != n * units for frag, n in need.items()):
        return False
    if not calm_lines(lines, start, end):
        return False   # a silence inside (a freeze): read line by line, which keeps it with its step
    first_seq, last_seq = _num(_SEQ, lines[start]), _num(_SEQ, lines[end - 1])
    due = w.next_seq()
    if first_seq is None or last_seq != first_seq + (end - start) - 1 or (due is not None and first_seq != due):
        return False
    j0, step0 = step_at[0], recs[step_at[0]]["step"]
    if step_of(lines[start + j0]) != step0 + 1 or step_of(lines[end - p + j0]) != step0 + units:
        return False
    for g, (j, c) in starts.items():
        if _num(_CSEQ, lines[start + j]) != c + 1 or _num(_CSEQ, lines[end - p + j]) != c + units:
            return False
        index = s.collectives.get(g)
        template = index.one.get(c) if isinstance(index, CollectiveIndex) else None
        if template is None or template.status != "ended" or (index.runs and index.runs[-1].last >= c):
            return False
    # accepted: account every record of the stretch
    for g, (j, c) in starts.items():
        s.collectives[g].runs.append(CollRun(c + 1, c + units, s.collectives[g].one[c], 1))
    for r in recs:
        if r["event"] != "step":
            s.events[r["event"]] += units
    w.saw_run(lines[start], lines[end - 1])
    w.step_seq.run(step0 + 1, step0 + units, units, w.n_steps + w.run_steps, w.s.transitions)
    w.took_bulk(end - start, units, last_seq, lines[end - 1])
    return True
