"""Tensor-parallel layers at 2 ranks (gloo on loopback, one thread a rank): each rank holds the
expected slice of the checkpoint tensor, the slices put together give the whole weight, and the
layers' outputs equal the unsplit layer's."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from atom_core.distributed import parallel_state
from atom_core.distributed.communication import all_gather
from atom_core.distributed.parallel_state import ParallelGroup, destroy_tensor_parallel, init_tensor_parallel
from atom_core.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom_core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

WORLD = 2


def gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    return all_gather(t.detach().clone(), dim=dim)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check_layers(rank: int) -> None:
    torch.manual_seed(0)  # the same "checkpoint" and inputs on every rank
    x = torch.randn(5, 16)

    w, b = torch.randn(12, 16), torch.randn(12)
    col = ColumnParallelLinear(16, 12, bias=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert torch.equal(col.weight, w[rank * 6 : rank * 6 + 6])
    assert torch.equal(gathered(col.weight, 0), w)
    col.process_weights_after_loading()
    close(gathered(col(x), -1), F.linear(x, w, b))

    w2, b2 = torch.randn(10, 12), torch.randn(10)
    row = RowParallelLinear(12, 10, bias=True)
    row.weight.weight_loader(row.weight, w2)
    row.bias.weight_loader(row.bias, b2)
    assert torch.equal(row.weight, w2[:, rank * 6 : rank * 6 + 6])
    assert torch.equal(gathered(row.weight, 1), w2)
    row.process_weights_after_loading()
    h = torch.randn(5, 12)
    close(row(h[:, rank * 6 : rank * 6 + 6].contiguous()), F.linear(h, w2, b2))  # all-reduced: whole on each rank

    gate, up = torch.randn(8, 16), torch.randn(8, 16)
    merged = MergedColumnParallelLinear(16, {"gate": 8, "up": 8})
    merged.weight.weight_loader(merged.weight, gate, "gate")
    merged.weight.weight_loader(merged.weight, up, "up")
    assert torch.equal(merged.weight, torch.cat([gate[rank * 4 : rank * 4 + 4], up[rank * 4 : rank * 4 + 4]]))
    merged.process_weights_after_loading()
    g_local, u_local = merged.split(merged(x))
    close(gathered(g_local, -1), F.linear(x, gate))
    close(gathered(u_local, -1), F.linear(x, up))

    d = 4
    for num_kv_heads in (2, 1):  # split KV heads, and one KV head replicated on both ranks
        q, k, v = torch.randn(4 * d, 16), torch.randn(num_kv_heads * d, 16), torch.randn(num_kv_heads * d, 16)
        qkv = QKVParallelLinear(16, d, num_heads=4, num_kv_heads=num_kv_heads)
        for name, t in (("q", q), ("k", k), ("v", v)):
            qkv.weight.weight_loader(qkv.weight, t, name)
        kv = slice(rank * d, rank * d + d) if num_kv_heads == 2 else slice(0, d)
        assert qkv.num_heads == 2 and qkv.num_kv_heads == 1
        assert torch.equal(qkv.weight, torch.cat([q[rank * 2 * d : (rank + 1) * 2 * d], k[kv], v[kv]]))
        qkv.process_weights_after_loading()
        q_out, k_out, v_out = qkv.split(qkv(x))
        close(gathered(q_out, -1), F.linear(x, q))
        close(k_out, F.linear(x, k[kv]))

    table = torch.randn(11, 6)  # a vocabulary that does not divide: the last rank's tail is padding
    embed = VocabParallelEmbedding(11, 6)
    embed.weight.weight_loader(embed.weight, table)
    assert torch.equal(gathered(embed.weight, 0)[:11], table)
    ids = torch.tensor([0, 5, 6, 10, 3, 7])
    close(embed(ids), F.embedding(ids, table))
    head = ParallelLMHead(11, 6)
    head.weight.weight_loader(head.weight, table)
    head.process_weights_after_loading()
    hidden = torch.randn(3, 6)
    close(head.gather_logits(head(hidden)), F.linear(hidden, table))


def _rank_main(rank: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, WORLD, init_method=rendezvous, backend="gloo", timeout_s=60)
    try:
        check_layers(rank)
    finally:
        destroy_tensor_parallel()


def test_parallel_layers_at_two_ranks_equal_the_whole_layer(tmp_path):
    mp.start_processes(
        _rank_main, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=WORLD, join=True, start_method="spawn"
    )


def test_one_rank_touches_no_process_group_and_splits_nothing():
    assert parallel_state.get_tp_group() == ParallelGroup()
    col = ColumnParallelLinear(8, 6)
    assert col.weight.shape == (6, 8)
    assert init_tensor_parallel(0, 1).group is None
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: QKVParallelLinear(16, 4, num_heads=8, num_kv_heads=4), "attention heads: 8 does not divide among 3"),
        (
            lambda: QKVParallelLinear(16, 4, num_heads=6, num_kv_heads=2),
            "KV heads: 2 cannot be replicated evenly over 3",
        ),
        (lambda: ColumnParallelLinear(16, 10), "output features: 10 does not divide among 3"),
        (lambda: RowParallelLinear(16, 10), "input features: 16 does not divide among 3"),
        (lambda: MergedColumnParallelLinear(16, {"gate": 9, "up": 8}), "shard 'up': 8 does not divide among 3"),
    ],
)
def test_a_split_that_does_not_divide_names_the_counts(monkeypatch, make, says):
    monkeypatch.setattr(parallel_state, "_tp", ParallelGroup(rank=0, world_size=3))
    with pytest.raises(ValueError, match=says):
        make()


def test_a_backend_name_is_checked():
    assert parallel_state.resolve_backend("auto", "cpu") == "gloo"
    assert parallel_state.resolve_backend("auto", "cuda:0") == "nccl"
    with pytest.raises(ValueError, match="distributed_backend must be 'auto' or one of gloo, nccl, mpi, got 'tcp'"):
        parallel_state.resolve_backend("tcp", "cpu")


def test_a_split_parameter_reads_only_its_part_of_the_checkpoint(monkeypatch, tmp_path):
    """The loader hands split parameters a `CheckpointSlice` (safetensors' `get_slice`): rank 1 of 2
    reads its rows and columns, never the whole tensor; a shape that does not fit is named."""
    from safetensors.torch import save_file

    from atom_core.layers.checkpoint_slice import CheckpointSlice
    from atom_core.loading.checkpoint import load_model_weights

    monkeypatch.setattr(parallel_state, "_tp", ParallelGroup(rank=1, world_size=2))
    model = torch.nn.Module()
    model.col, model.row = ColumnParallelLinear(8, 6), RowParallelLinear(6, 8)
    col, row = torch.randn(6, 8), torch.randn(8, 6)
    save_file({"col.weight": col, "row.weight": row}, str(tmp_path / "model.safetensors"))
    reads = []
    narrow = CheckpointSlice.narrow
    monkeypatch.setattr(CheckpointSlice, "narrow", lambda self, *a: reads.append(a) or narrow(self, *a))
    load_model_weights(model, tmp_path)
    assert torch.equal(model.col.weight, col[3:]) and torch.equal(model.row.weight, row[:, 3:])
    assert reads == [(0, 3, 3), (1, 3, 3)]
    save_file({"col.weight": torch.randn(7, 8), "row.weight": row}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'col.weight'.*shape \(7, 8\) is not 2 parts of 3 along dimension 0"):
        load_model_weights(model, tmp_path)


def _shm_rank(rank: int, rendezvous: str, out: str) -> None:
    from atom_core.distributed.communication import all_gather, all_reduce, enable_shared_memory_collectives

    torch.set_num_threads(1)
    init_tensor_parallel(rank, WORLD, init_method=rendezvous, backend="gloo", timeout_s=60)
    try:
        g = torch.Generator().manual_seed(rank)
        xs = [torch.randn(n, generator=g) for n in (1, 576, 3 * 1000)] + [torch.randn(4, 7, generator=g).bfloat16()]
        by_gloo = [all_reduce(x.clone()) for x in xs] + [all_gather(xs[1], dim=0)]
        assert enable_shared_memory_collectives(30.0) and parallel_state.get_tp_group().shm is not None
        for _ in range(3):  # both sets of slots, in turn
            by_shm = [all_reduce(x.clone()) for x in xs] + [all_gather(xs[1], dim=0)]
        for a, b in zip(by_gloo, by_shm):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if a.dtype == torch.float32 else 1e-2)
        big = torch.ones(3 << 20)  # past a slot: gloo
        assert torch.equal(all_reduce(big), torch.full_like(big, WORLD))
        torch.save(by_shm, f"{out}/shm{rank}.pt")
    finally:
        destroy_tensor_parallel()


def test_shared_memory_collectives_equal_gloos_and_every_rank_gets_the_same_bits(tmp_path):
    mp.start_processes(
        _shm_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=WORLD, join=True,
        start_method="spawn",
    )  # fmt: skip
    ranks = [torch.load(tmp_path / f"shm{r}.pt") for r in range(WORLD)]
    for a, b in zip(*ranks):
        assert torch.equal(a, b)
