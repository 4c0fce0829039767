"""Atom's core: configuration, requests, paged KV blocks, scheduling and the plugin hooks.

Everything model-specific (models, attention kernels, samplers, proposers) arrives as
a plugin through the "atom" entry-point group; this package imports none of them.
"""

from atom_core.block_manager import Block, BlockManager
from atom_core.config import Config, SpeculativeConfig
from atom_core.hookspecs import hookimpl
from atom_core.plugins import get_plugin_manager, get_registry
from atom_core.registry import Registry, RegistryError
from atom_core.request import RequestOutput
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler import ScheduledBatch, ScheduledBatchOutput, Scheduler
from atom_core.sequence import Sequence, SequenceStatus, SequenceType



def __getattr__(name: str):
    # The engine needs torch; `import atom_core` alone must not load it.
    if name == "LLMEngine":
        from atom_core.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'atom_core' has no attribute {name!r}")


__all__ = [
    "Block",
    "BlockManager",
    "Config",
    "LLMEngine",
    "RequestOutput",
    "Registry",
    "RegistryError",
    "SamplingParams",
    "ScheduledBatch",
    "ScheduledBatchOutput",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "SequenceType",
    "SpeculativeConfig",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
]
