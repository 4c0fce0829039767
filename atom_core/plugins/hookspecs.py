"""The hooks a plugin implements. Each hands the plugin a registry to add names to.

A plugin is any module or object with functions marked `@atom_core.hookimpl`,
published under the entry-point group "atom" (see README, "Writing a plugin").
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("atom")
hookimpl = pluggy.HookimplMarker("atom")


@hookspec
def atom_register_models(registry):
    """Register model classes by HF `architectures` name, e.g.
    `registry.register("LlamaForCausalLM", "my_pkg.llama:LlamaForCausalLM")`."""


@hookspec
def atom_register_attention_builders(registry):
    """Register AttentionMetadataBuilder classes by attention type ("mha", "mla", "gdn", ...)."""


@hookspec
def atom_register_samplers(registry):
    """Register samplers by name ("default", ...)."""


@hookspec
def atom_register_proposers(registry):
    """Register speculative-decoding proposers by method name ("eagle", "mtp", "ngram", ...)."""


@hookspec
def atom_register_scheduler_policies(registry):
    """Register scheduling policies (`atom_core.sched.policy.SchedulingPolicy` subclasses) by name,
    picked with `Config.scheduling_policy` ("prefill_first", "mixed", "spyre", ...)."""


@hookspec
def atom_register_gguf_architectures(registry):
    """Register how a GGUF file of one architecture becomes a Hugging Face checkpoint, by the
    file's `general.architecture` name ("llama", "qwen3", "deepseek2", ...): an instance of
    `atom_core.loading.gguf.architecture.GGUFArchitecture` (its config keys, tensor names, permuted and fused
    tensors), e.g. `registry.register("llama", "my_pkg.llama:GGUF_LLAMA")`. The model plugin
    that runs the architecture is the one that knows how llama.cpp wrote it."""


@hookspec
def atom_register_cpp_kernels(registry):
    """Register C++ CPU kernels (`atom_core.layers.cpp.CppKernel`) by name, e.g.
    `registry.register("paged_attention", "my_pkg.kernels:PAGED_ATTENTION")`. Called when
    `atom env` or `atom kernels` lists or builds them; the kernel itself is built per CPU
    variant when its plugin first loads it."""
