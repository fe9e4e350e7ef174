"""Policies by name.

``get_policy("default")`` returns the policy class; ``register_policy(name, cls)`` adds one.
A policy may be registered lazily as ``"package.module:ClassName"``: the module is
imported the first time the name is looked up, so registering it costs no import. The
built-in entries ("default", "movement_aware") are such paths, but they save no import:
this module lives in :mod:`eplb_fsm.policy`, whose ``__init__`` imports both policy
modules (and they register their classes over their paths), so any import of the
registry has already imported them. The laziness helps policies registered by path
from modules outside that package.
"""

from __future__ import annotations

import importlib
import inspect

from eplb_fsm.policy.base import AbstractEplbPolicy

__all__ = ["available_policies", "get_policy", "register_policy"]

# name -> policy class, or "module:Class" still to be imported
_REGISTRY: dict[str, type[AbstractEplbPolicy] | str] = {
    "default": "eplb_fsm.policy.default:DefaultEplbPolicy",
    "movement_aware": "eplb_fsm.policy.movement.policy:MovementAwarePolicy",
}


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _check_class(name: str, cls: object) -> type[AbstractEplbPolicy]:
    if not (isinstance(cls, type) and issubclass(cls, AbstractEplbPolicy)):
        raise ValueError(f"policy {name!r} must be a subclass of AbstractEplbPolicy, got {cls!r}")
    # the base's rebalance_experts is abstract and returns None: such a class is no policy
    owner = next(klass for klass in cls.__mro__ if "rebalance_experts" in vars(klass))
    if inspect.isabstract(cls) or owner is AbstractEplbPolicy:
        raise ValueError(f"policy {name!r} must implement rebalance_experts (an abstract class is not a policy), "
                         f"got {cls!r}")
    return cls


def _check_path(name: str, path: str) -> None:
    """``path`` must be ``"package.module:ClassName"``: a dotted absolute module and one identifier."""
    module_name, colon, attr = path.partition(":")
    parts = module_name.split(".")
    if not (colon and attr.isidentifier() and all(part.isidentifier() for part in parts)):
        raise ValueError(
            f"policy path for {name!r} must look like 'package.module:ClassName' (an absolute dotted module, "
            f"a colon, a class name), got {path!r}"
        )


def register_policy(name: str, cls: type[AbstractEplbPolicy] | str, *, replace: bool = False) -> None:
    """Register ``cls`` (a policy class or a ``"module:Class"`` path) under ``name``.

    Raises ``ValueError`` for an empty name, a path not of that form (an absolute dotted
    module, a colon, one identifier), a class that is not an ``AbstractEplbPolicy`` or is
    abstract (no ``rebalance_experts`` of its own), or a name already taken by another
    policy (pass ``replace=True`` to override).
    Registering the same class again under its name, or its ``"module:Class"`` path (before or
    after a lookup imported it), is a no-op.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if isinstance(cls, str):
        _check_path(name, cls)
    else:
        _check_class(name, cls)
    current = _REGISTRY.get(name)
    # Registering a class over its own lazy path (a module registering itself on import) is fine, and so is
    # registering the path again after a lookup has resolved it to that class (which the entry then keeps).
    resolved = isinstance(current, type) and isinstance(cls, str) and _path_of(current) == cls
    same = current == cls or resolved or (
        isinstance(current, str) and isinstance(cls, type) and current == _path_of(cls))
    if current is not None and not same and not replace:
        raise ValueError(f"policy {name!r} is already registered ({current!r}); pass replace=True to override")
    if not resolved:
        _REGISTRY[name] = cls


def get_policy(name: str) -> type[AbstractEplbPolicy]:
    """Return the policy class registered as ``name``; ``ValueError`` listing the known names otherwise.

    A path entry is imported here: any failure (the import raising, no such class, an
    abstract class) is a ``ValueError`` naming the policy and its path.
    """
    try:
        entry = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {name!r}; available policies: {', '.join(available_policies())}"
        ) from None
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # noqa: BLE001 - whatever the import raises, the policy is what failed
            raise ValueError(
                f"policy {name!r} could not be loaded from {entry!r}: {type(exc).__name__}: {exc}"
            ) from None
        entry = _check_class(name, cls)
        _REGISTRY[name] = entry
    return entry


def available_policies() -> list[str]:
    """Sorted names of the registered policies."""
    return sorted(_REGISTRY)
