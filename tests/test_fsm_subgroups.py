"""pad_registered_groups: members of a subset EP group build their transfer group under one name."""

from __future__ import annotations

import numpy as np
import torch

from eplb_fsm.fsm.subgroups import pad_registered_groups, registered_groups
from eplb_fsm.sim.launcher import run_ranks


def test_a_rank_below_the_largest_count_registers_groups_up_to_it(one_rank_group):
    """A peer holding two groups more (the summed vector says so): this rank registers two one-rank groups."""
    before = registered_groups()
    assert before is not None and before >= 1

    def peer_holds_two_more(counts: torch.Tensor) -> None:
        assert counts.dtype == torch.float64 and counts.shape == (1,) and counts[0] == before
        counts += 2

    assert pad_registered_groups(peer_holds_two_more, 0, 1) == 2
    assert registered_groups() == before + 2
    assert pad_registered_groups(lambda counts: None, 0, 1) == 0      # alone at the largest: nothing to add
    assert registered_groups() == before + 2


def _subset_with_uneven_counts(rank: int, world: int) -> dict | None:
    """World 3: rank 0 also belongs to a group over ranks 0 and 2, so it holds one group more than rank 1 when both
    build a controller over the EP group of ranks 0 and 1; then one sync rearrangement moves weights."""
    import torch.distributed as dist

    from eplb_fsm import EplbConfig, EplbController
    from eplb_fsm.sim.model import ToyMoE

    dist.new_group(ranks=[0, 2])     # every process takes part; only ranks 0 and 2 register it
    ep = dist.new_group(ranks=[0, 1])
    if rank == 2:
        return None
    config = EplbConfig(window_size=8, step_interval=1000, num_redundant_experts=4, collective_timeout_s=5.0)
    ctl = EplbController(config, group=ep, keep_trace=True, liveness_interval_s=None)
    model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=rank, world_size=2)
    ctl.add_model(model, "main")
    target = np.full((2, 8), 0.05)
    target[:, 5] = 1.0                # one hot expert: the plan replicates it, so weights move
    model.set_load_target(target / target.sum(axis=1, keepdims=True))
    for step in range(8):
        model.forward(model.make_batch(step, 32), ep)
        ctl.step()
    entry = ctl.rearrange()
    out = {"outcome": entry and entry.get("outcome"), "moves": entry and entry.get("moves"),
           "bad_rows": model.check_weights(ctl.maps("main").phy2log), "state": ctl.state,
           "group_name": ctl.transfer_group.group_name}
    ctl.close()
    return out


def test_ranks_holding_different_numbers_of_groups_build_one_transfer_group_and_move_weights():
    """gloo world 3, EP group of ranks 0-1 where rank 0 holds one group more: the controller starts at once on both
    (torch's name agrees after the padding; before, each waited for the other under its own name until the timeout),
    and a rearrangement that moves experts leaves every row bit-exact."""
    results = run_ranks(_subset_with_uneven_counts, 3, timeout=120)
    assert results[2] is None
    for out in results[:2]:
        assert out["outcome"] == "committed" and out["moves"] > 0 and out["bad_rows"] == [], out
        assert out["state"] == "collecting", out
    assert results[0]["group_name"] == results[1]["group_name"]
