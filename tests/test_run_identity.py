"""Run identity: rank 0's run id reaches every rank, a differing config fails every rank at construction."""

from __future__ import annotations

import threading

import pytest
import torch

from eplb_fsm.run_identity import (
    ConfigMismatch, FieldSetMismatch, agree, field_hashes, field_set_digest, for_controller, lookup, publish,
)


class _SumWorld:
    """W threads summing float64 tensors (a SUM all-reduce), bounded waits."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world)

    def reduce_for(self, rank: int):
        def reduce(t: torch.Tensor) -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait(10)
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait(10)
            t.copy_(total)

        return reduce


def _run(world: int, configs: list[dict]) -> list:
    sums = _SumWorld(world)
    out: list = [None] * world

    def body(rank: int) -> None:
        try:
            out[rank] = agree(configs[rank], rank, world, sums.reduce_for(rank))
        except Exception as exc:  # kept for the assertions
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_every_rank_gets_rank_0s_run_id():
    """Equal configs: every rank ends with the same 16-hex run id."""
    cfg = {"window_size": 4, "policy": "default"}
    got = _run(3, [cfg, dict(cfg), dict(cfg)])
    ids = {g.run_id for g in got}
    assert len(ids) == 1 and all(g.agreed for g in got)
    run_id = ids.pop()
    assert len(run_id) == 16 and int(run_id, 16) >= 0


def test_a_differing_field_fails_every_rank_naming_it():
    """Rank 2's step_interval differs: all ranks raise ConfigMismatch naming step_interval only."""
    cfg = {"window_size": 4, "step_interval": 10, "policy": "default"}
    got = _run(3, [cfg, dict(cfg), dict(cfg, step_interval=11)])
    assert all(isinstance(g, ConfigMismatch) for g in got)
    assert all(g.fields == ["step_interval"] and g.counts == {"step_interval": 1} for g in got)
    assert got[2].mine == ["step_interval"] and got[0].mine == [] and "'step_interval'" in str(got[0])


def test_field_hashes_tell_values_apart():
    """Field hashes are per field and fit in 32 bits (exact through a float64 sum)."""
    names, hashes = field_hashes({"b": 1.0, "a": [1, 2]})
    names2, hashes2 = field_hashes({"b": 1.5, "a": [1, 2]})
    assert names == names2 == ["a", "b"]
    assert hashes[0] == hashes2[0] and hashes[1] != hashes2[1]
    assert all(0 <= h < 2 ** 32 for h in hashes + hashes2)


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class _StoreBacked:
    def __init__(self, store) -> None:
        self.store = store
        self.namespace = "eplb"


def test_a_joiner_reads_the_published_run_id():
    """Rank 0 publishes its run id in the store; a joiner's lookup returns it (agreed)."""
    from eplb_fsm.run_identity import RunIdentity

    group = _StoreBacked(_Store())
    publish(group, RunIdentity("00000000deadbeef", agreed=True), rank=0)
    got = lookup(group)
    assert got.run_id == "00000000deadbeef" and got.agreed
    assert not lookup(_StoreBacked(_Store())).agreed  # nothing published: a fresh id, not agreed


def test_a_failed_agreement_is_reported_not_raised():
    """A group whose all-reduce fails gives a RuntimeError naming the run-id agreement."""

    class Broken:
        def all_reduce(self, t, timeout_s):
            raise TimeoutError("nobody came")

        def transfer_communicator(self, timeout_s):  # pragma: no cover - the protocol's second half
            raise NotImplementedError

    identity, err = for_controller(Broken(), True, 1, 2, {"a": 1}, 0.1, "cpu", "member")
    assert isinstance(err, RuntimeError) and "run id" in str(err) and "nobody came" in str(err)
    assert identity.run_id and not identity.agreed


def _construct(rank: int, world: int, trace_dir: str) -> dict:
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.trace import read_trace, trace_path

    cfg = EplbConfig(window_size=8 if rank == 1 else 4, collective_timeout_s=20.0)
    try:
        ctl = EplbController(cfg, trace_dir=trace_dir, liveness_interval_s=None)
    except ConfigMismatch as exc:
        records, _ = read_trace(trace_path(trace_dir, rank))
        return {"error": str(exc), "fields": exc.fields, "events": [r["event"] for r in records],
                "end": records[-1]}
    ctl.close()
    return {"error": None}


def _construct_same(rank: int, world: int, trace_dir: str) -> str:
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.trace import read_trace, trace_path

    with EplbController(EplbConfig(collective_timeout_s=20.0), trace_dir=trace_dir, liveness_interval_s=None):
        pass
    records, _ = read_trace(trace_path(trace_dir, rank))
    return records[0]["run_id"], records[0]["config_hash"]


@pytest.mark.multiprocess
def test_gloo_ranks_with_different_configs_fail_at_construction(tmp_path):
    """Two gloo ranks, window_size 4 vs 8: both raise naming window_size; each trace is header + end."""
    from eplb_fsm.sim.launcher import run_ranks

    out = run_ranks(_construct, 2, args=(str(tmp_path),), timeout=60)
    for res in out:
        assert res["fields"] == ["window_size"] and "'window_size'" in res["error"]
        assert res["events"] == ["header", "end"]
        assert res["end"]["how"] == "exception" and "ConfigMismatch" in res["end"]["error"]


@pytest.mark.multiprocess
def test_a_config_mismatch_folder_replays_as_one_run_with_verdict_config_mismatch(tmp_path):
    """Two gloo ranks, window_size 4 vs 8: both headers carry rank 0's agreed run id, and replay names window_size."""
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.sim.launcher import run_ranks
    from eplb_fsm.trace import read_trace, trace_path

    run_ranks(_construct, 2, args=(str(tmp_path),), timeout=60)
    ids = {read_trace(trace_path(tmp_path, r))[0][0]["run_id"] for r in range(2)}
    report = replay_dir(tmp_path)
    assert len(ids) == 1 and report.run_id == ids.pop()
    assert report.verdict == "config_mismatch" and report.culprit_ranks == [1] and "window_size" in report.summary


def test_a_mismatch_carries_the_run_id_every_rank_agreed_on():
    """Differing values and differing field sets both raise with rank 0's run id on every rank."""
    cfg = {"window_size": 4, "step_interval": 10}
    values = _run(2, [cfg, dict(cfg, window_size=8)])
    names = _run(2, [cfg, dict(cfg, extra_knob=1)])
    for got, kind in ((values, ConfigMismatch), (names, FieldSetMismatch)):
        assert all(type(g) is kind for g in got), got
        assert got[0].run_id == got[1].run_id and len(got[0].run_id) == 16


def _header_with_own_fields(rank: int, world: int, trace_dir: str) -> str:
    from types import SimpleNamespace

    import torch.distributed as dist

    from eplb_fsm.run_identity import write_header
    from eplb_fsm.trace import EventTrace

    cfg = {"a": 1, "b": 2} if rank == 0 else {"a": 1, "b": 2, "c": 3}
    coll = SimpleNamespace(group=dist.group.WORLD, custom=False, rank=rank, world_size=world, timeout_s=20.0,
                           comm_device="cpu")
    trace = EventTrace(rank, world, trace_dir)
    try:
        write_header(trace, coll, cfg, "member", mode="sync")
    except FieldSetMismatch as exc:
        return type(exc).__name__
    trace.close()
    return "no error"


@pytest.mark.multiprocess
def test_a_field_set_mismatch_folder_replays_as_one_run_naming_the_extra_field(tmp_path):
    """Two gloo ranks whose configs differ in field names: one run id in both headers; replay names field c."""
    from eplb_fsm.inspect.replay import replay_dir
    from eplb_fsm.sim.launcher import run_ranks

    assert run_ranks(_header_with_own_fields, 2, args=(str(tmp_path),), timeout=60) == ["FieldSetMismatch"] * 2
    report = replay_dir(tmp_path)
    assert report.run_id is not None and report.verdict == "config_mismatch"
    assert report.culprit_ranks == [1] and "c=3" in report.summary


@pytest.mark.multiprocess
def test_gloo_ranks_share_one_run_id_in_their_headers(tmp_path):
    """Two gloo ranks with equal configs write the same run_id and config_hash in their headers."""
    from eplb_fsm.sim.launcher import run_ranks

    (id0, h0), (id1, h1) = run_ranks(_construct_same, 2, args=(str(tmp_path),), timeout=60)
    assert id0 == id1 and h0 == h1 and len(id0) == 16


def test_write_header_keeps_a_role_field_for_the_header(tmp_path):
    """A joiner's header has its own `role` field: write_header passes it through, beside the identity's role."""
    from types import SimpleNamespace

    from eplb_fsm.run_identity import write_header
    from eplb_fsm.trace import EventTrace, read_trace, trace_path

    coll = SimpleNamespace(group=None, custom=False, rank=0, world_size=1, timeout_s=1.0, comm_device="cpu")
    with EventTrace(0, 1, tmp_path) as trace:
        identity = write_header(trace, coll, {"a": 1}, "joiner", role="joiner", generation=1)
    header = read_trace(trace_path(tmp_path, 0))[0][0]
    assert header["role"] == "joiner" and header["generation"] == 1 and header["run_id"] == identity.run_id


def test_a_lone_rank_of_a_store_backed_group_publishes_its_id_for_later_joiners():
    """World 1 with a store (an elastic job that starts on one rank): its id is published; a joiner reads it."""
    group = _StoreBacked(_Store())
    identity, error = for_controller(group, True, 0, 1, {"a": 1}, 5.0, torch.device("cpu"), "member")
    joined, _ = for_controller(group, True, 1, 2, {"a": 1}, 5.0, torch.device("cpu"), "joiner")
    assert error is None and joined.run_id == identity.run_id and joined.agreed


def test_field_sets_that_differ_fail_every_rank_naming_what_each_can():
    """Rank 1 has an extra field, rank 2 another name for one: every rank raises FieldSetMismatch (a
    ConfigMismatch) before any vector sized by its own fields; each names its fields that others lack."""
    cfg = {"window_size": 4, "step_interval": 10}
    got = _run(3, [cfg, dict(cfg, extra_knob=1), {"window_size": 4, "step_every": 10}])
    assert all(isinstance(g, FieldSetMismatch) and isinstance(g, ConfigMismatch) for g in got), got
    assert all("config field set differs between ranks" in str(g) for g in got)
    assert got[0].fields == ["step_interval"] and got[0].counts == {"step_interval": 1}
    assert got[1].fields == ["extra_knob", "step_interval"] and got[1].counts == {"extra_knob": 2, "step_interval": 1}
    assert got[2].fields == got[2].mine == ["step_every"] and "'step_every' (missing on 2 of 3 ranks)" in str(got[2])
    assert "has 3, not the same names as rank 0" in str(got[1]) and "rank 0 has 2 field(s)" in str(got[2])


def test_the_field_set_digest_is_small_and_order_free():
    """The digest: the field count and four 16-bit pieces (squares summed stay exact); the names' order is not in it."""
    digest = field_set_digest(["b", "a"])
    assert digest == field_set_digest(["a", "b"]) and digest[0] == 2 and all(0 <= x < 2 ** 16 for x in digest)
    assert field_set_digest(["a", "c"]) != digest and len(field_set_digest([])) == 5


def _agree_with_own_fields(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from eplb_fsm.run_identity import group_sum

    cfg = {"a": 1, "b": 2} if rank == 0 else {"a": 1, "b": 2, "c": 3}
    try:
        agree(cfg, rank, world, group_sum(dist.group.WORLD, False, 20.0))
    except ConfigMismatch as exc:
        return {"type": type(exc).__name__, "error": str(exc), "fields": exc.fields}
    return {"type": None}


@pytest.mark.multiprocess
def test_gloo_ranks_with_different_field_sets_raise_config_mismatch(tmp_path):
    """Two real gloo ranks whose config dicts have different field sets: both raise FieldSetMismatch (no gloo
    size mismatch, no abort); rank 1 names the field rank 0 lacks."""
    from eplb_fsm.sim.launcher import run_ranks

    r0, r1 = run_ranks(_agree_with_own_fields, 2, timeout=60)
    assert r0["type"] == r1["type"] == "FieldSetMismatch"
    assert "config field set differs between ranks" in r0["error"] and r0["fields"] == []
    assert r1["fields"] == ["c"] and "'c' (missing on 1 of 2 ranks)" in r1["error"]
