"""A toy MoE model that follows the controller's MoE protocol, for simulations and tests.

Shape: L MoE layers, N logical experts, R redundant slots (P = N + R), hidden size d,
top-k routing, G ranks each holding S = P / G slots. Each layer is residual:
``x <- q(x + sum_j c_j * q(x @ W_e + b_e))`` over the token's top-k experts e_j, with
dyadic coefficients c_j = 2^-j.

Why outputs can be compared bit for bit across placements: every value lives on a
fixed-point grid (multiples of 1/16, bounded by ``CLAMP``), expert weights too, and the
hidden size is small, so every product and partial sum is exactly representable in
float64. Sums are then exact in any order: it does not matter which rank computed which
token's expert, nor in which order the all-reduce adds the partial outputs. The
reference forward (:meth:`ToyMoE.reference_forward`) uses the logical experts directly,
with no placement at all, and must match the distributed forward exactly.

Routing: a real gate (``x @ W_gate``) plus a per-layer bias ``strength * log(p)`` that
makes the routed load follow a target distribution ``p`` (L, N) given by the load source.
The replica of expert e for global token t is ``t mod replica_count[l, e]``
(``log2phy[l, e, t % count]``), computed identically on every rank. The batch is global
and identical on every rank; rank r records the load of tokens t with t % G == r (so the
ranks' load passes sum to the batch's load), and computes the tokens routed to its own
slots; one all-reduce per layer sums the partial outputs.

Expert weights are a deterministic function of (seed, layer, expert): ``expert_params``
gives the original weights of any logical expert, which is what every slot holding it
must contain bit for bit (``check_weights``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

GRID = 16.0     # values are multiples of 1 / GRID
CLAMP = 8.0     # and lie in [-CLAMP, CLAMP]
WEIGHT_RANGE = 3  # expert weight entries are integers in [-3, 3] / GRID

__all__ = ["ToyMoE", "expert_params", "quantize", "make_batch"]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Round to the 1/GRID grid and clamp to [-CLAMP, CLAMP] (exact in float64)."""
    return torch.clamp(torch.round(x * GRID) / GRID, -CLAMP, CLAMP)


def _seed(*parts: int) -> int:
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1_000_003 + int(part) + 0x7F4A7C15) % (2**61 - 1)
    return value


def _sum_over_ranks(tensor: torch.Tensor, group: Any, timeout_s: float = 60.0) -> None:
    """All-reduce (sum) over a torch process group, or a controller-style group object."""
    custom = getattr(group, "all_reduce", None)
    if callable(custom) and callable(getattr(group, "transfer_communicator", None)):
        custom(tensor, timeout_s)
    else:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=group)


def expert_params(seed: int, layer: int, expert: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The original (W (d, d), b (d,)) float64 of logical ``expert`` in ``layer``."""
    gen = torch.Generator().manual_seed(_seed(seed, 1, layer, expert))
    w = torch.randint(-WEIGHT_RANGE, WEIGHT_RANGE + 1, (hidden, hidden), generator=gen).double() / GRID
    b = torch.randint(-8, 9, (hidden,), generator=gen).double() / GRID
    return w, b


def make_batch(seed: int, step: int, tokens: int, hidden: int) -> torch.Tensor:
    """The global batch of engine step ``step`` (identical on every rank): (T, d) float64 on the grid."""
    gen = torch.Generator().manual_seed(_seed(seed, 2, step))
    return torch.randint(-32, 33, (tokens, hidden), generator=gen).double() / GRID


class ToyMoE:
    """A small MoE model on one rank of G, following the MoE protocol (model_protocol)."""

    def __init__(
        self,
        num_layers: int = 4,
        num_experts: int = 32,
        num_redundant: int = 8,
        hidden: int = 16,
        top_k: int = 2,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        gate_strength: float = 1.0,
        num_expert_groups: int = 1,
        phy2log: Any = None,
    ) -> None:
        P = num_experts + num_redundant
        if num_layers < 1 or num_experts < 1 or num_redundant < 0 or hidden < 1:
            raise ValueError("num_layers, num_experts, hidden must be >= 1 and num_redundant >= 0")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if world_size < 1 or P % world_size:
            raise ValueError(f"physical experts ({P}) must be divisible by world_size ({world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.num_moe_layers = num_layers
        self.num_logical_experts = num_experts
        self.num_redundant_experts = num_redundant
        self.num_physical_experts = P
        self.num_local_physical_experts = P // world_size
        self.num_expert_groups = num_expert_groups
        self.hidden = hidden
        self.top_k = top_k
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.gate_strength = float(gate_strength)
        S = self.num_local_physical_experts
        if phy2log is None:
            placement = np.tile(np.arange(P) % num_experts, (num_layers, 1))
        else:
            placement = np.asarray(phy2log, dtype=np.int64)
        gen = torch.Generator().manual_seed(_seed(seed, 3))
        # gate: logits spread like a Gumbel's (std ~1.2) for inputs on the batch's scale
        self.gate = [torch.randn(hidden, num_experts, generator=gen, dtype=torch.float64) / hidden ** 0.5
                     for _ in range(num_layers)]
        self.bias = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.coef = torch.tensor([2.0 ** -j for j in range(top_k)], dtype=torch.float64)
        self._expert_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.expert_weights: list[list[torch.Tensor]] = []
        for layer in range(num_layers):
            w = torch.empty(S, hidden, hidden, dtype=torch.float64)
            b = torch.empty(S, hidden, dtype=torch.float64)
            for row in range(S):
                w[row], b[row] = self.expert(layer, int(placement[layer, rank * S + row]))
            self.expert_weights.append([w, b])
        # set by the controller (set_eplb_state); a standalone model routes on its own maps
        self.load_pass: torch.Tensor | None = None
        # the forward's all-reduce (sum in place), called as fn(tensor, group, layer); None: a plain
        # all-reduce on ``group``. A harness may trace or bound it (eplb_fsm.sim.inject does both)
        self.engine_all_reduce: Any = None
        from eplb_fsm.maps import derive_log2phy

        log2phy, counts = derive_log2phy(placement, num_experts, max(P - num_experts + 1, 1))
        self.log2phy = torch.from_numpy(log2phy)
        self.replica_count = torch.from_numpy(counts)
        self.state_updates = 0
        # (L, P) tokens per slot of the last forward's whole batch (all ranks' tokens)
        self.last_global_load = torch.zeros(num_layers, P, dtype=torch.int64)

    # -- protocol --------------------------------------------------------
    def set_eplb_state(self, load_pass: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor) -> None:
        self.load_pass = load_pass
        self.log2phy = log2phy
        self.replica_count = replica_count
        self.state_updates += 1

    # -- elastic EP ------------------------------------------------------
    @property
    def non_expert_weights(self) -> list[torch.Tensor]:
        """The weights every rank holds whole (the gates): what a joining rank is sent."""
        return self.gate

    def set_ep_world(self, rank: int, world_size: int) -> None:
        """Serve as ``rank`` of ``world_size`` after an elastic switch (S slots per rank stay)."""
        S = self.num_local_physical_experts
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.num_physical_experts = S * self.world_size
        self.num_redundant_experts = self.num_physical_experts - self.num_logical_experts
        self.last_global_load = torch.zeros(self.num_moe_layers, self.num_physical_experts, dtype=torch.int64)

    # -- weights ---------------------------------------------------------
    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Original weights of a logical expert (cached)."""
        key = (layer, expert)
        if key not in self._expert_cache:
            self._expert_cache[key] = expert_params(self.seed, layer, expert, self.hidden)
        return self._expert_cache[key]

    def check_weights(self, phy2log: Any) -> list[tuple[int, int]]:
        """(layer, local row) of every slot whose weights differ from its expert's originals.

        Empty slots (-1, elastic EP) hold nothing in particular and are not checked.
        """
        placement = np.asarray(phy2log)
        S = self.num_local_physical_experts
        bad = []
        for layer in range(self.num_moe_layers):
            w, b = self.expert_weights[layer]
            for row in range(S):
                expert = int(placement[layer, self.rank * S + row])
                if expert < 0:
                    continue
                ew, eb = self.expert(layer, expert)
                if not (torch.equal(w[row], ew) and torch.equal(b[row], eb)):
                    bad.append((layer, row))
        return bad

    # -- routing ---------------------------------------------------------
    def set_load_target(self, probs: Any) -> None:
        """Bias the gate so routed load follows ``probs`` (L, N) (rows need not be normalised)."""
        p = torch.as_tensor(np.asarray(probs, dtype=np.float64))
        if p.shape != (self.num_moe_layers, self.num_logical_experts):
            raise ValueError(f"probs must have shape ({self.num_moe_layers}, {self.num_logical_experts}), "
                             f"got {tuple(p.shape)}")
        p = p / p.sum(dim=1, keepdim=True).clamp(min=1e-300)
        self.bias = self.gate_strength * torch.log(p.clamp(min=1e-9))

    def route(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Top-k logical experts of every token: (T, k) int64 (same on every rank)."""
        logits = x @ self.gate[layer] + self.bias[layer]
        return torch.topk(logits, self.top_k, dim=1).indices

    def slots(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        """Physical slot of each (token, choice): replica ``t mod replica_count``. (T, k) int64."""
        log2phy = self.log2phy[layer].cpu()
        counts = self.replica_count[layer].cpu()
        tokens = torch.arange(experts.shape[0]).unsqueeze(1).expand_as(experts)
        replica = tokens % counts[experts].clamp(min=1)
        return log2phy[experts, replica]

    # -- forward ---------------------------------------------------------
    def _layer_stack(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All logical experts of a layer stacked: (N, d, d), (N, d) (cached; for the reference)."""
        key = ("stack", layer)
        if key not in self._expert_cache:
            pairs = [self.expert(layer, e) for e in range(self.num_logical_experts)]
            self._expert_cache[key] = (torch.stack([w for w, _ in pairs]), torch.stack([b for _, b in pairs]))
        return self._expert_cache[key]

    @staticmethod
    def _apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """q(x_t @ w[index[t, j]] + b[index[t, j]]) for every (t, j): (T, k, d).

        Every expert is applied to every token ((E, T, d) products) and the needed ones are
        gathered: cheap at toy sizes, and exact (all values are on the fixed-point grid).
        """
        every = torch.matmul(x.unsqueeze(0), w) + b.unsqueeze(1)          # (E, T, d)
        tokens = torch.arange(x.shape[0]).unsqueeze(1).expand_as(index)
        return quantize(every[index, tokens])                              # (T, k, d)

    def forward(self, x: torch.Tensor, group: Any = None, record: bool = True) -> torch.Tensor:
        """Distributed forward of the global batch; records this rank's tokens' load."""
        S = self.num_local_physical_experts
        lo = self.rank * S
        tokens = torch.arange(x.shape[0])
        mine = (tokens % self.world_size) == self.rank
        coef = self.coef.view(1, -1, 1)
        for layer in range(self.num_moe_layers):
            experts = self.route(layer, x)
            slots = self.slots(layer, experts)
            if record and self.load_pass is not None:
                owned = slots[mine].reshape(-1).to(self.load_pass.device)
                self.load_pass[layer].index_add_(0, owned, torch.ones_like(owned))
            # the whole batch's load per slot (every rank routes every token, so no collective)
            self.last_global_load[layer] = torch.bincount(slots.reshape(-1), minlength=self.num_physical_experts)
            w_all, b_all = self.expert_weights[layer]
            local = (slots >= lo) & (slots < lo + S)
            rows = torch.where(local, slots - lo, 0)
            y = self._apply(x, w_all, b_all, rows) * coef * local.unsqueeze(-1)
            partial = y.sum(dim=1)
            if group is not None and self.world_size > 1:
                if self.engine_all_reduce is not None:
                    self.engine_all_reduce(partial, group, layer)
                else:
                    _sum_over_ranks(partial, group)
            x = quantize(x + partial)
        return x

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same computation from the logical experts, with no placement and no collectives."""
        coef = self.coef.view(1, -1, 1)
        for layer in range(self.num_moe_layers):
            experts = self.route(layer, x)
            w, b = self._layer_stack(layer)
            x = quantize(x + (self._apply(x, w, b, experts) * coef).sum(dim=1))
        return x

    def make_batch(self, step: int, tokens: int) -> torch.Tensor:
        return make_batch(self.seed, step, tokens, self.hidden)

    def serve(self, controller: Any, steps: int, tokens: int = 16) -> int:
        """``steps`` engine steps of ``tokens`` tokens under ``controller``; how many forwards differed from
        :meth:`reference_forward` (0 while every slot holds its expert's weights exactly)."""
        bad = 0
        for _ in range(steps):
            x = self.make_batch(controller.steps, tokens)
            bad += int(not torch.equal(self.forward(x, controller.group), self.reference_forward(x)))
            controller.step()
        return bad
