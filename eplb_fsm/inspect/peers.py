"""Who a participant's peers are: the ranks whose ends tell when it stopped (``liveness``)."""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key

__all__ = ["group_peers", "lone_joiner"]


def group_peers(cast: Cast, key: Key, before: bool = False) -> list[Key]:
    """The other participants of ``key``'s current group that did not end on purpose (leave in a scale); for one a
    scale moved into a later group it never switched to (killed at the switch), that group's; with ``before``,
    for a joiner alone in its generation (the group never formed), the ranks of the one before: they waited for
    it, and their ends tell when it died."""

    def of(generation: object) -> list[Key]:
        return [o for o, s in cast.parts.items()
                if o != key and not s.ended_on_purpose and cast.final_gen.get(o) == generation]

    gen = cast.final_gen.get(key)
    peers = of(gen)
    later = [] if peers or type(gen) is not int else [g for g, m in cast.gen_members.items()
                                                       if g > gen and key in m.values()]
    if later:
        return of(min(later))
    if peers or not before or type(gen) is not int or gen < 1:
        return peers
    return of(gen - 1)


def lone_joiner(cast: Cast, key: Key) -> bool:
    """A joiner alone in its generation (its group never formed) that the ranks of the one before waited for:
    ranks signalled over an interval after it are the launcher's reaction, as after a lost connection."""
    return not group_peers(cast, key) and bool(group_peers(cast, key, before=True))
