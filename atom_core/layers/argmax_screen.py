"""An LM head that, when only the argmax of its logits is read, reads an 8-bit copy of its weight.

Why: at batch 1 a decode step streams every weight once, and a small model's LM head is a
large share of them (SmolLM2-135M in float32: 113 of 538 MB). A greedy request with no log
probabilities reads nothing of its logits but the argmax. The screen multiplies by an
8-bit copy of the weight in groups of 32 (`gemv_cpu.cpp`'s `qgemm`, 32 MB for SmolLM2),
bounds how far each of those logits can be from the exact one, and recomputes exactly, with
the plain kernel, only the logits the bound cannot rule out as the row's maximum (1 to 3 of
49,152 on SmolLM2's answers); every other entry is -inf. The argmax, ties and all, is then
the plain head's: the streaming kernel computes each output as one chain of products in k
order whatever the other columns and rows, so a recomputed logit is the plain head's value
bit for bit.

The bound, for a row x against weight row w (Cauchy-Schwarz):

    |screen - plain| <= |x| (D + c (W + Q + Z)) + Q |x - x16|

D: the largest distance between a weight row and its 8-bit copy; W, Q and Z: the largest
norms of a weight row, of the copy's `q * scale` part and of its `min` part; x16: x as the
kernel rounds it (int16 per group of 32, at most 0.55 * max|x| / 32767 off per value);
c: float32 rounding of both kernels' sums ((K + 2 K / 32 + 8) units of 2^-24, 1% slack).
Where the plain head rounds its output to bfloat16, `near_max`'s relative margin covers it.

The runner asks for it with `ForwardContext.argmax_only`, which it sets only for steps
whose every sampling row is greedy, asks for no log probabilities and goes to a sampler
that reads a greedy row's argmax alone (`greedy_reads_argmax_only`). Rows beyond the
streaming kernel's (over 8, or a batch-invariant head) take the plain head, as does a row
that is not finite. ATOM_DISABLE_ARGMAX_SCREEN=1 turns it off.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from atom_core.forward_context import get_forward_context
from atom_core.layers.ops import near_max
from atom_core.layers.quant import StreamingGroupGemm, quantize_int8

GROUP = 32
ROUNDOFF = 2.0**-24  # float32's unit roundoff
# `near_max`'s relative margin: bfloat16's unit roundoff with 5% slack where the plain head
# rounds its output to bfloat16, next to nothing where it keeps float32.
EPS = {torch.bfloat16: 2.0**-8 * 1.05, torch.float32: 2.0**-22}


class ArgmaxScreen:
    """Wraps an LM head's streaming GEMM (`linear.StreamingGemm`); see the module's docstring."""

    def __init__(self, inner: Any):
        weight = inner.weight
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"the screen takes in_features a multiple of {GROUP}, not {k}")
        self.inner, self.out_features, self.in_features = inner, n, k
        qw = quantize_int8(weight, GROUP)
        self.kernel = StreamingGroupGemm(qw, inner.ops)
        codes, scales, mins = StreamingGroupGemm.codes(qw)
        d = w = q = z = 0.0
        for i in range(0, n, 4096):  # a float64 vocabulary at once is big
            block = slice(i, i + 4096)
            part = codes[block].double() * scales[block].double().repeat_interleave(GROUP, dim=1)
            zero = mins[block].double().repeat_interleave(GROUP, dim=1)
            rows = weight[block].double()
            d = max(d, float((rows - part - zero).norm(dim=1).max()))
            w = max(w, float(rows.norm(dim=1).max()))
            q = max(q, float(part.norm(dim=1).max()))
            z = max(z, float(zero.norm(dim=1).max()))
        if not all(math.isfinite(v) for v in (d, w, q, z)):
            raise ValueError("the weight does not fit float16 scales")
        c = 1.01 * (k + 2 * k // GROUP + 8) * ROUNDOFF
        self.per_norm = d + c * (w + q + z)  # times |x|
        self.per_max = q * 0.55 * math.sqrt(k) / 32767  # times max|x|

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if get_forward_context().argmax_only and 0 < rows <= self.inner.max_rows and x.dtype in EPS:
            out = self.screened(x, bias)
            if out is not None:
                return out
        return self.inner(x, weight, bias)

    def screened(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """[rows, vocab] in x's dtype: the plain head's logits where they may be the row's
        maximum, -inf elsewhere; None for a row that is not finite."""
        xf = x.float().contiguous()
        bound = torch.linalg.vector_norm(xf, dim=1).mul_(self.per_norm).add_(xf.abs().amax(dim=1), alpha=self.per_max)
        if not math.isfinite(float(bound.max())):  # NaN or infinity in x
            return None
        eps = EPS[x.dtype]
        hit_rows, hit_cols = near_max(self.kernel.qgemm(xf, bias), bound.div_(eps), eps)
        out = torch.full((x.shape[0], self.out_features), float("-inf"), dtype=x.dtype)
        weight = self.inner.weight
        if x.shape[0] == 1:  # one row: its columns come sorted and distinct
            out[0, hit_cols] = self.inner.ops.gemv(x, weight[hit_cols], None if bias is None else bias[hit_cols])[0]
        else:
            cols, where = torch.unique(hit_cols, return_inverse=True)
            exact = self.inner.ops.gemv(x, weight[cols], None if bias is None else bias[cols])
            out[hit_rows, hit_cols] = exact[hit_rows, where]
        return out

    def make_batch_invariant(self) -> None:
        """The plain head's one kernel at every row count; the screen (a 1-8 row path) goes."""
        self.inner.make_batch_invariant()
        self.kernel = None

    @property
    def batch_invariant(self) -> bool:
        return self.inner.batch_invariant


def screen_lm_head(gemm: Any) -> Any:
    """`gemm` wrapped in an `ArgmaxScreen` where it applies (the streaming kernel on a float
    weight whose in_features are whole groups of 32); else `gemm` itself."""
    if os.environ.get("ATOM_DISABLE_ARGMAX_SCREEN") or getattr(gemm, "weight", None) is None:
        return gemm
    if not hasattr(gemm, "max_rows") or gemm.weight.shape[1] % GROUP:
        return gemm
    try:
        return ArgmaxScreen(gemm)
    except ValueError:
        return gemm
