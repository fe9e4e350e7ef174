"""The movement-aware search's candidate scoring in C, where the optional extension is built.

``eplb_fsm/policy/movement/csearch.c`` (built by setup.py like the default policy's
kernel, ``optional``) scores the candidates of :mod:`~eplb_fsm.policy.movement.moves`
one layer at a time: :func:`repoints`, :func:`pair_swaps` and :func:`widened_choice`
return what the numpy functions of the same names return (the widened swap's choice
only: the caller applies it). The numpy functions define the results; the C loops follow
their arithmetic and tie-breaks, so both paths choose the same changes (the tests run
both). :func:`renumbered_default` is ``targets.renumbered_default``, the fallback's
renumbering, in one call. :func:`enabled` says whether the C path is taken: the
extension is built and ``EPLB_FSM_NATIVE`` is not ``0`` (read at each call);
:func:`usable` adds, for a search state, that its replica counts per rank are int8
(fewer than 128 slots per rank).

``st`` is a :class:`~eplb_fsm.policy.movement.search.SearchState` (not imported: that
module imports this one through :mod:`~eplb_fsm.policy.movement.moves`).
"""

from __future__ import annotations

import os

import numpy as np

try:
    from eplb_fsm.policy.movement.csearch import (
        pair_swaps as _pair_swaps,
        repoints as _repoints,
        renumber_default as _renumber_default,
        widened_choice as _widened_choice,
    )
except ImportError:  # not built (no compiler at install): the numpy path is used
    _pair_swaps = _repoints = _renumber_default = _widened_choice = None

__all__ = ["built", "enabled", "pair_swaps", "renumbered_default", "repoints", "usable", "widened_choice"]


def built() -> bool:
    """Whether the C extension was built and imports."""
    return _repoints is not None


def enabled() -> bool:
    """Whether the C path is taken now: built, and ``EPLB_FSM_NATIVE`` is not ``0``."""
    return _repoints is not None and os.environ.get("EPLB_FSM_NATIVE", "1") != "0"


def usable(st) -> bool:
    """Whether ``st``'s candidates are scored in C now (:func:`enabled`, and int8 counts per rank)."""
    return enabled() and st.on_rank.dtype == np.int8


def _dims(st) -> tuple[int, int, int, int, int]:
    return st.L, st.N, st.P, st.G, st.nodes


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _f64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64)


def repoints(st, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """``moves.repoints`` in C: ``(eff, rank, new, donor, cost, after (n, G))``."""
    n = len(lr)
    eff, after = np.empty(n), np.empty((n, st.G))
    rank, new, donor, cost = (np.empty(n, np.int64) for _ in range(4))
    _repoints(st.w_f, st.count_f, st.cur_f, st.on_rank, st.held8, st.node_of_expert, _i64(st.moves),
                _i64(st.limit), _i64(lr), _f64(RL), _f64(T), eff, rank, new, donor, cost, after, *_dims(st))
    return eff, rank, new, donor, cost, after


def pair_swaps(st, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """``moves.pair_swaps`` in C: ``(pair_layer, eff, slot_a, slot_b, rank_o, rank_u, cost, delta)`` or None."""
    n, Gn = len(lr), st.Gn
    if Gn < 2 or n == 0:
        return None
    cap = n * st.nodes * (Gn // 2)
    pr, slot_a, slot_b, o, u, cost = (np.empty(cap, np.int64) for _ in range(6))
    eff, delta = np.empty(cap), np.empty(cap)
    m = _pair_swaps(st.cur_f, st.sl_f, st.held8, st.moved8, _i64(st.moves), _i64(st.limit), _i64(lr), _f64(RL),
                      _f64(T), pr, eff, slot_a, slot_b, o, u, cost, delta, *_dims(st))
    if m == 0:
        return None
    return pr[:m], eff[:m], slot_a[:m], slot_b[:m], o[:m], u[:m], cost[:m], delta[:m]


def widened_choice(st, lr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The swap ``moves.widened_swap`` would apply to each layer: ``found (n,) bool, slot_a, slot_b (n,)``."""
    n = len(lr)
    found = np.zeros(n, dtype=np.int8)
    slot_a, slot_b = np.empty(n, np.int64), np.empty(n, np.int64)
    _widened_choice(st.cur_f, st.sl_f, _f64(st.rank_load), _f64(st.goal), st.held8, st.moved8, _i64(st.moves),
                      _i64(st.limit), _i64(lr), found, slot_a, slot_b, *_dims(st))
    return found.view(bool), slot_a, slot_b


def renumbered_default(old: np.ndarray, held: np.ndarray, new: np.ndarray, num_ranks: int, num_nodes: int):
    """``targets.renumbered_default`` in C: ``(placement (L, P), moved (L,))`` int64.

    ``held`` (L, N, G) bool must be the membership of ``old`` (as the policy passes it).
    """
    old, new = _i64(old), _i64(new)
    held = np.ascontiguousarray(held, dtype=bool)
    num_layers, num_slots = new.shape
    out = np.empty_like(new)
    moved = np.empty(num_layers, np.int64)
    _renumber_default(old, held, new, out, moved, num_layers, held.shape[1], num_slots, num_ranks, num_nodes)
    return out, moved
