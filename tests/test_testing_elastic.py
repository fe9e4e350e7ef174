"""The synthetic builder's elastic EP: scale records as the controller writes them, faults per scale."""

from __future__ import annotations


import pytest

from eplb_fsm.testing import SyntheticJob
from eplb_fsm.trace import read_trace, trace_path

# slots a rank: the default job's 8 experts then fit on 2 ranks, so it can scale 4 -> 2 (or 3 -> 2) as a real
# controller would let it (the default, ceil(8 / world), leaves no spare slot)
SPARE = 4


def _events(recs: list[dict], step: int) -> list[str]:
    return [r.get("trigger", r["event"]) for r in recs if r["step"] == step and r["event"] not in (
        "step", "collective_end")]


def test_scale_down_leaving_rank_ends_with_its_switch():
    """A leaving rank sends its layers in the old group, fires switched, writes group_switch (-1), scaling, end."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2)
    recs = job.records()[3]
    assert _events(recs, 12) == [
        "scale_requested", "collective_start", "collective_start", "groups_ready", "collective_start", "plan_ready",
        "collective_start", "collective_start", "layer_done", "collective_start", "collective_start", "layer_done",
        "collective_start", "committed", "rearrangement", "switched", "group_switch", "scaling", "end"]
    # the forced plan all-reduces the loads only; each ready agreement is [ready, failed, late, broken]
    agreements = [(r["parts"], r["shape"], r.get("layer")) for r in recs
                  if r["event"] == "collective_start" and r["op"] == "all_reduce" and r["step"] == 12]
    # scale_check: [no go-ahead, the request's digest (3 x 16), the maps' digest (16)]
    assert agreements == [(["scale_check"], [65], None), (["scale_ready"], [1], None), (["loads"], [16], None),
                          (["ready"], [4], 0), (["ready"], [4], 1), (["ready"], [4], None)]
    switch = recs[-3]
    assert (switch["role"], switch["new_group"], switch["new_rank"], switch["old_world"]) == ("leaving", None, -1, 4)
    assert recs[-2]["rank"] == -1 and recs[-2]["outcome"] == "left"
    assert recs[-1]["how"] == "closed"  # the engine closes a leaving rank's controller
    assert {r["group"] for r in recs if r["event"] == "collective_start" and r["step"] == 12} == {"ep", "ep_transfer"}
    assert sorted(job.ranks) == [0, 1] and job.world == 2


def test_survivors_move_to_the_new_group_with_new_rank_and_world():
    """Survivors' group_switch names ep@1 / ep_transfer@1; their later records carry world 2 and use ep@1."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2, rank_mapping={0: -1, 1: -1, 2: 0, 3: 1})
    job.run(12)
    recs = job.records()[3]
    switch = next(r for r in recs if r["event"] == "group_switch")
    assert (switch["old_group"], switch["new_group"], switch["transfer_group"]) == ("ep", "ep@1", "ep_transfer@1")
    assert (switch["old_rank"], switch["new_rank"], switch["rank"], switch["world"]) == (3, 1, 1, 2)
    later = [r for r in recs if r["event"] == "collective_start" and r["step"] > 12]
    assert later and {r["group"] for r in later} == {"ep@1", "ep_transfer@1"}


def test_joiner_appends_a_session_to_the_file_of_the_rank_it_takes(tmp_path):
    """Scale-up: the joiner's header (role joiner, generation, machine) follows the leaver's records in rank00003."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, trace_dir=tmp_path, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2)
    job.run(5)
    job.scale(4)
    job.run(3)
    job.close()
    recs = read_trace(trace_path(tmp_path, 3))[0]
    headers = [i for i, r in enumerate(recs) if r["event"] == "header"]
    assert len(headers) == 2 and recs == job.records()[3]
    joiner = recs[headers[1]]
    assert (joiner["role"], joiner["generation"], joiner["seq"], joiner["step"]) == ("joiner", 2, 0, 17)
    assert joiner["machine"] == {"state": "scaling", "scale_pending": True} and joiner["group"] == "ep@2"
    first = next(r for r in recs[headers[1]:] if r["event"] == "transition")
    assert (first["trigger"], first["source"], first["step"]) == ("groups_ready", "scaling", 17)


def test_absent_joiners_abort_the_scale_up():
    """absent=True: scale_aborted (prepare) and a recoverable fault on every old rank; no joiner session."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    job.scale(3, absent=True)
    job.run(3)
    records = job.records()
    assert sorted(records) == [0, 1] and job.world == 2 and job.generation == 1
    assert _events(records[1], 12) == ["scale_requested", "collective_start", "scale_aborted", "fault", "scaling"]


def test_dying_leaving_rank_breaks_the_old_group_and_survivors_salvage():
    """die={2: 0}: rank 2 stops before layer 0; the others fail, then survivors fire salvaged and switch (degraded)."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12)
    assert job.scale(2, die={2: 0})["degraded"]
    records = job.records()
    assert records[2][-1]["trigger"] == "plan_ready"
    moves = [r["trigger"] for r in records[0] if r["event"] == "transition" and r["step"] == 12]
    assert moves == ["scale_requested", "groups_ready", "plan_ready", "fault", "salvaged", "switched"]
    salvaged, switched = (r for r in records[0] if r["event"] == "transition" and r["trigger"] in moves[-2:])
    assert [salvaged[k] for k in ("source", "dest", "scale", "generation")] == ["failed", "scaling", 1, 1]
    assert switched["salvage"] is True and "salvage" not in salvaged
    assert any(r["event"] == "collective_start" and r["group"] == "ep@1" for r in records[0])


def test_die_at_two_layers_is_refused_since_the_first_death_ends_every_transfer():
    """die={2: 0, 3: 1}: rank 3 could never reach layer 1 once rank 2's death broke the group: ValueError, no record."""
    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(4)
    before = {r: len(recs) for r, recs in job.records().items()}
    with pytest.raises(ValueError, match=r"die must name one layer for every dying rank"):
        job.scale(2, die={2: 0, 3: 1})
    assert {r: len(recs) for r, recs in job.records().items()} == before and job.generation == 0
    assert job.scale(2, die={2: 1, 3: 1})["degraded"]
    records = job.records()
    for r in (2, 3):   # both leaving ranks die where asked: after layer 0, before their layer-1 wave
        assert [x["layer"] for x in records[r] if x.get("trigger") == "layer_done"] == [0]
        assert records[r][-1]["trigger"] == "layer_done"


def test_scale_of_a_job_that_simulates_some_ranks_is_refused_up_front():
    """SyntheticJob(world=4, ranks=[0]).scale(2): a ValueError naming the simulated ranks, not rank_mapping."""
    job = SyntheticJob(world=4, ranks=[0], num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(4)
    before = len(job.records()[0])
    for kwargs in ({}, {"rank_mapping": {0: 0}}):
        with pytest.raises(ValueError, match=r"scale needs every rank of the world simulated: this job simulates "
                                             r"ranks \[0\] of world=4"):
            job.scale(2, **kwargs)
    assert len(job.records()[0]) == before and job.generation == 0 and job.world == 4


def test_bad_scale_requests_are_rejected():
    """Same size, a mapping that misses a rank or collides, or die on a rank that stays: ValueError."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, slots_per_rank=SPARE)
    for kwargs, match in [({"new_world": 3}, "differ"), ({"new_world": 2, "rank_mapping": {0: 0}}, "every"),
                          ({"new_world": 2, "rank_mapping": {0: 0, 1: 0, 2: -1}}, "distinct"),
                          ({"new_world": 2, "die": {0: 1}}, "die")]:
        with pytest.raises(ValueError, match=match):
            job.scale(**kwargs)


def test_scale_arguments_that_could_not_take_effect_are_refused_before_any_record():
    """A bool world, a mapping of -5, a layer the model lacks, absent on a scale-down: ValueError, nothing written."""
    job = SyntheticJob(world=3, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(4)
    before = {r: len(recs) for r, recs in job.records().items()}
    for kwargs, match in [({"new_world": True}, "new_world must be an integer"),
                          ({"new_world": 2, "rank_mapping": {0: 0, 1: 1, 2: -5}}, r"rank_mapping\[2\]"),
                          ({"new_world": 2, "rank_mapping": {0: 0, 1: 1, 2: "x"}}, r"rank_mapping\[2\]"),
                          ({"new_world": 2, "die": {2: 7}}, "below num_layers=2"),
                          ({"new_world": 2, "die": {2: -1}}, r"die\[2\] must be >= 0"),
                          ({"new_world": 2, "absent": True}, "absent=True")]:
        with pytest.raises(ValueError, match=match):
            job.scale(**kwargs)
    assert {r: len(recs) for r, recs in job.records().items()} == before
    assert job.generation == 0 and job.world == 3


def test_a_scale_that_leaves_an_expert_without_a_slot_is_refused_before_any_record():
    """8 experts, 2 slots a rank: 4 -> 2 or 4 -> 3 is request_scale's "every expert needs a slot" ValueError, nothing
    written; with 4 slots a rank the same 4 -> 2 goes through and down to 1 rank is refused."""
    job = SyntheticJob(world=4, num_layers=2, interval=10)
    job.run(12)
    before = job.records()
    for new_world, slots in ((2, 4), (3, 6)):
        with pytest.raises(ValueError, match=rf"^new_world {new_world} gives model 'main' {slots} slots \(2 per rank\) "
                                             r"for 8 experts: every expert needs a slot$"):
            job.scale(new_world)
    assert job.records() == before
    assert (job.generation, job.world, sorted(job.ranks)) == (0, 4, [0, 1, 2, 3])
    spare = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    spare.run(12)
    assert spare.scale(2)["outcome"] == "switched" and spare.world == 2
    with pytest.raises(ValueError, match=r"new_world 1 gives model 'main' 4 slots \(4 per rank\) for 8 experts"):
        spare.scale(1)
    assert spare.generation == 1


def test_a_rank_a_fault_stopped_cannot_take_part_in_a_scale():
    """scale() after a Stop fault names the stopped rank instead of writing records for a dead process."""
    from eplb_fsm.testing import Faults, Stop

    job = SyntheticJob(world=4, num_layers=2, interval=10, slots_per_rank=SPARE)
    job.run(12, Faults(stop={3: Stop(5)}))
    with pytest.raises(ValueError, match=r"ranks \[3\] have stopped"):
        job.scale(2)
    assert job.generation == 0 and job.records()[3][-1]["step"] == 4


def test_a_closed_elastic_job_replays_healthy_with_every_rank_ended(tmp_path):
    """4 -> 2 -> 4 then close(): every session ends (leaving ranks at their scale), replay has no unended rank."""
    from eplb_fsm.inspect import replay_dir

    job = SyntheticJob(world=4, num_layers=2, interval=10, trace_dir=tmp_path, keep=False, slots_per_rank=SPARE)
    job.run(12)
    job.scale(2)
    job.run(12)
    job.scale(4)
    job.run(12)
    job.close()
    report = replay_dir(tmp_path)
    assert report.verdict == "healthy"
    assert report.to_dict()["unended_ranks"] == []


def _real_scale_down_records(info) -> dict[int, list[dict]]:
    """Each rank's trace records of a real 2 -> 1 scale-down (gloo ranks as threads of this process)."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.sim.model import ToyMoE
    from eplb_fsm.testing.threads import run_threads
    from eplb_fsm.transfer.groups import StoreGroup

    config = EplbConfig(window_size=4, step_interval=1000, num_redundant_experts=4, collective_timeout_s=2.0)

    def rank(r, _thread_group):   # the ranks talk over the store's gloo group, not the thread world's
        ctl = EplbController(config, group=StoreGroup.connect(info, 0, r, 2, 30.0), keep_trace=True)
        ctl.add_model(ToyMoE(2, 4, 4, 4, 2, r, 2), "main")
        ctl.step()
        out = ctl.request_scale(1, timeout_s=5.0)
        records = list(ctl.trace.records)
        ctl.close()
        return out, records

    outs = run_threads(2, rank, timeout=30.0)
    assert outs[0][0]["outcome"] == "switched" and outs[1][0]["outcome"] == "left", outs
    return {r: outs[r][1] for r in range(2)}


def test_synthetic_scale_records_carry_the_fields_of_the_real_ones(store):
    """scale_requested and scaling written by scale() have the key sets a real request_scale writes, and an
    absent joiner's abort says phase prepare as the controller's does."""
    real = _real_scale_down_records(store)[0]
    job = SyntheticJob(world=2, num_layers=2, interval=10, slots_per_rank=8)   # one rank holds all 8 experts
    job.run(3)
    job.scale(1)
    synthetic = job.records()[0]

    def first(recs, pick):
        return next(r for r in recs if pick(r))

    for pick in (lambda r: r["event"] == "scaling", lambda r: r.get("trigger") == "scale_requested"):
        assert set(first(synthetic, pick)) == set(first(real, pick))
    request = first(synthetic, lambda r: r.get("trigger") == "scale_requested")
    # scale_bounds(20, 60): forward = 20 + 2 * 60 + 5, bound = forward + 2 * 60 + 5
    assert (request["deadline_s"], request["bound_s"]) == (145.0, 270.0)
    absent = SyntheticJob(world=2, num_layers=2, interval=10)
    absent.run(3)
    absent.scale(3, absent=True)
    record = first(absent.records()[0], lambda r: r["event"] == "scaling")
    assert (record["outcome"], record["phase"], record["partial"]) == ("aborted", "prepare", False)


def test_a_real_leaving_rank_s_scaling_record_says_new_rank_minus_one_and_keeps_its_own_rank(store):
    """The controller's scaling record of a rank that left says new_rank -1 and is stamped with the rank it wrote
    as (the trace stamps rank itself), as the end record its close writes is; controller.scalings says rank -1."""
    leaving = _real_scale_down_records(store)[1]
    scaling = next(r for r in leaving if r["event"] == "scaling")
    assert (scaling["outcome"], scaling["new_rank"], scaling["old_rank"], scaling["rank"]) == ("left", -1, 1, 1)
    assert leaving[-1]["event"] == "end" and leaving[-1]["rank"] == 1
