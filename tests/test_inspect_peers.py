"""peers: whose ends tell when a participant stopped, across the generations of an elastic job."""

from __future__ import annotations

from types import SimpleNamespace

from eplb_fsm.inspect.elastic import Cast
from eplb_fsm.inspect.peers import group_peers, lone_joiner


def cast(final_gen: dict, members: dict, on_purpose: tuple = ()) -> Cast:
    """A cast of participants (rank, 0) ending in ``final_gen``, generation ``members``, ``on_purpose`` left."""
    parts = {k: SimpleNamespace(ended_on_purpose=k in on_purpose) for k in final_gen}
    c = Cast(parts, world=len(parts), world_ranks=[k[0] for k in parts])
    c.final_gen.update(final_gen)
    c.gen_members.update(members)
    return c


def test_the_peers_are_the_others_of_its_group_that_did_not_leave():
    """Ranks 0 and 1 serve generation 1, rank 2 left in the scale: rank 0's peer is rank 1 alone."""
    c = cast({(0, 0): 1, (1, 0): 1, (2, 0): None}, {0: {0: (0, 0), 1: (1, 0), 2: (2, 0)}}, on_purpose=((2, 0),))
    assert group_peers(c, (0, 0)) == [(1, 0)]


def test_a_rank_killed_before_its_switch_has_the_group_it_was_moved_to():
    """Rank 0 never switched (still generation 0) but the scale placed it in generation 1 with rank 1: rank 1 is its
    peer (was: none, so its death went unread, a red team's staying rank SIGKILLed at the switch)."""
    members = {0: {0: (0, 0), 1: (1, 0), 2: (2, 0)}, 1: {0: (0, 0), 1: (1, 0)}}
    c = cast({(0, 0): 0, (1, 0): 1, (2, 0): None}, members, on_purpose=((2, 0),))
    assert group_peers(c, (0, 0)) == [(1, 0)] and group_peers(c, (1, 0)) == []


def test_a_joiner_alone_in_its_generation_has_the_ranks_before_it():
    """A joiner whose group never formed: no peers, but with ``before`` the ranks it was to join; a lone joiner."""
    c = cast({(0, 0): 0, (1, 0): 0, (2, 1): 1}, {0: {0: (0, 0), 1: (1, 0)}, 1: {2: (2, 1)}})
    assert group_peers(c, (2, 1)) == [] and group_peers(c, (2, 1), before=True) == [(0, 0), (1, 0)]
    assert lone_joiner(c, (2, 1)) and not lone_joiner(c, (0, 0))
