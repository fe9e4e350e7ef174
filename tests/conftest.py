"""Shared test settings: hypothesis profile sized for a 2-core CI machine; a 1-rank gloo group."""

import os

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from eplb_fsm.sim.launcher import find_free_port

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group in this process, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
