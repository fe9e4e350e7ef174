"""ToyMoE: follows the MoE protocol, routes like its load target, and its outputs ignore placement bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from eplb_fsm.fsm.model_protocol import MoEModel, validate_model
from eplb_fsm.maps import derive_log2phy
from eplb_fsm.sim.model import ToyMoE, expert_params, make_batch


def _placement(layers, experts, slots, seed):
    """A random valid placement: every expert once, the rest random replicas, shuffled."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(layers):
        row = np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)])
        rows.append(rng.permutation(row))
    return np.stack(rows).astype(np.int64)


def _set_maps(model, phy2log):
    log2phy, counts = derive_log2phy(phy2log, model.num_logical_experts,
                                     model.num_physical_experts - model.num_logical_experts + 1)
    load = torch.zeros(model.num_moe_layers, model.num_physical_experts, dtype=torch.int64)
    model.set_eplb_state(load, torch.from_numpy(log2phy), torch.from_numpy(counts))
    return load


class _Sum:
    """A G-thread all-reduce for tests (the controller-style group object, without transfers)."""

    def __init__(self, world):
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def member(self, rank):
        outer = self

        class Member:
            world_size = len(outer.slots)

            def all_reduce(self, tensor, timeout_s):
                outer.slots[rank] = tensor.clone()
                outer.barrier.wait(timeout_s)
                total = sum(outer.slots[1:], outer.slots[0].clone())
                outer.barrier.wait(timeout_s)
                tensor.copy_(total)

            def transfer_communicator(self, timeout_s):  # pragma: no cover - not used here
                raise NotImplementedError

        m = Member()
        m.rank = rank
        return m


def test_follows_the_protocol():
    """The toy model satisfies the MoE protocol for its world size."""
    model = ToyMoE(num_layers=3, num_experts=8, num_redundant=4, rank=1, world_size=4)
    assert isinstance(model, MoEModel)
    shape = validate_model(model, 4, 4)
    assert shape["num_local_physical_experts"] == 3
    assert [tuple(t.shape) for t in model.expert_weights[0]] == [(3, 16, 16), (3, 16)]


def test_weights_are_the_experts_originals_for_any_placement():
    """Each slot row holds its expert's deterministic weights; check_weights flags a wrong row."""
    placement = _placement(2, 8, 12, seed=1)
    model = ToyMoE(num_layers=2, num_experts=8, num_redundant=4, hidden=8, rank=1, world_size=2, phy2log=placement)
    assert model.check_weights(placement) == []
    w, b = expert_params(0, 1, int(placement[1, 6]), 8)
    assert torch.equal(model.expert_weights[1][0][0], w) and torch.equal(model.expert_weights[1][1][0], b)
    model.expert_weights[0][0][2] += 1.0 / 16
    assert model.check_weights(placement) == [(0, 2)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_is_bit_identical_under_any_placement(seed):
    """One rank, two random placements: both forwards equal the placement-free reference exactly."""
    x = make_batch(seed, 0, 96, 16)
    outs = []
    for p_seed in (10 + seed, 20 + seed):
        placement = _placement(3, 16, 24, p_seed)
        model = ToyMoE(num_layers=3, num_experts=16, num_redundant=8, seed=seed, phy2log=placement)
        _set_maps(model, placement)
        outs.append(model.forward(x))
        assert torch.equal(outs[-1], model.reference_forward(x))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], x)  # the layers do something


def test_ranks_sum_to_the_reference_and_record_only_their_tokens():
    """Across 3 thread ranks the all-reduced output is exact and the load passes add up to the batch's load."""
    world, layers, experts, slots = 3, 2, 8, 12
    placement = _placement(layers, experts, slots, seed=5)
    reducer = _Sum(world)
    x = make_batch(0, 7, 60, 16)
    outs, loads = [None] * world, [None] * world

    def rank_body(rank):
        model = ToyMoE(num_layers=layers, num_experts=experts, num_redundant=slots - experts, rank=rank,
                       world_size=world, phy2log=placement)
        loads[rank] = _set_maps(model, placement)
        outs[rank] = model.forward(x, reducer.member(rank))

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ref_model = ToyMoE(num_layers=layers, num_experts=experts, num_redundant=slots - experts, phy2log=placement)
    _set_maps(ref_model, placement)
    expected = ref_model.reference_forward(x)
    for out in outs:
        assert torch.equal(out, expected)
    total = sum(loads)
    assert torch.equal(total.sum(dim=1), torch.full((layers,), 60 * 2))  # 60 tokens x top-2
    ref_model.forward(x)
    assert torch.equal(total, ref_model.last_global_load)
    for rank, load in enumerate(loads):
        assert int(load.sum()) == len(range(rank, 60, world)) * 2 * layers


def test_replica_is_token_index_mod_replica_count():
    """Tokens of an expert with several replicas go to replica t mod count, deterministically."""
    placement = np.array([[0, 1, 2, 3, 0, 0]])
    model = ToyMoE(num_layers=1, num_experts=4, num_redundant=2, top_k=1, phy2log=placement)
    _set_maps(model, placement)
    experts = torch.zeros(7, 1, dtype=torch.int64)
    assert model.slots(0, experts).reshape(-1).tolist() == [0, 4, 5, 0, 4, 5, 0]


def test_routed_load_follows_the_target():
    """With a skewed target, the hot expert gets far more tokens than the cold one."""
    model = ToyMoE(num_layers=1, num_experts=8, num_redundant=0, top_k=2, seed=3)
    load = _set_maps(model, np.arange(8)[None, :])
    target = np.array([[0.5, 0.2, 0.1, 0.08, 0.06, 0.03, 0.02, 0.01]])
    model.set_load_target(target)
    for step in range(20):
        model.forward(make_batch(3, step, 128, 16))
    counts = load[0].double()
    assert counts[0] > 3 * counts[7]
    assert np.corrcoef(counts.numpy(), target[0])[0, 1] > 0.8
    with pytest.raises(ValueError, match="probs must have shape"):
        model.set_load_target(np.ones((2, 8)))


def test_bad_shapes_are_refused():
    """Slots that don't divide by the world size, or a top-k larger than N, raise ValueError."""
    with pytest.raises(ValueError, match="divisible"):
        ToyMoE(num_experts=8, num_redundant=3, world_size=2)
    with pytest.raises(ValueError, match="top_k"):
        ToyMoE(num_experts=4, num_redundant=0, top_k=5)


def test_toy_model_resizes_and_skips_empty_slots():
    """set_ep_world keeps S slots per rank; check_weights ignores empty (-1) slots."""
    model = ToyMoE(1, 4, 4, 4, 2, 1, 4)
    model.set_ep_world(0, 2)
    assert (model.num_physical_experts, model.num_redundant_experts, model.world_size) == (4, 0, 2)
    placement = np.array([[-1, -1, 3, 3]])
    model.expert_weights[0][0].zero_()
    assert model.check_weights(placement) == []


def test_serve_counts_the_steps_whose_forward_left_the_reference():
    """serve() steps the controller once per batch and counts forwards that differ from the reference: none with
    the original weights, every one after a slot's weights are corrupted."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    model = ToyMoE(num_layers=2, num_experts=4, num_redundant=0, hidden=4, top_k=2, rank=0, world_size=1)
    ctl = EplbController(EplbConfig(window_size=4, step_interval=1000), keep_trace=True, liveness_interval_s=None)
    ctl.add_model(model, "main")
    assert model.serve(ctl, 3) == 0 and ctl.steps == 3
    with torch.no_grad():
        for w in model.expert_weights[0]:
            w.add_(1.0)
    assert model.serve(ctl, 2) == 2 and ctl.steps == 5
    ctl.close()
