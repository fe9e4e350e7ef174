"""One transition record re-driven through the machine (``replay_transition``): how the walk resynchronises,
and what lines lost before it explain."""

from __future__ import annotations

import pytest

from eplb_fsm.fsm.machine import EplbMachine
from eplb_fsm.inspect.summary import summarize_rank
from eplb_fsm.testing import SyntheticJob

NUM_LAYERS = 2


class Trace:
    """A rank's records written from a live machine, as the controller writes them."""

    def __init__(self) -> None:
        self.machine = EplbMachine(NUM_LAYERS)
        self.records: list[dict] = []
        self.emit("header", schema=1, config={}, mode="sync", group="ep", transfer_group="ep_transfer")

    def emit(self, event: str, **fields) -> dict:
        seq = len(self.records)
        rec = {"ts": 1.0 + seq, "rank": 0, "world": 2, "event": event, "state": self.machine.state, "step": seq,
               "seq": seq, **fields}
        self.records.append(rec)
        return rec

    def fire(self, trigger: str, **data) -> dict:
        fired = self.machine.fire(trigger, **data)
        fields = dict(data)
        layer = fields.pop("layer", fired.layer)
        return self.emit("transition", trigger=trigger, source=fired.source, dest=fired.dest, layer=layer,
                         num_layers=NUM_LAYERS, layer_after=fired.layer, **fields)

    def rearrange(self) -> None:
        """A due step, a plan worth moving, every layer, the commit (committed goes where scale_pending says)."""
        self.fire("step", due=True)
        self.fire("plan_ready", moves=5, worth=True)
        for layer in range(NUM_LAYERS):
            self.fire("layer_done", layer=layer)
        self.fire("committed")


def scale_then_fault() -> tuple[Trace, dict, dict]:
    """A scale begins, a recoverable fault aborts it mid-transfer (clearing scale_pending), a rearrangement follows."""
    t = Trace()
    t.fire("scale_requested")
    t.fire("groups_ready")
    plan = t.fire("plan_ready", moves=5, worth=True)
    fault = t.fire("fault", recoverable=True)
    t.rearrange()
    assert t.machine.state == "collecting"
    return t, plan, fault


def never_written(records: list[dict], *gone: dict) -> list[dict]:
    """``records`` without ``gone``, the ones after them renumbered as the controller would have numbered them (no
    seq gap where they were)."""
    kept = [dict(r) for r in records if not any(r is g for g in gone)]
    for rec in kept:
        rec["seq"] -= sum(g["seq"] < rec["seq"] for g in gone)
    return kept


def test_a_transition_never_written_gives_one_illegal_transition_not_a_second_later():
    """A plan_ready never written (seq runs on) before a fault: one finding there; the machine's answer clears the
    scale flag for later."""
    t, plan, fault = scale_then_fault()
    assert summarize_rank(t.records, 0).illegal == []
    s = summarize_rank(never_written(t.records, plan), 0)
    assert [(i["step"], i["trigger"]) for i in s.illegal] == [(fault["step"], "fault")]
    assert "recorded source 'transferring' but the replayed state is 'planning'" in s.illegal[0]["reason"]


def test_a_transition_lost_with_its_line_is_no_illegal_transition():
    """plan_ready's line lost (seq jumps): the fault's source is explained, the gap keeps the change, none later."""
    t, plan, fault = scale_then_fault()
    s = summarize_rank([r for r in t.records if r is not plan], 0)
    assert s.illegal == []
    (gap,) = s.gaps
    assert (gap["first"], gap["last"], gap["state_from"], gap["state_to"]) == (plan["seq"], plan["seq"], "planning",
                                                                               "transferring")
    assert "lines lost before 1 record(s) held state changes the replay did not see (first: seq 3, from " \
           "'planning' to 'transferring'); not illegal: the replay goes on from the state recorded after them" \
        in s.warnings, s.warnings


def test_a_record_the_machine_refuses_after_lost_lines_is_still_illegal():
    """plan_ready's line lost, and the fault after it goes where the machine would not go: still illegal."""
    t, plan, fault = scale_then_fault()
    fault["recoverable"] = False        # the machine goes to failed; the record says collecting
    s = summarize_rank([r for r in t.records if r is not plan], 0)
    assert [(i["seq"], i["trigger"]) for i in s.illegal] == [(fault["seq"], "fault")]
    assert "the machine goes to 'failed'" in s.illegal[0]["reason"]


def test_lines_lost_before_the_previous_transition_explain_nothing():
    """A gap before plan_ready (whose source matches) does not excuse a later transition's wrong source."""
    t = Trace()
    t.fire("step", due=True)
    lost = t.emit("collective_start", op="all_reduce", group="ep", cseq=0, shape=[4], dtype="float32")
    t.fire("plan_ready", moves=5, worth=True)
    for layer in range(NUM_LAYERS):
        t.fire("layer_done", layer=layer)
    commit = t.fire("committed")
    t.fire("step", due=True)
    records = [r for r in t.records if r is not lost]
    s = summarize_rank(never_written(records, commit), 0)
    assert len(s.gaps) == 1
    assert [(i["trigger"], i["replayed_state"]) for i in s.illegal] == [("step", "committing")]


def test_a_transition_with_a_foreign_seq_is_still_illegal():
    """The seq jump at the transition itself is a foreign line (the next record goes on from before it): no lines
    were lost, so its wrong source stays illegal."""
    t, plan, fault = scale_then_fault()
    records = never_written(t.records, plan)
    bad = next(r for r in records if r.get("trigger") == "fault")
    bad["seq"] += 7
    s = summarize_rank(records, 0)
    assert s.gaps == [] and any("outside the rank's sequence" in w for w in s.warnings), s.warnings
    assert [(i["step"], i["trigger"]) for i in s.illegal] == [(fault["step"], "fault")]


@pytest.mark.parametrize("compact", [False, True], ids=["step-records", "steps-runs"])
def test_a_step_record_stamped_with_the_state_lost_lines_reached_is_not_illegal(compact):
    """Rank 1's plan_ready to collecting and the records after it are lost: the step (or steps run) after the gap,
    stamped collecting, is no illegal transition; the gap is where the lines were, with the change."""
    records = SyntheticJob(world=2, compact_steps=compact).run(45).records()[1]
    skip = next(r for r in records if r.get("trigger") == "plan_ready" and r["dest"] == "collecting")
    lost = [r for r in records if skip["seq"] <= r["seq"] <= skip["seq"] + 2]
    assert [r["event"] for r in lost] == ["transition", "plan_skipped", "rearrangement"]
    after = records[records.index(lost[-1]) + 1]
    assert after["event"] == ("steps" if compact else "step") and after["state"] == "collecting"
    s = summarize_rank([r for r in records if not any(r is g for g in lost)], 1)
    assert s.illegal == []
    (gap,) = s.gaps
    assert {k: gap[k] for k in ("first", "last", "from_step", "to_step", "state_from", "state_to")} == {
        "first": skip["seq"], "last": skip["seq"] + 2, "from_step": skip["step"], "to_step": after["step"],
        "state_from": "planning", "state_to": "collecting"}


@pytest.mark.parametrize("compact", [False, True], ids=["step-records", "steps-runs"])
def test_a_step_record_stamped_with_another_state_and_no_gap_is_still_illegal(compact):
    """The same records renumbered (never written, no seq gap): the step after them is illegal as before."""
    records = SyntheticJob(world=2, compact_steps=compact).run(45).records()[1]
    skip = next(r for r in records if r.get("trigger") == "plan_ready" and r["dest"] == "collecting")
    lost = [r for r in records if skip["seq"] <= r["seq"] <= skip["seq"] + 2]
    s = summarize_rank(never_written(records, *lost), 1)
    assert s.gaps == []
    assert [i["reason"] for i in s.illegal][:1] == [
        f"{'steps' if compact else 'step'} record stamped 'collecting' but the replayed state is 'planning'"]


def test_resynchronising_on_a_refused_record_sets_the_scale_flag_as_the_machine_would():
    """A fault resynchronised on its recorded dest still clears the scale flag: the later commit is legal."""
    t, _, fault = scale_then_fault()
    fault["recoverable"] = False        # the machine goes to failed; the record says collecting
    s = summarize_rank(t.records, 0)
    assert [(i["seq"], i["trigger"]) for i in s.illegal] == [(fault["seq"], "fault")]
    assert "the machine goes to 'failed'" in s.illegal[0]["reason"]
