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
A logit is kept when it is within twice (bound (1 + 2 eps) + eps (|max| + 1)) of the
screen's maximum (`near_max`): eps is bfloat16's unit roundoff with 5% slack where the
plain head rounds its output to bfloat16 (a value off by eps of itself), 2^-22 in float32.
Its absolute eps also covers what the bound leaves out: the kernel's underflow on
activations below ~1e-30.

The runner asks for it with `ForwardContext.argmax_only`, which it sets only for steps
whose every sampling row is greedy, asks for no log probabilities and goes to a sampler
whose class declares that a greedy row reads its argmax alone (`greedy_reads_argmax_only`,
not inherited). The 8-bit copy (0.4 s for SmolLM2) is made at load for a target model
whose sampler can use it (`linear.prepare_lm_head_screens`), else at the first screened
step, so a head that never screens (a draft's, or a target's under speculative decoding,
whose GEMMs are batch-invariant) costs nothing. Rows beyond the streaming kernel's (over MAX_ROWS),
rows that are not finite, a head with a bias that is not finite, and rows whose kept
logits would be more than an eighth of the vocabulary (a flat row) take the plain head; a
head whose rows keep coming out flat skips the screen for a while (`FLAT_STREAK`, `BACKOFF`).
Only float32 heads get one (`SCREENED_WEIGHTS`); ATOM_DISABLE_ARGMAX_SCREEN=1 turns it off.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from atom_core.forward_context import get_forward_context
from atom_core.layers.ops import near_max
from atom_core.layers.quantized_gemm import StreamingGroupGemm, streaming_error_bound
from atom_core.layers.quantized_weight import quantize_int8

GROUP = 32
EPS = {torch.bfloat16: 2.0**-8 * 1.05, torch.float32: 2.0**-22}  # see the module's docstring
MAX_KEPT = 1 / 8  # past this share of a row's logits, the plain head is cheaper
# A head whose rows keep coming out flat (an untrained model's, or a stretch of high-entropy
# text) would pay the 8-bit pass and then the plain head at every step: after FLAT_STREAK
# screened calls in a row that fell back so, the next BACKOFF calls take the plain head
# directly, then the screen is tried again. The logits are the plain head's either way.
FLAT_STREAK = 4
BACKOFF = 64


class ArgmaxScreen:
    """Wraps an LM head's streaming GEMM (`linear.StreamingGemm`); see the module's docstring."""

    def __init__(self, inner: Any):
        self.inner, self.out_features = inner, inner.out_features
        self.kernel: StreamingGroupGemm | None = None  # made at the first screened step
        self.usable = True
        self.flat_streak = 0  # screened calls in a row that fell back on flat rows
        self.skip = 0  # calls left that take the plain head directly (FLAT_STREAK, BACKOFF)

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if get_forward_context().argmax_only and 0 < rows <= self.max_rows and x.dtype in EPS and self.usable:
            if self.skip:
                self.skip -= 1
            else:
                out = self.screened(x, bias)
                if out is not None:
                    return out
        return self.inner(x, weight, bias)

    @property
    def max_rows(self) -> int:
        """The rows the screen serves: the streaming kernel's decode rows (a head whose kernel
        takes every row count, AVX2's float32, still screens only its first MAX_ROWS)."""
        return min(self.inner.max_rows, self.inner.ops.MAX_ROWS)

    def build(self, bias: torch.Tensor | None) -> None:
        """The 8-bit copy and the bound's constants; `usable` False where they cannot serve."""
        weight = self.inner.rows()  # the plain [N, K] weight, for the copy and the bound
        qw = quantize_int8(weight, GROUP)
        kernel = StreamingGroupGemm(qw, self.inner.ops)
        terms = streaming_error_bound(lambda block: weight[block], kernel, qw)
        finite_bias = bias is None or bool(torch.isfinite(bias).all())
        self.usable = finite_bias and terms is not None  # else: float16 scales overflow
        if terms is None or not self.usable:
            return
        self.per_norm, self.per_max = terms  # times |x|, times max|x|
        self.kernel = kernel

    def screened(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """[rows, vocab] in x's dtype: the plain head's logits where they may be the row's
        maximum, -inf elsewhere; None where the plain head must serve."""
        if self.kernel is None:
            self.build(bias)
            if not self.usable:
                return None
        assert self.kernel is not None  # built where usable
        xf = x.float().contiguous()
        bound = torch.linalg.vector_norm(xf, dim=1).mul_(self.per_norm).add_(xf.abs().amax(dim=1), alpha=self.per_max)
        if not math.isfinite(float(bound.max())):  # NaN or infinity in x
            return None
        eps = EPS[x.dtype]
        # near_max keeps x >= max - 2 eps (base + |max| + 1): base = bound (1 / eps + 2)
        hit_rows, hit_cols = near_max(self.kernel.qgemm(xf, bias), bound.mul_(1 / eps + 2), eps)
        if hit_cols.numel() > MAX_KEPT * x.shape[0] * self.out_features:
            self.flat_streak += 1
            if self.flat_streak >= FLAT_STREAK:
                self.flat_streak, self.skip = 0, BACKOFF
            return None
        self.flat_streak = 0
        out = torch.full((x.shape[0], self.out_features), float("-inf"), dtype=x.dtype)
        cols, where = torch.unique(hit_cols, return_inverse=True)
        exact = self.inner.columns(x, cols, bias)
        out[hit_rows, hit_cols] = exact[hit_rows, where]
        return out

    def make_batch_invariant(self) -> None:
        """The plain head's one kernel at every row count; the screen (a 1 to MAX_ROWS row path) goes."""
        self.inner.make_batch_invariant()
        self.kernel, self.usable = None, False

    @property
    def batch_invariant(self) -> bool:
        return self.inner.batch_invariant


# Weight dtypes whose heads get a screen: float32's 4 bytes a weight against the copy's 1.125.
# A bfloat16 head (2 bytes) measured slower screened, at 1 row and at 32: the 8-bit kernel's
# integer work costs more than the bytes it saves (docs/performance.md).
SCREENED_WEIGHTS = (torch.float32,)


def screen_lm_head(gemm: Any) -> Any:
    """`gemm` wrapped in an `ArgmaxScreen` where it applies (the streaming kernel, on a float32
    weight with in_features in whole groups of 32); else `gemm` itself."""
    streaming = all(hasattr(gemm, a) for a in ("max_rows", "ops", "rows", "columns", "make_batch_invariant"))
    if os.environ.get("ATOM_DISABLE_ARGMAX_SCREEN") or not streaming:
        return gemm
    if gemm.in_features % GROUP or gemm.dtype not in SCREENED_WEIGHTS:
        return gemm
    return ArgmaxScreen(gemm)
