"""The MoE experts layer every MoE model shares: all experts' weights stacked, tokens grouped per expert.

A step's T tokens each pick k experts. Rather than loop over tokens (or run every expert
on every token), the T*k (token, expert) assignments are sorted by expert, each active
expert runs one GEMM over its rows for gate+up and one for down, the rows are scaled by
their routing weights and added back onto their tokens in float32 (`index_add_`, or a sum
over each token's k slots). The only host sync is one read of the per-expert counts.

Each expert's GEMMs go through `pick_gemm` like every Linear: on CPU each expert's two
matrices are repacked once for oneDNN, which at a few rows per expert (decode, small
batches: reading the weights is the whole cost) ran 1.6-2x faster than MKL's
`torch.mm` and torch's `grouped_mm` on a 64-expert layer. With those, a C++ loop
(`csrc/moe_cpu.cpp`) hands whole experts to threads instead of splitting each small
GEMM over all of them; elsewhere a Python loop over the active experts does the same work.

Checkpoints store experts one by one (`experts.{e}.gate_proj.weight`, Mixtral's
`experts.{e}.w1.weight`); `FusedMoE.checkpoint_mapping` turns those names into
(stacked parameter, shard) pairs for the loader, and `weight_loader` copies each into
its expert's slice.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers.cpp import load_extension
from atom_core.layers.linear import Gemm, _onednn_linear, pick_gemm
from atom_core.layers.ops import silu_and_mul
from atom_core.layers.routers import ROUTERS, register_router, select_experts

__all__ = ["FusedMoE", "ExpertNameMapper", "ROUTERS", "register_router", "select_experts"]

# Hub expert names -> our shard kinds.
QWEN_EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen-MoE, DeepSeek
MIXTRAL_EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}


@functools.cache
def moe_ops() -> ModuleType | None:
    return load_extension("atom_moe_ops", Path(__file__).parent / "csrc" / "moe_cpu.cpp")


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
    # One op in a compiled graph (atom_core/compile.py): grouping tokens by expert is data-dependent.
    compile_opaque = True

    @property
    def out_features(self) -> int:
        return self.hidden_size

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu"):
        super().__init__()
        if activation != "silu":
            raise ValueError(f"activation {activation!r} is not supported by FusedMoE; only 'silu'")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        i = intermediate_size
        # shard -> (parameter, first row, rows): every expert's three tensors must arrive
        self.shard_offsets: dict[tuple[str, int], tuple[str, int, int]] = {}
        for e in range(num_experts):
            self.shard_offsets[("gate", e)] = ("w13", 0, i)
            self.shard_offsets[("up", e)] = ("w13", i, i)
            self.shard_offsets[("down", e)] = ("w2", 0, hidden_size)
        for name in ("w13", "w2"):
            param = getattr(self, name)
            param.weight_loader = self.weight_loader
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
        if shard not in self.shard_offsets:
            raise ValueError(f"FusedMoE with {self.num_experts} experts has no shard {shard!r}")
        name, first, rows = self.shard_offsets[shard]
        if param is not getattr(self, name):
            raise ValueError(f"shard {shard!r} belongs to {name!r}, not to the parameter it was sent to")
        expected = (rows, param.shape[2])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {shard[1]} {shard[0]} expects shape {expected}, the checkpoint tensor has {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            param.data[shard[1], first : first + rows].copy_(loaded)

    gemm: Gemm = staticmethod(F.linear)
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # per-expert (w13, w2) for `gemm`

    def process_weights_after_loading(self) -> None:
        """Repack each expert's matrices for the GEMM `pick_gemm` chooses; the copies replace the stacks."""
        if self.packed is not None:
            return
        self.gemm, _ = pick_gemm(self.w2[0], streaming=False)  # the choice depends on device and dtype only
        if self.gemm is F.linear:
            return
        self.weight_dtype = self.w13.dtype
        self.packed = ([pick_gemm(w, False)[1] for w in self.w13], [pick_gemm(w, False)[1] for w in self.w2])
        self.w13 = None
        self.w2 = None

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        num_tokens, k = topk_ids.shape
        w13, w2 = self.packed if self.packed is not None else (self.w13, self.w2)
        dtype = self.w13.dtype if self.packed is None else self.weight_dtype
        flat_ids = topk_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)  # assignments grouped by expert, tokens in order within one
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # the one host sync
        weights = topk_weights.reshape(-1).to(torch.float32)
        ops = moe_ops() if self.packed is not None and self.gemm is _onednn_linear else None
        if ops is not None:  # each token's weighted rows come back summed (in float32) in the weights' dtype
            out = ops.experts_forward(hidden.to(dtype).contiguous(), order, counts, weights.contiguous(), k, w13, w2)
            return out.to(hidden.dtype)
        token_of = order // k
        x = hidden.index_select(0, token_of).to(dtype)
        out = torch.empty(x.shape[0], self.hidden_size, dtype=dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                end = start + n
                out[start:end] = self.gemm(silu_and_mul(self.gemm(x[start:end], w13[e], None)), w2[e], None)
                start = end
        weighted = out.to(torch.float32).mul_(weights[order].unsqueeze(1))
        acc = torch.zeros(num_tokens, self.hidden_size, dtype=torch.float32, device=hidden.device)
        return acc.index_add_(0, token_of, weighted).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"
