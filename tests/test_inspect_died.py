"""The wording of a ``rank_died`` finding for ranks that died together."""

from __future__ import annotations

from conftest import timeline

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose

T0 = 1_796_607_000.0
HEADER = {"schema": 1, "run_id": "d1e2d3f4a5b6c7d8", "mode": "sync", "group": "ep", "transfer_group": "ep_transfer",
          "config": {"num_layers": 2}, "step": 0}


def rank(r: int, tail: list[tuple[float, str, dict]]) -> list[dict]:
    """Header, 3 quiet steps, then ``tail`` at step 4."""
    return timeline(r, 3, T0, [(0.0, "header", HEADER), (0.5, "steps", {"count": 3, "dummy": 0, "step": 1}),
                               *tail], state="collecting", step=4)


def test_ranks_that_died_together_in_different_states_say_where_each_stopped():
    """Ranks 1-2 killed together, rank 1 already transferring: the finding gives the first one's place and rank 1's
    beside it (was: both 'at step 4 in planning')."""
    transition = {"trigger": "step", "source": "collecting", "dest": "planning", "layer": 0, "num_layers": 2,
                  "layer_after": 0, "due": True, "state": "planning"}
    plan = {"trigger": "plan_ready", "source": "planning", "dest": "transferring", "layer": 0, "num_layers": 2,
            "layer_after": 0, "moves": 1, "worth": True, "balancedness_before": 0.7, "balancedness_after": 0.9,
            "gain": 0.2, "moved_bytes": 8192, "changed_layers": 2, "policy_s": 0.0004, "forced": False,
            "state": "transferring"}
    report = diagnose({
        0: rank(0, [(1.0, "transition", transition), (1.01, "transition", plan),
                    (1.5, "end", {"how": "exception", "state": "transferring",
                                  "error": "RuntimeError: Connection closed by peer [127.0.0.1]:58797"})]),
        1: rank(1, [(1.0, "transition", transition), (1.01, "transition", plan)]),
        2: rank(2, [(1.0, "transition", transition)]),
    })
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [1, 2]), text
    # rank 2 stopped first (its last record is the earlier one): its place leads, rank 1's is beside it
    assert report.summary.startswith("ranks 1-2 died (SIGKILL?) at step 4 in planning (rank 1 at step 4 in "
                                     "transferring): no end record on any of them"), text
