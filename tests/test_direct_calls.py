"""Direct module calls (atom_core/runner/direct_calls.py): the eager path skips nn.Module.__call__'s
machinery, and nothing a user of the modules can see changes: classes, state, instance
forwards, hooks registered before or after. Every parity test runs models through it too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from atom_core.runner.direct_calls import direct_calls, is_direct, plain_type  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_direct_modules_compute_the_same_and_keep_their_identity():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    want, keys = net(x), list(net.state_dict())
    direct_calls(net)
    assert all(is_direct(m) for m in net.modules())
    assert isinstance(net.layers[0], Block) and type(net.layers[0]).__name__ == "Block"
    assert torch.equal(net(x), want)
    assert list(net.state_dict()) == keys
    # the machinery really is skipped: nn.Module.__call__ is not on the call path
    calls = []
    original = nn.Module._call_impl
    nn.Module._call_impl = lambda self, *a, **k: calls.append(self) or original(self, *a, **k)
    try:
        net(x)
    finally:
        nn.Module._call_impl = original
    assert calls == []


def test_hooks_before_and_after_still_run():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    seen = []
    net.layers[0].register_forward_hook(lambda m, args, out: seen.append("before"))
    direct_calls(net)
    assert not is_direct(net.layers[0])  # it has a hook: the normal call, which runs it
    assert is_direct(net.layers[1])
    net.layers[1].proj.register_forward_hook(lambda m, args, out: seen.append("after"))
    assert not is_direct(net.layers[1].proj)  # turned back into a plain Linear
    assert type(net.layers[1].proj) is nn.Linear
    net(x)
    assert seen == ["before", "after"]
    pre = []
    net.layers[1].norm.register_forward_pre_hook(lambda m, args: pre.append(1))
    net(x)
    assert pre == [1]


def test_an_instance_forward_is_honoured():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    direct_calls(net)
    block = net.layers[1]
    calls = []
    own = block.forward
    block.forward = lambda x: calls.append(1) or own(x)  # a profiler's wrapper, say
    net(x)
    assert calls == [1]


def test_idempotent_and_classes_shared():
    a, b = Net(), Net()
    direct_calls(a)
    direct_calls(a)
    direct_calls(b)
    assert type(a.layers[0]) is type(b.layers[0])
    assert plain_type(a.layers[0]) is Block and plain_type(Block()) is Block


def test_engine_runs_its_model_through_direct_calls(tmp_path):
    from model_utils import build_tiny_model

    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine

    build_tiny_model("llama", tmp_path)
    engine = LLMEngine(str(tmp_path), dtype="float32", max_model_len=64, kv_cache_memory=1 << 22)
    assert all(is_direct(m) for m in engine.runner.model.modules())
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4


def test_attribute_reads_skip_getattr_and_follow_every_change():
    """Parameters, buffers and submodules are mirrored into the instance dict (no
    nn.Module.__getattr__ on the hot path), and the mirror follows each way they change."""
    torch.manual_seed(0)
    net = Net()
    direct_calls(net)
    block, proj = net.layers[0], net.layers[0].proj
    assert vars(block)["proj"] is proj and vars(proj)["weight"] is proj._parameters["weight"]
    reads = []
    original = nn.Module.__getattr__
    nn.Module.__getattr__ = lambda self, name: reads.append(name) or original(self, name)
    try:
        net(torch.randn(3, 4))
    finally:
        nn.Module.__getattr__ = original
    assert reads == []

    new_weight = nn.Parameter(torch.zeros(4, 4))
    proj.weight = new_weight  # setattr of a parameter
    assert proj.weight is new_weight and proj._parameters["weight"] is new_weight
    proj.bias = None  # a parameter set to None
    assert proj.bias is None and proj._parameters["bias"] is None
    proj.register_buffer("scale", torch.ones(4))
    assert proj.scale is proj._buffers["scale"]
    other = nn.Linear(4, 4)
    block.proj = other  # a submodule replaced
    assert block.proj is other and block._modules["proj"] is other
    block.add_module("extra", nn.Identity())
    assert block.extra is block._modules["extra"]
    del block.extra
    assert "extra" not in vars(block) and not hasattr(block, "extra")

    kept = net.layers[1].proj
    kept.register_buffer("scale", torch.ones(4))
    net.to(torch.float64)  # may replace buffers: the mirror follows
    assert kept.scale is kept._buffers["scale"] and kept.scale.dtype == torch.float64
    assert kept.weight is kept._parameters["weight"] and kept.weight.dtype == torch.float64

    norm = net.layers[1].norm
    norm.register_forward_hook(lambda *a: None)  # back to the plain class: the mirror goes
    assert not is_direct(norm) and "weight" not in vars(norm)
    norm.weight = nn.Parameter(torch.full((4,), 2.0, dtype=torch.float64))
    assert norm.weight is norm._parameters["weight"]
