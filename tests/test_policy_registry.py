"""Tests for eplb_fsm.policy.registry and the AbstractEplbPolicy interface."""

from __future__ import annotations

import pytest
import torch

from eplb_fsm.policy import registry
from eplb_fsm.policy.base import AbstractEplbPolicy
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.registry import available_policies, get_policy, register_policy


class _RoundRobin(AbstractEplbPolicy):
    """Test policy: slot p holds expert p mod N."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log=None):
        layers, experts = weight.shape
        phy2log = (torch.arange(num_replicas) % experts).repeat(layers, 1)
        count = torch.bincount(phy2log[0], minlength=experts).repeat(layers, 1)
        log2phy = torch.full((layers, experts, num_replicas - experts + 1), -1, dtype=torch.int64)
        return phy2log, log2phy, count


@pytest.fixture
def clean_registry():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_default_is_registered():
    """'default' is available and resolves to DefaultEplbPolicy."""
    assert "default" in available_policies()
    assert get_policy("default") is DefaultEplbPolicy


def test_default_callable_on_the_class():
    """The policy is used through the class, without an instance."""
    phy2log, log2phy, count = get_policy("default").rebalance_experts(torch.ones(2, 4), 8, 1, 1, 2)
    assert phy2log.shape == (2, 8) and log2phy.shape == (2, 4, 5) and count.shape == (2, 4)


def test_unknown_name_lists_known_policies():
    """An unknown name raises ValueError that lists the registered names."""
    with pytest.raises(ValueError, match=r"unknown policy 'nope'.*default"):
        get_policy("nope")


def test_register_and_get(clean_registry):
    """A registered subclass is returned by name and listed, sorted."""
    register_policy("round_robin", _RoundRobin)
    assert get_policy("round_robin") is _RoundRobin
    assert available_policies() == sorted(available_policies())
    assert "round_robin" in available_policies()


def test_register_lazy_path(clean_registry):
    """A 'module:Class' path is imported on first lookup."""
    register_policy("lazy", "eplb_fsm.policy.default:DefaultEplbPolicy")
    assert get_policy("lazy") is DefaultEplbPolicy


def test_lazy_path_then_self_registration(clean_registry):
    """A module registering its class over its own lazy path is not a conflict."""
    register_policy("lazy_rr", f"{__name__}:_RoundRobin")
    register_policy("lazy_rr", _RoundRobin)
    assert get_policy("lazy_rr") is _RoundRobin


def test_lazy_path_that_cannot_be_imported(clean_registry):
    """A lazy path to a missing module fails at lookup with ValueError naming the policy."""
    register_policy("ghost", "eplb_fsm.no_such_module:Ghost")
    with pytest.raises(ValueError, match="policy 'ghost' could not be loaded"):
        get_policy("ghost")


def test_lazy_path_to_non_policy_fails(clean_registry):
    """A lazy path to something that is not a policy fails at lookup with ValueError."""
    register_policy("bogus", "eplb_fsm.policy.default:balanced_packing")
    with pytest.raises(ValueError, match="subclass of AbstractEplbPolicy"):
        get_policy("bogus")


@pytest.mark.parametrize(
    "name, cls, match",
    [
        ("", _RoundRobin, "non-empty"),
        ("x", object, "subclass of AbstractEplbPolicy"),
        ("x", "no_colon_here", "package.module:ClassName"),
        ("default", _RoundRobin, "already registered"),
    ],
)
def test_register_rejects_bad_input(clean_registry, name, cls, match):
    """Empty names, non-policies, malformed paths and taken names raise ValueError."""
    with pytest.raises(ValueError, match=match):
        register_policy(name, cls)


def test_replace_and_idempotent(clean_registry):
    """Re-registering the same class is a no-op; replace=True overrides another."""
    register_policy("rr", _RoundRobin)
    register_policy("rr", _RoundRobin)
    register_policy("rr", DefaultEplbPolicy, replace=True)
    assert get_policy("rr") is DefaultEplbPolicy


def test_abstract_policy_cannot_be_instantiated():
    """AbstractEplbPolicy is abstract; a subclass must implement rebalance_experts."""
    with pytest.raises(TypeError):
        AbstractEplbPolicy()

    class Incomplete(AbstractEplbPolicy):
        pass

    with pytest.raises(TypeError):
        Incomplete()


def test_same_lazy_path_again_after_a_lookup_is_a_no_op(clean_registry):
    """Registering a "module:Class" path again after get_policy resolved it to that class is no conflict."""
    path = "eplb_fsm.policy.default:DefaultEplbPolicy"
    register_policy("lazy_again", path)
    assert get_policy("lazy_again") is DefaultEplbPolicy
    register_policy("lazy_again", path)
    assert get_policy("lazy_again") is DefaultEplbPolicy
    with pytest.raises(ValueError, match="already registered"):
        register_policy("lazy_again", f"{__name__}:_RoundRobin")


class _Incomplete(AbstractEplbPolicy):
    """Test class: forgets to implement rebalance_experts."""


class _BaseMethod(AbstractEplbPolicy):
    """Test class: takes the base's (abstract) rebalance_experts with the abstract flag cleared."""


_BaseMethod.__abstractmethods__ = frozenset()


@pytest.mark.parametrize("path", [
    ".default:DefaultEplbPolicy",  # relative: importlib wants a package
    ":DefaultEplbPolicy",  # no module
    "eplb_fsm..policy:X",  # an empty module part
    "eplb_fsm.policy.default:",  # no class
    "eplb_fsm.policy.default:Default.Policy",  # not one identifier
    "eplb_fsm.policy.default:a:b",
    "eplb fsm:X",
])
def test_a_malformed_path_is_refused_at_registration(clean_registry, path):
    """A path that is not 'absolute.module:Identifier' raises ValueError naming the policy when registered."""
    with pytest.raises(ValueError, match=r"policy path for 'p' must look like 'package.module:ClassName'"):
        register_policy("p", path)
    assert "p" not in available_policies()


@pytest.mark.parametrize("cls", [AbstractEplbPolicy, _Incomplete, _BaseMethod])
def test_an_abstract_class_is_refused(clean_registry, cls):
    """AbstractEplbPolicy, or a subclass without its own rebalance_experts, is no policy: ValueError at registration."""
    with pytest.raises(ValueError, match="policy 'half' must implement rebalance_experts"):
        register_policy("half", cls)
    assert "half" not in available_policies()


def test_a_lazy_path_to_an_abstract_class_fails_at_lookup(clean_registry):
    """A path resolving to an abstract class raises ValueError naming the policy at lookup, not None from a call."""
    register_policy("lazy_half", f"{__name__}:_Incomplete")
    with pytest.raises(ValueError, match="policy 'lazy_half' must implement rebalance_experts"):
        get_policy("lazy_half")


def test_any_error_while_importing_a_lazy_path_is_a_value_error(clean_registry, tmp_path, monkeypatch):
    """A module that raises any exception on import makes the lookup raise ValueError naming the policy and path."""
    (tmp_path / "eplb_test_broken_policy.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_policy("broken", "eplb_test_broken_policy:Policy")
    with pytest.raises(ValueError, match=r"policy 'broken' could not be loaded from .*RuntimeError: broken on purpose"):
        get_policy("broken")
