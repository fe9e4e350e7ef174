"""The engine ``bench stall`` runs on each rank: a model with heavy expert rows and a fixed step.

Shapes: L MoE layers, N logical experts, R redundant slots, P = N + R physical slots,
G ranks, S = P / G slots per rank, H floats per expert tensor (two tensors per slot).

:class:`HeavyMoE` follows the controller's MoE protocol (eplb_fsm.fsm.model_protocol)
and does nothing else: its weights exist to be moved. Every row holds one value that
names (layer, expert, tensor), exact in float32, so after a rearrangement each slot can
be checked bit for bit against the expert the committed maps put there.

:class:`EngineStep` is one engine step's work: a fixed-size matmul (the compute that
gives a step its baseline time), the routed load of a skewed, fixed token distribution
recorded through the router's current maps, and one small all-reduce over the EP group
(the engine's own collective, which keeps the ranks in lockstep as a real one does).

Two engine models (``engine=``): ``matmul`` computes on the CPU, so on a small box every
CPU millisecond of the async worker comes out of the engine's; ``device`` models a GPU
engine whose compute leaves the host CPU idle: the step sleeps for the median time the
same matmul takes (:func:`device_step_s`, measured once and given to every run and rank,
so sync, async and plain runs step alike), which is what a serving step looks like to
the host while the kernels run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

__all__ = ["ENGINES", "HeavyMoE", "EngineStep", "device_step_s", "expert_value", "skewed_load"]

ENGINES = ("matmul", "device")


def expert_value(layer: int, expert: int, tensor: int) -> float:
    """The value every entry of ``expert``'s ``tensor`` holds in ``layer`` (an integer < 251: exact)."""
    return float((layer * 1009 + expert * 7 + tensor * 3) % 251)


def device_step_s(matmul: int, seed: int = 0, samples: int = 9) -> float:
    """The median seconds an (matmul, matmul) @ (matmul, matmul) float32 product takes here."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(matmul, matmul, generator=gen), torch.randn(matmul, matmul, generator=gen)
    took = []
    for _ in range(samples):
        t0 = time.perf_counter()
        a @ b
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def skewed_load(seed: int, num_layers: int, num_experts: int, tokens: int) -> np.ndarray:
    """(L, N) int64 tokens per logical expert and step: Zipf-like, a random expert order per layer."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / np.arange(1, num_experts + 1) ** 1.2
    rows = [np.floor(tokens * shape[rng.permutation(num_experts)] / shape.sum()) for _ in range(num_layers)]
    return np.stack(rows).astype(np.int64)


class HeavyMoE:
    """Rank ``rank``'s share of an MoE model whose expert rows are large (MoE protocol)."""

    def __init__(self, num_layers: int, num_experts: int, num_redundant: int, hidden: int,
                 rank: int, world_size: int) -> None:
        P = num_experts + num_redundant
        if P % world_size:
            raise ValueError(f"experts + redundant ({P}) must be divisible by the world size ({world_size})")
        self.num_moe_layers = num_layers
        self.num_logical_experts = num_experts
        self.num_redundant_experts = num_redundant
        self.num_physical_experts = P
        self.num_local_physical_experts = P // world_size
        self.num_expert_groups = 1
        self.rank = rank
        S = self.num_local_physical_experts
        # two per-expert tensors per layer (think up and down projections), (S, H) float32 each
        self.expert_weights = [[torch.empty(S, hidden, dtype=torch.float32) for _ in range(2)]
                               for _ in range(num_layers)]
        self.load_pass: torch.Tensor | None = None
        self.log2phy: torch.Tensor | None = None
        self.replica_count: torch.Tensor | None = None

    def set_eplb_state(self, load_pass: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor) -> None:
        self.load_pass, self.log2phy, self.replica_count = load_pass, log2phy, replica_count

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.expert_weights for w in layer)

    def _rows(self, phy2log: np.ndarray):
        S = self.num_local_physical_experts
        for k, layer in enumerate(self.expert_weights):
            for t, w in enumerate(layer):
                for i in range(S):
                    yield w[i], expert_value(k, int(phy2log[k, self.rank * S + i]), t)

    def load_weights(self, phy2log: np.ndarray) -> None:
        """Fill this rank's rows with the experts ``phy2log`` (L, P) places there."""
        for row, value in self._rows(phy2log):
            row.fill_(value)

    def weights_match(self, phy2log: np.ndarray) -> bool:
        """True when every row holds exactly the expert ``phy2log`` (L, P) places there."""
        return all(bool((row == value).all()) for row, value in self._rows(phy2log))


class EngineStep:
    """One engine step: matmul (n, n) @ (n, n) (``engine="matmul"``) or a CPU-idle wait of its
    median time (``engine="device"``), then route a fixed load and all-reduce ``combine`` floats.
    ``device_s``: the device engine's wait (default: :func:`device_step_s` measured now)."""

    def __init__(self, model: HeavyMoE, load: np.ndarray, matmul: int, combine: int = 4096, seed: int = 0,
                 engine: str = "matmul", device_s: float | None = None) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.randn(matmul, matmul, generator=gen)
        self.b = torch.randn(matmul, matmul, generator=gen)
        self.model = model
        self.load = torch.from_numpy(load)           # (L, N) tokens per logical expert
        self.combine = torch.zeros(min(combine, matmul * matmul))
        self.engine = engine
        self.device_s = 0.0
        self.out = None
        self.parts: dict[str, float] = {}   # the last step's parts, seconds
        if device_s is not None and not device_s >= 0:
            raise ValueError(f"device_s must be >= 0 seconds, got {device_s}")
        if engine == "device":
            self.out = self.a @ self.b
            # the kernel time the host waits out
            self.device_s = device_step_s(matmul, seed) if device_s is None else float(device_s)

    def _record_load(self) -> None:
        """Spread each expert's tokens evenly over its replicas (the router's maps, read now)."""
        model = self.model
        log2phy, counts = model.log2phy, model.replica_count.clamp(min=1)   # (L, N, K), (L, N)
        share, rest = self.load // counts, self.load % counts
        for j in range(log2phy.shape[2]):
            live = counts > j
            tokens = torch.where(live, share + (rest if j == 0 else 0), 0)
            slots = torch.where(live, log2phy[:, :, j], 0)
            model.load_pass.scatter_add_(1, slots, tokens)

    def __call__(self, group: Any = None) -> None:
        """One step; ``parts`` then holds its ``compute``, ``route`` and ``engine_all_reduce`` seconds."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        if self.engine == "device":
            time.sleep(self.device_s)   # the host waits on the device: its CPU is free meanwhile
            out = self.out
        else:
            out = self.a @ self.b
        t1 = time.perf_counter()
        self._record_load()
        t2 = time.perf_counter()
        self.combine.copy_(out.reshape(-1)[: self.combine.numel()])
        if dist.is_initialized():
            dist.all_reduce(self.combine, group=group)
        t3 = time.perf_counter()
        self.parts = {"compute": t1 - t0, "route": t2 - t1, "engine_all_reduce": t3 - t2}
