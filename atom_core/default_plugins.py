"""What the core itself contributes through the hooks, registered like any plugin."""

from atom_core.hookspecs import hookimpl


@hookimpl
def atom_register_samplers(registry):
    registry.register("default", "atom_core.sampler:Sampler")
