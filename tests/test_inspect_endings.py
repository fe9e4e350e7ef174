"""endings.waiting_text: where a rank waited, in words, from its last alive record."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eplb_fsm.inspect.endings import waiting_text


def _rank(engine: tuple | None, mine: tuple | None = None) -> SimpleNamespace:
    """A rank with one alive record at step 7 naming no controller collective, ``engine`` as its engine wait and
    ``mine`` as its main thread's own (``main_wait``)."""
    return SimpleNamespace(alive=[(100.0, 7, "collecting", None, engine, mine)], collectives={}, end=None,
                           last_step=7)


@pytest.mark.parametrize("engine, text", [
    (("all_reduce", True, "WORLD:[4]", True), "in no controller collective, inside the engine's all_reduce"),
    (("all_reduce", True, "WORLD:[4]", None), "in no controller collective, inside the engine's all_reduce"),
    (("all_gather", True, "WORLD:[4]", False),
     "in no controller collective, its main thread in its own work (a side thread in all_gather)"),
    (None, "in no controller collective (so in the engine's step or its own work)"),
], ids=["main thread", "older trace", "side thread", "none"])
def test_an_engine_wait_is_named_when_no_controller_collective_is(engine, text):
    """The engine's collective the record names is said, and whose thread waits in it; without one, the old text."""
    assert waiting_text(_rank(engine)) == text


def test_the_main_threads_own_wait_answers_before_a_side_threads():
    """A side thread in the all-reduce of every rank, the main thread in its pair's (``main_wait``): the main
    thread's is named (a red team's metrics thread once made such a rank read as in its own work)."""
    mine = ("all_reduce", "2:[4]", False, True, None)
    assert waiting_text(_rank(("all_reduce", True, "WORLD:[4]", False), mine)) == \
        "in no controller collective, inside the engine's all_reduce (2:[4])"


def test_a_send_or_recv_names_its_peer():
    """The main thread in the engine's recv from rank 1 (``main_wait`` with its peer): the peer is named."""
    assert waiting_text(_rank(None, ("recv", "WORLD:[4]", True, False, 1))) == \
        "in no controller collective, inside the engine's recv from rank 1 (WORLD:[4])"
