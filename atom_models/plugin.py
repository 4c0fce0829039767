"""Hook implementations only: names map to lazily imported classes, so listing plugins
never imports torch."""

from atom_core import hookimpl


@hookimpl
def atom_register_models(registry):
    registry.register("LlamaForCausalLM", "atom_models.llama:LlamaForCausalLM")
    registry.register("Qwen3ForCausalLM", "atom_models.qwen3:Qwen3ForCausalLM")
