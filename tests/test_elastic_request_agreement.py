"""elastic/prepare.py: the old ranks agree on the scale request itself (``scale_check``) before anything
is built, so that ranks asking for different scales abort in ``prepare`` instead of timing out in the
transfer or switching with different views of who left.

Real gloo ranks as threads of this process (world 3) on one store; each serves a few steps of a
``ToyMoE`` (forward outputs checked against its reference), then calls ``request_scale`` with its own
arguments.
"""

from __future__ import annotations

import threading

import pytest

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.sim.model import ToyMoE
from eplb_fsm.transfer.groups import StoreGroup

WAIT_S = 30.0  # every wait of these tests; only a hang reaches it
WORLD, SLOTS, LAYERS = 3, 4, 2
PREFIX = "ranks disagree on the scale request (new_world_size / rank_mapping / generation): "


def _scale_with(info, experts: int, requests: dict) -> dict:
    """Every rank of a 3-rank group calls ``request_scale(*requests[r])`` after 3 steps; returns
    ``{rank: (entry, state, world, maps before, maps after, bad rows, bad forwards, records)}``."""
    config = EplbConfig(window_size=4, step_interval=1000, num_redundant_experts=SLOTS * WORLD - experts,
                        collective_timeout_s=2.0)
    outs: dict = {}
    errors: list = []

    def rank(r):
        try:
            model = ToyMoE(LAYERS, experts, SLOTS * WORLD - experts, 4, 2, r, WORLD)
            ctl = EplbController(config, group=StoreGroup.connect(info, 0, r, WORLD, WAIT_S), keep_trace=True)
            ctl.add_model(model, "main")
            bad = model.serve(ctl, 3)
            before = ctl.models[0].maps.phy2log.copy()
            new_world, mapping, generation = requests[r]
            out = ctl.request_scale(new_world, mapping, timeout_s=5.0, generation=generation)
            after = ctl.models[0].maps.phy2log.copy()
            rows = model.check_weights(after)
            state, world = ctl.state, ctl.world_size
            if out["outcome"] == "aborted":
                bad += model.serve(ctl, 2)   # the old group still serves, all three ranks in it
            outs[r] = (out, state, world, before, after, rows, bad, list(ctl.trace.records))
            ctl.close()
        except BaseException as exc:  # reported to the test
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank did not return"
    assert not errors, errors
    return outs


LEAVES_2 = {0: 0, 1: 1, 2: -1}   # the default mapping of 3 -> 2
LEAVES_1 = {0: 0, 1: -1, 2: 1}


@pytest.mark.parametrize("experts, requests, differ", [
    # rank 0 lets rank 2 leave, ranks 1 and 2 let rank 1 leave: this used to switch, ranks disagreeing on who left
    (4, {0: (2, None, None), 1: (2, LEAVES_1, None), 2: (2, LEAVES_1, None)}, "rank_mapping differs"),
    # the same with 6 experts: this used to time out in the transfer with a gloo error
    (6, {0: (2, None, None), 1: (2, LEAVES_1, None), 2: (2, LEAVES_1, None)}, "rank_mapping differs"),
    (4, {0: (2, LEAVES_2, 1), 1: (2, LEAVES_2, 1), 2: (2, LEAVES_2, 2)}, "generation differs"),
    (4, {0: (2, None, None), 1: (1, None, None), 2: (2, None, None)},
     "new_world_size and rank_mapping differ"),
])
def test_ranks_asking_for_different_scales_abort_in_prepare(store, experts, requests, differ):
    """Old ranks whose new_world_size / rank_mapping / generation differ all end aborted in prepare, naming
    what differs, before anything is built: maps unchanged, every row bit-exact, the old group serves on."""
    outs = _scale_with(store, experts, requests)
    for r in range(WORLD):
        out, state, world, before, after, rows, bad, records = outs[r]
        assert (out["outcome"], out["phase"]) == ("aborted", "prepare"), (r, out)
        assert out["reason"].startswith(PREFIX + differ + "; this rank asked"), out["reason"]
        assert (state, world, out["moved_slots"]) == ("collecting", WORLD, 0), (r, state, world)
        assert (before == after).all() and rows == [] and bad == 0, (r, rows, bad)
        events = [rec["event"] for rec in records]
        assert "group_switch" not in events and "scale_aborted" in events, events
        faults = [rec for rec in records if rec.get("trigger") == "fault"]
        assert [f.get("scale") for f in faults] == [out["generation"]], faults
