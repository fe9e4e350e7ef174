"""The ``wrong-collective`` fault of ``eplb-fsm simulate --inject``: an all-reduce that becomes a broadcast.

:class:`WrongCollective` wraps a controller's ``Collectives`` once the injector arms the
fault (:mod:`eplb_fsm.sim.inject`); the next all-reduce after that, blocking or posted,
is sent as a broadcast from the injecting rank, traced as such, so replay sees a
collective whose op differs across ranks.
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = ["WrongCollective", "Done"]


class WrongCollective:
    """The controller's ``Collectives``, except that the next all-reduce after the injection is
    armed becomes a broadcast from this rank (every other attribute is the wrapped object's)."""

    def __init__(self, inner: Any, injector: Any) -> None:
        self.inner = inner
        self.injector = injector

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_reduce(self, parts: dict, timeout_s: float, **fields: Any) -> dict:
        inj = self.injector.take_wrong()
        if inj is None:
            return self.inner.all_reduce(parts, timeout_s, **fields)
        self.injector.note(inj, f"broadcast instead of the all-reduce of {list(parts)}")
        return self.broadcast(parts, timeout_s)

    def post(self, parts: dict, timeout_s: float, *, blocking: bool = False, **fields: Any) -> Any:
        """A posted all-reduce, or once armed the broadcast (done now, handed over by ``wait()``)."""
        inj = self.injector.take_wrong()
        if inj is None:
            return self.inner.post(parts, timeout_s, blocking=blocking, **fields)
        self.injector.note(inj, f"broadcast instead of the posted all-reduce of {list(parts)}")
        return Done(self.broadcast, parts, timeout_s)

    def broadcast(self, parts: dict, timeout_s: float) -> dict:
        """A broadcast from this rank of the tensor the all-reduce would have summed, traced as such."""
        import torch
        import torch.distributed as dist

        from eplb_fsm.fsm.collectives import GroupBroken

        inner = self.inner
        names = list(parts)
        flat = [parts[n].reshape(-1).to(dtype=torch.float64, device="cpu") for n in names]
        sizes = [t.numel() for t in flat]
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        group = inner.group
        try:
            with inner.trace.collective("broadcast", group=inner.name, shape=tuple(buf.shape),
                                        dtype=buf.dtype, parts=names, sizes=sizes, src=inner.rank):
                src = inner.rank
                if group is not None and group is not dist.group.WORLD:
                    src = dist.get_global_rank(group, inner.rank)
                work = dist.broadcast(buf, src=src, group=group, async_op=True)
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            raise GroupBroken(f"broadcast of {names} failed: {type(exc).__name__}: {exc}") from exc
        return {n: piece.reshape(parts[n].shape) for n, piece in zip(names, torch.split(buf, sizes))}


class Done:
    """What :meth:`WrongCollective.post` returns: ``wait()`` gives the collective's result (or its error)."""

    def __init__(self, run: Any, *args: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        try:
            self.result = run(*args)
        except Exception as exc:
            self.error = exc

    def wait(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result
