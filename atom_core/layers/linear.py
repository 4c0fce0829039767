"""Linear layers whose GEMM is picked once the weights are loaded (vLLM's `process_weights_after_loading`).

`process_weights_after_loading` asks `pick_gemm` (gemm.py) for a float weight's GEMM, or
`pick_quantized_gemm` (quantized_gemm.py) for a layer given a quantized weight (`quant`,
set by `atom_core.loading.quantize`); the kernel keeps the weight in the layout it reads
(oneDNN's packed one, the streaming kernel's tiles, packed integer groups) and the plain
weight is dropped. An output projection gets the greedy screen (argmax_screen.py) or, when
quantized, `ExactTopLogits`. An embedding tied to a streamed head reads its rows from the
head's tiled copy (`StreamedEmbedding`), so a tied table is not held a third time. Other
devices keep `F.linear`. Why each kernel, with measurements: docs/kernels.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed.communication import all_reduce
from atom_core.distributed.parallel_state import divide, get_tp_group
from atom_core.layers.argmax_screen import ArgmaxScreen, screen_lm_head
from atom_core.layers.checkpoint_slice import materialize, reads_slices
from atom_core.layers.embedding import LookupEmbedding, replace_embedding, tied_embeddings
from atom_core.layers.gemm import Gemm, StreamingGemm, gemv_rows, pick_gemm
from atom_core.layers.quantized_gemm import pick_quantized_gemm
from atom_core.layers.quantized_weight import QuantizedWeight
from atom_core.platform.memory import weight_arena


class StreamedEmbedding(LookupEmbedding):
    """An embedding tied to a streamed LM head: its rows are read from the head's tiled copy,
    so the table is not held a third time (`process_weights`)."""

    def __init__(self, tiled: torch.Tensor, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.tiled = tiled

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return gemv_rows(self.tiled, ids, self.embedding_dim)


def batch_invariant_gemms(model: nn.Module) -> None:
    """Give every Linear of `model` one kernel for every row count, so a row's result does not
    depend on how many rows share its step (float weights: oneDNN at every row count, the
    streaming kernel's 1 to MAX_ROWS row path off; 4- and 8-bit groups: the streaming kernel at every
    row count, which rounds each row alike).

    Why: speculative decoding verifies a request's drafts in a step of k + 1 rows per
    request, and promises the tokens plain decoding (1 row per request) would give; a
    kernel that rounds differently at different row counts breaks that on near ties (at 4
    bits torch's kernel keeps 8 bits of the activations where the streaming kernel keeps 16).
    """
    for kernel in gemm_kernels(model):
        if hasattr(kernel, "make_batch_invariant"):
            kernel.make_batch_invariant()


def gemm_kernels(model: nn.Module) -> Iterator[Any]:
    """Every Linear's kernel objects: the GEMM itself, what it takes, and what that wraps (an LM head's)."""
    for m in model.modules():
        if isinstance(m, Linear):
            for kernel in (m.gemm, m.packed_weight, getattr(m.packed_weight, "kernel", None)):
                if kernel is not None:
                    yield kernel


class Linear(nn.Linear):
    gemm: Gemm = staticmethod(F.linear)
    packed_weight: Any = None  # set when `gemm` takes a repacked copy (or a quantized kernel)
    # Set by `quant.quantize_model` before kernels are picked: the weight runs quantized.
    quant: QuantizedWeight | None = None
    # The output projection (`mark_lm_heads`): a quantized one recomputes its top logits
    # exactly (`quant.ExactTopLogits`), a float one gets the greedy screen (`argmax_screen.py`).
    is_lm_head: bool = False
    # False keeps a layer in floating point whatever `Config.quantization` says (MoE routers).
    quantizable: bool = True
    # `Config.activation_bits`, set with `quant`: what a 4-bit kernel rounds x to.
    activation_bits: int = 16

    def process_weights_after_loading(self) -> None:
        if self.packed_weight is not None:
            return  # already done: the plain weight is gone
        if self.quant is not None:
            self.gemm, self.packed_weight = pick_quantized_gemm(
                self.quant, self.weight.device, self.weight.dtype, self.is_lm_head, self.activation_bits
            )
            self.quant = None  # the kernel holds its own copy (a tied embedding keeps this one)
            self.weight = None  # type: ignore[assignment]  # torch keeps a dropped parameter as None
            return
        self.gemm, weight = pick_gemm(self.weight)
        if self.is_lm_head:
            self.gemm = screen_lm_head(self.gemm)
        if weight is not self.weight:
            self.packed_weight = weight
            # the copies serve (a tied embedding reads the tiled one, `process_weights`)
            self.weight = None  # type: ignore[assignment]  # torch keeps a dropped parameter as None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.packed_weight is None else self.packed_weight
        return self.gemm(x, weight, self.bias)


def process_weights(model: nn.Module) -> None:
    """Every module's `process_weights_after_loading`; then each embedding whose table a streamed
    LM head now holds in its tiled copy becomes a `StreamedEmbedding` of that copy."""
    tied = tied_embeddings(model)  # now: processing lets go of the heads' plain weights
    for m in model.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()  # type: ignore[operator]  # stubs: Module attrs are Tensor | Module
    for name, head in tied:
        gemm = getattr(head, "gemm", None)
        kernel = getattr(gemm, "inner", gemm)  # an ArgmaxScreen wraps the streaming GEMM
        if isinstance(kernel, StreamingGemm) and kernel.tiled is not None:
            replace_embedding(model, name, StreamedEmbedding(kernel.tiled, kernel.out_features, kernel.in_features))


def mark_lm_heads(model: nn.Module) -> None:
    """Flag the output projection: a Linear named `lm_head` (Hugging Face's name) or sharing an embedding's weight."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            m.is_lm_head = name.rpartition(".")[2] == "lm_head" or id(m.weight) in tied


def prepare_lm_head_screens(model: nn.Module) -> bool:
    """Make the 8-bit copies of `model`'s screened LM heads now (else the first screened step
    does); whether any head can screen."""
    screens = [(m.gemm, m.bias) for m in model.modules() if isinstance(m, Linear) and isinstance(m.gemm, ArgmaxScreen)]
    with weight_arena():
        for screen, bias in screens:
            if screen.kernel is None and screen.usable:
                screen.build(bias)
    return any(screen.usable for screen, _ in screens)


class MergedLinear(Linear):
    """Rows of `weight` are the named shards stacked in order: one GEMM instead of three.

    The loader calls `weight_loader(param, tensor, shard)` for each checkpoint tensor a
    model's `packed_modules_mapping` sends here.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        # the loader's hook, an attribute torch's Parameter stubs do not declare
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> set | None:
        """Copy checkpoint tensor `loaded` of `shard` into its rows. `shard=None`: a tensor already
        fused on disk (Phi-3's `qkv_proj`, `gate_up_proj`), every shard's rows in order; returns
        the shards it filled."""
        if shard is None:
            return self.load_fused(param, loaded)
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(
                f"shard {shard!r} expects {size} rows, the checkpoint tensor has shape {tuple(loaded.shape)}"
            )
        param.data[offset : offset + size].copy_(loaded)
        return None

    def load_fused(self, param: nn.Parameter, loaded: Any) -> set:
        parts = self.split_fused(loaded)
        for shard, part in parts.items():
            self.weight_loader(param, materialize(part), shard)
        return set(parts)

    def split_fused(self, loaded: Any) -> dict[str, Any]:
        """A tensor fused on disk (a checkpoint tensor, `CheckpointSlice` or GGUF's blocks) cut
        into the whole shards it holds, in row order: each then loads as its own tensor would."""
        whole = getattr(self, "whole_sizes", {k: size for k, (_, size) in self.shard_offsets.items()})
        order = sorted(self.shard_offsets, key=lambda k: self.shard_offsets[k][0])
        if loaded.shape[0] != sum(whole[k] for k in order):
            raise ValueError(
                f"a fused tensor of shards {', '.join(order)} expects {sum(whole[k] for k in order)} rows, "
                f"the checkpoint tensor has shape {tuple(loaded.shape)}"
            )
        parts, start = {}, 0
        for k in order:
            parts[k] = loaded.narrow(0, start, whole[k])
            start += whole[k]
        return parts

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s for _, s in self.shard_offsets.values()], dim=-1))


# -- tensor parallel (one rank: each is its plain counterpart) --------------------------------


class ColumnParallelLinear(Linear):
    """`out_features` split across the tensor-parallel ranks: each computes its rows' outputs
    (no collective). Its weight loader takes the whole checkpoint tensor and keeps this rank's rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(in_features, divide(out_features, tp.world_size, "output features"), bias=bias)
        _split_loader(self, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        _copy(param, self.rank_part(loaded, shard))

    def rank_part(self, loaded: Any, shard: Any = None) -> Any:
        """This rank's rows of a whole checkpoint tensor (or `CheckpointSlice`, or GGUF's blocks)."""
        rows = self.out_features
        return _narrow(loaded, 0, self.tp_rank * rows, rows, self.tp_size)


class RowParallelLinear(Linear):
    """`in_features` split across the ranks: each multiplies its slice of the input (the output
    of a column-parallel layer) and the partial results are summed with one all-reduce
    (`reduce_results=False` leaves that to the caller, so a MoE block and its shared expert
    share one). The bias is added once: on rank 0, zeros elsewhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.reduce_results = tp.rank, tp.world_size, reduce_results
        super().__init__(divide(in_features, tp.world_size, "input features"), out_features, bias=bias)
        _split_loader(self, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        if param.dim() == 1:  # the bias: once over the ranks
            with torch.no_grad():
                param.data.copy_(materialize(loaded)) if self.tp_rank == 0 else param.data.zero_()
            return
        _copy(param, self.rank_part(loaded, shard))

    def rank_part(self, loaded: Any, shard: Any = None) -> Any:
        """This rank's columns of a whole checkpoint tensor (or `CheckpointSlice`, or GGUF's blocks)."""
        cols = self.in_features
        return _narrow(loaded, 1, self.tp_rank * cols, cols, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return all_reduce(out) if self.reduce_results and self.tp_size > 1 else out


class MergedColumnParallelLinear(MergedLinear):
    """Named shards stacked in one GEMM (gate and up), each split across the ranks: this rank
    holds its part of every shard, in the same order. Shards named in `replicated` are held
    whole on every rank (MLA's latent projection beside its per-head queries)."""

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool = False, replicated: tuple[str, ...] = (),
        sections: dict[str, list[int]] | None = None,
    ):  # fmt: skip
        """`sections`: a shard made of consecutive parts split each on its own (Qwen3.5's one
        `qkv` tensor of q, k and v: this rank keeps its heads of each)."""
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.replicated = tp.rank, tp.world_size, replicated
        self.sections = sections or {}
        sizes = {k: v if k in replicated else divide(v, tp.world_size, f"shard {k!r}") for k, v in shards.items()}
        super().__init__(in_features, sizes, bias)
        self.whole_sizes = dict(shards)  # each shard's rows in the checkpoint
        if tp.world_size > 1:
            for param in self.parameters():
                reads_slices(param)

    def shard_start(self, shard: str) -> int:
        """Where this rank's part of `shard` starts in the checkpoint tensor."""
        return 0 if shard in self.replicated else self.tp_rank * self.shard_offsets[shard][1]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> set | None:
        if shard is None:
            return self.load_fused(param, loaded)
        return super().weight_loader(param, materialize(self.rank_part(loaded, shard)), shard)

    def rank_part(self, loaded: Any, shard: str) -> Any:
        """This rank's part of `shard` (a whole checkpoint tensor, `CheckpointSlice` or GGUF's blocks)."""
        if shard in self.sections:
            return rank_sections(loaded, self.sections[shard])
        whole = self.whole_sizes[shard]
        if loaded.shape[0] != whole:
            raise ValueError(
                f"shard {shard!r} expects {whole} rows, the checkpoint tensor has shape {tuple(loaded.shape)}"
            )
        return loaded.narrow(0, self.shard_start(shard), self.shard_offsets[shard][1])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections split by heads. With more ranks than KV heads each KV head is
    replicated on `tp_size // num_kv_heads` ranks (vLLM's `QKVParallelLinear`)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
        q_size_per_head: int | None = None,
    ):  # fmt: skip
        """`q_size_per_head`: a query head's rows when they hold more than `head_dim` (Qwen3-Next's
        query and output gate side by side per head)."""
        tp = get_tp_group()
        self.q_size_per_head = q_size_per_head or head_dim
        self.num_heads = divide(num_heads, tp.world_size, "attention heads")
        if tp.world_size >= num_kv_heads:
            if tp.world_size % num_kv_heads:
                raise ValueError(
                    f"KV heads: {num_kv_heads} cannot be replicated evenly over {tp.world_size} tensor-parallel ranks"
                )
            self.num_kv_heads, self.kv_replicas = 1, tp.world_size // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp.world_size, "KV heads"), 1
        self.head_dim = head_dim
        q = self.num_heads * self.q_size_per_head
        sizes = {"q": q, "k": self.num_kv_heads * head_dim, "v": self.num_kv_heads * head_dim}
        # the whole sizes, which MergedColumnParallelLinear divides again by the ranks
        super().__init__(hidden_size, {k: v * tp.world_size for k, v in sizes.items()}, bias)
        self.whole_sizes.update(k=num_kv_heads * head_dim, v=num_kv_heads * head_dim)

    def shard_start(self, shard: str) -> int:
        if shard == "q":
            return self.tp_rank * self.num_heads * self.q_size_per_head
        return (self.tp_rank // self.kv_replicas) * self.num_kv_heads * self.head_dim


def rank_sections(loaded: Any, sections: list[int]) -> Any:
    """This rank's equal share of each consecutive part of `loaded`'s rows (sizes `sections`), joined."""
    tp = get_tp_group()
    if sum(sections) != loaded.shape[0]:
        raise ValueError(f"expects {sum(sections)} rows ({' + '.join(map(str, sections))}), got {tuple(loaded.shape)}")
    parts, start = [], 0
    for size in sections:
        share = divide(size, tp.world_size, "a tensor-parallel section's rows")
        parts.append(loaded.narrow(0, start + tp.rank * share, share))
        start += size
    return QuantizedWeight.cat(parts) if isinstance(parts[0], QuantizedWeight) else torch.cat(parts)


def shard_rows(param: nn.Parameter, sections: list[int] | None = None) -> None:
    """Give a plain parameter (not a `Linear`'s) a loader that keeps this rank's equal share of
    the checkpoint tensor's rows, or of each of its consecutive `sections`; nothing at one rank."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return
    whole = sections or [param.shape[0] * tp.world_size]

    def load(p: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        _copy(p, rank_sections(loaded, whole))

    param.weight_loader = load  # type: ignore[attr-defined]
    reads_slices(param)


def _split_loader(layer: ColumnParallelLinear | RowParallelLinear, bias: bool) -> None:
    """Route the checkpoint's tensors through `layer.weight_loader` when it is split; one rank's
    layer loads as a plain `Linear` does (and takes GGUF's kept blocks as one)."""
    if layer.tp_size > 1:
        for param in layer.parameters():
            param.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
            reads_slices(param)


def _narrow(loaded: Any, dim: int, start: int, size: int, ranks: int) -> Any:
    """`loaded.narrow(dim, start, size)`, once `loaded` is checked to be `ranks` such parts."""
    if loaded.shape[dim] != size * ranks:
        raise ValueError(
            f"the checkpoint tensor's shape {tuple(loaded.shape)} is not {ranks} parts of {size} along dimension {dim}"
        )
    return loaded.narrow(dim, start, size)


def _copy(param: nn.Parameter, part: Any) -> None:
    part = materialize(part)
    if tuple(part.shape) != tuple(param.shape):
        raise ValueError(f"this rank's part has shape {tuple(part.shape)}, the parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.data.copy_(part)
