"""Stage 2 of the replay: the checks across participants, each returning findings.

Headers (configuration), illegal transitions, the order of state changes (the n-th state
change is the same event at the same step everywhere; a joiner's sequence starts at the
others' ``groups_ready`` of its generation; one shifted by state changes its trace lost is
``lost_records``, ``lost``), traces that stop early, ranks that all closed at different
steps (``step_count_mismatch``), ranks left ``failed``, watchdog reports. The collectives are
checked in ``collective_checks``.
Participants, labels and group membership come from ``elastic.Cast``.
"""

from __future__ import annotations

import json
from typing import Any

from eplb_fsm.fsm.machine import COLLECTING, FAILED, PLANNING
from eplb_fsm.inspect.elastic import Cast, Key, build_cast, config_payloads
from eplb_fsm.inspect.findings import Finding, canon, last_seen, majority
from eplb_fsm.inspect.lost import LostRecords
from eplb_fsm.inspect.model import WORLD_GROUP, RankSummary, Transition
from eplb_fsm.inspect.stepseq import own_steps_broken, step_break_text

# ranks are not stopped in lockstep: a trace ending one step before the others is not a death
DIED_SLACK_STEPS = 1
STILL_WRITING = 2.5   # alive intervals: a trace whose last record is this close to the job's newest did not stop


def check_headers(cast: Cast, warnings: list[str]) -> list[Finding]:
    """Headers must agree: schema, mode and config everywhere; world and the fields a scale
    changes (``num_redundant_experts``) among the sessions that started in the same generation."""
    payload: dict[Key, tuple[dict, dict]] = {}
    shared: dict[str, list[Key]] = {}
    per_gen: dict[int, dict[str, list[Key]]] = {}
    for k, s in cast.parts.items():
        if s.header is None:
            warnings.append(f"{cast.label(k)}: no header record (the trace may have lost its beginning)")
            continue
        payload[k] = config_payloads(s)
        shared.setdefault(canon(payload[k][0]), []).append(k)
        gen = s.generation if s.role == "joiner" else 0
        per_gen.setdefault(gen, {}).setdefault(canon(payload[k][1]), []).append(k)
    diffs: dict[Key, list[str]] = {}
    for part, groups in [(0, shared)] + [(1, g) for _, g in sorted(per_gen.items())]:
        if len(groups) < 2:
            continue
        ref_key = majority(groups)
        ref = json.loads(ref_key)
        for key, ks in groups.items():
            if key != ref_key:
                for k in ks:
                    diffs.setdefault(k, []).extend(_differences(payload[k][part], ref))
    found: list[Finding] = []
    if diffs:
        culprits = sorted(diffs)
        others = sorted(k for k in payload if k not in diffs)
        text = {k: ", ".join(diffs[k]) for k in culprits}
        step = min((cast.parts[k].header.get("step") or 0) for k in culprits)
        found.append(Finding.of(
            "config_mismatch", step, culprits,
            f"{cast.who(culprits)} started with a different configuration than {cast.who(others)}: "
            + text[culprits[0]],
            state=cast.parts[culprits[0]].header.get("state"),
            ranks=[cast.position(k, "different_config", text[k], step) if k in diffs
                   else cast.position(k, "reference", "the majority's configuration", step) for k in sorted(payload)],
        ))
    versions: dict[str, list[Key]] = {}
    for k, s in cast.parts.items():
        if s.header is not None:
            versions.setdefault(json.dumps(s.header.get("versions"), sort_keys=True), []).append(k)
    if len(versions) > 1:
        warnings.append("ranks run different package versions: " + "; ".join(
            f"{cast.who(ks)}: {json.loads(v)}" for v, ks in sorted(versions.items(), key=lambda kv: min(kv[1]))))
    return found


def _differences(mine: dict, ref: dict) -> list[str]:
    diffs = [f"{top}={mine[top]!r} (others {ref[top]!r})" for top in ("schema", "world", "mode")
             if top in mine and mine[top] != ref.get(top)]
    a, b = mine.get("config") or {}, ref.get("config") or {}
    if isinstance(a, dict) and isinstance(b, dict):
        diffs += [f"{k}={a.get(k)!r} (others {b.get(k)!r})" for k in sorted(set(a) | set(b))
                  if canon(a.get(k)) != canon(b.get(k))]
    elif canon(a) != canon(b):
        diffs.append(f"config={a!r} (others {b!r})")
    return diffs


def check_illegal(cast: Cast) -> list[Finding]:
    found = []
    for k, s in cast.parts.items():
        if not s.illegal:
            continue
        first = s.illegal[0]
        more = f" ({len(s.illegal) - 1} more on this rank)" if len(s.illegal) > 1 else ""
        found.append(Finding.of(
            "illegal_transition", first["step"], [k],
            f"{cast.label(k)} recorded {first['trigger']} {first['source']}->{first['dest']} at step {first['step']}, "
            f"which the machine does not allow: {first['reason']}{more}",
            state=first["replayed_state"], layer=first["layer"],
            ranks=[cast.position(k, "illegal", first["reason"], first["step"], first["replayed_state"],
                                 first["layer"])],
        ))
    return found


def kept_transitions(cast: Cast) -> dict[Key, list[Transition]]:
    """Each participant's state changes that every kept history covers.

    A rank whose oldest segments were deleted holds its history from a ``continued`` header on,
    and ranks roll at different byte counts: numbering each one's state changes from 0 would
    compare different events. They are compared from the latest header step of those cuts,
    exclusive (records of that very step may lie on either side of a roll).
    """
    top = latest_cut(cast)
    if top is None:
        return {k: s.transitions for k, s in cast.parts.items()}
    return {k: [t for t in s.transitions if type(t.step) is not int or t.step > top] for k, s in cast.parts.items()}


def latest_cut(cast: Cast) -> int | None:
    """The latest step a participant's kept history starts at (a ``continued`` header), or None."""
    cuts = [s.cut["step"] for s in cast.parts.values() if s.cut is not None and type(s.cut.get("step")) is int]
    return max(cuts, default=None)


def align_transitions(cast: Cast, offsets: dict[Key, int],
                      transitions: dict[Key, list[Transition]] | None = None) -> list[Finding]:
    """The n-th state change must be the same event at the same step on every participant.

    ``offsets`` places each participant's first transition in the job's sequence (0 for the
    first ranks; a joiner's at the others' ``groups_ready`` of its generation); one that
    ended (a rank that left) simply has no entry past its end. ``transitions``: each one's
    state changes to compare (``kept_transitions``; default all).

    A participant whose state changes are shifted by lines its trace lost (``lost.LostRecords.shifted``)
    is told as ``lost_records`` at the first divergence it causes, and the others are compared
    on without it.
    """
    keys = sorted(k for k in offsets if k in cast.parts)
    if len(keys) < 2:
        return []
    trans = transitions if transitions is not None else {k: cast.parts[k].transitions for k in keys}
    compare = {k: [(t.key(), t.step) for t in trans[k]] for k in keys}
    longest = max(offsets[k] + len(compare[k]) for k in keys)
    plain = all(offsets[k] == 0 for k in keys)
    lost, found = LostRecords(cast), []
    i = -1
    while i + 1 < longest and len(keys) > 1:
        i += 1
        if plain:
            at_i = [c[i] for c in compare.values() if i < len(c)]
        else:
            at_i = [compare[k][i - offsets[k]] for k in keys if 0 <= i - offsets[k] < len(compare[k])]
        if len(at_i) < 2 or len(set(at_i)) == 1:
            continue
        at = {k: trans[k][i - offsets[k]] for k in keys if 0 <= i - offsets[k] < len(compare[k])}
        ended = [k for k in keys if i - offsets[k] >= len(compare[k]) and not cast.parts[k].ended_on_purpose]
        rest = {k: (trans[k], i - offsets[k]) for k in at}
        finding = _transition_divergence(cast, i, at, ended, rest)
        if finding is None:
            continue
        shifted, told = lost.shifted(finding, rest)
        if shifted:     # their lost lines, not their decisions: compare #i again among the others
            found += [told] if told is not None else []
            keys = [k for k in keys if k not in shifted]
            compare = {k: compare[k] for k in keys}
            i -= 1
            continue
        if transitions is not None and latest_cut(cast) is not None:
            finding.details.append(f"state changes counted after step {latest_cut(cast)}, where every rank's "
                                   "kept history begins (older trace segments were deleted)")
        return found + [finding]
    return found


def _transition_divergence(cast: Cast, i: int, at: dict, ended: list[Key],
                           rest: dict[Key, tuple[list[Transition], int]]) -> Finding | None:
    """State change #i (``at``: each participant's; ``rest``: its state changes and #i's index among them)
    differs: the event (``decision_divergence``) or the step (``step_divergence``)."""
    def context(status_of) -> list[dict]:
        rows = [cast.position(k, status_of(t), f"{t.text()} at step {t.step}", t.step, t.source, t.layer_k)
                for k, t in at.items()]
        rows += [cast.position(k, "ended", f"trace ended before: {last_seen(cast.parts[k])}",
                               cast.parts[k].last_step) for k in ended]
        return sorted(rows, key=lambda p: (p["rank"], p["session"]))

    by_key: dict[tuple, list[Key]] = {}
    for k, t in at.items():
        by_key.setdefault(t.key(), []).append(k)
    if len(by_key) > 1:
        ref_key = majority(by_key)
        ref = at[by_key[ref_key][0]]
        culprits = sorted(k for key, ks in by_key.items() if key != ref_key for k in ks)
        odd = at[culprits[0]]
        return Finding.of(
            "decision_divergence", min((t.step for t in at.values() if t.step is not None), default=None), culprits,
            f"{cast.who(culprits)} took {odd.text()} at step {odd.step} where {cast.who(by_key[ref_key])} "
            f"took {ref.text()} (state change #{i})",
            state=ref.source, layer=ref.layer_k, ranks=context(lambda t: "same" if t.key() == ref_key else "different"),
        )
    by_step: dict[Any, list[Key]] = {}
    for k, t in at.items():     # an unknown step (a mistyped field, already warned about) is compared with none
        if t.step is not None:
            by_step.setdefault(t.step, []).append(k)
    if len(by_step) > 1:
        ref_step = majority(by_step)
        details, undecided = [], False
        tied = [s for s, ks in by_step.items() if len(ks) == len(by_step[ref_step])]
        if len(tied) > 1:
            decided, note = _step_tie(cast, by_step, tied, rest)
            details.append(note)
            ref_step, undecided = (ref_step, True) if decided is None else (decided, False)
        ref = at[by_step[ref_step][0]]
        # an undecided tie names every rank of it: none is presented as the certain culprit
        culprits = sorted(k for s, ks in by_step.items() if s != ref_step or undecided for k in ks)
        steps = sorted(by_step)
        odd_steps = ", ".join(f"{cast.who(by_step[s])} at step {s}" for s in steps if s != ref_step)
        return Finding.of(
            "step_divergence", steps[0], culprits,
            f"state change #{i} ({ref.text()}) happened at different steps: {cast.who(by_step[ref_step])} "
            f"at step {ref_step}, {odd_steps}: a skipped or extra step" + ("; a tie, undecided" if undecided else ""),
            state=ref.source, layer=ref.layer_k, details=details,
            ranks=context(lambda t: "same" if t.step == ref_step else "different_step"),
        )
    return None


# the state changes of one rearrangement after its due step: the interval counter restarted at that step
_CYCLE = frozenset({"plan_ready", "layer_done", "committed"})
_DUE = ("step", COLLECTING, PLANNING)


def _step_tie(cast: Cast, by_step: dict[Any, list[Key]], tied: list, rest: dict) -> tuple[Any | None, str]:
    """As many participants took state change #i at one step as at another (``tied``): which step is right.

    The evidence, in order: participants whose own step numbers break (``stepseq``) are the odd
    ones; for a due step into planning, the interval: the counter restarts at every due (or
    forced) step, so the next one comes ``step_interval`` steps later (one less after a forced
    one, whose record carries the next step's number), when the participant was back in
    collecting by then with only that rearrangement's state changes between. Returns (the
    reference step, a note for the finding), or (None, a note saying the tie is undecided).
    """
    broken = {s: [k for k in by_step[s] if own_steps_broken(cast.parts[k])] for s in tied}
    clean = [s for s in tied if not broken[s]]
    if len(clean) == 1:
        k = next(k for s in tied for k in broken[s])
        return clean[0], f"a tie, decided by the step numbers: {cast.label(k)}: {step_break_text(cast.parts[k])}"
    fits = {s: [_interval_fits(cast.parts[k], *rest[k]) for k in by_step[s]] for s in tied}
    right = [s for s in tied if all(f is True for f in fits[s])]
    if len(right) == 1 and all(f is False for s in tied if s != right[0] for f in fits[s]):
        iv = _interval(cast.parts[by_step[right[0]][0]])
        return right[0], (f"a tie, decided by the interval: step {right[0]} is {iv} steps (step_interval) after "
                          f"{cast.who(by_step[right[0]])}'s previous due step, the others' step is not")
    return None, ("a tie: as many ranks took it at one step as at another, and neither their own step numbers nor "
                  "the rearrangement interval tells which is right; undecided, so every rank of the tie is named")


def _interval(s: RankSummary) -> int | None:
    config = (s.header or {}).get("config")
    iv = config.get("step_interval") if isinstance(config, dict) else None
    return iv if type(iv) is int and iv >= 1 else None


def _interval_fits(s: RankSummary, trans: list[Transition], j: int) -> bool | None:
    """Whether due step ``trans[j]`` comes the interval after the session's previous one (None: nothing to tell)."""
    t, iv = trans[j], _interval(s)
    if iv is None or (t.trigger, t.source, t.dest) != _DUE or type(t.step) is not int:
        return None
    back = None
    for n in range(j - 1, -1, -1):
        prev = trans[n]
        if prev.trigger in _CYCLE:
            back = prev if back is None else back
            continue
        if (prev.trigger, prev.source, prev.dest) != _DUE or type(prev.step) is not int:
            return None   # a scale, a fault or a recovery restarts the counter elsewhere
        if back is not None and (type(back.step) is not int or back.step >= prev.step + iv - 1):
            return None   # still busy when the interval ran out: due at the first step back in collecting
        return t.step - prev.step in (iv, iv - 1)
    return None


def world_groups(summaries: dict[int, RankSummary]) -> set[str]:
    """Groups every rank of the (first) world belongs to: ``world``, the groups the first
    ranks' headers name (``group``, ``transfer_group``), their re-creations (``ep_transfer.1``,
    named by ``transfer_group_reset``), and any other group every first rank uses."""
    cast = build_cast(summaries, None, [])
    names = set(cast.group_gen)
    for s in cast.parts.values():
        names |= s.named_groups | set(s.collectives)
    return {WORLD_GROUP} | {g for g in names if cast.generation_of(g) == 0 or (
        cast.generation_of(g) is None and cast.used_by_every_first_rank(g))}


def _still_writing(s: RankSummary, newest: float | None) -> bool:
    """Whether a session with alive records wrote its last record within ``STILL_WRITING`` of its alive interval
    (at least 2 s) of the job's newest record: its trace did not stop."""
    return bool(s.alive) and newest is not None and s.last_ts is not None \
        and newest - s.last_ts <= max(STILL_WRITING * (s.alive_interval or 1.0), 2.0)


def check_ends(cast: Cast, folded: set[Key]) -> list[Finding]:
    """A trace that stops while the others went on: the rank died (unless it left on purpose)."""
    lasts = {k: s.last_step for k, s in cast.parts.items() if isinstance(s.last_step, int)}
    if len(lasts) < 2:
        return []
    top = max(lasts.values())
    newest = max((s.last_ts for s in cast.parts.values() if s.last_ts is not None), default=None)
    found = []
    for k, last in sorted(lasts.items()):
        s = cast.parts[k]
        # a session with an end record stopped in order (the liveness checks judge it); one whose liveness thread
        # wrote until the newest record of the job did not stop at all: a pipeline's last stage runs steps behind
        # the first (a red team's healthy 4-stage pipeline, read live, named its last stage dead)
        if top - last <= DIED_SLACK_STEPS or k in folded or s.ended_on_purpose or s.end is not None \
                or _still_writing(s, newest):
            continue
        others = {o: v for o, v in lasts.items() if o != k and not cast.parts[o].ended_on_purpose}
        positions = [cast.position(k, "stopped", last_seen(s), last, s.final_state, s.final_layer)]
        for o, other_last in sorted(others.items()):
            went = other_last > last + DIED_SLACK_STEPS
            positions.append(cast.position(o, "went_on" if went else "stopped",
                                           f"{'went on to' if went else 'stopped at'} step {other_last} in "
                                           f"{cast.parts[o].final_state}", other_last, cast.parts[o].final_state))
        went_on = [o for o, v in others.items() if v > last + DIED_SLACK_STEPS]
        found.append(Finding.of(
            "rank_died", last, [k],
            f"{cast.label(k)}'s trace stops at step {last} in {s.final_state} while {cast.who(went_on)} went on "
            f"(to step {top})" + ("; its last line is truncated" if s.truncated else ""),
            state=s.final_state, layer=s.final_layer, ranks=positions,
        ))
    return found


def check_failed(cast: Cast) -> list[Finding]:
    failed = sorted(k for k, s in cast.parts.items() if s.final_state == FAILED and not s.ended_on_purpose)
    if not failed:
        return []
    steps = {}
    for k in failed:
        into = [t for t in cast.parts[k].transitions if t.dest == FAILED]
        steps[k] = into[-1].step if into else cast.parts[k].last_step
    first = min(failed, key=lambda k: (steps[k] is None, steps[k]))
    return [Finding.of(
        "failed", steps[first], failed,
        f"{cast.who(failed)} ended in the failed state (first at step {steps[first]}); the engine must recover them",
        state=FAILED,
        ranks=[cast.position(k, "failed", last_seen(cast.parts[k]), steps[k], FAILED) for k in failed],
    )]


def check_stuck(cast: Cast) -> list[Finding]:
    stuck = sorted(k for k, s in cast.parts.items() if s.stuck and not s.progress_after_stuck)
    if not stuck:
        return []
    first = cast.parts[stuck[0]].stuck[-1]
    return [Finding.of(
        "stuck", first.get("step"), stuck,
        f"the watchdog of {cast.who(stuck)} reported no progress in {first.get('state')} "
        f"(layer {first.get('layer')}, {first.get('seconds')} s, last collective {first.get('last_collective')}) "
        "and nothing moved afterwards",
        state=first.get("state"), layer=first.get("layer"),
        collective=first.get("last_collective") if isinstance(first.get("last_collective"), dict) else None,
        ranks=[cast.position(k, "stuck", last_seen(cast.parts[k]), cast.parts[k].last_step) for k in stuck],
    )]


def step_count_mismatch(cast: Cast) -> list[Finding]:
    """Every participant closed in order but their final steps differ: the odd ones skipped or added steps.

    The reference is the final step most participants reached; in a tie, the one whose participants' own
    step numbers run on unbroken (``stepseq``), then the higher."""
    parts = {k: s for k, s in cast.parts.items() if not s.ended_on_purpose}
    if len(parts) < 2 or any((s.end or {}).get("how") != "closed" for s in parts.values()):
        return []
    by_step: dict = {}
    for k, s in parts.items():
        by_step.setdefault(s.last_step, []).append(k)
    if len(by_step) < 2:
        return []
    ref = max(by_step, key=lambda v: (len(by_step[v]), not any(own_steps_broken(parts[k]) for k in by_step[v]),
                                      v is not None and v))
    odd = sorted(k for v, ks in by_step.items() if v != ref for k in ks)
    steps = ", ".join(f"{cast.who(ks)} at step {v}" for v, ks in sorted(by_step.items(), key=lambda kv: str(kv[0]))
                      if v != ref)
    first = cast.parts[odd[0]]
    return [Finding.of(
        "step_count_mismatch", first.last_step, odd,
        f"every rank closed in order, but {steps} where {cast.who(by_step[ref])} ended at step {ref}: "
        "a rank skipped or added engine steps",
        state=first.final_state,
        ranks=[cast.position(k, "odd" if k in odd else "reference", f"closed at step {parts[k].last_step}",
                             parts[k].last_step) for k in sorted(parts)],
        details=[f"{cast.label(k)}: {text}" for k in odd if (text := step_break_text(parts[k]))],
    )]
