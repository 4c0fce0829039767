"""Hook implementations only: names map to lazily imported classes, so listing plugins
never imports torch."""

from atom_core.plugin_api import hookimpl


@hookimpl
def atom_register_models(registry):
    registry.register("LlamaForCausalLM", "atom_models.llama:LlamaForCausalLM")
    registry.register("MistralForCausalLM", "atom_models.mistral:MistralForCausalLM")
    registry.register("Phi3ForCausalLM", "atom_models.phi3:Phi3ForCausalLM")
    registry.register("SmolLM3ForCausalLM", "atom_models.smollm3:SmolLM3ForCausalLM")
    registry.register("Gemma2ForCausalLM", "atom_models.gemma:Gemma2ForCausalLM")
    registry.register("Gemma3ForCausalLM", "atom_models.gemma:Gemma3ForCausalLM")
    registry.register("Qwen2ForCausalLM", "atom_models.qwen2:Qwen2ForCausalLM")
    registry.register("Qwen3ForCausalLM", "atom_models.qwen3:Qwen3ForCausalLM")
    registry.register("Qwen3MoeForCausalLM", "atom_models.qwen3_moe:Qwen3MoeForCausalLM")
    registry.register("Qwen3NextForCausalLM", "atom_models.qwen3_next:Qwen3NextForCausalLM")
    registry.register("Qwen3_5ForCausalLM", "atom_models.qwen3_5:Qwen3_5ForCausalLM")
    registry.register("Qwen3_5MoeForCausalLM", "atom_models.qwen3_5:Qwen3_5MoeForCausalLM")
    # The multimodal releases: their text model (the vision tower's weights are skipped).
    registry.register("Qwen3_5ForConditionalGeneration", "atom_models.qwen3_5:Qwen3_5ForCausalLM")
    registry.register("Qwen3_5MoeForConditionalGeneration", "atom_models.qwen3_5:Qwen3_5MoeForCausalLM")
    registry.register("MixtralForCausalLM", "atom_models.mixtral:MixtralForCausalLM")
    registry.register("GptOssForCausalLM", "atom_models.gpt_oss:GptOssForCausalLM")
    registry.register("GlmForCausalLM", "atom_models.glm:GlmForCausalLM")
    registry.register("Glm4ForCausalLM", "atom_models.glm:Glm4ForCausalLM")
    registry.register("Glm4MoeForCausalLM", "atom_models.glm4_moe:Glm4MoeForCausalLM")
    registry.register("MiniMaxM2ForCausalLM", "atom_models.minimax_m2:MiniMaxM2ForCausalLM")
    registry.register("DeepseekV2ForCausalLM", "atom_models.deepseek_v2:DeepseekV2ForCausalLM")
    registry.register("DeepseekV3ForCausalLM", "atom_models.deepseek_v2:DeepseekV3ForCausalLM")
    # EAGLE-3 draft heads: built beside a target by the "eagle3" proposer, never run alone.
    registry.register("LlamaForCausalLMEagle3", "atom_models.llama_eagle3:LlamaForCausalLMEagle3")
    registry.register("Eagle3LlamaForCausalLM", "atom_models.llama_eagle3:LlamaForCausalLMEagle3")


@hookimpl
def atom_register_gguf_architectures(registry):
    # By llama.cpp's `general.architecture` name; "llama" covers Mixtral (written as llama with experts).
    registry.register("llama", "atom_models.llama:GGUF_LLAMA")
    registry.register("qwen2", "atom_models.qwen3:GGUF_QWEN2")
    registry.register("gemma2", "atom_models.gemma:GGUF_GEMMA2")
    registry.register("gemma3", "atom_models.gemma:GGUF_GEMMA3")
    registry.register("glm4", "atom_models.glm:GGUF_GLM4")
    registry.register("phi3", "atom_models.phi3:GGUF_PHI3")
    registry.register("smollm3", "atom_models.smollm3:GGUF_SMOLLM3")
    registry.register("qwen3", "atom_models.qwen3:GGUF_QWEN3")
    registry.register("qwen3moe", "atom_models.qwen3_moe:GGUF_QWEN3_MOE")
    registry.register("deepseek2", "atom_models.deepseek_v2:GGUF_DEEPSEEK2")


@hookimpl
def atom_register_hf_configs(registry):
    registry.register("kimi_k2", "atom_models.deepseek_v2:kimi_k2_config")
