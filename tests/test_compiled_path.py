"""The compiled decode path (atom_core/runner/compile.py) against the plain path, float32.

For one tiny random model of every model plugin, the same workload runs once with
`enforce_eager=True` and once with `enforce_eager=False`, in one engine each: prompts of
several lengths, some longer than the token budget (chunked prefill), a repeated shared
prefix (prefix-cache hits) and a pool small enough that a request is preempted mid-decode.
Greedy tokens must be identical and the logits that produced them close; steps of up to
`MAX_TOKENS` tokens must have gone through the compiled callable, longer ones never.

Where the path cannot apply (`enforce_eager`, another device, an attention layer without
`out_features`, a compiler failure) the model runs eagerly, said once in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from conftest import record_preemptions  # noqa: E402
from model_utils import ARCHS, random_prompts, run_with_logits  # noqa: E402

from atom_core import SamplingParams, get_registry  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.runner.compile import MAX_TOKENS, CompiledForward, compile_model  # noqa: E402

# One arch per model class the atom_models plugin registers (test_families_cover_every_model_plugin).
FAMILIES = [
    "llama",
    "mistral",  # a sliding window that binds
    "qwen2",
    "gemma2",  # soft-capped attention and logits
    "gemma3",  # rope per layer type
    "phi3",  # partial rotary, LongRoPE
    "smollm3",  # a NoPE layer
    "gpt_oss",  # sinks, biased experts
    "glm",  # rope over interleaved pairs
    "glm4",  # four norms a layer
    "glm4_moe",
    "minimax_m2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "deepseek_v2_group",
    "deepseek_v3",
]
NEW = 8
BUDGET = 32  # max_num_batched_tokens: the 48..70-token prompts are chunked
NUM_BLOCKS = 10  # 16-token blocks: the second wave preempts a request after its first token
MAX_LEN = 128

OFF = "compiled decode path off"
FAILED = "compiling the decode path failed"


def make_engine(folder: Path, **config) -> LLMEngine:
    # the plain path: module by module (decode graphs are test_decode_graph's)
    config.setdefault("max_graph_capture_size", 0)
    config.setdefault("num_kvcache_blocks", 32)
    config.setdefault("max_model_len", MAX_LEN)
    engine = LLMEngine(folder, dtype="float32", **config)
    # Unwritten KV slots and per-request state start as NaN: nothing may rely on a clean pool.
    # (The null block past the pool is the kernels' own, zero by construction.)
    nb = config["num_kvcache_blocks"]
    kv = engine.runner.kv_cache_tensors
    assert set(kv) <= {"kv_cache", "mla_kv_cache"}, f"unknown pool layout {sorted(kv)}"
    if "kv_cache" in kv:
        kv["kv_cache"][:, :, :, :nb].fill_(float("nan"))
    if "mla_kv_cache" in kv:
        kv["mla_kv_cache"][:, :nb].fill_(float("nan"))
    for t in engine.runner.per_req_cache_tensors.values():
        t.fill_(float("nan"))
    return engine


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def records(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "atom" and text in r.getMessage()]


# -- the workload, eager and compiled ----------------------------------------------------

BASE = random_prompts([48], seed=2)[0]
TAILS = random_prompts([3, 20, 10], seed=3)
OTHERS = random_prompts([5, 70, 17, 1], seed=4)
# Wave 1 writes the shared prefix; wave 2 hits it (three prompts start with BASE[:32] or more)
# and, in 10 blocks, preempts a request (BASE itself) after its first token.
WAVE1 = [BASE + TAILS[0], OTHERS[0], OTHERS[1]]
WAVE2 = [BASE[:32] + TAILS[1], OTHERS[2], BASE + TAILS[2], OTHERS[3], list(BASE)]
SHARES_PREFIX = [True, False, True, False, True]


def run_workload(folder: Path, enforce_eager: bool, **config) -> dict:
    engine = make_engine(
        folder,
        num_kvcache_blocks=NUM_BLOCKS,
        enable_prefix_caching=True,
        max_num_batched_tokens=BUDGET,
        enforce_eager=enforce_eager,
        **config,
    )
    preempted = record_preemptions(engine.scheduler)
    step_sizes: list[int] = []  # tokens of every step the runner ran
    compiled_sizes: list[int] = []  # tokens of every step the compiled callable ran
    original_forward = engine.runner.forward

    def forward(batch, seqs):
        step_sizes.append(len(batch.scheduled_tokens))
        return original_forward(batch, seqs)

    engine.runner.forward = forward
    run_model = engine.runner.run_model
    if not enforce_eager:
        assert isinstance(run_model, CompiledForward), type(run_model)
        compiled = run_model.compiled

        def spy(input_ids, positions):
            compiled_sizes.append(input_ids.shape[0])
            return compiled(input_ids, positions)

        run_model.compiled = spy
    r1, l1 = run_with_logits(engine, WAVE1, max_tokens=NEW)
    r2, l2 = run_with_logits(engine, WAVE2, max_tokens=NEW)
    bm = engine.scheduler.block_manager
    return dict(
        engine=engine,
        run_model=run_model,
        tokens=[r["token_ids"] for r in r1 + r2],
        logits=l1 + l2,
        cached=[r["num_cached_tokens"] for r in r2],
        preempted=len(preempted),
        step_sizes=step_sizes,
        compiled_sizes=compiled_sizes,
        pool_whole=bm.num_free_blocks == bm.num_blocks == NUM_BLOCKS,
        groups_whole=len(bm.per_req_cache_free_groups) == bm.num_per_req_cache_groups,
    )


def divergence(i: int, eager: dict, compiled: dict) -> str:
    """Where request `i`'s tokens first differ, with the eager logits' top-2 margin there
    (a margin near float32 rounding is a near-tie in random weights, not a wrong kernel)."""
    a, b = eager["tokens"][i], compiled["tokens"][i]
    k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    le, lc = eager["logits"][i][k], compiled["logits"][i][k]
    top = le.topk(2)
    return (
        f"request {i} (prompt of {len(([*WAVE1, *WAVE2])[i])} tokens) first differs at token {k}: eager {a[k]}, "
        f"compiled {b[k]}; eager top-2 margin {float(top.values[0] - top.values[1]):.3g}, "
        f"max |eager - compiled| logit there {float((le - lc).abs().max()):.3g}"
    )


# The default model's kernel too: 4-bit groups of 32 (`qgemm`, traced as the op `atom_gemv::qgemm`).
@pytest.mark.parametrize("family, quantization", [(f, "auto") for f in FAMILIES] + [("llama", "int4")])
def test_compiled_path_gives_the_tokens_of_the_plain_path(tiny_folder, family, quantization):
    # With the C++ kernels the traced GEMMs are their ops; without them (ATOM_CPU_KERNELS=0),
    # oneDNN's as the opaque `atom::onednn_linear` and torch's int4 kernel.
    folder = tiny_folder(family)
    eager = run_workload(folder, enforce_eager=True, quantization=quantization)
    assert eager["run_model"] is eager["engine"].runner.model
    torch._dynamo.reset()  # a fresh Dynamo cache: entries from other families' engines share code objects
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # reset() leaves the counters
    compiled = run_workload(folder, enforce_eager=False, quantization=quantization)

    for i, (a, b) in enumerate(zip(eager["tokens"], compiled["tokens"])):
        assert a == b, divergence(i, eager, compiled)
    # The 4-bit kernel rounds each activation to 16 bits per group of 32: the fused norms'
    # last-bit differences can move one by a step, ~1e-4 of a tiny model's logits (at
    # activation_bits=8 a step is 1/127 of the group's largest: 0.07 of these logits).
    atol = 1e-4 if quantization == "auto" else 1e-3
    for i, (a, b) in enumerate(zip(eager["logits"], compiled["logits"])):
        torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=lambda m, i=i: f"request {i}: {m}")

    for run in (eager, compiled):
        # The workload did what it is for, in both modes (the schedule does not depend on the tokens).
        assert max(len(p) for p in WAVE1 + WAVE2) > BUDGET >= max(run["step_sizes"]), "no prompt was chunked"
        hits = [c for c, shared in zip(run["cached"], SHARES_PREFIX) if shared]
        assert all(c >= 16 for c in hits), f"prefix cache missed: {run['cached']}"
        assert run["preempted"] >= 1, "no request was preempted"
        assert run["pool_whole"] and run["groups_whole"]
    assert compiled["step_sizes"] == eager["step_sizes"]

    # Every step of up to MAX_TOKENS tokens went through the compiled callable, no longer one did,
    # and it never fell back.
    run_model = compiled["run_model"]
    assert not run_model.failed
    assert compiled["compiled_sizes"] == [n for n in compiled["step_sizes"] if n <= MAX_TOKENS]
    assert 1 in compiled["compiled_sizes"] and any(1 < n <= MAX_TOKENS for n in compiled["compiled_sizes"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, "Dynamo captured no graph"
    # Every attention layer runs as the opaque op.
    assert all(hasattr(m, "eager_forward") for m in compiled["engine"].runner.attn_layers)


def test_families_cover_every_model_plugin():
    """Every model class the atom_models plugin registers (bar EAGLE-3 draft heads, never run
    alone) has a family above."""
    registry = get_registry("models")
    registered = {
        registry.get(name)
        for name in registry.names()
        if registry.get(name).__module__.startswith("atom_models.") and "eagle" not in registry.get(name).__module__
    }
    covered = {registry.get(ARCHS[f]["cls"]) for f in FAMILIES}
    assert registered - covered == set()


# -- where the path does not apply ---------------------------------------------------


def test_enforce_eager_runs_the_plain_model(tiny_folder, caplog):
    caplog.set_level(logging.INFO, logger="atom")
    engine = make_engine(tiny_folder("llama"), enforce_eager=True)
    assert engine.config.enforce_eager  # the default
    assert engine.runner.run_model is engine.runner.model
    assert not any(hasattr(m, "eager_forward") for m in engine.runner.attn_layers)
    assert not records(caplog, FAILED)


def test_default_config_is_eager(tiny_folder):
    engine = LLMEngine(tiny_folder("llama"), dtype="float32", num_kvcache_blocks=16, max_model_len=MAX_LEN)
    assert not isinstance(engine.runner.run_model, CompiledForward)  # the model, behind decode graphs


def test_attention_layer_without_out_features_falls_back_with_one_log_line(tiny_folder, monkeypatch, caplog):
    from atom_core.layers.attention import Attention

    folder = tiny_folder("llama")
    prompts = random_prompts((5, 20, 40), seed=5)
    expected = make_engine(folder).generate(prompts, greedy(), use_tqdm=False)
    monkeypatch.delattr(Attention, "out_features")  # a layer that does not declare its output width
    caplog.set_level(logging.INFO, logger="atom")
    engine = make_engine(folder, enforce_eager=False)
    runner = engine.runner
    assert runner.run_model is runner.model
    assert len(runner.attn_layers) > 1  # one line for all of them
    off = records(caplog, OFF)
    assert len(off) == 1 and off[0].levelno == logging.INFO
    message = off[0].getMessage()
    assert "out_features" in message and message.count("Attention") == 1, message
    assert not any(hasattr(m, "eager_forward") for m in runner.attn_layers)  # no layer was rerouted
    results = engine.generate(prompts, greedy(), use_tqdm=False)
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    assert len(records(caplog, OFF)) == 1 and not records(caplog, FAILED)


def test_another_device_falls_back_with_one_log_line(tiny_folder, caplog):
    engine = make_engine(tiny_folder("llama"))
    runner = engine.runner
    caplog.set_level(logging.INFO, logger="atom")
    config = SimpleNamespace(enforce_eager=False)
    out = compile_model(runner.model, config, torch.device("meta"))
    assert out is runner.model
    off = records(caplog, OFF)
    assert len(off) == 1 and off[0].levelno == logging.INFO
    assert "'meta'" in off[0].getMessage()
    assert not any(hasattr(m, "eager_forward") for m in runner.attn_layers)


class Toy(torch.nn.Module):
    """`model(input_ids, positions)` -> [tokens, hidden], no attention: for CompiledForward alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, positions):
        return self.embed(input_ids) * (1 + positions[:, None].float())


def test_compiler_failure_falls_back_to_eager_with_one_warning(caplog):
    model = Toy()
    calls = []

    def broken(input_ids, positions):
        calls.append(input_ids.shape[0])
        raise RuntimeError("inductor says no")

    forward = CompiledForward(model, broken)
    caplog.set_level(logging.INFO, logger="atom")
    for n in (3, 1, 8, 2):
        ids, pos = torch.arange(n) % 32, torch.arange(n)
        torch.testing.assert_close(forward(ids, pos), model(ids, pos), atol=0, rtol=0)
    assert forward.failed and calls == [3]  # tried once, then eager from there on
    warned = records(caplog, FAILED)
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "RuntimeError" in warned[0].getMessage() and "inductor says no" in warned[0].getMessage()


def test_compiler_failure_in_an_engine_keeps_the_tokens(tiny_folder, caplog):
    folder = tiny_folder("llama")
    prompts = random_prompts((5, 20, 40, 1), seed=6)
    expected = make_engine(folder).generate(prompts, greedy(), use_tqdm=False)
    engine = make_engine(folder, enforce_eager=False)
    run_model = engine.runner.run_model
    assert isinstance(run_model, CompiledForward)
    calls = []

    def broken(input_ids, positions):
        calls.append(input_ids.shape[0])
        raise RuntimeError("inductor says no")

    run_model.compiled = broken
    caplog.set_level(logging.INFO, logger="atom")
    results = engine.generate(prompts, greedy(), use_tqdm=False)
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    assert run_model.failed and len(calls) == 1
    assert len(records(caplog, FAILED)) == 1
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_model_that_cannot_be_traced_whole_runs_eagerly_with_its_state_intact(tiny_folder, monkeypatch, caplog):
    """The graph is traced whole (fullgraph) before any layer of the step runs: a model Dynamo
    cannot trace in one piece fails before its GDN layers touch their per-request state, so
    the eager rerun of that step advances the state once."""
    from atom_models.qwen3_next import ZeroCenteredRMSNorm  # the decoder layers' norms: traced

    folder = tiny_folder("qwen3_next")
    prompts = random_prompts((5, 20, 40), seed=6)
    expected = make_engine(folder).generate(prompts, greedy(), use_tqdm=False)
    forward = ZeroCenteredRMSNorm.forward

    def breaks_the_graph(self, *args):
        torch._dynamo.graph_break()
        return forward(self, *args)

    monkeypatch.setattr(ZeroCenteredRMSNorm, "forward", breaks_the_graph)
    torch._dynamo.reset()
    engine = make_engine(folder, enforce_eager=False)
    with caplog.at_level(logging.WARNING, logger="atom"):
        results = engine.generate(prompts, greedy(), use_tqdm=False)
    assert engine.runner.run_model.failed
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    assert sum(FAILED in r.getMessage() for r in caplog.records) == 1


def test_steps_longer_than_max_tokens_never_take_the_compiled_callable():
    model = Toy()
    calls = []

    def spy(input_ids, positions):
        calls.append(input_ids.shape[0])
        return model(input_ids, positions)

    forward = CompiledForward(model, spy)
    for n in (MAX_TOKENS + 1, 3 * MAX_TOKENS, 1, MAX_TOKENS, 2, MAX_TOKENS + 1):
        ids, pos = torch.arange(n) % 32, torch.arange(n)
        torch.testing.assert_close(forward(ids, pos), model(ids, pos), atol=0, rtol=0)
    assert calls == [1, MAX_TOKENS, 2]
    assert not forward.failed
