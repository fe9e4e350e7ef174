"""fsm/transfers.py: a layer's maps and window commit prepared ahead matches the unprepared commit exactly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from eplb_fsm.fsm.model_entry import ModelEntry
from eplb_fsm.fsm.transfers import PreparedRow
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.stats import LoadWindow

L, N, P, W = 3, 6, 10, 5


class _Router:
    """The model side of the protocol that a commit touches: the router's state."""

    def __init__(self) -> None:
        self.state = None

    def set_eplb_state(self, load_pass, log2phy, replica_count) -> None:
        self.state = (load_pass, log2phy, replica_count)


def _entry(seed: int) -> ModelEntry:
    maps = ExpertMaps.initial(L, N, P)
    window = LoadWindow(L, P, W)
    window.window[:] = torch.from_numpy(np.random.default_rng(seed).integers(0, 50, (W, L, P)))
    return ModelEntry(name="m", model=_Router(), index=0, layer_offset=0, num_layers=L, num_logical=N,
                      num_physical=P, num_local=P // 2, num_groups=1, maps=maps, window=window,
                      log2phy=torch.from_numpy(maps.log2phy.copy()),
                      replica_count=torch.from_numpy(maps.replica_count.copy()), buffer=None, slot_bytes=[0] * L)


def _placements(seed: int, count: int) -> list[np.ndarray]:
    """Random valid rows: every expert once, the redundant slots any experts (some thrice)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        row = np.concatenate([np.arange(N), rng.integers(0, N, P - N)])
        rows.append(rng.permutation(row).astype(np.int64))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_prepared_commit_equals_commit_row_bit_for_bit(seed):
    """Maps, router tensors and every held window pass come out identical to ModelEntry.commit_row's."""
    a, b = _entry(seed), _entry(seed)
    for layer, row in zip((1, 0, 2, 1), _placements(seed, 4)):
        prepared = PreparedRow(b.maps, b.maps.phy2log[layer].copy(), row)
        a.commit_row(layer, row)
        prepared.apply(b, layer)
        for name in ("phy2log", "log2phy", "replica_count"):
            np.testing.assert_array_equal(getattr(a.maps, name), getattr(b.maps, name))
        assert torch.equal(a.window.window, b.window.window)
        assert torch.equal(a.log2phy, b.log2phy) and torch.equal(a.replica_count, b.replica_count)
        assert b.model.state[1] is b.log2phy and b.model.state[0] is b.window.load_pass
    # each expert's total over the window is kept by the remap
    assert int(b.window.window.sum()) == int(_entry(seed).window.window.sum())


def test_a_bad_row_is_refused_when_prepared_naming_the_rule():
    """An expert out of range or one left without a slot is refused before anything changes."""
    entry = _entry(0)
    bad = np.arange(P) % N
    bad[0] = N + 3
    with pytest.raises(ValueError, match="phy2log"):
        PreparedRow(entry.maps, entry.maps.phy2log[0].copy(), bad)
    with pytest.raises(ValueError, match="10 slots"):
        PreparedRow(entry.maps, entry.maps.phy2log[0].copy(), np.arange(P - 2) % N)


def _assert_refused_and_unchanged(entry, prepared, layer: int, match: str) -> None:
    """prepared.apply raises ValueError matching ``match`` and leaves the maps and the window as they were."""
    before = copy.deepcopy((entry.maps.phy2log, entry.window.window))
    with pytest.raises(ValueError, match=match):
        prepared.apply(entry, layer)
    np.testing.assert_array_equal(entry.maps.phy2log, before[0])
    assert torch.equal(entry.window.window, before[1])


def test_apply_refuses_a_layer_whose_maps_moved_on_and_changes_nothing():
    """A prepared commit for a stale old row raises, and maps and window stay as they were."""
    entry = _entry(1)
    rows = _placements(1, 2)
    prepared = PreparedRow(entry.maps, entry.maps.phy2log[0].copy(), rows[0])
    entry.commit_row(0, rows[1])
    _assert_refused_and_unchanged(entry, prepared, 0, "changed since its commit was prepared")


def test_apply_refuses_to_drop_an_expert_with_recorded_load_before_any_change():
    """A row with empty slots that leaves out an expert holding load: ValueError, maps and window unchanged."""
    entry = _entry(2)
    row = np.full(P, -1, dtype=np.int64)
    row[: N - 1] = np.arange(N - 1)          # expert N-1 loses its slot (empty slots allowed mid-scale)
    prepared = PreparedRow(entry.maps, entry.maps.phy2log[2].copy(), row)
    _assert_refused_and_unchanged(entry, prepared, 2, "drops an expert that has recorded load")


def test_write_checks_a_prepared_commit_before_touching_the_weights():
    """LayerMover.write refuses a stale prepared commit before the weights' copy is even attempted."""
    from eplb_fsm.fsm.transfers import LayerMover, TransferredLayer

    entry = _entry(3)
    rows = _placements(3, 2)
    prepared = PreparedRow(entry.maps, entry.maps.phy2log[1].copy(), rows[0])
    entry.commit_row(1, rows[1])
    mover = LayerMover([entry], collectives=None, trace=None, batching=False, hooks=[])
    # the pending layer is a placeholder: reaching the weights' copy would fail on it differently
    with pytest.raises(ValueError, match="changed since its commit was prepared"):
        mover.write([np.stack([rows[0]] * L)], 1, TransferredLayer(object(), prepared))


def test_chunk_counts_are_each_changed_layers_chunks_counted_ahead():
    """chunk_counts gives every changed layer the chunks its paced transfer is cut into, 1 for the rest and unpaced."""
    from types import SimpleNamespace

    from eplb_fsm.fsm.transfers import LayerMover
    from eplb_fsm.transfer.chunks import chunk_count, message_count

    entry = _entry(4)
    entry.model.expert_weights = [[torch.zeros(P // 2, 8), torch.zeros(P // 2, 4)] for _ in range(L)]  # 48-byte rows
    collectives = SimpleNamespace(communicator=SimpleNamespace(world_size=2))
    new = np.stack(_placements(5, L))
    new[0] = [5, 4, 3, 2, 1, 0, 4, 1, 2, 3]   # each rank now lacks one expert it needs: two messages
    changed = [True, False, True]
    paced = LayerMover([entry], collectives=collectives, trace=None, batching=False, hooks=[], max_bytes_per_step=48)
    counts = paced.chunk_counts([new], changed)
    expected = [chunk_count(message_count(entry.maps.phy2log[k], new[k], 2), 48, 48) if changed[k] else 1
                for k in range(L)]
    assert counts == expected and max(counts) > 1
    assert counts == [paced.chunks([new], k) if changed[k] else 1 for k in range(L)]
    unpaced = LayerMover([entry], collectives=collectives, trace=None, batching=False, hooks=[])
    assert unpaced.chunk_counts([new], changed) == [1, 1, 1]
