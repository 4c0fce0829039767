"""The `spyre` policy: sendnn-inference's scheduling rules and padding, each with numbers."""

from __future__ import annotations

import random

import attrs
import pytest
from conftest import make_seq

from atom_core import Config, ScheduledBatchOutput, Scheduler, SpeculativeConfig
from atom_core.sched.policies.spyre import SpyreOptions, batch_tkv_volume

BS = 16


def spyre(**config) -> Scheduler:
    config.setdefault("num_kvcache_blocks", 128)
    config.setdefault("prefill_chunk_size", 64)
    config.setdefault("max_model_len", 2048)
    own = {f.name for f in attrs.fields(SpyreOptions)}  # the policy's settings, not Config's
    options = {k: config.pop(k) for k in list(config) if k in own}
    return Scheduler(Config(scheduling_policy="spyre", additional_config=options, **config))


def run_step(sched: Scheduler):
    batch, seqs = sched.schedule()
    out = {rid: (7,) for rid, s in zip(batch.req_ids, batch.do_sample) if s}
    sched.postprocess(seqs, ScheduledBatchOutput(out))
    return batch


def kind(batch) -> str:
    return "P" if batch.total_seqs_num_prefill else "D"


def drain(sched: Scheduler, limit: int = 10_000) -> list:
    batches = []
    while sched.has_unfinished_requests() and len(batches) < limit:
        batches.append(run_step(sched))
    return batches


# -- prefill padding and chunks ------------------------------------------------------------


def test_a_302_token_prompt_runs_in_three_padded_chunks():
    sched = spyre(prefill_chunk_size=128)
    seq = make_seq(302, max_tokens=2)
    sched.add(seq)
    chunks = [run_step(sched) for _ in range(3)]
    # Right-padded to 304, left-padded by 80 tokens (5 blocks) to 384 = 3 chunks of 128.
    assert [b.num_scheduled_tokens for b in chunks] == [[48], [128], [126]]
    assert [b.left_pad_blocks for b in chunks] == [[5], [5], [5]]
    assert [b.tkvs for b in chunks] == [[128], [256], [382]]
    assert [b.do_sample for b in chunks] == [[False], [False], [True]]
    assert all(b.pad_block == 0 for b in chunks)


def test_a_15_token_prompt_is_one_chunk_left_padded_by_seven_blocks():
    sched = spyre(prefill_chunk_size=128)
    sched.add(make_seq(15, max_tokens=2))
    batch = run_step(sched)
    assert batch.num_scheduled_tokens == [15] and batch.left_pad_blocks == [7] and batch.tkvs == [127]


def test_block_0_is_the_padding_block_and_never_handed_out():
    sched = spyre(num_kvcache_blocks=12)
    assert 0 in sched.block_manager.reserved_block_ids and 0 not in sched.block_manager.free_block_ids
    for i in range(4):
        sched.add(make_seq(40, start=100 * i, max_tokens=20))
    for batch in drain(sched):
        assert all(0 not in table for table in batch.block_tables)
    assert sched.block_manager.num_free_blocks == 11


# -- priority rules ------------------------------------------------------------------------


def test_one_prefill_at_a_time_and_an_ongoing_prefill_goes_first():
    sched = spyre(interleave_prefill_decode=False)
    a, b = make_seq(150, max_tokens=3), make_seq(40, start=500, max_tokens=3)
    sched.add(a)
    sched.add(b)
    steps = [run_step(sched) for _ in range(4)]
    # a: left pad 32, chunks of 32, 64, 54 real tokens; b starts only after a's last chunk.
    assert [b_.req_ids for b_ in steps[:3]] == [[a.id]] * 3
    assert [b_.num_scheduled_tokens for b_ in steps[:3]] == [[32], [64], [54]]
    assert steps[3].req_ids == [b.id]


def test_interleaving_forbids_two_prefill_steps_in_a_row_while_decoding():
    sched = spyre()
    a = make_seq(10, max_tokens=30)
    sched.add(a)
    run_step(sched)
    b = make_seq(150, start=500, max_tokens=3)  # three chunks
    sched.add(b)
    # a's prefill was the last step: a decode comes first, then chunk and decode alternate.
    assert "".join(kind(run_step(sched)) for _ in range(6)) == "DPDPDP"


def test_without_interleaving_prefill_chunks_run_back_to_back():
    sched = spyre(interleave_prefill_decode=False)
    a = make_seq(10, max_tokens=30)
    sched.add(a)
    run_step(sched)
    sched.add(make_seq(150, start=500, max_tokens=3))
    assert "".join(kind(run_step(sched)) for _ in range(4)) == "PPPD"


def test_first_chunk_needs_a_free_slot_in_the_batch():
    sched = spyre(max_num_seqs=2)
    a, b, c = make_seq(10, max_tokens=6), make_seq(10, start=100, max_tokens=20), make_seq(10, start=200, max_tokens=3)
    for s in (a, b, c):
        sched.add(s)
    trace = [(kind(x), x.req_ids) for x in drain(sched)]
    first_c = next(i for i, (_, ids) in enumerate(trace) if c.id in ids)
    last_a = max(i for i, (_, ids) in enumerate(trace) if a.id in ids)
    assert first_c == last_a + 1  # c waited for a to leave the batch; no idle step meanwhile
    assert all(ids for _, ids in trace)


def test_no_idle_step_while_a_prefill_is_held_back():
    sched = spyre(max_num_seqs=1)
    a, b = make_seq(10, max_tokens=5), make_seq(10, start=100, max_tokens=2)
    sched.add(a)
    sched.add(b)
    trace = "".join(kind(x) for x in drain(sched))
    assert trace == "PDDDDPD"  # b cannot start while a decodes: decode steps, never empty ones


# -- last-chunk constraints ------------------------------------------------------------------


def test_volumetric_example_from_the_seed_defers_the_prefill():
    """Three decoding requests and a new one: projected max-tkv 426 in a batch of 4 is
    1,704 > 1,536, so the prefill waits until a request finishes."""
    sched = spyre(max_batch_tkv_limit=1536, max_num_seqs=8)
    a, b, c = (make_seq(10, start=100 * i, max_tokens=m) for i, m in enumerate((390, 400, 410)))
    new = make_seq(40, start=900, max_tokens=387)
    for s in (a, b, c):
        sched.add(s)
    for _ in range(6):  # P a, D, P b, D, P c, D
        run_step(sched)
    sched.add(new)
    policy = sched.policy
    decoding = [a, b, c]
    rows = policy.decode_rows(new, decoding)  # (position at the next decode, decode steps left)
    assert rows == [(14, 386), (13, 397), (12, 408), (41, 386)]
    # At the next decode the new request would need 3 blocks: every other row is padded to 3.
    # Last tkvs: new 41 + 385 = 426 (the seed's figure); a 46 + 385 = 431, b 441, c 451.
    assert policy._last_tkvs(rows) == [431, 441, 451, 426]
    # While all four run, the max tkv is a's, 431 at its last step (the seed counts the new
    # request's 426): 4 x 431 = 1,724 > 1,536.
    assert batch_tkv_volume(rows, BS) == 4 * 431 == 1724
    assert not policy.last_chunk_fits(new, decoding)
    trace = []
    while new.num_computed_tokens == 0:
        trace.append(run_step(sched))
    assert all(kind(x) == "D" for x in trace[:-1]) and trace[-1].req_ids == [new.id]
    # Deferred until the first request finished (a, in the decode step just before), not longer.
    assert a.is_finished and a.id in trace[-2].req_ids and not b.is_finished
    assert len(trace) == 387  # a had 386 tokens left to generate


def stepped_volume(rows, bs):
    """batch_tkv_volume by its definition: every decode step ahead, one at a time."""
    peak = 0
    for t in range(1, max((r for _, r in rows), default=0) + 1):
        pos = [p + t - 1 for p, r in rows if r >= t]
        width = max(-(-q // bs) for q in pos)
        peak = max(peak, len(pos) * max((width - -(-q // bs)) * bs + q for q in pos))
    return peak


def test_batch_tkv_volume_is_the_largest_product_of_the_steps_ahead():
    assert batch_tkv_volume([], BS) == 0
    assert batch_tkv_volume([(10, 5)], BS) == 14  # alone: no padding, its last position
    # A short request beside a longer context: while both run the max tkv is the longer one's
    # (44 at the short one's last step, 2 x 44 = 88), not the short one's own last tkv (39).
    assert batch_tkv_volume([(41, 15), (4, 4)], BS) == 2 * 44
    rng = random.Random(0)
    for _ in range(2000):
        bs = rng.choice([1, 4, 16])
        rows = [(rng.randint(1, 80), rng.randint(1, 60)) for _ in range(rng.randint(1, 6))]
        assert batch_tkv_volume(rows, bs) == stepped_volume(rows, bs), (rows, bs)


def test_the_volume_limit_holds_at_every_decode_step():
    """A request admitted beside a longer context must count that context's tkv, not its own."""
    for limit, requests in ((88, [(40, 17), (3, 5)]), (600, None), (400, None)):
        rng = random.Random(limit)
        requests = requests or [(rng.randint(1, 120), rng.randint(2, 80)) for _ in range(6)]
        sched = spyre(max_batch_tkv_limit=limit, max_model_len=512, max_num_seqs=4)
        seqs = [make_seq(n, start=1000 * i, max_tokens=m) for i, (n, m) in enumerate(requests)]
        for seq in seqs:
            sched.add(seq)
        for batch in drain(sched):
            if kind(batch) == "D":
                assert len(batch.req_ids) * max(batch.tkvs) <= limit, (batch.req_ids, batch.tkvs)
        assert all(s.is_finished and s.leave_reason == "max_tokens" for s in seqs)


def test_max_model_len_holds_back_the_last_chunk_while_realignment_would_overflow():
    # r0 decodes towards 216 tokens. r1's last chunk (150 tokens: 10 blocks at its first
    # decode) would pad r0 to 10 blocks: r0's last tkv = (10 - r0's blocks) * 16 + 215,
    # over max_model_len=256 until r0 holds 8 blocks (113 tokens). Until then: held back.
    sched = spyre(max_model_len=256)
    r0 = make_seq(16, max_tokens=200)
    r1 = make_seq(150, start=500, max_tokens=50)
    sched.add(r0)
    run_step(sched)
    sched.add(r1)
    trace = []
    while not r1.num_completion_tokens:
        trace.append(run_step(sched))
    r1_rows = [x for x in trace if r1.id in x.req_ids]
    assert [x.num_scheduled_tokens for x in r1_rows] == [[32], [64], [54]]
    held = trace[trace.index(r1_rows[1]) + 1 : trace.index(r1_rows[2])]
    assert len(held) > 80 and all(x.req_ids == [r0.id] for x in held)  # decode steps only
    assert held[-1].context_lens == [112]  # r0 computed its 112th token; now 113 tokens, 8 blocks


def test_decode_batch_capacity_is_a_last_chunk_constraint():
    sched = spyre(max_num_seqs=2, interleave_prefill_decode=False)
    policy = sched.policy
    a, b = make_seq(10, max_tokens=50), make_seq(10, start=100, max_tokens=50)
    assert policy.last_chunk_fits(b, [a])
    assert not policy.last_chunk_fits(b, [a, make_seq(5, start=300)])


# -- decode padding and tkv ----------------------------------------------------------------------


def test_tkv_jumps_forward_and_backward_and_padding_stays_minimal():
    sched = spyre()
    long, short = make_seq(30, max_tokens=30), make_seq(5, start=500, max_tokens=15)
    sched.add(long)
    sched.add(short)
    decodes = [x for x in drain(sched) if kind(x) == "D" and len(x.req_ids) == 2]
    for x in decodes:
        ctx = dict(zip(x.req_ids, x.context_lens))
        pads = dict(zip(x.req_ids, x.left_pad_blocks))
        tkv = dict(zip(x.req_ids, x.tkvs))
        assert min(pads.values()) == 0  # minimal: the widest request has none
        assert {(t - 1) // BS for t in tkv.values()} == {max(pads[i] + -(-ctx[i] // BS) for i in ctx) - 1}
        assert all(tkv[i] == pads[i] * BS + ctx[i] for i in ctx)
    tkvs = [dict(zip(x.req_ids, x.tkvs)) for x in decodes]
    short_tkv = [t[short.id] for t in tkvs]
    long_tkv = [t[long.id] for t in tkvs]
    # The first two-row decode: long computes position 31 (2 blocks), short position 5 (1 block + 1 pad).
    assert (long_tkv[0], short_tkv[0]) == (32, 16 + 6)
    # long crosses into a third block: short gets one more padding block, its tkv jumps forward.
    assert (long_tkv[1], short_tkv[1]) == (33, 32 + 7)
    # short crosses into its second block: one padding block less, its tkv jumps backward.
    crossing = next(i for i in range(1, len(short_tkv)) if short_tkv[i] < short_tkv[i - 1])
    assert short_tkv[crossing - 1] == 32 + 16 and short_tkv[crossing] == 16 + 17


def test_padding_is_removed_when_the_long_request_finishes():
    sched = spyre()
    long, short = make_seq(40, max_tokens=4), make_seq(5, start=500, max_tokens=20)
    sched.add(long)
    sched.add(short)
    decodes = [x for x in drain(sched) if kind(x) == "D"]
    with_long = [x for x in decodes if long.id in x.req_ids]
    after = [x for x in decodes if long.id not in x.req_ids]
    assert with_long[-1].left_pad_blocks == [0, 2]  # short (1 block) padded to long's 3
    assert after[0].left_pad_blocks == [0] and after[0].tkvs == after[0].context_lens  # jumps back


# -- prefix caching ------------------------------------------------------------------------


def test_prefix_cache_skips_whole_chunks_and_redirects_the_boundary_chunk():
    sched = spyre(enable_prefix_caching=True)
    base = list(range(1000, 1200))
    first = make_seq(base, max_tokens=1)
    sched.add(first)
    drain(sched)
    # 200 tokens, left pad 48 (208 -> 256): chunks hold real [0,16) [16,80) [80,144) [144,200).
    # 128 cached tokens end at padded 176, inside chunk 2: chunks 0 and 1 are skipped,
    # chunk 2 is recomputed from 80 with its writes below 128 sent to the padding block.
    second = make_seq(base[:128] + list(range(5000, 5072)), max_tokens=1)
    sched.add(second)
    batch = run_step(sched)
    assert batch.num_cached_tokens == [128]
    assert batch.num_computed_tokens == [80] and batch.num_scheduled_tokens == [64]
    assert batch.pad_block == 0 and batch.left_pad_blocks == [3] and batch.tkvs == [48 + 144]
    last = run_step(sched)
    assert last.num_computed_tokens == [144] and last.num_scheduled_tokens == [56]


def test_a_fully_cached_prompt_still_recomputes_its_last_chunk():
    sched = spyre(enable_prefix_caching=True)
    base = list(range(1000, 1128))  # 128 tokens: no padding, two chunks of 64
    sched.add(make_seq(base, max_tokens=1))
    drain(sched)
    again = make_seq(base, max_tokens=1)
    sched.add(again)
    batch = run_step(sched)
    assert batch.num_cached_tokens == [112]  # the last block is never served from cache
    assert batch.num_computed_tokens == [64] and batch.num_scheduled_tokens == [64]


def test_spyre_refuses_speculative_decoding_and_requests_over_the_volume():
    with pytest.raises(ValueError, match="spyre.*speculative"):
        spyre(speculative_config=SpeculativeConfig(num_speculative_tokens=1))
    sched = spyre(max_batch_tkv_limit=100)
    seq = make_seq(50, max_tokens=60)
    sched.add(seq)
    assert seq.is_finished and "max_batch_tkv_limit=100" in seq.leave_reason
    assert "50 prompt tokens plus up to 60 new ones reach a decode tkv of 109" in seq.leave_reason
    # The prefill samples the first new token: 50 + 51 - 1 = 100 fits exactly (sendnn-inference's bound).
    fits = make_seq(50, max_tokens=51)
    sched.add(fits)
    assert not fits.is_finished
    with pytest.raises(ValueError, match="prefill chunk of 128 tokens exceeds max_batch_tkv_limit=96"):
        spyre(max_batch_tkv_limit=96, prefill_chunk_size=128, max_num_batched_tokens=128)


def test_configurations_spyre_cannot_run_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="prefill_chunk_size=128.* exceeds max_num_batched_tokens=32"):
        spyre(prefill_chunk_size=128, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        spyre(enable_chunked_prefill=False)
