"""The MoE experts layer every MoE model shares: all experts' weights stacked, tokens grouped per expert.

A step's T tokens each pick k experts. Rather than loop over tokens (or run every expert
on every token), the T*k (token, expert) assignments are sorted by expert, each active
expert runs one GEMM over its rows for gate+up and one for down, the rows are scaled by
their routing weights and added back onto their tokens in float32 (`index_add_`, or a sum
over each token's k slots). The only host sync is one read of the per-expert counts.

On CPU (float32, bfloat16) each expert's matrices are packed once into panels of output
columns for oneDNN's batch-reduce micro-kernel, and a C++ loop (`csrc/moe_cpu.cpp`) hands
whole experts to threads, each expert's gather, GEMMs, activation and weighting fused in
one pass: faster than giving every small GEMM all the threads, and than oneDNN's packed
linear per expert, at every row count measured (docs/kernels.md). Elsewhere a
Python loop over the active experts does the same work with `F.linear`, with each expert's
streaming kernel (weights Atom does not give oneDNN: float16, and bfloat16 without
avx512_bf16 or AMX), with each expert's oneDNN Linear (where torch refuses its bfloat16
micro-kernel but oneDNN takes the weights), or with each expert's quantized kernels when
`Config.quantization` quantized them (`quant`).

Checkpoints store experts one by one (`experts.{e}.gate_proj.weight`, Mixtral's
`experts.{e}.w1.weight`); `FusedMoE.checkpoint_mapping` turns those names into
(stacked parameter, shard) pairs for the loader, and `weight_loader` copies each into
its expert's slice.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed.communication import all_reduce
from atom_core.distributed.parallel_state import divide, get_tp_group
from atom_core.layers.checkpoint_slice import materialize, reads_slices
from atom_core.layers.cpp import CppKernel
from atom_core.layers.gemm import onednn_takes, pick_gemm
from atom_core.layers.graph_capture import launch
from atom_core.layers.ops import silu_and_mul
from atom_core.layers.quantized_gemm import pick_quantized_gemm
from atom_core.layers.routers import ROUTERS, register_router, select_experts

__all__ = ["FusedMoE", "ExpertNameMapper", "ROUTERS", "register_router", "select_experts"]

ACTIVATIONS = ("silu", "swigluoai")

# Hub expert names -> our shard kinds.
QWEN_EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen-MoE, DeepSeek
MIXTRAL_EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


MOE_KERNEL = CppKernel("atom_moe_ops", Path(__file__).parent / "csrc" / "moe_cpu.cpp")


def moe_ops(variant: str | None = None) -> ModuleType | None:
    return MOE_KERNEL.load(variant)


class ExpertNameMapper:
    """Checkpoint name `...{module}.{e}.{name}.weight` -> (`...{module}.w13|w2`, (kind, e)), else None.

    One regex per name instead of a table of E*3 substrings: DeepSeek-V3 has 256 experts
    in each of 58 layers.
    """

    def __init__(self, names: dict[str, str], module: str = "experts"):
        bad = {n: k for n, k in names.items() if k not in FusedMoE.SHARD_PARAMS}
        if bad:
            raise ValueError(f"expert names {bad} map to unknown shard kinds; known: {sorted(FusedMoE.SHARD_PARAMS)}")
        self.names = dict(names)
        alternatives = "|".join(re.escape(n) for n in names)
        self.pattern = re.compile(rf"^((?:.*\.)?{re.escape(module)})\.(\d+)\.({alternatives})\.weight$")

    def __call__(self, name: str) -> tuple[str, tuple[str, int]] | None:
        m = self.pattern.match(name)
        if m is None:
            return None
        kind = self.names[m.group(3)]
        return f"{m.group(1)}.{FusedMoE.SHARD_PARAMS[kind]}", (kind, int(m.group(2)))


class FusedMoE(nn.Module):
    """Stacked experts: `w13` [E, 2*I, H] (gate rows then up rows), `w2` [E, H, I].

    forward(hidden [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H] in hidden's dtype.
    """

    SHARD_PARAMS = {"gate": "w13", "up": "w13", "down": "w2"}
    # One op in a compiled graph (atom_core/runner/compile.py): grouping tokens by expert is data-dependent.
    compile_opaque = True

    @property
    def out_features(self) -> int:
        return self.hidden_size

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
        reduce_results: bool = True, bias: bool = False, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
    ):  # fmt: skip
        """`activation`: "silu" (gate and up: silu(gate) * up), or "swigluoai" (GPT-OSS: gate
        clamped above at `swiglu_limit`, up clamped to +-limit, (up + 1) * gate * sigmoid(alpha *
        gate)). `bias`: each expert's gate/up and down projections add a bias (GPT-OSS); the
        C++ loop takes neither, so such experts run the per-expert path."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} is not supported by FusedMoE; supported: {', '.join(ACTIVATIONS)}"
            )
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.reduce_results = tp.rank, tp.world_size, reduce_results
        # Tensor parallel: each rank holds every expert's slice of the intermediate size, or
        # under expert parallel whole experts; either way the ranks' outputs are summed.
        self.expert_parallel = tp.expert_parallel
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, tp.world_size, "experts")
            i = intermediate_size
        else:
            self.num_local_experts = num_experts
            i = divide(intermediate_size, tp.world_size, "expert intermediate size")
        self.first_expert = tp.rank * self.num_local_experts if self.expert_parallel else 0
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, i
        e_local = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty(e_local, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e_local, hidden_size, i), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.zeros(e_local, 2 * i), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(e_local, hidden_size), requires_grad=False) if bias else None
        # shard -> (parameter, first row, rows): every local expert's tensors must arrive
        self.shard_offsets: dict[tuple[str, int], tuple[str, int, int]] = {}
        for e in range(self.first_expert, self.first_expert + e_local):
            self.shard_offsets[("gate", e)] = ("w13", 0, i)
            self.shard_offsets[("up", e)] = ("w13", i, i)
            self.shard_offsets[("down", e)] = ("w2", 0, hidden_size)
            if bias:
                self.shard_offsets[("gate_bias", e)] = ("w13_bias", 0, i)
                self.shard_offsets[("up_bias", e)] = ("w13_bias", i, i)
                self.shard_offsets[("down_bias", e)] = ("w2_bias", 0, hidden_size)
        for name in ("w13", "w2") + (("w13_bias", "w2_bias") if bias else ()):
            param = getattr(self, name)
            param.weight_loader = self.weight_loader
            if tp.world_size > 1:  # a slice of each expert, or only this rank's experts, read
                reads_slices(param)
            param.expected_shards = {s for s, (p, _, _) in self.shard_offsets.items() if p == name}

    @staticmethod
    def checkpoint_mapping(names: dict[str, str] | None = None, module: str = "experts") -> ExpertNameMapper:
        """A model's `map_checkpoint_name`: hub per-expert tensors -> this layer's shards.

        `names` maps the hub's per-expert tensor names to "gate" / "up" / "down"
        (default: gate_proj/up_proj/down_proj; `MIXTRAL_EXPERT_NAMES` for w1/w3/w2);
        `module` is the FusedMoE's attribute name in its parent block.
        """
        return ExpertNameMapper(QWEN_EXPERT_NAMES if names is None else names, module)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[str, int]) -> None:
        part = self.rank_part(loaded, shard)
        if part is None:
            return  # another rank's expert
        name, first, rows = self.shard_offsets[shard]
        if param is not getattr(self, name):
            raise ValueError(f"shard {shard!r} belongs to {name!r}, not to the parameter it was sent to")
        with torch.no_grad():
            param.data[shard[1] - self.first_expert, first : first + rows].copy_(materialize(part))

    def rank_part(self, loaded: Any, shard: tuple[str, int]) -> Any:
        """This rank's part of one expert's whole tensor (or `CheckpointSlice`, or GGUF's blocks):
        gate and up [intermediate, hidden], down [hidden, intermediate], sliced along the
        intermediate size; None for another rank's expert under expert parallel."""
        if shard not in self.shard_offsets:
            if self.expert_parallel and isinstance(shard, tuple) and 0 <= shard[1] < self.num_experts:
                return None
            raise ValueError(f"FusedMoE with {self.num_experts} experts has no shard {shard!r}")
        name, _, rows = self.shard_offsets[shard]
        split_here = self.tp_size > 1 and not self.expert_parallel
        size = self.intermediate_size
        if name == "w2_bias":  # added once over the ranks that split the expert
            if list(loaded.shape) != [rows]:
                raise ValueError(
                    f"expert {shard[1]} down bias expects {rows} values, the checkpoint has {tuple(loaded.shape)}"
                )
            return loaded if not split_here or self.tp_rank == 0 else torch.zeros(rows)
        if name == "w13_bias":
            whole_rows = rows * (self.tp_size if split_here else 1)
            if list(loaded.shape) != [whole_rows]:
                raise ValueError(
                    f"expert {shard[1]} {shard[0]} expects {whole_rows} values, the checkpoint has {tuple(loaded.shape)}"
                )
            return loaded.narrow(0, self.tp_rank * size, size) if split_here else loaded
        split = 1 if name == "w2" else 0  # the intermediate dimension
        whole = [rows, self.hidden_size if name == "w13" else size]
        whole[split] *= self.tp_size if split_here else 1
        if list(loaded.shape) != whole:
            raise ValueError(
                f"expert {shard[1]} {shard[0]} expects shape {tuple(whole)}, the checkpoint tensor has {tuple(loaded.shape)}"
            )
        return loaded.narrow(split, self.tp_rank * size, size) if split_here else loaded

    packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13, w2) in the C++ loop's panels
    # Set by `quant.quantize_model` before kernels are picked: each expert's w13 and w2 quantized,
    # and `Config.activation_bits` (what a 4-bit kernel rounds x to).
    quant: tuple[list, list] | None = None
    activation_bits: int = 16
    # The checkpoint's own quantized experts as a model's loader kept them, exactly, in a format
    # the kernels run (GPT-OSS's MXFP4 as 8-bit groups), this rank's part: `quantize_model`
    # makes them `quant` under quantization="auto" and drops them under any other setting.
    checkpoint_quant: tuple[list, list] | None = None
    # Per expert ((gemm, weight) for w13, (gemm, weight) for w2) from the quantized kernels,
    # as `Linear` keeps its own (`_expert_gemms` falls back to `F.linear` on the stacks).
    expert_gemms: list | None = None

    def process_weights_after_loading(self) -> None:
        """Pack the stacks into the C++ loop's panels where it runs; the copies replace them.

        Quantized experts take `pick_quantized_gemm`'s kernels instead (at a decode step the
        active experts' weights are streamed from memory, so their bytes set the pace)."""
        if self.packed is not None or self.expert_gemms is not None:
            return
        if self.quant is not None:
            device, dtype = self.w13.device, self.w13.dtype
            self.expert_gemms = [
                tuple(pick_quantized_gemm(q, device, dtype, activation_bits=self.activation_bits) for q in (q13, q2))
                for q13, q2 in zip(*self.quant)
            ]
            self.quant = self.w13 = self.w2 = None  # type: ignore[assignment]  # the kernels hold their own copies
            return
        if self.w13.device.type != "cpu" or self.w13.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return
        if self.activation != "silu" or self.w13_bias is not None:
            return  # the C++ loop runs SiLU without biases: the per-expert path runs these
        # The C++ loop's micro-kernel is oneDNN's: it needs oneDNN kernels for this dtype, and
        # torch's bfloat16 brgemm also needs avx512_bf16 (or AMX), which `usable` checks.
        ops = None if os.environ.get("ATOM_DISABLE_ONEDNN") or not onednn_takes(self.w13.dtype) else moe_ops()
        if ops is None or not ops.usable(self.w13):
            # Each expert's own GEMMs instead (`pick_gemm`): the streaming kernel, which keeps
            # 16-bit weights oneDNN has no kernels for (float16; bfloat16 without avx512_bf16) in 16
            # bits, or oneDNN's packed Linear (where torch's bfloat16 micro-kernel is missing, or
            # the kernels are off); plain `F.linear` stays on slices of the stacks.
            gemms = [
                (pick_gemm(w13, streaming=False), pick_gemm(w2, streaming=False)) for w13, w2 in zip(self.w13, self.w2)
            ]
            if all(gemm is not F.linear for pair in gemms for gemm, _ in pair):
                self.expert_gemms = gemms
                self.w13 = self.w2 = None  # type: ignore[assignment]  # torch keeps a dropped parameter as None
            return
        self.packed = (pack_panels(self.w13.data, ops.PANEL), pack_panels(self.w2.data, ops.PANEL))
        self.w13 = None  # type: ignore[assignment]  # torch keeps a dropped parameter as None
        self.w2 = None  # type: ignore[assignment]  # torch keeps a dropped parameter as None

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel:  # this rank's experts' assignments, one row each
            local = topk_ids - self.first_expert
            mine = (local >= 0) & (local < self.num_local_experts)
            token_of = mine.nonzero()[:, 0]
            out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            if token_of.numel():
                rows = self._experts(hidden[token_of], topk_weights[mine].unsqueeze(1), local[mine].unsqueeze(1))
                out.index_add_(0, token_of, rows.to(torch.float32))
            out = out.to(hidden.dtype)
        else:
            out = self._experts(hidden, topk_weights, topk_ids)
        return all_reduce(out) if self.reduce_results and self.tp_size > 1 else out

    def _experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over its experts (ids local to this rank's)."""
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)  # assignments grouped by expert, tokens in order within one
        counts = torch.bincount(flat_ids, minlength=self.num_local_experts)
        weights = topk_weights.reshape(-1).to(torch.float32)
        if self.packed is not None:  # each token's weighted rows come back summed (in float32)
            x = hidden.to(self.packed[0].dtype).contiguous()
            ops = moe_ops()
            assert ops is not None  # packed where the kernel loaded
            out = launch(
                ops.experts_forward, x, order, counts, weights.contiguous(), k, *self.packed, self.intermediate_size
            )
            return out.to(hidden.dtype)
        sizes = counts.tolist()  # the one host sync (a decode graph cannot record it: this path runs eagerly)
        token_of = order // k
        x = hidden.index_select(0, token_of)
        if self.expert_gemms is None:
            x = x.to(self.w13.dtype)
        out = torch.empty(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(sizes):
            if n:
                end = start + n
                (gemm13, w13), (gemm2, w2) = self._expert_gemms(e)
                b13 = None if self.w13_bias is None else self.w13_bias[e]
                b2 = None if self.w2_bias is None else self.w2_bias[e]
                out[start:end] = gemm2(self._activate(gemm13(x[start:end], w13, b13)), w2, b2)
                start = end
        weighted = out.to(torch.float32).mul_(weights[order].unsqueeze(1))
        acc = torch.zeros(num_tokens, self.hidden_size, dtype=torch.float32, device=hidden.device)
        return acc.index_add_(0, token_of, weighted).to(hidden.dtype)

    def _activate(self, h13: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return silu_and_mul(h13)
        gate, up = h13.chunk(2, dim=-1)  # GPT-OSS's clamped SwiGLU
        limit = self.swiglu_limit
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def _expert_gemms(self, e: int) -> tuple[tuple, tuple]:
        """Expert e's ((gemm, weight) for w13, (gemm, weight) for w2): its quantized kernels, or
        `F.linear` on slices of the stacks (taken only for the experts a step uses)."""
        if self.expert_gemms is not None:
            return self.expert_gemms[e]
        return (F.linear, self.w13[e]), (F.linear, self.w2[e])

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


def pack_panels(w: torch.Tensor, panel: int) -> torch.Tensor:
    """[E, N, K] -> [E, N / panel, K, panel] (bfloat16: [E, N / panel, K / 2, panel, 2], VNNI
    pairs along K), N padded with zero rows to whole panels and bfloat16 K to even."""
    e, n, k = w.shape
    vnni = w.dtype == torch.bfloat16
    w = F.pad(w, (0, k % 2 if vnni else 0, 0, -n % panel))
    panels, kp = w.shape[1] // panel, w.shape[2]
    if vnni:
        return w.view(e, panels, panel, kp // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return w.view(e, panels, panel, kp).permute(0, 1, 3, 2).contiguous()
