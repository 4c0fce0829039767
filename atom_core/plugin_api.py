"""Everything a plugin may use from the core, besides `atom_core.layers` and the names
`atom_core` itself exports.

A plugin (Atom's own `atom_models`, `atom_attention` and `atom_spec`, or a third party's)
imports from here, so the core can move its modules without breaking one. Grouped by what
a plugin contributes:

- every plugin: `hookimpl` (the hooks are in `atom_core.plugins.hookspecs`), `get_registry`;
- an attention type: `AttentionMetadataBuilder` and what it is made from and builds
  (`BuilderContext`, `AttentionMetadata`, `KVCacheTensor`), its cache declared as a
  `KVLayout` and the planned `KVPoolPlan`, the step's `ScheduledBatch`, the forward context
  the layers read, `empty_resident` for pool tensors, and `cpu_features` (what the CPU can
  run, to choose between kernels);
- a model: the checkpoint-name helpers (`SKIP`, `packed_target`, `safetensors_files`) and,
  for GGUF files, `GGUFArchitecture` and its helpers;
- a proposer: `Proposer`, `ProposerContext`, `ProposalInput`, `Drafts`;
- a sampler or verifier: `SamplingMetadata`, `process_logits` (grammar masks, min_tokens,
  logit bias and penalties: call it first), `Penalties`, `apply_penalties`, `processed_probs`,
  `seed_for_step`;
- a structured-output backend: `StructuredOutputBackend`, `Grammar`, `StructuredOutputParams`;
- a scheduling policy: `SchedulingPolicy`, `StepBuilder`;
- a tool-call parser: `ToolParser` (or `TaggedToolParser`, for calls between tags), what it
  returns (`ParsedReply`, `ParsedCall`) and `call_of` for JSON call objects;
- a reasoning parser: `ReasoningParser`;
- settings of its own (a policy's or a builder's `options_class`, read from
  `Config.additional_config`): validators whose errors name the setting, the limit and the
  value (`boolean`, `positive`, `non_negative_int`, `one_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atom_core._validators import boolean, non_negative_int, one_of, positive
from atom_core.forward_context import (
    Context,
    ForwardContext,
    get_forward_context,
    reset_forward_context,
    set_forward_context,
)
from atom_core.kv.layout import KVLayout, KVPoolPlan
from atom_core.plugins.hookspecs import hookimpl
from atom_core.plugins.manager import get_registry
from atom_core.sched.batch import ScheduledBatch
from atom_core.sched.policy import SchedulingPolicy, StepBuilder

# Names whose modules load torch (or gguf) are imported on first use: the hook modules of
# plugins import this one, and reading the registries must not load torch.
_LAZY = {
    "AttentionMetadata": "atom_core.runner.attention_builder",
    "AttentionMetadataBuilder": "atom_core.runner.attention_builder",
    "BuilderContext": "atom_core.runner.attention_builder",
    "KVCacheTensor": "atom_core.runner.attention_builder",
    "STEP_ONLY": "atom_core.runner.attention_builder",
    "Drafts": "atom_core.runner.proposer",
    "ProposalInput": "atom_core.runner.proposer",
    "Proposer": "atom_core.runner.proposer",
    "ProposerContext": "atom_core.runner.proposer",
    "SamplingMetadata": "atom_core.runner.sampler",
    "Penalties": "atom_core.runner.sampler",
    "apply_penalties": "atom_core.runner.sampler",
    "process_logits": "atom_core.runner.sampler",
    "StructuredOutputBackend": "atom_core.structured_output.backend",
    "Grammar": "atom_core.structured_output.backend",
    "StructuredOutputParams": "atom_core.sampling_params",
    "processed_probs": "atom_core.runner.sampler",
    "seed_for_step": "atom_core.runner.sampler",
    "SKIP": "atom_core.loading.checkpoint",
    "packed_target": "atom_core.loading.checkpoint",
    "safetensors_files": "atom_core.loading.checkpoint",
    "GGUFArchitecture": "atom_core.loading.gguf.architecture",
    "GGUFFile": "atom_core.loading.gguf.architecture",
    "Joined": "atom_core.loading.gguf.architecture",
    "moe_tensors": "atom_core.loading.gguf.architecture",
    "empty_resident": "atom_core.platform.memory",
    "cpu_features": "atom_core.platform.cpu_features",
    "ToolParser": "atom_core.serve.tool_parser",
    "TaggedToolParser": "atom_core.serve.tool_parser",
    "ParsedReply": "atom_core.serve.tool_parser",
    "ParsedCall": "atom_core.serve.tool_parser",
    "call_of": "atom_core.serve.tool_parser",
    "ReasoningParser": "atom_core.serve.reasoning_parser",
}

if TYPE_CHECKING:
    from atom_core.loading.checkpoint import SKIP, packed_target, safetensors_files
    from atom_core.loading.gguf.architecture import GGUFArchitecture, GGUFFile, Joined, moe_tensors
    from atom_core.platform.cpu_features import cpu_features
    from atom_core.platform.memory import empty_resident
    from atom_core.runner.attention_builder import (
        STEP_ONLY,
        AttentionMetadata,
        AttentionMetadataBuilder,
        BuilderContext,
        KVCacheTensor,
    )
    from atom_core.runner.proposer import Drafts, ProposalInput, Proposer, ProposerContext
    from atom_core.runner.sampler import (
        Penalties,
        SamplingMetadata,
        apply_penalties,
        process_logits,
        processed_probs,
        seed_for_step,
    )
    from atom_core.sampling_params import StructuredOutputParams
    from atom_core.serve.reasoning_parser import ReasoningParser
    from atom_core.serve.tool_parser import ParsedCall, ParsedReply, TaggedToolParser, ToolParser, call_of
    from atom_core.structured_output.backend import Grammar, StructuredOutputBackend


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'atom_core.plugin_api' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SKIP",
    "STEP_ONLY",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "BuilderContext",
    "Context",
    "Drafts",
    "ForwardContext",
    "GGUFArchitecture",
    "GGUFFile",
    "Joined",
    "Penalties",
    "KVCacheTensor",
    "KVLayout",
    "KVPoolPlan",
    "ProposalInput",
    "Proposer",
    "ProposerContext",
    "SamplingMetadata",
    "ScheduledBatch",
    "SchedulingPolicy",
    "StepBuilder",
    "ToolParser",
    "TaggedToolParser",
    "ParsedReply",
    "ParsedCall",
    "call_of",
    "ReasoningParser",
    "apply_penalties",
    "process_logits",
    "StructuredOutputBackend",
    "Grammar",
    "StructuredOutputParams",
    "boolean",
    "empty_resident",
    "cpu_features",
    "get_forward_context",
    "get_registry",
    "hookimpl",
    "moe_tensors",
    "non_negative_int",
    "one_of",
    "packed_target",
    "positive",
    "processed_probs",
    "reset_forward_context",
    "safetensors_files",
    "seed_for_step",
    "set_forward_context",
]
