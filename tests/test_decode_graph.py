"""Decode graphs (atom_core/runner/decode_graph.py): replayed steps against the plain path.

For a tiny random model of each family, the same workload runs with `max_graph_capture_size=0`
(every step module by module) and with graphs on: requests of several lengths join and leave,
so decode batches of 1 to 3 rows repeat across block boundaries, and a pool small enough to
preempt. Greedy tokens and logits must be identical (a replay makes the same kernel calls on the
same values), and where the family's layers can be recorded, steps must have been replayed.
The recorder itself is checked on torch ops, and a kernel a wrapper calls past `launch` must be
caught before a replay answers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402
from model_utils import random_prompts, run_with_logits  # noqa: E402

from atom_attention.gdn.builder import GDNImpl, GDNMetadataBuilder  # noqa: E402
from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers import graph_capture  # noqa: E402
from atom_core.layers.cpp import compiler, kernels_enabled  # noqa: E402
from atom_core.layers.graph_capture import CaptureUnsupported, record  # noqa: E402
from atom_core.layers.ops import cpu_ops  # noqa: E402
from atom_core.runner.decode_graph import DecodeGraphs  # noqa: E402
from atom_core.runner.graph_arena import GraphArena, Slot, plan  # noqa: E402

# family -> whether its decode steps replay
FAMILIES = {
    "llama": True,
    "mistral": True,  # a sliding window that binds
    "qwen2": True,  # q/k/v biases
    "gemma2": True,  # soft-capping
    "gemma3": True,  # rope per layer type, q/k norms
    "phi3": True,  # partial rotary
    "smollm3": True,  # a NoPE layer
    "glm": True,  # rope over interleaved pairs
    "qwen3": True,
    "gpt_oss": False,  # sinks; its biased experts take the torch path, which loops over counts in Python
    "mixtral": True,  # MoE (the experts' C++ kernel takes its token counts as a tensor)
    "qwen3_moe": True,
    "qwen3_next": True,  # GDN (its C++ decode step) beside gated full attention, MoE
    "qwen3_5": True,
    "deepseek_v3": True,  # MLA on the C++ kernel
    "deepseek_v2_group": True,  # MLA with a q_lora
}
NEW = 40  # crosses two 16-token block boundaries after the prompt
PROMPTS = random_prompts([5, 17, 30], seed=11)


def run(folder: Path, graphs: int, **config) -> dict:
    config.setdefault("dtype", "float32")
    engine = LLMEngine(folder, num_kvcache_blocks=12, max_model_len=128, max_graph_capture_size=graphs, **config)
    # staggered lengths: batches of 3, then 2, then 1 row, each size for many steps
    results, logits = run_with_logits(engine, PROMPTS, max_tokens=[NEW // 2, NEW, 3 * NEW // 2])
    bm = engine.scheduler.block_manager
    return dict(
        engine=engine,
        tokens=[r["token_ids"] for r in results],
        logits=logits,
        pool_whole=bm.num_free_blocks == bm.num_blocks,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replayed_steps_give_the_tokens_and_logits_of_the_plain_path(tiny_folder, family):
    folder = tiny_folder(family)
    plain = run(folder, 0)
    graphed = run(folder, 8)
    assert plain["engine"].runner.run_model is plain["engine"].runner.model
    assert graphed["tokens"] == plain["tokens"]
    for a, b in zip(plain["logits"], graphed["logits"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert graphed["pool_whole"] and plain["pool_whole"]
    run_model = graphed["engine"].runner.run_model
    replays = run_model.replays if isinstance(run_model, DecodeGraphs) else 0
    # without the C++ kernels attention takes the torch path, which is not graph_safe (a kernel
    # that failed to build where a compiler is fails here: no replays)
    kernels = kernels_enabled() and compiler() is not None
    if FAMILIES[family] and kernels:
        # 3, 2 and 1 rows each recorded, checked once, then replayed
        assert set(run_model.graphs) == {1, 2, 3} and all(
            g is not None and g.checked for g in run_model.graphs.values()
        )
        assert replays > NEW
    else:
        assert replays == 0


@pytest.mark.parametrize(
    "config",
    [
        dict(dtype="bfloat16"),
        dict(dtype="float16"),  # the GEMV's float16 tiles, widened as loaded
        dict(quantization="int4"),
        dict(quantization="int4", activation_bits=8),
        dict(quantization="int8"),
        dict(kv_cache_dtype="bfloat16"),  # float32 queries over a bfloat16 cache
    ],
    ids=["bf16", "fp16", "int4", "int4-a8", "int8", "kv-bf16"],
)
def test_replayed_steps_in_every_precision(tiny_folder, config):
    """bfloat16 and float16 (the GEMV's 16-bit tiles), the 4- and 8-bit group kernels, a narrow KV cache."""
    require_kernel(cpu_ops())  # MHA's decode graphs need the C++ attention kernel
    folder = tiny_folder("llama")
    plain, graphed = run(folder, 0, **config), run(folder, 8, **config)
    assert graphed["tokens"] == plain["tokens"]
    for a, b in zip(plain["logits"], graphed["logits"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert graphed["engine"].runner.run_model.replays > NEW


def test_a_kernel_called_past_launch_is_caught_before_a_replay_answers(tiny_folder, monkeypatch, caplog):
    """A wrapper that calls its kernel directly is invisible to the recording: the graph would
    replay without it. The check against an eager step finds the difference and the size runs eagerly."""
    require_kernel(cpu_ops())
    from atom_core.layers import ops as layer_ops

    monkeypatch.setattr(layer_ops, "launch", lambda kernel, *args: kernel(*args))  # silu_and_mul, the norms
    folder = tiny_folder("llama")
    plain = run(folder, 0)
    with caplog.at_level(logging.WARNING, logger="atom"):
        graphed = run(folder, 8)
    assert graphed["tokens"] == plain["tokens"]
    graphs = graphed["engine"].runner.run_model.graphs
    assert graphs and all(g is None for g in graphs.values()), graphs
    assert graphed["engine"].runner.run_model.replays == 0
    assert any("differed from the eager step" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next"])
def test_a_forward_that_reads_values_back_runs_eagerly_with_one_log_line(family, tiny_folder, caplog, monkeypatch):
    """MoE experts on the torch path (oneDNN's micro-kernel off, as float16 experts and AVX2's
    bfloat16 ones take) loop over their token counts in Python: recording refuses, and every
    step from then on runs eagerly, with the plain path's tokens and logits. Qwen3-Next's GDN
    layers before the first MoE layer have advanced their state by then: it is put back
    before the eager run, or that step would advance it twice."""
    require_kernel(cpu_ops())
    monkeypatch.setenv("ATOM_DISABLE_ONEDNN", "1")
    folder = tiny_folder(family)
    plain = run(folder, 0)
    with caplog.at_level(logging.WARNING, logger="atom"):
        graphed = run(folder, 8)
    assert graphed["tokens"] == plain["tokens"]
    for a, b in zip(plain["logits"], graphed["logits"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    graphs = graphed["engine"].runner.run_model
    assert isinstance(graphs, DecodeGraphs) and graphs.max_size == 0 and graphs.replays == 0
    assert list(graphs.graphs.values()) == [None]  # one attempt, not one per row count
    (line,) = [r.getMessage() for r in caplog.records if "cannot be recorded" in r.getMessage()]
    assert "depends on tensor values" in line and "decode steps run eagerly" in line


def test_graphs_of_alternating_sizes_share_one_arena(tiny_folder):
    """One long request, and short ones joining and leaving: decode steps of 1, 2 and 3 rows
    alternate, so each size's graph replays after the others have written the arena they share.
    Tokens and logits are the plain path's, bit for bit."""
    require_kernel(cpu_ops())
    folder = tiny_folder("llama")
    prompts = random_prompts([9, 4, 6, 12, 5, 7, 3, 8], seed=5)

    def alternate(graphs: int) -> tuple[list, dict, LLMEngine]:
        engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=24, max_model_len=128,
                           max_graph_capture_size=graphs)  # fmt: skip
        greedy = dict(temperature=0, ignore_eos=True)
        engine.add_request(prompts[0], SamplingParams(max_tokens=60, **greedy))
        logits: dict[str, list] = {}
        step = 0
        while engine.has_unfinished_requests():
            if step % 6 == 3 and step // 6 < len(prompts) - 1:  # a request of 3-5 tokens joins
                engine.add_request(prompts[1 + step // 6], SamplingParams(max_tokens=3 + step % 3, **greedy))
            engine.step()
            step += 1
            for rid, row in zip(engine.runner.last_req_ids, engine.runner.last_logits):
                logits.setdefault(rid, []).append(row.clone())
        return [torch.stack(v) for v in logits.values()], engine.runner.run_model, engine

    plain, _, _ = alternate(0)
    graphed, run_model, engine = alternate(8)
    assert len(graphed) == len(plain) == len(prompts)
    for a, b in zip(plain, graphed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert {1, 2}.issubset(run_model.graphs) and run_model.replays > 30
    arena = run_model.arena.arena
    assert arena is not None
    for graph in run_model.graphs.values():  # each graph's intermediates are views of the one arena
        keys = {graph_capture.storage_key(t) for t in graph_capture.tensors([a for _, a, _ in graph.calls])}
        assert graph_capture.storage_key(arena) in keys
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_arena_plan_never_overlaps_buffers_in_use():
    """Two recorded graphs of torch ops planned into one arena: buffers alive at the same call
    never share a byte, the arena holds less than the buffers did, and replays of the two
    graphs in turn, on new inputs each time, give what the ops give eagerly."""

    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w)
        g = h * 2 + 1
        return (torch.cat([g, h], dim=1).sum(dim=1, keepdim=True) * x).sin()

    w = torch.randn(8, 8)
    arena = GraphArena()
    graphs = {}
    for rows in (3, 5):
        x = torch.randn(rows, 8)
        with torch.inference_mode(), record() as recorder:
            out = forward(x, w)
        template, needs = plan(recorder.calls, recorder.produced, keep={graph_capture.storage_key(out)})
        spans = {}  # slot -> (first call, last call)
        for i, (_, args, kwargs) in enumerate(template):
            for slot in _slots((args, kwargs)):
                spans[slot] = (spans.get(slot, (i, i))[0], i)
        assert len(spans) >= 5 and needs < sum(s.size[0] * s.size[1] * 4 for s in spans)
        for a, (a0, a1) in spans.items():
            for b, (b0, b1) in spans.items():
                if a != b and a0 <= b1 and b0 <= a1:  # in use together: disjoint bytes
                    assert (
                        a.offset + a.size[0] * a.size[1] * 4 <= b.offset
                        or b.offset + b.size[0] * b.size[1] * 4 <= a.offset
                    )
        graph = type("G", (), {})()
        graph.calls = arena.add(template, needs, graph, out.device)
        graphs[rows] = (graph, x, out)
    for _ in range(3):
        for graph, x, out in graphs.values():
            x.copy_(torch.randn_like(x))
            with torch.inference_mode():
                for fn, args, kwargs in graph.calls:
                    fn(*args, **kwargs)
            torch.testing.assert_close(out, forward(x, w), rtol=0, atol=0)


def _slots(values) -> list[Slot]:
    if isinstance(values, Slot):
        return [values]
    if isinstance(values, (list, tuple)):
        return [s for v in values for s in _slots(v)]
    if isinstance(values, dict):
        return [s for v in values.values() for s in _slots(v)]
    return []


def test_graphs_off_where_they_cannot_apply(tiny_folder, caplog, monkeypatch):
    folder = tiny_folder("llama")
    with caplog.at_level(logging.INFO, logger="atom"):
        engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=12, max_model_len=128, enforce_eager=False)
    assert not isinstance(engine.runner.run_model, DecodeGraphs)  # the compiled path instead
    # GDN's torch decode step takes its slots as Python values: not graph_safe
    monkeypatch.setattr(GDNMetadataBuilder, "impl_cls", GDNImpl)
    with caplog.at_level(logging.INFO, logger="atom"):
        engine = LLMEngine(tiny_folder("qwen3_next"), dtype="float32", num_kvcache_blocks=12, max_model_len=128)
    assert engine.runner.run_model is engine.runner.model
    assert any("decode graphs off" in r.getMessage() and "not graph_safe" in r.getMessage() for r in caplog.records)


# -- the recorder on torch ops ----------------------------------------------------------


def test_recorded_torch_ops_replay_into_the_buffers_they_wrote():
    a, b = torch.randn(4, 8), torch.randn(8)
    ids = torch.tensor([2, 0])
    with torch.inference_mode(), record() as recorder:
        x = a[ids]  # index -> index.Tensor_out
        y = (x * b).to(torch.float64)  # mul -> mul.out; _to_copy has no dtype-taking out=: copied in
        z = y.reshape(-1)  # a view: not replayed
        z.add_(1.0)  # in place: replayed as it is
        w = y.t().contiguous()  # a copy (clone.out)
    names = [str(fn) for fn, _, _ in recorder.calls]
    assert names[:2] == ["aten.index.Tensor_out", "aten.mul.out"] and "aten.add_.Tensor" in names
    assert "aten.clone.out" in names and not any("view" in n or "reshape" in n for n in names)
    with torch.inference_mode(), record() as two:
        top = a.topk(2, dim=1)  # two outputs: topk.values(..., values, indices)
    assert [str(fn) for fn, _, _ in two.calls] == ["aten.topk.values"]
    # new values in the recorded inputs: a replay writes the same buffers with the new results
    a.copy_(torch.randn(4, 8))
    ids.copy_(torch.tensor([1, 3]))
    with torch.inference_mode():  # as the runner's steps run
        for fn, args, kwargs in recorder.calls:
            fn(*args, **kwargs)
    expected = (a[ids] * b).double() + 1
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(w, expected.t(), rtol=0, atol=0)
    with torch.inference_mode():
        for fn, args, kwargs in two.calls:
            fn(*args, **kwargs)
    torch.testing.assert_close(top.values, a.topk(2, dim=1).values, rtol=0, atol=0)
    assert torch.equal(top.indices, a.topk(2, dim=1).indices)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: int(t[0]),
        lambda t: bool(t[0]),
        lambda t: t.nonzero(),
        lambda t: t + torch.tensor([1, 2, 3]),  # a tensor of Python values: the recorded step's at a replay
    ],
    ids=["tolist", "numpy", "int", "bool", "nonzero", "tensor"],
)
def test_values_read_back_to_python_make_the_recording_fail(read):
    t = torch.tensor([1, 2, 3])
    with pytest.raises(CaptureUnsupported, match="depends on tensor values"):
        with torch.inference_mode(), record():
            read(t)
    assert not graph_capture.recording()


def test_launch_records_the_kernels_output_as_its_out_argument():
    ops = require_kernel(cpu_ops())
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    with torch.inference_mode(), record() as recorder:
        y = graph_capture.launch(ops.rms_norm, x, w, 1e-6)
    ((fn, args, _),) = recorder.calls
    assert fn is ops.rms_norm and args[-1] is y
    x.copy_(torch.randn(3, 64))
    ptr = y.data_ptr()
    fn(*args)
    assert y.data_ptr() == ptr
    torch.testing.assert_close(y, ops.rms_norm(x, w, 1e-6), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        ops.rms_norm(x, w, 1e-6, torch.empty(2, 64))
