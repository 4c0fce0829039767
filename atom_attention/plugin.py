"""Hook implementations only; builders are imported when a model asks for their type."""

from atom_core.plugin_api import hookimpl


@hookimpl
def atom_register_attention_builders(registry):
    registry.register("mha", "atom_attention.mha.builder:MHAMetadataBuilder")
    registry.register("mla", "atom_attention.mla.builder:MLAMetadataBuilder")
    registry.register("gdn", "atom_attention.gdn.builder:GDNMetadataBuilder")


@hookimpl
def atom_register_cpp_kernels(registry):
    registry.register("paged_attention", "atom_attention.cpu_kernels:PAGED_ATTENTION_KERNEL")
    registry.register("gdn", "atom_attention.cpu_kernels:GDN_KERNEL")
