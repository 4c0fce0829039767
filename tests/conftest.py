from __future__ import annotations

import pytest

try:  # two threads on a busy 2-core machine made small forwards 10-200x slower
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

from atom_core import Config, SamplingParams, Scheduler, Sequence, get_plugin_manager
from atom_core.platform.cpu_features import cpu_features

# Every kernel variant this host can run, best first: on an AVX-512 host the AVX2 and portable
# builds are checked too, so either kind of host tests both paths (ATOM_CPU_ISA caps the list).
KERNEL_VARIANTS = cpu_features().variants


def require_kernel(ops):
    """A C++ kernel module a test needs. A kernel that did not build fails the test, it does not
    skip it; only ATOM_CPU_KERNELS=0 (the suite's torch-path run) or a host with no compiler skip."""
    from atom_core.layers.cpp import compiler, kernels_enabled

    if ops is None:
        if not kernels_enabled():
            pytest.skip("C++ kernels turned off (ATOM_CPU_KERNELS=0): the torch path runs")
        if compiler() is None:
            pytest.skip("no C++ compiler on this host")
        pytest.fail("the C++ kernel did not build on a host with a compiler (see the log line)")
    return ops


@pytest.fixture(scope="session")
def _kernels_built():
    """Builds every declared kernel in every variant up front, one build per core at a time,
    rather than one by one as tests first ask for them."""
    from atom_core.layers.cpp import build_all, kernels_enabled

    if kernels_enabled():
        build_all(KERNEL_VARIANTS)


@pytest.fixture(params=KERNEL_VARIANTS)
def kernel_variant(request, _kernels_built) -> str:
    """Each variant of the C++ kernels this host can run, in turn."""
    return request.param


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """`tiny_folder(name)`: the tiny random checkpoint of arch `name` (tests/model_utils.py),
    built once per test module."""
    from model_utils import build_tiny_model

    folders = {}

    def get(name: str):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            build_tiny_model(name, folders[name])
        return folders[name]

    return get


def make_seq(n: int | list[int], block_size: int = 16, start: int = 0, **params) -> Sequence:
    """A sequence of `n` distinct tokens (or the given list), with sampling params."""
    tokens = list(range(start, start + n)) if isinstance(n, int) else list(n)
    return Sequence(tokens, block_size, SamplingParams(**params))


def make_scheduler(**config) -> Scheduler:
    """ATOM's scheduler by default (prefill-first, no chunking); tests of other policies say so."""
    config.setdefault("num_kvcache_blocks", 64)
    config.setdefault("scheduling_policy", "prefill_first")
    config.setdefault("enable_chunked_prefill", False)
    return Scheduler(Config(**config))


def record_preemptions(scheduler) -> list[int]:
    """Ids of the requests `scheduler` preempts from now on, in order."""
    preempted: list[int] = []
    original = scheduler.preempt

    def preempt(seq):
        preempted.append(seq.id)
        original(seq)

    scheduler.preempt = preempt
    return preempted


def is_prefill(batch) -> bool:
    return batch.total_seqs_num_prefill > 0


@pytest.fixture
def plugin_manager():
    """The real plugin manager; plugins a test registers are removed after it."""
    pm = get_plugin_manager()
    before = {id(p) for p in pm.get_plugins()}
    yield pm
    for plugin in list(pm.get_plugins()):
        if id(plugin) not in before:
            pm.unregister(plugin)


# Bounded: every string, array and number has a limit, so a valid answer fits in max_tokens.
CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "colour": {"enum": ["black", "white", "ginger", "grey"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "colour", "age", "toys"],
    "additionalProperties": False,
}
