"""What the core itself contributes through the hooks, registered like any plugin."""

from atom_core.plugins.hookspecs import hookimpl


@hookimpl
def atom_register_samplers(registry):
    registry.register("default", "atom_core.runner.sampler:Sampler")


@hookimpl
def atom_register_scheduler_policies(registry):
    registry.register("prefill_first", "atom_core.sched.policies.prefill_first:PrefillFirstPolicy")
    registry.register("mixed", "atom_core.sched.policies.mixed:MixedPolicy")
    registry.register("spyre", "atom_core.sched.policies.spyre:SpyrePolicy")


@hookimpl
def atom_register_cpp_kernels(registry):
    registry.register("cpu_ops", "atom_core.layers.ops:CPU_OPS_KERNEL")
    registry.register("gemv", "atom_core.layers.gemm:GEMV_KERNEL")
    registry.register("moe", "atom_core.layers.moe:MOE_KERNEL")


@hookimpl
def atom_register_structured_output_backends(registry):
    registry.register("guidance", "atom_core.structured_output.guidance:GuidanceBackend")


@hookimpl
def atom_register_distributed_executors(registry):
    registry.register("mp", "atom_core.executor.multiproc:MultiprocExecutor")
    registry.register("torchrun", "atom_core.executor.torchrun:TorchrunExecutor")
    registry.register("ray", "atom_core.executor.ray_executor:RayExecutor")  # the `ray` extra


@hookimpl
def atom_register_tool_parsers(registry):
    registry.register("hermes", "atom_core.serve.tool_parsers.hermes:HermesToolParser")
    registry.register("llama3_json", "atom_core.serve.tool_parsers.llama3_json:Llama3JsonToolParser")
    registry.register("qwen3_coder", "atom_core.serve.tool_parsers.qwen3_coder:Qwen3CoderToolParser")
    registry.register("mistral", "atom_core.serve.tool_parsers.mistral:MistralToolParser")
    registry.register("pythonic", "atom_core.serve.tool_parsers.pythonic:PythonicToolParser")
    registry.register("deepseek_v3", "atom_core.serve.tool_parsers.deepseek_v3:DeepSeekV3ToolParser")


@hookimpl
def atom_register_reasoning_parsers(registry):
    registry.register("qwen3", "atom_core.serve.reasoning_parsers.qwen3:Qwen3ReasoningParser")
    registry.register("deepseek_r1", "atom_core.serve.reasoning_parsers.deepseek_r1:DeepSeekR1ReasoningParser")
