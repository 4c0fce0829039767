"""A step's batch as int64 data (`ScheduledBatch.to_ints` / `from_ints`), what rank 0 sends the
other tensor-parallel ranks: every field the model and the attention builders read survives,
locally and through a gloo broadcast between 2 processes."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_scheduler, make_seq

from atom_core.sched.batch import BATCH_HEADER_LEN, ScheduledBatch, ScheduledBatchOutput

FIELDS = (
    "req_ids", "num_scheduled_tokens", "num_computed_tokens", "num_cached_tokens", "context_lens", "do_sample",
    "block_tables", "scheduled_tokens", "per_req_cache_groups", "scheduled_spec_decode_tokens", "left_pad_blocks",
    "tkvs", "pad_block", "state_loads", "state_saves", "total_tokens_num", "total_tokens_num_prefill",
    "total_tokens_num_decode", "total_seqs_num", "total_seqs_num_prefill", "total_seqs_num_decode", "num_spec_step",
)  # fmt: skip


def assert_same(a: ScheduledBatch, b: ScheduledBatch) -> None:
    for name in FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def round_trip(batch: ScheduledBatch) -> ScheduledBatch:
    header, payload = batch.to_ints()
    assert len(header) == BATCH_HEADER_LEN
    return ScheduledBatch.from_ints(header, payload)


def scheduler_batches() -> list[ScheduledBatch]:
    """Mixed steps of a chunked-prefill scheduler: prompt chunks, decode rows, both."""
    sched = make_scheduler(scheduling_policy="mixed", enable_chunked_prefill=True, max_num_batched_tokens=24)
    for n in (40, 7, 19):
        sched.add(make_seq(n, max_tokens=3))
    batches = []
    while (step := sched.schedule()) is not None:
        batch, seqs = step
        batches.append(batch)
        sampled = {r: (5,) for r, last in zip(batch.req_ids, batch.do_sample) if last}
        sched.postprocess(seqs, ScheduledBatchOutput(sampled))
    return batches


def hand_built() -> ScheduledBatch:
    """Drafts, per-request state saves and loads, and a padding policy's fields."""
    a, b = make_seq(9), make_seq(5, start=100)
    a.block_table, b.block_table = [3, 4], [7]
    a.append_token(11)
    b.append_token(12)
    b.per_req_cache_group, b.has_per_req_cache = 2, True
    return ScheduledBatch(
        {a.id: a, b.id: b}, [3, 1], 4, total_tokens_num_decode=4, total_seqs_num=2, total_seqs_num_decode=2,
        num_spec_step=2, scheduled_spec_decode_tokens={a.id: [21, 22]},
        left_pad_blocks=[0, 1], tkvs=[64, 64], pad_block=0,
        state_loads={1: 5}, state_saves={0: [(16, 6), (8, 7)], 1: [(4, 8)]},
    )  # fmt: skip


def test_every_field_survives_the_round_trip():
    batches = scheduler_batches() + [hand_built()]
    assert any(b.total_seqs_num_prefill and b.total_seqs_num_decode for b in batches)  # a mixed step
    assert any(not all(b.do_sample) for b in batches)  # a middle prompt chunk
    for batch in batches:
        assert_same(round_trip(batch), batch)


def test_a_header_that_does_not_fit_is_refused():
    header, payload = hand_built().to_ints()
    with pytest.raises(ValueError, match="not a batch header of format 1"):
        ScheduledBatch.from_ints([99] + header[1:], payload)
    with pytest.raises(ValueError, match=f"describes {len(payload)} values, the payload has {len(payload) - 1}"):
        ScheduledBatch.from_ints(header, payload[:-1])


def _rank_main(rank: int, rendezvous: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        want = scheduler_batches() + [hand_built()]  # built alike on both ranks, sent from rank 0
        for batch in want:
            header = torch.zeros(BATCH_HEADER_LEN, dtype=torch.int64)
            if rank == 0:
                ints, values = batch.to_ints()
                header[:] = torch.tensor(ints)
            dist.broadcast(header, 0)
            payload = torch.tensor(values) if rank == 0 else torch.empty(int(header[1:].sum()), dtype=torch.int64)
            dist.broadcast(payload, 0)
            assert_same(ScheduledBatch.from_ints(header.tolist(), payload.tolist()), batch)
    finally:
        dist.destroy_process_group()


def test_a_batch_broadcast_over_gloo_arrives_whole(tmp_path):
    mp.start_processes(
        _rank_main, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=2, join=True, start_method="spawn"
    )
