"""A plugin for the serving tests, loaded through ATOM_PLUGINS: the "faulty" sampler is the
default one, except that a step holding a request seeded `FAULT_SEED` raises (an injected
forward-pass fault) and one holding a request seeded `SLOW_SEED` takes `SLOW_SECONDS` more
(a long step, as a long prompt's is)."""

import time

from atom_core.plugin_api import hookimpl
from atom_core.runner.sampler import Sampler

FAULT_SEED = 66613
SLOW_SEED = 5150
SLOW_SECONDS = 3.0


class FaultySampler(Sampler):
    def __call__(self, logits, meta):
        if FAULT_SEED in meta.seeds:
            raise RuntimeError("injected fault")
        if SLOW_SEED in meta.seeds:
            time.sleep(SLOW_SECONDS)
        return super().__call__(logits, meta)


@hookimpl
def atom_register_samplers(registry):
    registry.register("faulty", FaultySampler)
