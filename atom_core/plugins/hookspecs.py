"""The hooks a plugin implements, each named `atom_register_*`.

Every hook is called with a `PluginRegistry` each time Atom builds that kind's registry
(`get_registry(kind)`: when an engine starts, when a scheduler looks its policy up, when
`atom plugins` lists what is installed), so it must only register names: cheap, no I/O, no
torch. A hook returns nothing. A plugin is any module or object with functions marked
`@hookimpl` (import it from `atom_core.plugin_api`), published under the entry-point
group "atom"; see docs/plugins.md.
"""

from __future__ import annotations

import pluggy

from atom_core.plugins.registry import PluginRegistry

hookspec = pluggy.HookspecMarker("atom")
hookimpl = pluggy.HookimplMarker("atom")


@hookspec
def atom_register_models(registry: PluginRegistry) -> None:
    """Register model classes by the checkpoint's `architectures` name, e.g.
    `registry.register("LlamaForCausalLM", "my_pkg.llama:LlamaForCausalLM")`.

    Asked when an engine loads a checkpoint; the class is built as `cls(hf_config, config)`."""


@hookspec
def atom_register_attention_builders(registry: PluginRegistry) -> None:
    """Register `AttentionMetadataBuilder` subclasses by attention type ("mha", "mla", "gdn", ...).

    Asked when a model runner starts: each attention layer's `attn_type` picks one, built as
    `cls(BuilderContext, layers)`."""


@hookspec
def atom_register_samplers(registry: PluginRegistry) -> None:
    """Register samplers (and speculative-decoding verifiers) by name ("default", "rejection", ...).

    Asked when a model runner starts (`Config.sampler`, `SpeculativeConfig.verifier`); built as
    `cls(config)`, called as `sampler(logits, SamplingMetadata)` -> one token id per row."""


@hookspec
def atom_register_proposers(registry: PluginRegistry) -> None:
    """Register speculative-decoding proposers by method name ("ngram", "mtp", "eagle3", ...).

    Asked when a model runner starts with a `speculative_config`; built as
    `cls(ProposerContext, spec_config)`."""


@hookspec
def atom_register_scheduler_policies(registry: PluginRegistry) -> None:
    """Register `SchedulingPolicy` subclasses by name ("prefill_first", "mixed", "spyre", ...).

    Asked when a scheduler starts (`Config.scheduling_policy`) and when a model runner sizes
    the pool (a policy's `reserved_blocks`); built as `cls(config)`."""


@hookspec
def atom_register_gguf_architectures(registry: PluginRegistry) -> None:
    """Register how a GGUF file of one architecture becomes a Hugging Face checkpoint, by the
    file's `general.architecture` name ("llama", "qwen3", "deepseek2", ...): a
    `GGUFArchitecture` (its config keys, tensor names, permuted and fused tensors), e.g.
    `registry.register("llama", "my_pkg.llama:GGUF_LLAMA")`.

    Asked when a GGUF file is converted; the model plugin that runs the architecture is the
    one that knows how llama.cpp wrote it."""


@hookspec
def atom_register_cpp_kernels(registry: PluginRegistry) -> None:
    """Register C++ CPU kernels (`atom_core.layers.cpp.CppKernel`) by name, e.g.
    `registry.register("paged_attention", "my_pkg.kernels:PAGED_ATTENTION")`.

    Asked when `atom env` or `atom kernels` lists or builds them; the kernel itself is built
    per CPU variant when its plugin first loads it."""


@hookspec
def atom_register_structured_output_backends(registry: PluginRegistry) -> None:
    """Register structured-output backends (`atom_core.structured_output.backend.StructuredOutputBackend`)
    by name ("guidance" is llguidance's), e.g. `registry.register("xgrammar", "my_pkg.xg:XGrammarBackend")`.

    Asked when a request with `structured_output` arrives and its engine has not yet built that
    backend; built as `cls(tokenizer, vocab_size, eos_token_ids)`, once per engine."""


@hookspec
def atom_register_distributed_executors(registry: PluginRegistry) -> None:
    """Register ways to start the ranks of a tensor-parallel engine
    (`atom_core.executor.executor.DistributedExecutor` subclasses) by name ("mp", "torchrun"),
    e.g. `registry.register("ray", "my_pkg.ray_executor:RayExecutor")`.

    Asked when an engine with `tensor_parallel_size > 1` starts; built as `cls(config, hf_config)`
    in rank 0's process, by `Config.distributed_executor`."""


@hookspec
def atom_register_hf_configs(registry: PluginRegistry) -> None:
    """Register readers for checkpoints whose config.json names a `model_type` transformers does
    not know, by that name: a function taking the config.json dict and returning a transformers
    config, e.g. `registry.register("kimi_k2", "my_pkg.configs:kimi_k2_config")` (Kimi-K2's
    checkpoints are DeepSeek-V3's shape under a name of their own).

    Asked when a model folder's config.json is read and transformers refuses its model_type."""


@hookspec
def atom_register_tool_parsers(registry: PluginRegistry) -> None:
    """Register parsers of the tool calls a model writes in its replies
    (`atom_core.serve.tool_parser.ToolParser` subclasses) by format name ("hermes",
    "llama3_json", "qwen3_coder"), e.g. `registry.register("mistral", "my_pkg.tools:MistralToolParser")`.

    Asked when `atom serve --enable-auto-tool-choice --tool-call-parser NAME` starts; built as
    `cls(functions)` (the request's tools, name -> `parameters` schema) for each reply to a
    request whose `tool_choice` is "auto"."""


@hookspec
def atom_register_reasoning_parsers(registry: PluginRegistry) -> None:
    """Register ways a reasoning model marks its reasoning
    (`atom_core.serve.reasoning_parser.ReasoningParser` subclasses) by name ("qwen3",
    "deepseek_r1"), e.g. `registry.register("granite", "my_pkg.reasoning:GraniteReasoningParser")`.

    Asked when `atom serve --reasoning-parser NAME` starts; built as `cls()` for each chat reply
    no grammar shapes."""
