"""Communicators: in-process matching and counting; the torch.distributed one on a 1-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from eplb_fsm.transfer import Communicator, InProcessCommunicator, MessageMismatchError, TorchDistCommunicator


def test_in_process_matches_in_queue_order():
    """Messages of one (src, dst) pair are delivered in the order both sides queued them."""
    comm = InProcessCommunicator(3)
    a, b = torch.tensor([1, 2]), torch.tensor([3, 4])
    ra, rb, rc = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    comm.add_send(a, 0, 2)
    comm.add_send(b, 0, 2)
    comm.add_send(a, 1, 2)
    comm.add_recv(rc, 1, 2)
    comm.add_recv(ra, 0, 2)
    comm.add_recv(rb, 0, 2)
    comm.execute()
    assert ra.tolist() == [1, 2] and rb.tolist() == [3, 4] and rc.tolist() == [1, 2]
    assert comm.messages == {(0, 2): 2, (1, 2): 1} and comm.bytes[(0, 2)] == 32 and comm.executes == 1


def test_in_process_unmatched_raises_before_copying():
    """A send without its receive (a hang in a real group) raises and copies nothing."""
    comm = InProcessCommunicator(2)
    r = torch.zeros(1)
    comm.add_send(torch.ones(1), 0, 1)
    comm.add_send(torch.ones(1), 1, 0)
    comm.add_recv(r, 1, 0)
    with pytest.raises(MessageMismatchError, match="rank 0 queued 1 sends to rank 1"):
        comm.execute()
    assert r.item() == 0.0 and comm.total_messages == 0


def test_in_process_size_mismatch_raises():
    """A receive buffer of a different size or dtype than the message raises."""
    comm = InProcessCommunicator(2)
    comm.add_send(torch.ones(2), 0, 1)
    comm.add_recv(torch.zeros(3), 0, 1)
    with pytest.raises(MessageMismatchError, match="receive buffer"):
        comm.execute()


@pytest.mark.parametrize("src,dst,match",
                         [(0, 0, "cannot message itself"), (0, 2, "dst: rank 2"), (-1, 0, "src: rank -1")])
def test_in_process_rejects_bad_ranks(src, dst, match):
    """Out-of-group and self messages are rejected when queued."""
    with pytest.raises(ValueError, match=match):
        InProcessCommunicator(2).add_send(torch.ones(1), src, dst)


def test_in_process_is_a_communicator():
    """InProcessCommunicator satisfies the Communicator protocol and plays every rank."""
    comm = InProcessCommunicator(4)
    assert isinstance(comm, Communicator)
    assert comm.multi_rank and comm.local_ranks == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="world_size"):
        InProcessCommunicator(0)


def test_torch_dist_on_one_rank(one_rank_group):
    """On a 1-rank group the communicator is rank 0, executes an empty batch, refuses foreign ranks."""
    comm = TorchDistCommunicator(timeout=5.0)
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.world_size, comm.local_ranks, comm.multi_rank) == (0, 1, (0,), False)
    assert comm.backend == "gloo"
    comm.execute()  # nothing queued: a no-op
    with pytest.raises(ValueError, match="cannot send as rank 1"):
        comm.add_send(torch.ones(1), 1, 0)
    with pytest.raises(ValueError, match="cannot receive as rank 1"):
        comm.add_recv(torch.ones(1), 0, 1)
    with pytest.raises(ValueError, match="timeout"):
        TorchDistCommunicator(timeout=0)
    with pytest.raises(ValueError, match="cannot post as rank 1"):
        comm.add_ops(1, [(True, torch.ones(1), 0, 0)])


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300, True, "5"])
def test_torch_dist_refuses_a_timeout_that_would_fail_only_in_wait(one_rank_group, timeout):
    """An infinite, NaN, huge, bool or string timeout is refused by name at construction, not at the first wait."""
    with pytest.raises(ValueError, match="^timeout must be a finite number > 0"):
        TorchDistCommunicator(timeout=timeout)


def test_a_gloo_communicator_moves_host_memory_only(one_rank_group):
    """On gloo the communicator says it moves CPU tensors only; the in-process one does not."""
    assert TorchDistCommunicator(timeout=5.0).host_memory_only is True
    assert getattr(InProcessCommunicator(2), "host_memory_only", False) is False


def test_an_nccl_communicator_refuses_cpu_weights_before_posting(one_rank_group, monkeypatch):
    """A communicator whose group says NCCL moves CUDA memory only: CPU weights are refused before any start()."""
    from eplb_fsm.transfer import TransferBuffer, UnmovableWeightsError, rearrange_expert_weights_inplace

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # no NCCL run: only what the group says
    comm = TorchDistCommunicator(timeout=5.0)
    assert comm.cuda_memory_only is True and comm.host_memory_only is False
    starts = []
    comm.start = lambda: starts.append(1)
    w = torch.arange(4.0)[:, None].repeat(1, 3)
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[0\]: is on cpu.*\(nccl\) moves CUDA "
                                                    r"tensors only") as info:
        rearrange_expert_weights_inplace([[0, 1, 2, 3]], [[3, 2, 1, 0]], [[w]], communicator=comm,
                                         buffer=TransferBuffer())
    assert info.value.committed_layers == 0 and starts == [] and w[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torch_dist_requires_initialized():
    """Without an initialized default group the communicator refuses to build."""
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="not initialized"):
        TorchDistCommunicator()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_context_on_cuda(one_rank_group):
    """With a CUDA stream the copies run on it and finish() makes the caller's stream wait."""
    stream = torch.cuda.Stream()
    comm = TorchDistCommunicator(stream=stream)
    x = torch.ones(4, device="cuda")
    with comm.stream_context():
        assert torch.cuda.current_stream() == stream
        y = x * 2
    comm.finish()
    assert y.sum().item() == 8.0


def test_in_process_pairs_by_tag_across_starts():
    """Tagged messages pair by tag whatever the posting order; start() leaves the unpaired queued, wait() flags them."""
    comm = InProcessCommunicator(2)
    r0, r1 = torch.zeros(1), torch.zeros(1)
    comm.add_send(torch.tensor([5.0]), 0, 1, tag=0)
    comm.add_send(torch.tensor([7.0]), 0, 1, tag=1)
    comm.add_recv(r1, 0, 1, tag=1)  # the second message's receive first
    comm.start()
    assert r1.item() == 7.0 and r0.item() == 0.0 and comm.total_messages == 1
    comm.add_recv(r0, 0, 1, tag=0)  # the held receive, in a second phase
    comm.start()
    comm.wait()
    assert r0.item() == 5.0 and comm.total_messages == 2 and comm.executes == 1
    comm.add_send(torch.ones(1), 1, 0, tag=3)
    comm.start()  # nothing pairs yet: no error until the wave ends
    with pytest.raises(MessageMismatchError, match="rank 1 queued 1 sends to rank 0"):
        comm.wait()


def _tagged_pairs_rank(rank: int, world: int) -> list[list[float]]:
    """Rank 0 sends three tagged rows in one start(); rank 1 receives them over two start()s, out of order
    (the second start's receives queued with add_ops)."""
    comm = TorchDistCommunicator(timeout=30.0)
    rows = [torch.full((5,), float(10 * t + 1)) for t in range(3)]
    if rank == 0:
        for t, row in enumerate(rows):
            comm.add_send(row, 0, 1, tag=t)
        comm.start()
        comm.wait()
        return []
    got = [torch.zeros(5) for _ in range(3)]
    comm.add_recv(got[2], 0, 1, tag=2)
    comm.start()
    # the rest in one add_ops call: (is_send, tensor, peer, tag) each
    comm.add_ops(1, [(False, got[0], 0, 0), (False, got[1], 0, 1)])
    comm.start()
    comm.wait()
    return [g.tolist() for g in got]


@pytest.mark.multiprocess
def test_torch_dist_on_gloo_pairs_messages_by_tag_across_starts():
    """On 2 gloo ranks, receives posted in a later start() (via add_ops) and out of order still get the send with
    their tag."""
    from eplb_fsm.sim.launcher import run_ranks

    _, received = run_ranks(_tagged_pairs_rank, 2, timeout=60.0)
    assert received == [[1.0] * 5, [11.0] * 5, [21.0] * 5]


# which backend serves which device: "undefined" and per-device backend strings


STUB = {"default_map": {"cpu": "gloo", "cuda": "nccl"}, "capability": {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]}}


@pytest.mark.parametrize("backend,config,accelerator,want", [
    ("nccl", None, "cuda", {"cuda": "nccl"}),
    ("gloo", None, "cpu", {"cpu": "gloo", "cuda": "gloo"}),
    ("cpu:gloo,cuda:nccl", None, "cuda", {"cpu": "gloo", "cuda": "nccl"}),
    ("CPU:Gloo, cuda:NCCL", None, "cpu", {"cpu": "gloo", "cuda": "nccl"}),
    ("undefined", None, "cuda", {"cuda": "nccl"}),
    ("undefined", None, "cpu", {"cpu": "gloo"}),
    ("undefined", None, "tpu", {}),
    ("undefined", "cpu:gloo,cuda:nccl", "cuda", {"cpu": "gloo", "cuda": "nccl"}),
    ("undefined", "None", "cpu", {"cpu": "gloo"}),
    ("ucc", None, "cpu", {"cpu": "ucc", "cuda": "ucc"}),
])
def test_backends_by_device_reads_every_form_torch_reports(backend, config, accelerator, want):
    """One name, the per-device form and 'undefined' (the accelerator's default, or the group's config) per device."""
    from eplb_fsm.transfer.communicator import backends_by_device

    assert backends_by_device(backend, config, accelerator=accelerator, **STUB) == want


def test_torch_backend_defaults_match_this_torch():
    """This torch's tables reach backends_by_device: gloo for the CPU, NCCL for CUDA, the build's accelerator."""
    from eplb_fsm.transfer.communicator import torch_backend_defaults

    d = torch_backend_defaults()
    assert d["default_map"]["cpu"] == "gloo" and d["default_map"]["cuda"] == "nccl"
    assert "cpu" in d["capability"]["gloo"] and d["capability"]["nccl"] == ["cuda"]
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # a CPU build, as here
        assert d["accelerator"] == "cpu"


def _has_accelerator() -> bool:
    """Whether torch builds a group without a named backend on an accelerator's backend, not gloo."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    return current() is not None if current is not None else torch.cuda.is_available()


@pytest.fixture(params=[None, "cpu:gloo,cuda:gloo"])
def gloo_named_otherwise(request):
    """A 1-rank default group built with no backend named ('undefined') or with the per-device gloo string."""
    from eplb_fsm.sim.launcher import find_free_port

    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    if request.param is None and _has_accelerator():
        pytest.skip("with an accelerator, a group without a backend uses the accelerator's (NCCL for CUDA)")
    dist.init_process_group(request.param, init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def test_a_gloo_group_by_another_name_gets_tags_and_the_host_memory_rule(gloo_named_otherwise, monkeypatch):
    """A group reporting 'undefined' or 'cpu:gloo,cuda:gloo' is gloo: tags on, CPU only, no barrier; meta refused."""
    from eplb_fsm.transfer import TransferBuffer, UnmovableWeightsError, rearrange_expert_weights_inplace

    barriers = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: barriers.append(kw))
    comm = TorchDistCommunicator(timeout=5.0)
    assert comm.backend == (gloo_named_otherwise or "undefined")
    assert comm.supports_tags and comm.host_memory_only and not comm.cuda_memory_only
    assert comm.device_backends["cpu"] == "gloo"
    with pytest.raises(UnmovableWeightsError, match=r"is on meta, and the transfer group .* moves CPU tensors only|"
                                                    r"is on meta, and the transfer group .* has no backend for meta"):
        rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], [[torch.zeros(2, 3, device="meta")]], communicator=comm,
                                         buffer=TransferBuffer())
    w = torch.tensor([[1.0], [2.0]])
    rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], [[w]], communicator=comm, buffer=TransferBuffer())
    comm.start()
    assert w.flatten().tolist() == [2.0, 1.0] and barriers == []


def _mixed(monkeypatch, backend: str, config: str | None = None) -> TorchDistCommunicator:
    """A communicator on the 1-rank gloo group that reports ``backend`` (and ``config``); barriers are recorded."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    if config is not None:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    comm = TorchDistCommunicator(timeout=5.0)
    comm.barriers = []
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: comm.barriers.append(kw))
    return comm


def test_a_mixed_group_follows_the_backend_of_the_weights_device(one_rank_group, monkeypatch):
    """On 'cpu:gloo,cuda:nccl' CPU weights get gloo (tags, no barrier), CUDA ones NCCL (no tags, one barrier)."""
    comm = _mixed(monkeypatch, "cpu:gloo,cuda:nccl")
    assert comm.device_backends == {"cpu": "gloo", "cuda": "nccl"}
    assert not comm.host_memory_only and not comm.cuda_memory_only and not comm.supports_tags  # device unknown yet
    comm.use_device("cpu")
    assert comm.supports_tags
    comm.start()
    assert comm.barriers == []
    comm.use_device(torch.device("cuda", 1))
    assert not comm.supports_tags
    comm.start()
    comm.start()
    assert comm.barriers == [{"device_ids": [1]}]  # once, on the weights' GPU, which sets NCCL up
    comm.supports_tags = False  # an explicit choice (the bench's A/B) wins over the backend
    comm.use_device("cpu")
    assert comm.supports_tags is False


def test_a_mixed_group_moves_cpu_weights_and_refuses_a_device_it_has_no_backend_for(one_rank_group, monkeypatch):
    """CPU weights on 'cpu:gloo,cuda:nccl' move (the executor tells it their device); meta weights are refused."""
    from eplb_fsm.transfer import TransferBuffer, UnmovableWeightsError, rearrange_expert_weights_inplace

    comm = _mixed(monkeypatch, "cpu:gloo,cuda:nccl")
    w = torch.tensor([[1.0], [2.0]])
    rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], [[w]], communicator=comm, buffer=TransferBuffer())
    assert w.flatten().tolist() == [2.0, 1.0] and comm.supports_tags and comm.barriers == []
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[0\]: is on meta, and the transfer group "
                                                    r"\(cpu:gloo,cuda:nccl\) has no backend for meta tensors"):
        rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], [[torch.zeros(2, 3, device="meta")]], communicator=comm,
                                         buffer=TransferBuffer())


def test_an_undefined_group_on_a_cuda_machine_is_nccl(one_rank_group, monkeypatch):
    """'undefined' whose config says cuda:nccl moves CUDA memory only: CPU weights refused, no tags, a barrier."""
    from eplb_fsm.transfer import TransferBuffer, UnmovableWeightsError, rearrange_expert_weights_inplace

    comm = _mixed(monkeypatch, "undefined", "cuda:nccl")
    assert comm.cuda_memory_only and not comm.host_memory_only and not comm.supports_tags
    starts = []
    real_start, comm.start = comm.start, lambda: starts.append(1)
    w = torch.arange(4.0)[:, None]
    with pytest.raises(UnmovableWeightsError, match=r"is on cpu, and the transfer group \(undefined\) moves CUDA"):
        rearrange_expert_weights_inplace([[0, 1, 2, 3]], [[3, 2, 1, 0]], [[w]], communicator=comm,
                                         buffer=TransferBuffer())
    assert starts == [] and w.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    real_start()
    assert comm.barriers == [{}]  # no weights' device told: torch's default device for the barrier


class _DeviceSpy(InProcessCommunicator):
    """Records use_device calls and the number of executes when each came."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.told: list[tuple[torch.device, int]] = []

    def use_device(self, device) -> None:
        self.told.append((device, self.executes))


def test_the_executor_tells_the_communicator_the_weights_device_before_any_message():
    """Both moving entry points call use_device once with the weights' device, before the first wave."""
    from eplb_fsm.transfer import TransferBuffer, rearrange_expert_weights_inplace, transfer_layer_to_buffer

    comm = _DeviceSpy(2)
    w = [[[torch.tensor([[float(r)]])]] for r in range(2)]
    rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], w, communicator=comm, buffer=TransferBuffer())
    transfer_layer_to_buffer([0, 1], [1, 0], [x[0] for x in w], TransferBuffer(), communicator=comm)
    assert comm.told == [(torch.device("cpu"), 0), (torch.device("cpu"), 1)] and comm.executes == 2


def _unnamed_backend_rank(rank: int, world: int) -> tuple:
    """Three layers whose rows all cross ranks, on a group made without naming a backend; counts start() calls."""
    import numpy as np

    from eplb_fsm.transfer import TransferBuffer, rearrange_expert_weights_inplace

    comm = TorchDistCommunicator(timeout=30.0)
    starts, real_start = [], comm.start
    comm.start = lambda: (starts.append(1), real_start())
    old = np.tile(np.arange(4), (3, 1))
    new = np.roll(old, 2, axis=1)
    w = [[torch.tensor([[float(e)] for e in old[k, 2 * rank : 2 * rank + 2]])] for k in range(3)]
    rearrange_expert_weights_inplace(old, new, w, communicator=comm, buffer=TransferBuffer())
    return str(dist.get_backend()), comm.supports_tags, len(starts), [x[0].flatten().tolist() for x in w]


@pytest.mark.multiprocess
def test_two_ranks_without_a_named_backend_post_in_two_phases_with_tags():
    """On 2 CPU ranks of an 'undefined' (gloo) group the executor posts layers 1.. in two phases, bit-exact."""
    from eplb_fsm.sim.launcher import run_ranks

    if _has_accelerator():
        pytest.skip("with an accelerator, a group without a backend uses the accelerator's (NCCL for CUDA)")
    results = run_ranks(_unnamed_backend_rank, 2, timeout=60.0, backend=None)
    for rank, (backend, tags, starts, rows) in enumerate(results):
        assert backend == "undefined" and tags and starts == 1 + 2 * 2  # held receives: a second start per layer
        assert rows == [[2.0 * (1 - rank), 2.0 * (1 - rank) + 1]] * 3


@pytest.mark.parametrize("missing", ["raises", "absent"])
def test_an_undefined_group_falls_back_to_the_accelerator_default_without_its_config(one_rank_group, monkeypatch,
                                                                                     missing):
    """If get_backend_config raises or this torch lacks it, 'undefined' is the accelerator's default backend."""
    if _has_accelerator():
        pytest.skip("the fallback is the accelerator's backend there, not gloo")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    if missing == "absent":
        monkeypatch.delattr(dist, "get_backend_config")
    else:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: (_ for _ in ()).throw(TypeError("none")))
    comm = TorchDistCommunicator(timeout=5.0)
    assert comm.device_backends == {"cpu": "gloo"} and comm.host_memory_only and comm.supports_tags


# the batched path (NCCL and any backend but gloo): P2POp in the form every supported torch takes


class _P2POpOfTorch24:
    """torch 2.4's ``P2POp``: ``peer`` is a global rank; there is no ``group_peer`` keyword (added in 2.6)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def test_the_batched_path_builds_p2pops_with_a_global_peer_as_torch_2_4_takes(one_rank_group, monkeypatch):
    """Off gloo each message is P2POp(op, tensor, global rank of the peer, group=, tag=), no group_peer keyword."""
    comm = _mixed(monkeypatch, "nccl")  # no NCCL run: the barrier is recorded, the batch captured
    monkeypatch.setattr(dist, "P2POp", _P2POpOfTorch24)
    lookups, batches = [], []
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: lookups.append(group) or r + 10)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [])
    sent, got = torch.ones(3), torch.zeros(3)
    comm.add_send(sent, 0, 0, tag=5)
    comm.add_recv(got, 0, 0, tag=6)
    comm.start()
    comm.add_send(sent, 0, 0, tag=7)
    comm.start()
    first, second = batches  # one batch per start()
    assert [(op.op, op.tensor is t, op.peer, op.group, op.tag) for op, t in zip(first, (sent, got))] == [
        (dist.isend, True, 10, comm.group, 5), (dist.irecv, True, 10, comm.group, 6)]
    assert [op.peer for op in second] == [10] and lookups == [comm.group]  # global ranks looked up once


def _subgroup_batch_rank(rank: int, world: int) -> list[float] | None:
    """Global ranks 0 and 2 form a subgroup (group ranks 0 and 1) and post a message through batch_isend_irecv."""
    sub = dist.new_group([0, 2])  # collective: every rank makes it
    if rank == 1:
        return None
    comm = TorchDistCommunicator(sub, timeout=30.0)
    comm.device_backends["cpu"] = "batched"  # any backend but gloo: the path NCCL takes, on gloo underneath
    comm.use_device("cpu")
    me = comm.rank
    out = torch.zeros(4)
    if me == 0:
        comm.add_send(torch.arange(4.0) + 100 * rank, 0, 1)
    else:
        comm.add_recv(out, 0, 1)
    comm.execute()
    return out.tolist()


@pytest.mark.multiprocess
def test_the_batched_path_reaches_the_right_peer_in_a_subgroup():
    """In a subgroup whose group ranks differ from the global ones, group rank 1 (global 2) gets group rank 0's row."""
    from eplb_fsm.sim.launcher import run_ranks

    results = run_ranks(_subgroup_batch_rank, 3, timeout=90.0)
    assert results == [[0.0] * 4, None, [0.0, 1.0, 2.0, 3.0]]
