"""A layer's transfer in chunks (async_max_bytes_per_step): the same buffer and weights, cut alike on every rank."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer import InProcessCommunicator
from eplb_fsm.transfer.chunks import chunk_layer, chunk_pieces, row_bytes
from eplb_fsm.transfer.buffers import TransferBuffer
from eplb_fsm.transfer.execute import commit_layer_from_buffer, transfer_layer_to_buffer
from eplb_fsm.transfer.schedule import prepare_maps
from test_transfer_execute import check_world, make_world, placements


def _prep(old_row, new_row, g, batching):
    _, _, sched = prepare_maps(old_row, new_row, g, None, 1, tuple(range(g)), batching)
    return sched.layer(0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(max_layers=1), st.booleans(), st.integers(1, 4))
def test_chunked_transfer_ends_bit_exact_with_chunks_between(case, batching, rows_per_chunk):
    """Chunks of a few rows: every slot ends with its new expert's bytes, between_chunks runs once per cut."""
    old, new, g = case
    weights, tables = make_world(old, g)
    layer_w = [weights[r][0] for r in range(g)]
    size = row_bytes(layer_w[0])
    calls = []
    comm = InProcessCommunicator(g)
    pending = transfer_layer_to_buffer(old[0], new[0], layer_w, TransferBuffer(), communicator=comm,
                                       migration_batching=batching, max_chunk_bytes=rows_per_chunk * size,
                                       between_chunks=lambda: calls.append(1))
    commit_layer_from_buffer(pending, layer_w)
    check_world(weights, tables, old, new, g)
    prep = _prep(old[0], new[0], g, batching)
    messages = sum(len(i) for w in prep.waves for i in w.transfers)
    assert len(calls) == max(0, -(-messages // rows_per_chunk) - 1)


def _random_prep(seed: int, ranks: int, slots: int, experts: int, batching: bool):
    """A prepared layer moving a random (ranks * slots,) phy2log row to a permutation of itself."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, experts, size=ranks * slots)
    return _prep(old, rng.permutation(old), ranks, batching)


def test_chunks_cover_every_message_once_within_the_byte_bound():
    """Each chunk holds at most max_bytes of rows; together they hold every message of every pair once, in order."""
    g = 4
    prep = _random_prep(seed=3, ranks=g, slots=6, experts=12, batching=True)
    size = 100
    for max_bytes in (100, 250, 1000, 10**9):
        pieces = chunk_pieces(prep, size, max_bytes)
        assert all(sum((hi - lo) * size for _, _, lo, hi in c) <= max(max_bytes, size) for c in pieces)
        seen = [(w, pair, k) for c in pieces for w, pair, lo, hi in c for k in range(lo, hi)]
        want = [(w, pair, k) for w, wave in enumerate(prep.waves) for pair, idx in zip(wave.pairs, wave.transfers)
                for k in range(len(idx))]
        assert seen == want
    assert len(chunk_layer(prep, size, 10**9)) == 1 and chunk_layer(prep, size, 0) == [prep]


def test_each_rank_runs_its_own_share_of_every_chunk():
    """Per chunk, the sends of a pair on its source equal the receives on its destination (what gloo pairs)."""
    g = 3
    prep = _random_prep(seed=5, ranks=g, slots=8, experts=10, batching=False)
    total = 0
    for part in chunk_layer(prep, 1, 3):
        for ops in part.ops:
            for src in range(g):
                for dst in range(g):
                    sends = [row for peer, row in ops.sends[src] if peer == dst]
                    recvs = [row for peer, row in ops.recvs[dst] if peer == src]
                    assert len(sends) == len(recvs)
                    total += len(sends)
        assert part.commit is prep.commit
    assert total == sum(len(i) for w in prep.waves for i in w.transfers)
    # local copies go with the first chunk only
    parts = chunk_layer(prep, 1, 3)
    assert parts[0].local_runs == prep.local_runs and all(p.local_runs == {} for p in parts[1:])


def test_a_row_larger_than_the_bound_goes_alone():
    """max_bytes below one row: one message per chunk, none lost."""
    old = np.array([0, 1, 2, 3])
    new = np.array([2, 3, 0, 1])
    prep = _prep(old, new, 2, False)
    pieces = chunk_pieces(prep, 64, 10)
    assert all(len(c) == 1 and c[0][3] - c[0][2] == 1 for c in pieces)
    assert len(pieces) == sum(len(i) for w in prep.waves for i in w.transfers)
    assert row_bytes([torch.zeros(4, 3, dtype=torch.float32), torch.zeros(4, dtype=torch.int8)]) == 13


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(max_layers=1), st.booleans(), st.integers(1, 5))
def test_message_and_chunk_counts_match_the_prepared_layer(case, batching, rows_per_chunk):
    """message_count and chunk_count, from the maps alone, equal the planner's messages and chunk_layer's chunks."""
    from eplb_fsm.transfer.chunks import chunk_count, message_count

    old, new, g = case
    prep = _prep(old[0], new[0], g, batching)
    messages = sum(len(i) for w in prep.waves for i in w.transfers)
    assert message_count(old[0], new[0], g) == messages
    size = 64
    assert chunk_count(messages, size, rows_per_chunk * size) == len(chunk_layer(prep, size, rows_per_chunk * size))
    assert chunk_count(messages, size, rows_per_chunk * size - 1) == \
        len(chunk_layer(prep, size, rows_per_chunk * size - 1))
    assert chunk_count(messages, size, 0) == 1


def test_chunk_count_of_rows_larger_than_the_cap_is_one_a_row():
    """A row over the byte cap goes alone, so a layer of n messages takes n chunks; none moved is one chunk."""
    from eplb_fsm.transfer.chunks import chunk_count

    assert chunk_count(7, 1000, 10) == 7
    assert chunk_count(7, 100, 250) == 4
    assert chunk_count(0, 100, 250) == 1


def test_message_count_does_not_import_numpy_ma():
    """Counting a layer's messages (engine thread) never pulls in numpy.ma, whose first import costs a step ~20 ms."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from eplb_fsm.transfer.chunks import message_count\n"
            "n = message_count(np.array([0, 1, 2, -1]), np.array([2, 1, 0, 0]), 2)\n"
            "print(n, 'numpy.ma' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["2", "False"]
