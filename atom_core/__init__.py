"""Atom's core: configuration, requests, paged KV blocks, scheduling and the plugin hooks.

Everything model-specific (models, attention kernels, samplers, proposers) arrives as
a plugin through the "atom" entry-point group; this package imports none of them.
"""

from atom_core.platform.cpu_features import cap_torch_and_onednn

cap_torch_and_onednn()  # under ATOM_CPU_ISA, before torch chooses its kernels

from atom_core.config import Config, SpeculativeConfig  # noqa: E402
from atom_core.kv.block_manager import Block, BlockManager  # noqa: E402
from atom_core.plugins.hookspecs import hookimpl  # noqa: E402
from atom_core.plugins.manager import get_plugin_manager, get_registry  # noqa: E402
from atom_core.plugins.registry import Registry, RegistryError  # noqa: E402
from atom_core.request import RequestOutput  # noqa: E402
from atom_core.sampling_params import SamplingParams  # noqa: E402
from atom_core.sched.batch import ScheduledBatch, ScheduledBatchOutput  # noqa: E402
from atom_core.sched.scheduler import Scheduler  # noqa: E402
from atom_core.sequence import Sequence, SequenceStatus, SequenceType  # noqa: E402


def __getattr__(name: str):
    # The engine needs torch; `import atom_core` alone must not load it.
    if name == "LLMEngine":
        from atom_core.engine.llm_engine import LLMEngine

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
