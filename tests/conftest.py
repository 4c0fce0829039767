from __future__ import annotations

import pytest

try:  # two threads on a busy 2-core machine made small forwards 10-200x slower
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass

from atom_core import Config, SamplingParams, Scheduler, Sequence, get_plugin_manager


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
