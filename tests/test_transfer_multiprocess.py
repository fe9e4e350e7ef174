"""Real gloo process groups (world 2 and 4): bit-exact rearrangements, batching, elastic EP, timeouts.

Spawning is the expensive part, so each world size is one launch that runs several
scenarios; each rank checks its own weights and returns a list of problems (empty = ok)
plus what the parent compares across ranks (trace records).
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from eplb_fsm.sim.launcher import run_ranks

pytestmark = pytest.mark.multiprocess

# three tensors of different shapes and dtypes per layer
SPECS = [((8, 4), torch.float32), ((16,), torch.bfloat16), ((3, 5), torch.int8)]


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def _expert_row(layer: int, expert: int, t: int) -> torch.Tensor:
    """The original weights of (layer, expert) for tensor t: bytes from a (layer, expert, t) seed."""
    shape, dtype = SPECS[t]
    gen = torch.Generator().manual_seed(layer * 1_000_003 + (expert + 1) * 7919 + t * 104_729)
    raw = torch.randint(0, 256, (_nbytes(shape, dtype),), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _weights(rank: int, old: np.ndarray, s: int) -> list[list[torch.Tensor]]:
    """This rank's weights for map ``old`` (L, P); empty slots get the pattern of 'expert -1'."""
    out = []
    for k in range(old.shape[0]):
        row_experts = old[k, rank * s : (rank + 1) * s]
        out.append([torch.stack([_expert_row(k, int(e), t) for e in row_experts]) for t in range(len(SPECS))])
    return out


def _problems(tag: str, rank: int, weights, expect: np.ndarray, s: int) -> list[str]:
    """Rows of this rank whose bytes differ from the expert ``expect`` names (-1: left as-is pattern)."""
    bad = []
    for k, layer in enumerate(weights):
        for t, w in enumerate(layer):
            for i in range(s):
                e = int(expect[k, rank * s + i])
                want = _expert_row(k, e, t)
                if not torch.equal(w[i].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    bad.append(f"{tag}: rank {rank} layer {k} tensor {t} row {i} != expert {e}")
    return bad


def _random_maps(seed: int, num_layers: int, p: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Old and new maps holding all n experts plus random replicas, the same on every rank."""
    rng = np.random.default_rng(seed)

    def one():
        m = np.concatenate([rng.permutation(n), rng.integers(0, n, p - n)])
        return m[rng.permutation(p)]

    return np.stack([one() for _ in range(num_layers)]), np.stack([one() for _ in range(num_layers)])


def _collectives(trace) -> list[tuple]:
    return [
        (r["event"], r["cseq"], r["layer"], r["wave"])
        for r in trace.records
        if r["event"].startswith("collective_")
    ]


def _scenario_random(rank: int, world: int, batching: bool, seed: int,
                     buffer_layers: int = 1) -> tuple[list[str], list[tuple]]:
    from eplb_fsm.trace import EventTrace
    from eplb_fsm.transfer import TransferBuffer, rearrange_expert_weights_inplace

    s, num_layers = 4, 3
    p = world * s
    old, new = _random_maps(seed, num_layers, p, p - world)
    weights = _weights(rank, old, s)
    trace = EventTrace(rank=rank, world=world, keep=True)
    rearrange_expert_weights_inplace(
        torch.from_numpy(old), torch.from_numpy(new), weights, trace=trace,
        migration_batching=batching, buffer=TransferBuffer(buffer_layers), timeout=30.0,
    )
    return _problems(f"random(batching={batching}, buffer_layers={buffer_layers})", rank, weights, new, s), \
        _collectives(trace)


def _scenario_two_phase(rank: int, world: int) -> list[str]:
    """Every row crosses ranks in every layer: with tags and a one-layer buffer the held receives go out
    in a second start(); with a two-layer buffer nothing is held."""
    from eplb_fsm.transfer import TorchDistCommunicator, TransferBuffer, rearrange_expert_weights_inplace

    class Spy(TorchDistCommunicator):
        starts = 0

        def start(self) -> None:
            self.starts += 1
            super().start()

    s, num_layers = 2, 3
    p = world * s
    old = np.tile(np.arange(p), (num_layers, 1))
    new = np.roll(old, s, axis=1)  # each rank's rows come from the previous rank
    bad = []
    for tags, layers in ((True, 1), (False, 1), (True, 2)):
        weights = _weights(rank, old, s)
        comm = Spy(timeout=30.0)
        comm.supports_tags = tags
        rearrange_expert_weights_inplace(old, new, weights, communicator=comm, buffer=TransferBuffer(layers))
        bad += _problems(f"two-phase(tags={tags}, buffer_layers={layers})", rank, weights, new, s)
        # with held receives, layers after the first start twice
        want = 1 + 2 * (num_layers - 1) if tags and layers == 1 else num_layers
        if comm.starts != want:
            bad.append(f"rank {rank}: tags={tags}, buffer_layers={layers}: {comm.starts} starts, expected {want}")
    return bad


def _scenario_scale_down(rank: int, world: int) -> list[str]:
    """4 -> 2 in the old 4-rank group: ranks 0 and 2 leave, 1 and 3 become new ranks 0 and 1."""
    from eplb_fsm.transfer import TransferBuffer, expand_maps, rearrange_expert_weights_inplace

    s, num_layers, n = 3, 2, 5
    mapping = {0: -1, 1: 0, 2: -1, 3: 1}
    old, _ = _random_maps(11, num_layers, world * s, n)
    _, new = _random_maps(12, num_layers, 2 * s, n)  # over the 2 new ranks
    weights = _weights(rank, old, s)
    rearrange_expert_weights_inplace(old, new, weights, rank_mapping=mapping, buffer=TransferBuffer(), timeout=30.0)
    _, expect, _ = expand_maps(old, new, mapping, world)
    expect = np.where(expect >= 0, expect, old)  # leaving ranks keep what they had
    return _problems("scale-down", rank, weights, expect, s)


def _scenario_scale_up(rank: int, world: int) -> list[str]:
    """2 -> 4 in the new 4-rank group: old ranks 0, 1 become 2, 0; ranks 1 and 3 join empty."""
    from eplb_fsm.transfer import TransferBuffer, expand_maps, rearrange_expert_weights_inplace

    s, num_layers, n = 3, 2, 5
    mapping = {0: 2, 1: 0}
    old, _ = _random_maps(21, num_layers, 2 * s, n)  # over the 2 old ranks
    _, new = _random_maps(22, num_layers, world * s, n)
    expanded_old, _, _ = expand_maps(old, new, mapping, world)
    weights = _weights(rank, expanded_old, s)  # joining ranks hold the '-1' pattern
    rearrange_expert_weights_inplace(old, new, weights, rank_mapping=mapping, buffer=TransferBuffer(), timeout=30.0)
    return _problems("scale-up", rank, weights, new, s)


def _scenario_one_layer(rank: int, world: int) -> list[str]:
    """transfer_layer_to_buffer keeps the old weights; commit_layer_from_buffer writes the new ones."""
    from eplb_fsm.transfer import (
        TorchDistCommunicator,
        TransferBuffer,
        commit_layer_from_buffer,
        transfer_layer_to_buffer,
    )

    s = 4
    old, new = _random_maps(31, 1, world * s, world * s - 2)
    weights = _weights(rank, old, s)
    comm = TorchDistCommunicator(timeout=30.0)
    pending = transfer_layer_to_buffer(old[0], new[0], weights[0], TransferBuffer(), communicator=comm,
                                       migration_batching=True)
    bad = _problems("before commit", rank, weights, old, s)
    commit_layer_from_buffer(pending, weights[0])
    return bad + _problems("after commit", rank, weights, new, s)


def _scenario_timeout(rank: int, world: int) -> list[str]:
    """Ranks that disagree on the maps: the receiver's wait times out with TransferError, traced."""
    import torch.distributed as dist

    from eplb_fsm.trace import EventTrace
    from eplb_fsm.transfer import TransferBuffer, TransferError, rearrange_expert_weights_inplace

    old = np.array([[0, 1]])
    new = np.array([[0, 0]]) if rank == 1 else old.copy()  # only rank 1 believes it needs expert 0
    weights = [[torch.full((1, 4), float(rank + 1))]]
    trace = EventTrace(rank=rank, world=world, keep=True)
    bad = []
    t0 = time.monotonic()
    try:
        rearrange_expert_weights_inplace(old, new, weights, trace=trace, buffer=TransferBuffer(), timeout=0.5)
        if rank == 1:
            bad.append("rank 1 did not time out")
    except TransferError as exc:
        if rank != 1 or exc.layer != 0 or exc.committed_layers != 0:
            bad.append(f"unexpected TransferError on rank {rank}: {exc}")
        if not 0.4 < time.monotonic() - t0 < 20:
            bad.append(f"timeout took {time.monotonic() - t0:.1f} s")
        if trace.records[-1]["event"] != "collective_error":
            bad.append("no collective_error record")
        if weights[0][0][0, 0].item() != 2.0:
            bad.append("weights written despite the failure")
    # gloo closes the pair after a wait timeout: the group is unusable from here on (the
    # controller treats such a failure as fatal for the group). Rank 0 stays alive until
    # rank 1 has seen its timeout, signalled through the rendezvous store.
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("timeout_seen", "1")
    else:
        store.wait(["timeout_seen"], timedelta(seconds=30))
    return bad


def _world_main(rank: int, world: int) -> dict:
    out: dict = {"problems": [], "traces": {}}
    for batching in (False, True):
        bad, trace = _scenario_random(rank, world, batching, seed=world * 100 + int(batching))
        out["problems"] += bad
        out["traces"][batching] = trace
    out["problems"] += _scenario_random(rank, world, False, seed=world * 100 + 7, buffer_layers=2)[0]
    out["problems"] += _scenario_one_layer(rank, world)
    out["problems"] += _scenario_two_phase(rank, world)
    if world == 4:
        out["problems"] += _scenario_scale_down(rank, world)
        out["problems"] += _scenario_scale_up(rank, world)
    if world == 2:  # last: it leaves the group broken
        out["problems"] += _scenario_timeout(rank, world)
    return out


def _check(results: list[dict]) -> None:
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    for batching in (False, True):
        traces = [r["traces"][batching] for r in results]
        # every rank brackets the same collectives (cseq, layer, wave) and every one ended
        assert all(t == traces[0] for t in traces), f"traces differ across ranks (batching={batching})"
        assert traces[0] and all(e[0] != "collective_error" for e in traces[0])
        starts = sum(1 for e in traces[0] if e[0] == "collective_start")
        assert starts == sum(1 for e in traces[0] if e[0] == "collective_end")


@pytest.mark.timeout(90)
def test_world_4_gloo():
    """4 gloo ranks: random rearrangements (batching, a two-layer buffer), one-layer API, two-phase posting, scale
    4->2 and 2->4."""
    _check(run_ranks(_world_main, 4, timeout=80.0))


@pytest.mark.timeout(90)
def test_world_2_gloo():
    """2 gloo ranks: random rearrangements (batching, a two-layer buffer), one-layer API, two-phase posting, a traced
    timeout."""
    _check(run_ranks(_world_main, 2, timeout=80.0))
