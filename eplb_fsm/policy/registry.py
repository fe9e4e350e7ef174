"""Policies by name.

``get_policy("default")`` returns the policy class; ``register_policy(name, cls)`` adds one.
A policy may be registered lazily as ``"package.module:ClassName"``: the module is
imported the first time the name is looked up, so registering costs no import. The
built-in policies are registered that way ("default", "movement_aware"); a module may
also register its class over its own lazy path when it is imported.
"""

from __future__ import annotations

import importlib

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
    return cls


def register_policy(name: str, cls: type[AbstractEplbPolicy] | str, *, replace: bool = False) -> None:
    """Register ``cls`` (a policy class or a ``"module:Class"`` path) under ``name``.

    Raises ``ValueError`` for an empty name, a class that is not an ``AbstractEplbPolicy``,
    or a name already taken by another policy (pass ``replace=True`` to override).
    Registering the same class again under its name, or its ``"module:Class"`` path (before or
    after a lookup imported it), is a no-op.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if isinstance(cls, str):
        if ":" not in cls:
            raise ValueError(f"policy path for {name!r} must look like 'package.module:ClassName', got {cls!r}")
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
    """Return the policy class registered as ``name``; ``ValueError`` listing the known names otherwise."""
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
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"policy {name!r} could not be loaded from {entry!r}: {exc}") from None
        entry = _check_class(name, cls)
        _REGISTRY[name] = entry
    return entry


def available_policies() -> list[str]:
    """Sorted names of the registered policies."""
    return sorted(_REGISTRY)
