"""The compiled decode path: `torch.compile` of a model's forward for decode-sized steps.

Why: a batch-1 decode step on a small model spends milliseconds dispatching ~15 small ops
per layer from Python (module calls, views, norms, rope, residual adds). Inductor traces
the whole forward once, fuses the elementwise ops into a few generated C++ loops and
calls the GEMM kernels directly, so that per-op cost goes.

Model-agnostic: nothing here or in a model plugin names a model. Each attention layer
(every module with an `attn_type`, whatever builder serves it) runs as one opaque op,
`atom::opaque_layer`, because its kernel reads per-step metadata and writes the KV pool
or per-request state in place; the op calls the layer's eager forward. So does any other
module that sets `compile_opaque = True` (the MoE experts, whose token grouping is
data-dependent). What the op returns is declared by the module's `out_features` ([tokens,
out_features], the dtype of its first input). Everything else is traced, as one graph
(`fullgraph=True`): it is compiled whole before any layer of the step runs, so a failure
never leaves a step half done. Layers' C++ elementwise kernels step aside while tracing
(`torch.compiler.is_compiling()`), the streaming GEMV runs as the torch op `atom_gemv_<variant>::gemv`
and oneDNN's packed GEMM as `atom::onednn_linear`.

Steps of up to `MAX_TOKENS` tokens (decode rows, drafts, short chunks) take the compiled
graph: one for a single token, one with a dynamic token count for the rest. Longer steps
(prompt chunks) stay eager, where per-op cost is spread over many tokens. `Config.enforce_eager`
(the default: on this machine it measured no faster) keeps the plain model. Where the path
cannot apply (a device other than CPU or CUDA, an opaque module without `out_features`, a
model Dynamo cannot trace whole, a compiler failure) the model runs eagerly, said once in
the log.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Callable, cast

import torch
from torch import nn

logger = logging.getLogger("atom")

# Steps with more tokens than this run eagerly (and their GEMMs take oneDNN's packed weights,
# which the traced graph does not).
MAX_TOKENS = 8

_layers: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_next_key = itertools.count()


@torch.library.custom_op("atom::opaque_layer", mutates_args=())
def opaque_layer(inputs: list[torch.Tensor], key: int) -> torch.Tensor:
    """One module's eager forward (an attention layer writes its pool in place; nothing else reads it)."""
    # set by `_opaque` (nn.Module types its attributes Tensor | Module)
    return cast("Callable[..., torch.Tensor]", _layers[key].eager_forward)(*inputs)


@opaque_layer.register_fake
def _(inputs: list[torch.Tensor], key: int) -> torch.Tensor:
    return inputs[0].new_empty((inputs[0].shape[0], cast(int, _layers[key].out_features)))


def _opaque(module: nn.Module) -> None:
    """Route `module`'s forward through `atom::opaque_layer` (its own forward stays `eager_forward`)."""
    key = next(_next_key)
    _layers[key] = module
    module.eager_forward = module.forward  # type: ignore[assignment]  # __setattr__ takes any value

    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.atom.opaque_layer(list(inputs), key)

    module.forward = forward


class CompiledForward:
    """`model(input_ids, positions)`, compiled for steps of up to `MAX_TOKENS` tokens."""

    def __init__(self, model: nn.Module, compiled: Callable):
        self.model, self.compiled = model, compiled
        self.failed = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        if self.failed or n > MAX_TOKENS:
            return self.model(input_ids, positions)
        if n > 1:  # one graph for 2..MAX_TOKENS tokens (a size of 1 would be specialised)
            torch._dynamo.mark_dynamic(input_ids, 0, min=2, max=MAX_TOKENS)
            torch._dynamo.mark_dynamic(positions, 0, min=2, max=MAX_TOKENS)
        try:
            return self.compiled(input_ids, positions)
        except Exception as e:  # a compiler error must not cost the request: run eagerly from now on
            self.failed = True
            logger.warning("atom: compiling the decode path failed (%s: %s); running eagerly", type(e).__name__, e)
            return self.model(input_ids, positions)


def opaque_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that run as one op in the compiled graph: attention layers and those that ask."""
    return [m for m in model.modules() if getattr(m, "attn_type", None) or getattr(m, "compile_opaque", False)]


def compile_model(model: nn.Module, config: Any, device: torch.device) -> Callable:
    """The forward the runner calls: compiled where it applies, else `model` itself (with one log line why)."""
    if config.enforce_eager:
        return model
    why = None
    opaque = opaque_modules(model)
    if device.type not in ("cpu", "cuda"):
        why = f"device {device.type!r} (compiled for cpu and cuda)"
    elif missing := sorted({type(m).__name__ for m in opaque if not hasattr(m, "out_features")}):
        why = f"opaque layers without `out_features`: {', '.join(missing)}"
    if why:
        logger.info("atom: compiled decode path off: %s; running eagerly", why)
        return model
    for m in opaque:
        _opaque(m)
    return CompiledForward(model, torch.compile(model, dynamic=False, fullgraph=True))
