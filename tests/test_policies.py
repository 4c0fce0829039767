"""Scheduling policies at the Scheduler level: chunked prefill, `mixed`, the plugin point."""

from __future__ import annotations

import pytest
from conftest import make_seq, record_preemptions

from atom_core import (
    Config,
    RegistryError,
    SamplingParams,
    ScheduledBatchOutput,
    Scheduler,
    Sequence,
    SequenceType,
    hookimpl,
)
from atom_core.sched.policy import SchedulingPolicy, StepBuilder


def sched_for(policy: str, **config) -> Scheduler:
    config.setdefault("num_kvcache_blocks", 64)
    return Scheduler(Config(scheduling_policy=policy, **config))


def run_step(sched: Scheduler, token: int = 7):
    """Schedule, 'sample' `token` for every row that samples, postprocess."""
    batch, seqs = sched.schedule()
    out = {rid: (token,) for rid, s in zip(batch.req_ids, batch.do_sample) if s}
    finished = sched.postprocess(seqs, ScheduledBatchOutput(out))
    return batch, finished


def rows(batch) -> dict[int, int]:
    return dict(zip(batch.req_ids, batch.num_scheduled_tokens))


# -- chunked prefill ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["prefill_first", "mixed"])
def test_a_150_token_prompt_with_budget_64_runs_as_64_64_22(policy):
    sched = sched_for(policy, max_num_batched_tokens=64)
    seq = make_seq(150, max_tokens=3)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        batch, _ = run_step(sched)
        chunks.append(batch.num_scheduled_tokens)
    assert chunks == [[64], [64], [22]]
    assert seq.num_completion_tokens == 1  # only the last chunk sampled


def test_two_128_token_prompts_with_budget_192_run_as_128_64_then_64():
    sched = sched_for("prefill_first", max_num_batched_tokens=192)
    a, b = make_seq(128, max_tokens=4), make_seq(128, start=500, max_tokens=4)
    sched.add(a)
    sched.add(b)
    first, _ = run_step(sched)
    assert rows(first) == {a.id: 128, b.id: 64}
    assert first.do_sample == [True, False]
    second, _ = run_step(sched)
    assert rows(second) == {b.id: 64}  # the ongoing chunk goes before decoding a (prefill first)
    third, _ = run_step(sched)
    assert rows(third) == {a.id: 1, b.id: 1}


def test_long_prefill_token_threshold_caps_a_chunk_and_floors_it():
    sched = sched_for("mixed", max_num_batched_tokens=256, long_prefill_token_threshold=40)
    seq = make_seq(100, max_tokens=2)
    sched.add(seq)
    sizes = [run_step(sched)[0].num_scheduled_tokens for _ in range(3)]
    assert sizes == [[32], [32], [36]]  # 40 floored to 2 blocks; the last chunk is whole


def test_a_truncated_chunk_is_floored_unless_the_step_would_be_empty():
    sched = sched_for("mixed", max_num_batched_tokens=40)
    seq = make_seq(100, max_tokens=2)
    sched.add(seq)
    assert run_step(sched)[0].num_scheduled_tokens == [32]
    # A budget under one block: flooring would leave the step empty, so the chunk is not floored.
    small = sched_for("mixed", max_num_batched_tokens=10)
    small.add(make_seq(25, max_tokens=2))
    assert [run_step(small)[0].num_scheduled_tokens for _ in range(3)] == [[10], [10], [5]]


def test_under_mixed_a_chunk_that_floors_to_zero_waits_for_the_next_step():
    sched = sched_for("mixed", max_num_batched_tokens=16)
    a = make_seq(4, max_tokens=3)
    sched.add(a)
    run_step(sched)  # a prefilled, now decoding
    b = make_seq(40, start=100, max_tokens=2)
    sched.add(b)
    batch, _ = run_step(sched)
    assert rows(batch) == {a.id: 1}  # 15 tokens left floor to 0 blocks: b waits
    run_step(sched)  # a finishes (max_tokens=3)
    assert rows(run_step(sched)[0]) == {b.id: 16}


def test_a_middle_chunk_emits_nothing_and_ttft_is_set_at_the_last_chunk():
    sched = sched_for("mixed", max_num_batched_tokens=32)
    seen = []
    seq = Sequence(list(range(70)), 16, SamplingParams(max_tokens=2), stream_callback=seen.append)
    sched.add(seq)
    batch, _ = sched.schedule()
    assert batch.do_sample == [False]
    # The runner sends nothing for a middle chunk; a token sent anyway is ignored.
    sched.postprocess({seq.id: seq}, ScheduledBatchOutput({seq.id: (5,)}))
    assert seq.num_completion_tokens == 0 and seq.first_token_time == 0.0 and seen == []
    assert seq.num_computed_tokens == 32 and seq.type == SequenceType.PREFILL
    run_step(sched)
    assert seq.first_token_time == 0.0
    batch, _ = run_step(sched)  # 6 tokens: the last chunk
    assert batch.num_scheduled_tokens == [6] and batch.do_sample == [True]
    assert seq.first_token_time > 0 and seq.num_completion_tokens == 1
    assert [o.output_tokens for o in seen] == [[7]]


def test_chunking_off_keeps_a_long_prompt_whole():
    sched = sched_for("prefill_first", max_num_batched_tokens=64, enable_chunked_prefill=False)
    a, b = make_seq(100, max_tokens=2), make_seq(10, start=200, max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert rows(run_step(sched)[0]) == {a.id: 100}  # alone, past the budget
    assert rows(run_step(sched)[0]) == {b.id: 10}


def test_mixed_with_chunking_off_runs_a_prompt_over_the_whole_budget_alone():
    sched = sched_for("mixed", max_num_batched_tokens=64, enable_chunked_prefill=False)
    a = make_seq(10, max_tokens=5)
    sched.add(a)
    run_step(sched)
    b, c = make_seq(100, start=300, max_tokens=2), make_seq(60, start=500, max_tokens=2)
    sched.add(b)
    assert rows(run_step(sched)[0]) == {b.id: 100}  # alone: a's decode waits one step
    sched.add(c)
    assert rows(run_step(sched)[0]) == {a.id: 1, b.id: 1, c.id: 60}  # 62 tokens: within the budget


def test_prefix_hits_count_as_done_under_chunking():
    sched = sched_for("mixed", max_num_batched_tokens=32, enable_prefix_caching=True)
    first = make_seq(64, max_tokens=1)
    sched.add(first)
    while sched.has_unfinished_requests():
        run_step(sched)
    second = make_seq(list(range(64)) + [900, 901], max_tokens=1)
    sched.add(second)
    batch, _ = run_step(sched)
    assert batch.num_cached_tokens == [64] and batch.num_computed_tokens == [64]
    assert batch.num_scheduled_tokens == [2]


def test_preempting_a_partial_prefill_frees_its_blocks_and_restarts_it():
    sched = sched_for("mixed", max_num_batched_tokens=32, num_kvcache_blocks=6)
    a = make_seq(40, max_tokens=30)
    sched.add(a)
    while a.type != SequenceType.DECODE:
        run_step(sched)
    b = make_seq(60, start=100, max_tokens=2)
    sched.add(b)
    run_step(sched)  # a decodes; b's first chunk: the 31 tokens left floored to 16
    assert b.num_computed_tokens > 0 and b.type == SequenceType.PREFILL
    preempted = record_preemptions(sched)
    while b.id not in preempted and sched.has_unfinished_requests():
        run_step(sched)
    assert b.id in preempted
    while sched.has_unfinished_requests():
        run_step(sched)
    assert b.num_completion_tokens == 2 and a.num_completion_tokens == 30
    assert sched.block_manager.num_free_blocks == 6


# -- mixed ---------------------------------------------------------------------------------


def test_mixed_carries_every_decode_while_a_300_token_prompt_is_chunked():
    sched = sched_for("mixed", max_num_batched_tokens=48)
    decoders = [make_seq(5, start=10 * i, max_tokens=40) for i in range(3)]
    for s in decoders:
        sched.add(s)
    run_step(sched)
    long = make_seq(300, start=1000, max_tokens=2)
    sched.add(long)
    chunk_steps = 0
    while long.num_completion_tokens == 0:
        batch, _ = run_step(sched)
        assert batch.req_ids[:3] == [s.id for s in decoders]  # decode rows first, every one of them
        assert batch.num_scheduled_tokens[:3] == [1, 1, 1]
        assert batch.total_seqs_num_decode == 3 and batch.total_seqs_num_prefill == 1
        assert batch.total_tokens_num <= 48
        chunk_steps += 1
    assert chunk_steps == 9  # 45 tokens left each step: eight chunks floored to 32, then the last 44 whole
    assert long.num_computed_tokens == 300


def test_prefill_first_stalls_decodes_while_prompt_chunks_run():
    sched = sched_for("prefill_first", max_num_batched_tokens=48)
    a = make_seq(5, max_tokens=40)
    sched.add(a)
    run_step(sched)
    long = make_seq(100, start=1000, max_tokens=2)
    sched.add(long)
    kinds = []
    while long.num_completion_tokens == 0:
        batch, _ = run_step(sched)
        kinds.append(list(batch.req_ids))
    assert kinds == [[long.id]] * 3  # 48, 48, 4: a waits
    assert rows(run_step(sched)[0]) == {a.id: 1, long.id: 1}


# -- the plugin point ----------------------------------------------------------------------


class ShortestFirst(SchedulingPolicy):
    """An out-of-tree policy: decodes first, then admits the shortest waiting prompt first."""

    def schedule(self, step: StepBuilder) -> None:
        for seq in step.decoding() + step.prefilling():
            step.schedule(seq)
        for seq in sorted(step.waiting(), key=lambda s: s.num_tokens):
            step.admit(seq)


class ShortestFirstPlugin:
    @hookimpl
    def atom_register_scheduler_policies(self, registry):
        registry.register("shortest_first", ShortestFirst)


def test_an_out_of_tree_policy_is_picked_by_name(plugin_manager):
    plugin_manager.register(ShortestFirstPlugin(), name="shortest-first")
    sched = sched_for("shortest_first", max_num_batched_tokens=24)
    long, short = make_seq(20, max_tokens=3), make_seq(8, start=100, max_tokens=3)
    sched.add(long)
    sched.add(short)
    assert isinstance(sched.policy, ShortestFirst)
    batch, _ = run_step(sched)
    assert rows(batch) == {short.id: 8, long.id: 16}  # short first; long's chunk floored to one block
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(
        RegistryError, match="unknown scheduling policy .nope.. Known scheduling policies: mixed.*prefill_first.*spyre"
    ):
        sched_for("nope")


def register_policy(pm, name: str, cls: type) -> None:
    """Register `cls` as scheduling policy `name` through an in-process plugin."""

    class Plugin:
        @hookimpl
        def atom_register_scheduler_policies(self, registry):
            registry.register(name, cls)

    pm.register(Plugin(), name=f"{name}-plugin")


def test_a_policy_that_schedules_nothing_is_an_error_not_a_hang(plugin_manager):
    class Idle(SchedulingPolicy):
        def schedule(self, step):
            pass

    register_policy(plugin_manager, "idle", Idle)
    sched = sched_for("idle")
    sched.add(make_seq(4))
    with pytest.raises(RuntimeError, match="'idle' scheduled nothing with 1 waiting and 0 running"):
        sched.schedule()


def test_config_checks_chunk_settings():
    def spyre(**config):
        return Scheduler(Config(scheduling_policy="spyre", num_kvcache_blocks=64, **config)).policy

    with pytest.raises(ValueError, match="prefill_chunk_size must be a multiple of kv_cache_block_size=16, got 100"):
        spyre(additional_config={"prefill_chunk_size": 100})
    with pytest.raises(ValueError, match="prefill_chunk_size must be a positive integer, got 0"):
        spyre(additional_config={"prefill_chunk_size": 0})
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be 0 .* got 8"):
        Config(long_prefill_token_threshold=8)
    assert spyre(max_num_batched_tokens=100).chunk_size == 96
    with pytest.raises(ValueError, match="prefill chunk of 16 tokens .* exceeds max_num_batched_tokens=8"):
        spyre(max_num_batched_tokens=8)  # the chunk is at least one block
    assert Config().scheduling_policy == "mixed" and Config().enable_chunked_prefill is True


def test_a_registered_policy_that_is_not_a_scheduling_policy_is_refused_by_name(plugin_manager):
    class NotAPolicy:
        pass

    register_policy(plugin_manager, "not_a_policy", NotAPolicy)
    with pytest.raises(
        TypeError, match="'not_a_policy' is registered as .*not a subclass of atom_core.sched.policy.SchedulingPolicy"
    ):
        Scheduler(Config(num_kvcache_blocks=8, scheduling_policy="not_a_policy"))
