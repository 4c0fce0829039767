import queue

import pytest
from conftest import is_prefill, make_scheduler, make_seq

from atom_core import (
    BlockManager,
    RequestOutput,
    SamplingParams,
    ScheduledBatchOutput,
    Scheduler,
    Sequence,
    SequenceStatus,
    SequenceType,
    SpeculativeConfig,
)


def step(sched: Scheduler, token: int | dict = 1, q=None):
    """One engine step: schedule, 'sample' `token` for every request, postprocess."""
    out = sched.schedule()
    assert out is not None
    batch, seqs = out
    tokens = token if isinstance(token, dict) else {sid: (token,) for sid in batch.req_ids}
    finished = sched.postprocess(list(seqs.values()), ScheduledBatchOutput(tokens, None), q)
    return batch, finished


def test_schedule_returns_none_when_nothing_is_queued():
    assert make_scheduler().schedule() is None


def test_prefill_batch_contents():
    sched = make_scheduler()
    a, b = make_seq(20), make_seq(5, start=100)
    sched.add(a)
    sched.add(b)
    batch, seqs = sched.schedule()
    assert list(seqs) == [a.id, b.id] and seqs[a.id] is a
    assert is_prefill(batch)
    assert batch.req_ids == [a.id, b.id]
    assert batch.num_scheduled_tokens == [20, 5]
    assert batch.total_tokens_num == 25 and batch.total_tokens_num_prefill == 25
    assert batch.total_tokens_num_decode == 0
    assert (batch.total_seqs_num, batch.total_seqs_num_prefill, batch.total_seqs_num_decode) == (2, 2, 0)
    assert batch.scheduled_tokens == list(range(20)) + list(range(100, 105))
    assert batch.context_lens == [20, 5]
    assert batch.block_tables == [[0, 1], [2]]
    assert batch.last_block_num_tokens == [4, 5]
    assert batch.num_cached_tokens == [0, 0]
    assert batch.temperatures == [1.0, 1.0]
    assert batch.num_spec_step == 0 and batch.scheduled_spec_decode_tokens == {}
    assert [s.status for s in (a, b)] == [SequenceStatus.RUNNING] * 2
    assert [s.type for s in (a, b)] == [SequenceType.PREFILL] * 2
    assert list(sched.running) == [a, b] and not sched.waiting


def test_decode_follows_prefill():
    sched = make_scheduler()
    a, b = make_seq(16), make_seq(3, start=50)
    sched.add(a)
    sched.add(b)
    step(sched, 7)
    batch, _ = step(sched, 8)
    assert not is_prefill(batch)
    assert batch.num_scheduled_tokens == [1, 1]
    assert batch.scheduled_tokens == [7, 7]  # the last sampled token of each
    assert batch.context_lens == [17, 4]
    assert batch.total_tokens_num_decode == 2 and batch.total_seqs_num_decode == 2
    assert batch.block_tables == [[0, 2], [1]]  # a's 17th token opened a new block
    assert a.type == SequenceType.DECODE
    assert a.token_ids[-2:] == [7, 8]


def test_prefill_first_new_arrival_preempts_nothing_but_goes_first():
    sched = make_scheduler()
    a = make_seq(4)
    sched.add(a)
    step(sched)
    b = make_seq(6, start=10)
    sched.add(b)
    batch, _ = step(sched)
    assert is_prefill(batch) and batch.req_ids == [b.id]  # no decode mixed in
    batch, _ = step(sched)
    assert not is_prefill(batch) and batch.req_ids == [a.id, b.id]


def test_token_budget_splits_prefills_across_steps():
    sched = make_scheduler(max_num_batched_tokens=64)
    seqs = [make_seq(30, start=i * 100) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, _ = step(sched)
    assert batch.req_ids == [seqs[0].id, seqs[1].id] and batch.total_tokens_num == 60
    batch, _ = step(sched)
    assert is_prefill(batch) and batch.req_ids == [seqs[2].id]


def test_prompt_longer_than_budget_runs_alone():
    sched = make_scheduler(max_num_batched_tokens=32)
    long, short = make_seq(100), make_seq(4, start=500)
    sched.add(long)
    sched.add(short)
    batch, _ = step(sched)
    assert batch.req_ids == [long.id] and batch.num_scheduled_tokens == [100]
    batch, _ = step(sched)
    assert batch.req_ids == [short.id]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(4, start=i * 10, max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, _ = step(sched)
    assert batch.req_ids == [seqs[0].id, seqs[1].id]
    batch, finished = step(sched)  # the third may not join while two run
    assert not is_prefill(batch) and batch.req_ids == [seqs[0].id, seqs[1].id]
    assert finished == seqs[:2]
    batch, _ = step(sched)
    assert is_prefill(batch) and batch.req_ids == [seqs[2].id]


def test_fifo_admission_decodes_when_the_head_cannot_get_blocks():
    sched = make_scheduler(num_kvcache_blocks=4)
    a = make_seq(32)  # 2 blocks
    sched.add(a)
    step(sched)
    big, small = make_seq(48, start=100), make_seq(4, start=200)  # big needs 3, only 2 free
    sched.add(big)
    sched.add(small)
    batch, _ = step(sched)
    # small would fit, but admission is FIFO: the step decodes instead.
    assert not is_prefill(batch) and batch.req_ids == [a.id]
    assert list(sched.waiting) == [big, small]


def test_decode_preempts_the_last_running_request():
    sched = make_scheduler(num_kvcache_blocks=3)
    a, b, c = make_seq(16), make_seq(16, start=100), make_seq(16, start=200)
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # all three prefilled: pool full
    assert len(sched.block_manager.free_block_ids) == 0
    batch, _ = step(sched)
    # a needs a block: c (last) is preempted, then b, and a gets a block.
    assert batch.req_ids == [a.id]
    assert list(sched.waiting) == [b, c]  # front of the queue, original order kept
    assert b.status == c.status == SequenceStatus.WAITING
    assert b.block_table == [] and c.block_table == []
    assert list(sched.running) == [a]
    assert len(a.block_table) == 2 and len(sched.block_manager.free_block_ids) == 1
    # b needs 2 blocks for its 17 tokens, only 1 is free: a decodes alone.
    batch, _ = step(sched)
    assert not is_prefill(batch) and batch.req_ids == [a.id]
    sched.abort(a.id)
    # A preempted request re-prefills its prompt plus what it generated.
    batch, _ = step(sched)
    assert is_prefill(batch) and batch.req_ids == [b.id] and batch.num_scheduled_tokens == [17]
    assert list(sched.waiting) == [c]


def test_request_that_outgrows_the_whole_pool_finishes_unschedulable():
    sched = make_scheduler(num_kvcache_blocks=2, enable_prefix_caching=True)
    a = make_seq(31, max_tokens=100)
    sched.add(a)
    step(sched)  # prefill: 32 tokens now, 2 blocks
    step(sched)  # decode writes position 31, still in block 2; 33 tokens now
    assert sched.schedule() is None  # it needs a 3rd block: preempted, then unschedulable
    assert a.is_finished and a.leave_reason.startswith("unschedulable")
    assert "3 KV blocks" in a.leave_reason and "pool has 2" in a.leave_reason
    assert sched.pop_finished() == [a]
    assert sched.pop_finished() == []
    bm = sched.block_manager
    assert len(bm.free_block_ids) == 2 and bm.used_block_ids == set()


@pytest.mark.parametrize(
    "config, seq, reason",
    [
        ({"max_model_len": 10}, lambda: make_seq(11), "unschedulable: 11 tokens exceed max_model_len=10"),
        ({"num_kvcache_blocks": 2}, lambda: make_seq(33), "unschedulable: 33 tokens need 3 KV blocks"),
        ({}, lambda: Sequence([1, 2], 16, has_per_req_cache=True), "unschedulable: the request needs a per-request"),
    ],
)
def test_unschedulable_requests_finish_at_once_and_block_nothing(config, seq, reason):
    sched = make_scheduler(**config)
    got = []
    bad = seq()
    bad.stream_callback = got.append
    ok = make_seq(4, start=900)
    sched.add(bad)
    sched.add(ok)
    assert bad.is_finished and bad.leave_reason.startswith(reason)
    assert got == [RequestOutput(bad.id, [], True, bad.leave_reason)]
    assert sched.pop_finished() == [bad]
    batch, _ = step(sched)
    assert batch.req_ids == [ok.id]


def test_add_rejects_mismatched_block_size():
    with pytest.raises(ValueError, match="block_size=1, the scheduler's kv_cache_block_size is 16"):
        make_scheduler().add(Sequence([1], 1))


def test_prefix_cache_hits_reduce_scheduled_tokens():
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=40)
    a = make_seq(40)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(32)) + [700, 701, 702, 703, 704, 705, 706, 707])  # 40 tokens, 32 cached
    c = make_seq(list(range(32)) + [800])
    sched.add(b)
    sched.add(c)
    batch, _ = step(sched)
    # Within the 40-token budget only because cached tokens do not count.
    assert batch.req_ids == [b.id, c.id]
    assert batch.num_cached_tokens == [32, 32]
    assert batch.num_scheduled_tokens == [8, 1]
    assert batch.scheduled_tokens == [700, 701, 702, 703, 704, 705, 706, 707, 800]
    assert batch.block_tables[0][:2] == batch.block_tables[1][:2] == a.block_table[:2]


def test_stop_conditions_and_their_order():
    sched = make_scheduler(eos_token_id=2, stop_token_ids=[5])
    mk = lambda **kw: make_seq(3, start=10, **kw)  # noqa: E731
    seqs = {
        "eos": mk(),
        "stop_5": mk(),
        "stop_sequence": Sequence([10, 11, 12], 16, SamplingParams(), stop_token_sequences=[[9, 2]]),
        "max_tokens": mk(max_tokens=1),
        "ignored": mk(ignore_eos=True, max_tokens=3),
    }
    for s in seqs.values():
        sched.add(s)
    step(
        sched,
        {
            seqs["eos"].id: (7,),
            seqs["stop_5"].id: (7,),
            seqs["stop_sequence"].id: (9,),
            seqs["max_tokens"].id: (2,),
            seqs["ignored"].id: (2,),
        },
    )
    # max_tokens=1 with EOS sampled: EOS is checked first.
    assert seqs["max_tokens"].leave_reason == "eos"
    batch, finished = step(
        sched, {seqs["eos"].id: (2,), seqs["stop_5"].id: (7,), seqs["stop_sequence"].id: (2,), seqs["ignored"].id: (2,)}
    )
    assert seqs["eos"].leave_reason == "eos"
    assert seqs["stop_sequence"].leave_reason == "stop_sequence"  # [9, 2] beats EOS
    assert seqs["stop_5"].status == SequenceStatus.RUNNING
    assert seqs["ignored"].status == SequenceStatus.RUNNING  # EOS ignored
    batch, finished = step(sched, 5)
    assert seqs["stop_5"].leave_reason == "stop_5"
    assert seqs["ignored"].leave_reason == "max_tokens"  # stop ids are ignored with EOS too
    assert seqs["ignored"].completion_token_ids == [2, 2, 5]
    assert not sched.running and sched.schedule() is None
    bm = sched.block_manager
    assert len(bm.free_block_ids) == 64 and not bm.used_block_ids


def test_finished_sequences_are_returned_freed_and_timed():
    sched = make_scheduler()
    a = make_seq(20, max_tokens=2)
    sched.add(a)
    _, finished = step(sched)
    assert finished == [] and a.first_token_time >= a.arrive_time > 0
    _, finished = step(sched)
    assert finished == [a]
    assert a.status == SequenceStatus.FINISHED and a.leave_reason == "max_tokens"
    assert a.leave_time >= a.first_token_time
    assert a.block_table == [] and len(sched.block_manager.free_block_ids) == 64
    assert not sched.running


def test_max_model_len_ends_generation():
    sched = make_scheduler(max_model_len=6)
    a = make_seq(4, max_tokens=100)
    sched.add(a)
    step(sched)
    _, finished = step(sched)
    assert finished == [a] and a.leave_reason == "max_model_len" and a.num_tokens == 6


def test_stream_queue_and_callbacks():
    q = queue.Queue()
    sched = make_scheduler(eos_token_id=0)
    got = []
    a = Sequence([1, 2], 16, SamplingParams(max_tokens=2), stream_callback=got.append)
    b = make_seq(3, start=10, max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched, 4, q)
    assert q.get_nowait() == [RequestOutput(a.id, [4], False, None), RequestOutput(b.id, [4], False, None)]
    step(sched, {a.id: (6,), b.id: (0,)}, q)
    assert q.get_nowait() == [RequestOutput(a.id, [6], True, "max_tokens"), RequestOutput(b.id, [0], True, "eos")]
    assert got == [RequestOutput(a.id, [4], False, None), RequestOutput(a.id, [6], True, "max_tokens")]
    assert q.empty()


def test_a_raising_callback_does_not_stop_other_requests():
    sched = make_scheduler()

    def boom(_):
        raise RuntimeError("client went away")

    a = Sequence([1], 16, SamplingParams(max_tokens=2), stream_callback=boom)
    b = make_seq(2, start=5, max_tokens=2)
    sched.add(a)
    sched.add(b)
    step(sched)
    _, finished = step(sched)
    assert finished == [a, b]


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(enable_prefix_caching=True)
    got = []
    a = Sequence(list(range(40)), 16, stream_callback=got.append)
    b = make_seq(20, start=100)
    sched.add(a)
    step(sched)
    sched.add(b)
    assert sched.abort(b.id) is b  # waiting
    assert sched.abort(a.id) is a  # running
    assert sched.abort(12345) is None
    assert a.leave_reason == b.leave_reason == "abort"
    assert a.status == b.status == SequenceStatus.FINISHED
    assert got[-1] == RequestOutput(a.id, [], True, "abort")
    assert sched.pop_finished() == [b, a]
    bm = sched.block_manager
    assert len(bm.free_block_ids) == 64 and not bm.used_block_ids
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert sched.schedule() is None and not sched.has_unfinished_requests()


def test_postprocess_skips_requests_aborted_after_scheduling():
    sched = make_scheduler()
    a, b = make_seq(3), make_seq(3, start=10)
    sched.add(a)
    sched.add(b)
    batch, seqs = sched.schedule()
    sched.abort(a.id)
    finished = sched.postprocess(list(seqs.values()), ScheduledBatchOutput({a.id: (1,), b.id: (1,)}, None))
    assert finished == [] and a.num_tokens == 3 and b.num_tokens == 4


def test_per_request_cache_groups_gate_admission():
    sched = make_scheduler(num_per_req_cache_groups=1)
    a = Sequence([1, 2], 16, SamplingParams(max_tokens=2), has_per_req_cache=True)
    b = Sequence([3, 4], 16, SamplingParams(max_tokens=2), has_per_req_cache=True)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.req_ids == [a.id] and batch.per_req_cache_groups == [0]
    batch, _ = step(sched)  # b waits for a's group; a finishes
    assert batch.req_ids == [a.id] and a.per_req_cache_group == -1
    batch, _ = step(sched)
    assert batch.req_ids == [b.id] and b.per_req_cache_group == 0


def test_preemption_returns_the_per_request_group():
    sched = make_scheduler(num_kvcache_blocks=2, num_per_req_cache_groups=2)
    a = Sequence(list(range(16)), 16, SamplingParams(max_tokens=50), has_per_req_cache=True)
    b = Sequence(list(range(100, 116)), 16, SamplingParams(max_tokens=50), has_per_req_cache=True)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # a needs a block: b preempted
    assert b.per_req_cache_group == -1 and list(sched.block_manager.per_req_cache_free_groups) == [1]


def test_delay_factor_holds_prefills_while_decoding():
    sched = make_scheduler(scheduler_delay_factor=1.0)
    a = make_seq(4, max_tokens=100)
    sched.add(a)
    step(sched)  # nothing running: passes at once
    sched.last_prompt_latency = 1000.0  # as if the last prefill took very long
    sched.prev_prompt = False
    b = make_seq(4, start=50)
    sched.add(b)
    batch, _ = step(sched)
    assert not is_prefill(batch)  # b has not waited delay_factor * latency yet
    b.arrive_time -= 2000.0
    batch, _ = step(sched)
    assert is_prefill(batch) and batch.req_ids == [b.id]


def test_speculative_decode_reserves_slots_and_counts_acceptance():
    sched = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=1), eos_token_id=3)
    assert sched.mtp_k == 1 and sched.use_spec
    a = make_seq(15, max_tokens=10)
    sched.add(a)
    batch, seqs = sched.schedule()
    sched.postprocess(list(seqs.values()), ScheduledBatchOutput({a.id: (100,)}, {a.id: [101]}))
    assert a.spec_token_ids == [101]
    batch, seqs = sched.schedule()
    assert batch.num_spec_step == 1
    assert batch.scheduled_spec_decode_tokens == {a.id: [101]}
    assert batch.num_scheduled_tokens == [2] and batch.scheduled_tokens == [100, 101]
    assert len(a.block_table) == 2  # positions 15 and 16: a second block
    sched.postprocess(list(seqs.values()), ScheduledBatchOutput({a.id: (101, 102)}, {a.id: [103]}))
    assert a.completion_token_ids == [100, 101, 102]
    assert (sched.total_draft_tokens, sched.total_accepted_tokens) == (1, 1)
    batch, seqs = sched.schedule()
    # EOS inside the accepted tokens ends the request; what follows it is dropped.
    finished = sched.postprocess(list(seqs.values()), ScheduledBatchOutput({a.id: (3, 104)}, {a.id: [105]}))
    assert finished == [a] and a.leave_reason == "eos" and a.completion_token_ids == [100, 101, 102, 3]
    assert a.spec_token_ids == []


def test_a_verify_step_trims_drafts_to_the_token_budget_even_in_its_first_row():
    sched = make_scheduler(
        speculative_config=SpeculativeConfig(num_speculative_tokens=4), max_num_batched_tokens=2, eos_token_id=None
    )
    a = make_seq(2, max_tokens=20)
    sched.add(a)
    for _ in range(3):
        batch, seqs = sched.schedule()
        assert sum(batch.num_scheduled_tokens) <= 2
        sched.postprocess(seqs, ScheduledBatchOutput({a.id: (7,)}, {a.id: [7, 7, 7, 7]}))
    assert batch.num_scheduled_tokens == [2] and batch.scheduled_spec_decode_tokens == {a.id: [7]}


def test_what_schedule_returns_for_each_queue_state():
    sched = make_scheduler(num_kvcache_blocks=4)
    assert sched.schedule() is None and sched.is_finished()  # neither queue
    a = make_seq(20, max_tokens=50)
    sched.add(a)
    assert sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 1
    batch, seqs = sched.schedule()  # waiting only: prefill
    assert is_prefill(batch) and list(seqs) == [a.id]
    sched.postprocess(seqs, ScheduledBatchOutput({a.id: (1,)}))
    batch, seqs = sched.schedule()  # running only: decode
    assert not is_prefill(batch) and list(seqs) == [a.id]
    sched.postprocess(seqs, ScheduledBatchOutput({a.id: (1,)}))
    b = make_seq(8, start=100)
    sched.add(b)
    batch, seqs = sched.schedule()  # both, and the head fits: prefill only
    assert is_prefill(batch) and list(seqs) == [b.id]
    sched.postprocess(seqs, ScheduledBatchOutput({b.id: (1,)}))
    c = make_seq(40, start=200)  # 3 blocks, 1 free
    sched.add(c)
    batch, seqs = sched.schedule()  # both, and the head does not fit: decode
    assert not is_prefill(batch) and list(seqs) == [a.id, b.id]
    assert sched.get_num_unfinished_requests() == 3


def test_adding_the_same_request_twice_is_an_error():
    sched = make_scheduler()
    a = make_seq(3)
    sched.add(a)
    with pytest.raises(ValueError, match=f"a request with id {a.id} is already queued"):
        sched.add(Sequence([1], 16, id=a.id))
    step(sched)
    with pytest.raises(ValueError, match="only a new WAITING sequence"):
        sched.add(a)


class AtomStyleConfig:
    """A stand-in with only the fields ATOM's Config has (ATOM's own tests build its Scheduler
    and BlockManager from one), block size 4 included."""

    def __init__(self, **overrides):
        fields = dict(
            kv_cache_block_size=4,
            num_kvcache_blocks=10,
            enable_prefix_caching=False,
            enable_chunked_prefill=True,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=0,
            max_model_len=64,
            bos_token_id=1,
            eos_token_id=2,
            stop_token_ids=[],
            scheduler_delay_factor=0.0,
            speculative_config=None,
        )
        for name, value in {**fields, **overrides}.items():
            setattr(self, name, value)


def test_a_stand_in_config_with_atoms_fields_drives_the_scheduler_as_atom_would():
    sched = Scheduler(AtomStyleConfig())
    a, b = (
        Sequence([5, 6, 7, 8, 9], 4, SamplingParams(max_tokens=3)),
        Sequence([5, 6, 7], 4, SamplingParams(max_tokens=2)),
    )
    sched.add(a)
    sched.add(b)
    steps = []
    while (scheduled := sched.schedule()) is not None:
        batch, seqs = scheduled
        steps.append((batch.req_ids, batch.num_scheduled_tokens))
        sched.postprocess(seqs, ScheduledBatchOutput({r: (7,) for r, s in zip(batch.req_ids, batch.do_sample) if s}))
    # ATOM's scheduling (no policy named: prefill_first): both prompts, then decode steps.
    assert steps == [([a.id, b.id], [5, 3]), ([a.id, b.id], [1, 1]), ([a.id], [1])]
    assert (a.leave_reason, b.leave_reason) == ("max_tokens", "max_tokens")
    assert sched.block_manager.num_free_blocks == 10
    bm = BlockManager(AtomStyleConfig(enable_prefix_caching=True))
    seq = Sequence(list(range(10, 19)), 4, SamplingParams())
    bm.allocate(seq)
    assert [bm.blocks[i].hash != -1 for i in seq.block_table] == [True, True, False]


def test_update_spec_stats_counts_as_atom_does():
    sched = make_scheduler(speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    sched.update_spec_stats(3)
    sched.update_spec_stats(4)
    assert (sched.total_draft_tokens, sched.total_accepted_tokens) == (4, 3)
