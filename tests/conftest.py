from __future__ import annotations

import contextlib
import os
import signal
import subprocess

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
NATIVE_VARIANT = cpu_features().variant.name  # the one scripts/setup.sh builds
_other_variants_build: subprocess.Popen | None = None


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


def pytest_sessionstart(session):
    """The variants other than this CPU's compile behind the tests, on the core their single
    torch thread leaves (`atom kernels --idle`), not in a pause before the first kernel test:
    on an AVX-512 host that is four variants of every kernel, minutes of compiling. Under
    pytest-xdist (`-n auto`) the controller starts it, once; a worker that reaches those tests
    first builds beside it (each build folder's lock keeps one compiler to a kernel)."""
    global _other_variants_build
    from atom_core.layers.cpp import compiler, declared_kernels, kernels_enabled, start_background_build

    others = [v for v in KERNEL_VARIANTS if v != NATIVE_VARIANT]
    if hasattr(session.config, "workerinput") or not (kernels_enabled() and compiler() and others):
        return
    if not all(k.built(v) for k in declared_kernels().values() for v in others):
        _other_variants_build = start_background_build(others)


def pytest_sessionfinish(session, exitstatus):
    """A run that never reached the other variants' tests (-k) leaves no compiler behind."""
    if _other_variants_build is not None and _other_variants_build.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_other_variants_build.pid, signal.SIGTERM)
        _other_variants_build.wait()


def _other_variant(nodeid: str) -> str | None:
    """The variant other than this CPU's that a test id names among its parameters (the
    `kernel_variant` fixture's, or "cpu-<variant>"), if any."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    return next((p for p in params if p in KERNEL_VARIANTS and p != NATIVE_VARIANT), None)


def pytest_collection_modifyitems(session, config, items):
    """Tests of the variants other than this CPU's run last, by when `pytest_sessionstart`'s
    build has had the rest of the suite's time."""
    items.sort(key=lambda item: _other_variant(item.nodeid) is not None)  # (a stable sort)


MAX_WORKERS = 4  # each worker holds its own models and servers


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n auto` (scripts/test.sh, .ci/run): a worker per core this process may run on, up to
    MAX_WORKERS; xdist's PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead (0: no workers)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)


def xdist_unit(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: its module, or its module's tests of one
    variant other than this CPU's."""
    module = nodeid.split("::", 1)[0]
    variant = _other_variant(nodeid)
    return f"{module}@{variant}" if variant else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N --dist loadfile` (scripts/test.sh), refined: a test module's tests go to one worker,
    so its servers and models start once, except its tests of each other variant, which are a
    unit of their own; units are handed out in collection order, so those come last (above)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleAndVariant(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    config.option.loadscopereorder = False  # (its reordering, by tests per unit, would not keep them last)
    return ModuleAndVariant(config, log)


@pytest.fixture(scope="session")
def _kernels_built():
    """Every declared kernel in every variant, built: after the background build, whatever it
    left (one build per core at a time), rather than one by one as tests first ask for them."""
    from atom_core.layers.cpp import build_all, kernels_enabled

    if _other_variants_build is not None:
        _other_variants_build.wait()
    if kernels_enabled():
        build_all(KERNEL_VARIANTS)


def built_variant(request, variant: str) -> str:
    """`variant`, once its kernels are built: this CPU's needs no wait (setup built it, or its
    first load does), the others wait for `_kernels_built`."""
    if variant != NATIVE_VARIANT:
        request.getfixturevalue("_kernels_built")
    return variant


@pytest.fixture(params=KERNEL_VARIANTS)
def kernel_variant(request) -> str:
    """Each variant of the C++ kernels this host can run, in turn."""
    return built_variant(request, request.param)


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
