"""Linear layers whose GEMM is picked once the weights are loaded (vLLM's `process_weights_after_loading`).

On CPU, float32 weights (and bfloat16 ones where oneDNN has bfloat16 kernels: AVX-512 or
AVX-NE-CONVERT) are repacked once into oneDNN's blocked layout and multiplied by oneDNN.
Without those, bfloat16 weights stay bfloat16, in the streaming kernel's tiled layout, and
that kernel serves every row count. torch's float32 `F.linear` runs through MKL, which on the AMD EPYC
machines we measure is 1.2-1.4x slower than packed oneDNN on the model's layer shapes
and 2x on the vocab-sized LM head; for bfloat16 the packed weight is 1.2x faster than
`F.linear` at 64 rows and 1.7x at one row (figures in README). The packed copy replaces
the plain weight (a tied embedding then reads the streaming kernel's copy). Other devices keep
`F.linear`. A kernel plugin replaces `pick_gemm`. A layer given a quantized weight
(`quant`, see `quant.py`) takes `pick_quantized_gemm`'s kernel instead.

At 1 to 8 rows (decode steps) a GEMM is a stream over its weight, which oneDNN reads well
under the memory's pace, and up to 64 rows (batched decode) oneDNN still rereads the
weight from memory at a lower pace than this kernel computes; the weight-streaming kernel
in `csrc/gemv_cpu.cpp` reads it at or near the machine's copy bandwidth
(`benchmarks/gemv_bandwidth.py`, README's Kernels), from its own copy of the weight in
tiles of two vectors' rows (`gemv_weight`), placed in huge pages (`memory.weight_arena`) and kept beside the packed one: float weights take twice their
size in memory on CPU (ATOM_DISABLE_GEMV=1 keeps one copy and the oneDNN path at every
row count). An embedding tied to a streamed head reads its rows from the tiled copy
(`StreamedEmbedding`), so a tied table is not held a third time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers.argmax_screen import ArgmaxScreen, screen_lm_head
from atom_core.platform.cpu_features import cpu_features
from atom_core.layers.cpp import CppKernel, compiled_op
from atom_core.layers.embedding import LookupEmbedding, replace_embedding, tied_embeddings
from atom_core.layers.quant import QuantizedWeight, pick_quantized_gemm
from atom_core.platform.memory import resident, weight_arena

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@torch.library.custom_op("atom::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on a packed weight, as one opaque op for `torch.compile` (Inductor's own
    lowering of `mkldnn._linear_pointwise` rejects the inputs a traced decode step gives it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return onednn_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# oneDNN lays a packed weight out for a row count; any count works. Packed for 64 rows,
# it was as fast as or faster than packed for 1 or 512 at every count from 1 to 10k.
PACK_ROWS = 64


GEMV_KERNEL = CppKernel("atom_gemv", Path(__file__).parent / "csrc" / "gemv_cpu.cpp")
_faked: set[str] = set()


def gemv_ops(variant: str | None = None) -> ModuleType | None:
    """The streaming GEMM and the 4/8-bit group kernel (`csrc/gemv_cpu.cpp`): this CPU's
    variant, or `variant`; None where they cannot build or are turned off (ATOM_DISABLE_GEMV)."""
    if os.environ.get("ATOM_DISABLE_GEMV"):
        return None
    ops = GEMV_KERNEL.load(variant)
    if ops is not None and ops.OPS_NAMESPACE not in _faked:  # the shapes `torch.compile` traces with
        _faked.add(ops.OPS_NAMESPACE)
        ns = ops.OPS_NAMESPACE
        torch.library.register_fake(f"{ns}::gemv")(lambda x, w, n, bias: x.new_empty((x.shape[0], n)))
        torch.library.register_fake(f"{ns}::qgemm")(lambda x, qw, d, mn, n, bias: x.new_empty((x.shape[0], n)))
    return ops


def gemv_weight(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """`weight` [N, K] in the streaming kernel's layout: tiles of `tile` output rows (the
    kernel's `TILE`, two vectors; N padded with zero rows), within a tile each k's values
    together; bfloat16 goes by pairs of k (K padded to even), so a tile is [K / 2, tile, 2].
    Why: see gemv_cpu.cpp."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    kp = k + k % 2 if pairs else k
    if kp != k or n % tile:
        weight = F.pad(weight, (0, kp - k, 0, -n % tile))
    tiles = weight.shape[0] // tile
    if pairs:
        return weight.reshape(tiles, tile, kp // 2, 2).transpose(1, 2).contiguous()
    return weight.reshape(tiles, tile, kp).transpose(1, 2).contiguous()


def gemv_rows(tiled: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """The rows `rows` [L] of the [N, K] weight `tiled` holds (`gemv_weight`'s layout): [L, K]."""
    pairs, tile = tiled.dim() == 4, tiled.shape[2]
    if pairs:  # bfloat16 pairs as one 32-bit value each: a gather of 4-byte elements
        tiled = tiled.view(torch.int32).squeeze(-1)
    picked = tiled[rows // tile, :, rows % tile]  # [L, K] (bfloat16: [L, K / 2] pairs)
    return (picked.view(torch.bfloat16) if pairs else picked)[:, :in_features]


class StreamingGemm:
    """The weight-streaming kernel on its own tiled copy (`gemv_weight`, in huge pages when
    loaded in a `weight_arena`): for 1 to `max_rows` rows beside packed oneDNN, or for every
    row count (`every_row`) where oneDNN has no kernel for the dtype (bfloat16 without
    AVX-512), the tiled copy then the only one."""

    def __init__(self, weight: torch.Tensor, ops: ModuleType, every_row: bool = False):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.tiled: torch.Tensor | None = resident(gemv_weight(weight.detach(), int(ops.TILE)))
        self.ops, self.every_row = ops, every_row
        self.max_rows = sys.maxsize if every_row else int(ops.MAX_ROWS)

    def __call__(self, x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if self.every_row and x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1]), packed, bias).reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and 0 < x.shape[0] <= self.max_rows:
            if x.shape[1] != self.in_features:  # the kernel sees K only through the padded tiles
                raise ValueError(f"x has {x.shape[1]} features, the weight takes {self.in_features}")
            if torch.compiler.is_compiling():
                return compiled_op(self.ops, "gemv")(x, self.tiled, self.out_features, bias)
            return self.ops.gemv(x, self.tiled, self.out_features, bias)
        if self.every_row:  # no rows
            return x.new_empty((0, self.out_features))
        return _onednn_linear(x, packed, bias)

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the weight as [len(index), K] (all of them when `index` is None)."""
        if index is None:
            index = torch.arange(self.out_features)
        return gemv_rows(self.tiled, index, self.in_features)

    def columns(self, x: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The outputs `cols` alone for 1 to `max_rows` rows of x, each equal bit for bit to that
        column of the whole product (the kernel sums each output alike in any subset)."""
        tiled = gemv_weight(self.rows(cols), int(self.ops.TILE))
        return self.ops.gemv(x, tiled, len(cols), None if bias is None else bias[cols])

    def make_batch_invariant(self) -> None:
        """One kernel at every row count: oneDNN, the tiled copy dropped (a tied embedding keeps
        its reference); a kernel that serves every row count already is."""
        if not self.every_row:
            self.max_rows, self.tiled = 0, None

    @property
    def batch_invariant(self) -> bool:
        return self.every_row or self.max_rows == 0


class StreamedEmbedding(LookupEmbedding):
    """An embedding tied to a streamed LM head: its rows are read from the head's tiled copy,
    so the table is not held a third time (`process_weights`)."""

    def __init__(self, tiled: torch.Tensor, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.tiled = tiled

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return gemv_rows(self.tiled, ids, self.embedding_dim)


def pick_gemm(weight: torch.Tensor, streaming: bool = True) -> tuple[Gemm, Any]:
    """The GEMM for this weight and the weight in the form that GEMM takes.

    On CPU, packed oneDNN for float32, and for bfloat16 where oneDNN has bfloat16 kernels
    (`cpu_features().onednn_bf16`; off with ATOM_DISABLE_ONEDNN=1), with the streaming
    kernel for decode-sized row counts unless `streaming` is False (MoE experts, whose rows
    per expert vary and whose plain copies would double the biggest weights). bfloat16
    without oneDNN's kernels (CPUs without AVX-512) keeps its weights in bfloat16 and runs
    the streaming kernel at every row count, widening them as it goes. `F.linear` on the
    plain weight elsewhere.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return F.linear, weight
    onednn = torch.backends.mkldnn.is_available() and not os.environ.get("ATOM_DISABLE_ONEDNN")
    if onednn and (weight.dtype == torch.float32 or cpu_features().onednn_bf16):
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        ops = gemv_ops() if streaming else None
        return (_onednn_linear if ops is None else StreamingGemm(weight, ops)), packed
    if onednn and (ops := gemv_ops()) is not None:  # bfloat16 where oneDNN has no kernel for it
        gemm = StreamingGemm(weight, ops, every_row=True)
        return gemm, gemm.tiled
    return F.linear, weight


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

    def process_weights_after_loading(self) -> None:
        if self.packed_weight is not None:
            return  # already done: the plain weight is gone
        if self.quant is not None:
            self.gemm, self.packed_weight = pick_quantized_gemm(
                self.quant, self.weight.device, self.weight.dtype, exact_top=self.is_lm_head
            )
            self.quant = None  # the kernel holds its own copy (a tied embedding keeps this one)
            self.weight = None
            return
        self.gemm, weight = pick_gemm(self.weight)
        if self.is_lm_head:
            self.gemm = screen_lm_head(self.gemm)
        if weight is not self.weight:
            self.packed_weight = weight
            self.weight = None  # the copies serve (a tied embedding reads the tiled one, `process_weights`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.packed_weight is None else self.packed_weight
        return self.gemm(x, weight, self.bias)


def process_weights(model: nn.Module) -> None:
    """Every module's `process_weights_after_loading`; then each embedding whose table a streamed
    LM head now holds in its tiled copy becomes a `StreamedEmbedding` of that copy."""
    tied = tied_embeddings(model)  # now: processing lets go of the heads' plain weights
    for m in model.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()
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
    screens = [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.gemm, ArgmaxScreen)]
    with weight_arena():
        for m in screens:
            if m.gemm.kernel is None and m.gemm.usable:
                m.gemm.build(m.bias)
    return any(m.gemm.usable for m in screens)


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
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} expects {size} rows, the checkpoint tensor has shape {tuple(loaded.shape)}")
        param.data[offset : offset + size].copy_(loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s for _, s in self.shard_offsets.values()], dim=-1))
