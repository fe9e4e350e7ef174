"""The movement-aware search in C, where the optional extension is built.

``eplb_fsm/policy/movement/csearch*.c`` (built by setup.py like the default policy's
kernel, ``optional``) holds the whole local search, :func:`run`
(``SearchState.run``, updating the state in place), its candidate scores one call per
kind (:func:`repoints`, :func:`pair_swaps`, :func:`widened_choice`: what the numpy
functions of :mod:`~eplb_fsm.policy.movement.moves` return; the widened swap's choice
only) and the fallback's renumbering, :func:`renumbered_default`. The numpy code defines
the results; the C loops follow its arithmetic, tie-breaks and order of updates, so both
paths reach the same placements (the tests compare them call by call and plan by plan).

:func:`enabled` says whether the C path is taken: the extension is built and
``EPLB_FSM_NATIVE`` is not ``0`` (read at each call, so a test or a benchmark can run
both in one process); :func:`usable` adds, for a search state, that its replica counts
per rank are int8 (fewer than 128 slots per rank) and its arrays have the types C reads.

``st`` is a :class:`~eplb_fsm.policy.movement.search.SearchState` (not imported: that
module imports this one). The scoring calls read the live layers' rank loads and goals
from ``st`` (``RL``, ``T`` are accepted for the numpy signature and must be
``st.rank_load[lr]``, ``st.goal[lr]``, as the search passes them).
"""

from __future__ import annotations

import os

import numpy as np

try:
    from eplb_fsm.policy.movement.csearch import (
        lagrange_levels as _lagrange_levels,
        pair_swaps as _pair_swaps,
        rank_counts as _rank_counts,
        rebalance_counts as _rebalance_counts,
        renumber_default as _renumber_default,
        repoints as _repoints,
        run as _run,
        widened_choice as _widened_choice,
    )
except ImportError:  # not built (no compiler at install): the numpy path is used
    _lagrange_levels = _pair_swaps = _rank_counts = _rebalance_counts = None
    _renumber_default = _repoints = _run = _widened_choice = None

__all__ = [
    "built", "enabled", "lagrange_levels", "pair_swaps", "rank_counts", "rebalance_counts", "renumbered_default",
    "repoints", "run", "usable", "widened_choice",
]

# (attribute, dtype) of the state tuple csearch.c reads, in its order
_STATE = (("w", np.float64), ("count", np.int64), ("cur", np.int64), ("slot_load", np.float64),
          ("rank_load", np.float64), ("on_rank", np.int8), ("held8", np.int8), ("moved8", np.int8),
          ("node_of_expert", np.int64), ("moves", np.int64), ("limit", np.int64), ("goal", np.float64))


def built() -> bool:
    """Whether the C extension was built and imports."""
    return _run is not None


def enabled() -> bool:
    """Whether the C path is taken now: built, and ``EPLB_FSM_NATIVE`` is not ``0``."""
    return _run is not None and os.environ.get("EPLB_FSM_NATIVE", "1") != "0"


def usable(st) -> bool:
    """Whether ``st`` is searched in C now (:func:`enabled`, int8 counts per rank, the array types C reads)."""
    if not enabled():
        return False
    return all(getattr(st, name).dtype == dtype and getattr(st, name).flags.c_contiguous for name, dtype in _STATE)


def _state(st) -> tuple:
    return tuple(getattr(st, name) for name, _ in _STATE), (st.L, st.N, st.P, st.G, st.nodes)


def _rows(lr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(lr, dtype=np.int64)


def run(st, budget: float, fixed_max: float, max_rounds: int) -> None:
    """``SearchState.run`` in C: the state's arrays change in place, ``st.rounds`` advances."""
    state, dims = _state(st)
    st.rounds = _run(state, dims, float(budget), float(fixed_max), int(max_rounds), int(st.rounds))


def rank_counts(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """``placement.rank_counts`` in C for fewer than 128 slots per rank: ``(L, P) -> (L, N, G)`` int8."""
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    num_layers, num_slots = phy2log.shape
    out = np.empty((num_layers, num_experts, num_ranks), dtype=np.int8)
    _rank_counts(phy2log, out, num_layers, num_experts, num_slots, num_ranks)
    return out


def rebalance_counts(st, cap: np.ndarray) -> None:
    """``search.rebalance_counts`` in C: the state's arrays change in place. ``cap`` (A,) float64."""
    _rebalance_counts(*_state(st), np.ascontiguousarray(cap, dtype=np.float64))


def repoints(st, lr: np.ndarray, RL: np.ndarray = None, T: np.ndarray = None):
    """``moves.repoints`` in C: ``(eff, rank, new, donor, cost, after (n, G))``."""
    n = len(lr)
    eff, after = np.empty(n), np.empty((n, st.G))
    rank, new, donor, cost = (np.empty(n, np.int64) for _ in range(4))
    _repoints(*_state(st), _rows(lr), eff, rank, new, donor, cost, after)
    return eff, rank, new, donor, cost, after


def pair_swaps(st, lr: np.ndarray, RL: np.ndarray = None, T: np.ndarray = None):
    """``moves.pair_swaps`` in C: ``(pair_layer, eff, slot_a, slot_b, rank_o, rank_u, cost, delta)`` or None."""
    n, Gn = len(lr), st.Gn
    if Gn < 2 or n == 0:
        return None
    cap = n * st.nodes * (Gn // 2)
    pr, slot_a, slot_b, o, u, cost = (np.empty(cap, np.int64) for _ in range(6))
    eff, delta = np.empty(cap), np.empty(cap)
    m = _pair_swaps(*_state(st), _rows(lr), pr, eff, slot_a, slot_b, o, u, cost, delta)
    if m == 0:
        return None
    return pr[:m], eff[:m], slot_a[:m], slot_b[:m], o[:m], u[:m], cost[:m], delta[:m]


def widened_choice(st, lr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The swap ``moves.widened_swap`` would apply to each layer: ``found (n,) bool, slot_a, slot_b (n,)``."""
    n = len(lr)
    found = np.zeros(n, dtype=np.int8)
    slot_a, slot_b = np.empty(n, np.int64), np.empty(n, np.int64)
    _widened_choice(*_state(st), _rows(lr), found, slot_a, slot_b)
    return found.view(bool), slot_a, slot_b


def lagrange_levels(rank_loads: np.ndarray, floor: np.ndarray, budget: float) -> np.ndarray:
    """``targets.lagrange_levels`` in C: ``(L, G), (L,) -> (L,)`` float64 goals."""
    rank_loads = np.ascontiguousarray(rank_loads, dtype=np.float64)
    num_layers, num_ranks = rank_loads.shape
    goal = np.empty(num_layers)
    _lagrange_levels(rank_loads, np.ascontiguousarray(floor, dtype=np.float64), float(budget), goal, num_layers,
                     num_ranks)
    return goal


def renumbered_default(old: np.ndarray, held: np.ndarray, new: np.ndarray, num_ranks: int, num_nodes: int):
    """``targets.renumbered_default`` in C: ``(placement (L, P), moved (L,))`` int64.

    ``held`` (L, N, G) bool must be the membership of ``old`` (as the policy passes it).
    """
    old = np.ascontiguousarray(old, dtype=np.int64)
    new = np.ascontiguousarray(new, dtype=np.int64)
    held = np.ascontiguousarray(held, dtype=bool)
    num_layers, num_slots = new.shape
    out = np.empty_like(new)
    moved = np.empty(num_layers, np.int64)
    _renumber_default(old, held, new, out, moved, num_layers, held.shape[1], num_slots, num_ranks, num_nodes)
    return out, moved
