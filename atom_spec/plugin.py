"""Hook implementations only; a proposer is imported when a config names its method."""

from atom_core.plugin_api import hookimpl


@hookimpl
def atom_register_proposers(registry):
    registry.register("ngram", "atom_spec.ngram:NgramProposer")
    registry.register("mtp", "atom_spec.mtp:MTPProposer")
    registry.register("eagle3", "atom_spec.eagle3:Eagle3Proposer")


@hookimpl
def atom_register_samplers(registry):
    registry.register("rejection", "atom_spec.rejection:RejectionSampler")
