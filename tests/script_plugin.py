"""A plugin for the tool-call tests, loaded through ATOM_PLUGINS: the "scripted" sampler writes,
for a request seeded with a key of the JSON file named by ATOM_SCRIPT_FILE, that entry's token
ids (then the model's end of text); other requests sample as the default sampler does. A
reply that makes tool calls, from a model too small to make them."""

import json
import os

import torch

from atom_core.plugin_api import hookimpl
from atom_core.runner.sampler import Sampler


class ScriptedSampler(Sampler):
    def __call__(self, logits, meta):
        tokens = super().__call__(logits, meta)
        with open(os.environ["ATOM_SCRIPT_FILE"]) as f:
            scripts = json.load(f)
        out = tokens.clone()
        for row, (seed, step) in enumerate(zip(meta.seeds, meta.steps)):
            script = scripts["replies"].get(str(seed))
            if script is not None:
                out[row] = script[step] if step < len(script) else scripts["eos"]
        return out.to(torch.int64) if out.dtype != tokens.dtype else out


@hookimpl
def atom_register_samplers(registry):
    registry.register("scripted", ScriptedSampler)
