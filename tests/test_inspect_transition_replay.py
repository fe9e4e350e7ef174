"""One transition record re-driven through the machine (``replay_transition``): how the walk resynchronises."""

from __future__ import annotations

from eplb_fsm.fsm.machine import EplbMachine
from eplb_fsm.inspect.summary import summarize_rank

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


def test_a_lost_line_gives_one_illegal_transition_not_a_second_later():
    """A lost plan_ready before a fault: one finding there; the machine's answer clears the scale flag for later."""
    t, plan, fault = scale_then_fault()
    assert summarize_rank(t.records, 0).illegal == []
    s = summarize_rank([r for r in t.records if r is not plan], 0)
    assert [(i["seq"], i["trigger"]) for i in s.illegal] == [(fault["seq"], "fault")]


def test_resynchronising_on_a_refused_record_sets_the_scale_flag_as_the_machine_would():
    """A fault resynchronised on its recorded dest still clears the scale flag: the later commit is legal."""
    t, _, fault = scale_then_fault()
    fault["recoverable"] = False        # the machine goes to failed; the record says collecting
    s = summarize_rank(t.records, 0)
    assert [(i["seq"], i["trigger"]) for i in s.illegal] == [(fault["seq"], "fault")]
    assert "the machine goes to 'failed'" in s.illegal[0]["reason"]
