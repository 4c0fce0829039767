"""What the core itself contributes through the hooks, registered like any plugin."""

from atom_core.hookspecs import hookimpl


@hookimpl
def atom_register_samplers(registry):
    registry.register("default", "atom_core.sampler:Sampler")


@hookimpl
def atom_register_scheduler_policies(registry):
    registry.register("prefill_first", "atom_core.policies.prefill_first:PrefillFirstPolicy")
    registry.register("mixed", "atom_core.policies.mixed:MixedPolicy")
    registry.register("spyre", "atom_core.policies.spyre:SpyrePolicy")


@hookimpl
def atom_register_cpp_kernels(registry):
    registry.register("cpu_ops", "atom_core.layers.ops:CPU_OPS_KERNEL")
    registry.register("gemv", "atom_core.layers.linear:GEMV_KERNEL")
    registry.register("moe", "atom_core.layers.moe:MOE_KERNEL")
