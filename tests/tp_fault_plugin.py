"""A plugin for the tensor-parallel tests, loaded through ATOM_PLUGINS (so the worker ranks load
it too): "FaultyRankLlamaForCausalLM" is Llama, except that on rank 1 a step whose tokens hold
`FAULT_TOKEN` three times raises (an injected fault on one rank, mid-step; a prompt of it three
times does it, where no generated token would)."""

from atom_core.layers import get_tp_group
from atom_core.plugin_api import hookimpl
from atom_models.llama import LlamaForCausalLM

FAULT_TOKEN = 251


class FaultyRankLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids, positions):
        if get_tp_group().rank == 1 and int((input_ids == FAULT_TOKEN).sum()) >= 3:
            raise RuntimeError("injected fault on rank 1")
        return super().forward(input_ids, positions)


@hookimpl
def atom_register_models(registry):
    registry.register("FaultyRankLlamaForCausalLM", FaultyRankLlamaForCausalLM)
