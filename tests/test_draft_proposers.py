"""The "mtp" and "eagle3" proposers: their drafts never change greedy output, and equal a direct computation.

Targets: a tiny DeepSeek-V3 given a random MTP layer (transformers builds none), and an
8-layer tiny Llama with a random EAGLE-3 head in the published layout (8 layers, so the
default low/middle/high boundaries 2, 4, 5 are distinct). Both the target's LM head and
the draft's lean towards a few tokens, so some drafts are accepted and every path of
verification runs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from conftest import (
    record_preemptions,  # noqa: E402
    require_kernel,  # noqa: E402
)
from model_utils import (
    add_mtp_layer,
    add_next_mtp_layer,
    build_eagle3_head,
    build_tiny_model,
    random_prompts,
    scale_rows,
)  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers.embedding import LookupEmbedding  # noqa: E402

NEW = 24
FAVOURED = [7, 42, 99, 200]  # both heads lean towards these: drafts are sometimes right


def prompts():
    """Different lengths; two share 37 tokens (two cached blocks, the cut inside the third)."""
    shared = random_prompts((37,), seed=5)[0]
    return [shared + p for p in random_prompts((3, 11), seed=6)] + random_prompts((5, 1, 28, 50, 19), seed=7)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3_mtp")
    model = build_tiny_model("deepseek_v3", folder)
    layer = add_mtp_layer(folder)
    n = model.config.num_hidden_layers
    scale_rows(
        folder / "model.safetensors",
        {"lm_head.weight": (FAVOURED, 6.0), f"model.layers.{n}.shared_head.head.weight": (FAVOURED, 6.0)},
    )
    return SimpleNamespace(folder=folder, model=model, mtp_layer=layer, spec=dict(method="mtp"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama8")
    model = build_tiny_model("llama", folder, num_hidden_layers=8)
    scale_rows(folder / "model.safetensors", {"lm_head.weight": (FAVOURED, 3.0)})
    g = torch.Generator().manual_seed(5)
    vocab = sorted(set(torch.randperm(256, generator=g)[:124].tolist()) | set(FAVOURED))  # 128 draft tokens
    heads = {}
    for name, aux in (("default", None), ("named", [1, 4, 6])):
        heads[name] = tmp_path_factory.mktemp(f"eagle3_{name}")
        build_eagle3_head(heads[name], folder, vocab, aux)
        rows = [vocab.index(t) for t in FAVOURED]
        scale_rows(heads[name] / "model.safetensors", {"lm_head.weight": (rows, 8.0)})
    spec = dict(method="eagle3", model=str(heads["default"]))
    return SimpleNamespace(folder=folder, model=model, heads=heads, spec=spec)


def next_mtp(name: str, tmp_path_factory) -> SimpleNamespace:
    """Qwen3-Next / Qwen3.5 with an MTP layer (`mtp.*`) whose LM head is the target's own."""
    folder = tmp_path_factory.mktemp(f"{name}_mtp")
    model = build_tiny_model(name, folder)
    add_next_mtp_layer(folder, name)
    scale_rows(folder / "model.safetensors", {"lm_head.weight": (FAVOURED, 6.0)})
    return SimpleNamespace(folder=folder, model=model, spec=dict(method="mtp"))


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory):
    return next_mtp("qwen3_next", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory):
    return next_mtp("qwen3_5", tmp_path_factory)


@pytest.fixture(scope="module")
def glm4_moe_mtp(tmp_path_factory):
    """GLM-4-MoE with an MTP layer of DeepSeek-V3's shape at index `num_hidden_layers`."""
    folder = tmp_path_factory.mktemp("glm4_moe_mtp")
    model = build_tiny_model("glm4_moe", folder)
    add_mtp_layer(folder, "glm4_moe")
    n = model.config.num_hidden_layers
    scale_rows(
        folder / "model.safetensors",
        {"lm_head.weight": (FAVOURED, 6.0), f"model.layers.{n}.shared_head.head.weight": (FAVOURED, 6.0)},
    )
    return SimpleNamespace(folder=folder, model=model, spec=dict(method="mtp"))


@pytest.fixture(scope="module", params=["mtp", "eagle3", "qwen3_next_mtp", "qwen3_5_mtp", "glm4_moe_mtp"])
def target(request):
    return request.getfixturevalue({"mtp": "deepseek", "eagle3": "llama"}.get(request.param, request.param))


def generate(folder, spec=None, **config):
    config.setdefault("num_kvcache_blocks", 64)
    config.setdefault("max_model_len", 256)
    engine = LLMEngine(folder, dtype="float32", speculative_config=spec, **config)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    out = engine.generate(prompts(), params, use_tqdm=False)
    assert engine.scheduler.block_manager.num_free_blocks == engine.kv_plan.num_blocks
    return [r["token_ids"] for r in out], engine, out


_plain: dict = {}


def plain(target):
    if target.folder not in _plain:
        _plain[target.folder] = generate(target.folder)[0]
    return _plain[target.folder]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_output_is_unchanged(target, k):
    # A budget of 32 chunks the longer prompts (middle chunks run beside drafting rows);
    # the second prompt with the shared prefix starts from two cached blocks.
    spec = dict(target.spec, num_speculative_tokens=k, min_acceptance_rate=0)
    tokens, engine, out = generate(target.folder, spec, max_num_batched_tokens=32, enable_prefix_caching=True)
    assert tokens == plain(target)
    assert any(r["num_cached_tokens"] for r in out)
    stats = engine.get_spec_stats()
    assert stats["num_draft_tokens"] > stats["num_drafts"] > 0 or k == 1
    assert stats["num_accepted_tokens"] > 0
    assert len(stats["accepted_per_position"]) == k


def test_greedy_output_is_unchanged_under_preemption(target):
    spec = dict(target.spec, num_speculative_tokens=3, min_acceptance_rate=0)
    engine = LLMEngine(
        target.folder,
        dtype="float32",
        max_model_len=128,
        num_kvcache_blocks=12,
        enable_prefix_caching=True,
        speculative_config=spec,
    )
    preempted = record_preemptions(engine.scheduler)
    out = engine.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert preempted, "the pool was meant to be too small for every request at once"
    assert [r["token_ids"] for r in out] == plain(target)
    assert engine.scheduler.block_manager.num_free_blocks == 12
    assert engine.get_spec_stats()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_eagle3_shares_a_tied_targets_embedding(tmp_path, quantization):
    """A tied target's embedding reads its rows from its LM head's kernel (the streaming
    kernel's tiled copy, or the quantized weight); a draft without its own shares it all the same."""
    from atom_core.layers.gemm import gemv_ops

    if quantization == "none":
        require_kernel(gemv_ops())  # the tiled copy is the streaming kernel's
    folder, head = tmp_path / "tied", tmp_path / "head"
    build_tiny_model("llama_tied_rope3", folder, num_hidden_layers=8)
    build_eagle3_head(head, folder, list(range(128)))
    spec = dict(method="eagle3", model=str(head), num_speculative_tokens=2, min_acceptance_rate=0)
    tokens, engine, _ = generate(folder, spec, quantization=quantization)
    assert isinstance(engine.runner.model.model.embed_tokens, LookupEmbedding)
    assert engine.get_spec_stats()["num_draft_tokens"] > 0
    assert tokens == generate(folder, quantization=quantization)[0]


# -- drafts against a direct computation on the checkpoints' weights --------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def mtp_drafts(ds, weights, tokens: list[int], k: int) -> list[int]:
    """h' = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]) -> decoder layer -> shared_head.norm -> head,
    chained on its own normed output, for the sequence `tokens` (its last token just emitted)."""
    cfg = ds.model.config
    p, eps = f"model.layers.{cfg.num_hidden_layers}.", cfg.rms_norm_eps
    w = {name.removeprefix(p): t for name, t in weights.items() if name.startswith(p)}
    embed = weights["model.embed_tokens.weight"]
    hidden = list(ds.model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0])  # the target's, normed
    after = list(tokens[1:])
    drafts = []
    for _ in range(k):
        n = len(after)
        x = torch.cat([rms(embed[after], w["enorm.weight"], eps), rms(torch.stack(hidden), w["hnorm.weight"], eps)], -1)
        x = (x @ w["eh_proj.weight"].T)[None]
        pos = torch.arange(n)[None]
        y = ds.mtp_layer(
            x, attention_mask=causal(n), position_ids=pos, position_embeddings=ds.model.model.rotary_emb(x, pos)
        )
        y = rms((y[0] if isinstance(y, tuple) else y)[0], w["shared_head.norm.weight"], eps)
        drafts.append(int((y[-1] @ w["shared_head.head.weight"].T).argmax()))
        hidden.append(y[-1])
        after.append(drafts[-1])
    return drafts


def eagle3_reference(folder):
    """The draft head's weights and its attention as transformers' LlamaAttention with 2H-wide q/k/v."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = AutoConfig.from_pretrained(folder)
    cfg._attn_implementation = "eager"
    w = load_file(folder / "model.safetensors")
    attn = LlamaAttention(cfg, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        rows = w[f"midlayer.self_attn.{name}.weight"].shape[0]
        setattr(attn, name, torch.nn.Linear(2 * cfg.hidden_size, rows, bias=False))
    attn.load_state_dict({n.removeprefix("midlayer.self_attn."): t for n, t in w.items() if ".self_attn." in n})
    aux = (cfg.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids") if hasattr(cfg, "eagle_config") else None
    return SimpleNamespace(cfg=cfg, w=w, attn=attn, rotary=LlamaRotaryEmbedding(cfg), aux=aux)


def eagle3_drafts(ll, head, tokens: list[int], k: int) -> list[int]:
    """fc over the target's hidden states at three boundaries, then the midlayer on
    [input_layernorm(embed(t_{p+1})) | hidden_norm(h_p)], norm, lm_head, d2t; chained on its pre-norm output."""
    w, eps = head.w, head.cfg.rms_norm_eps
    layers = ll.model.config.num_hidden_layers
    aux = head.aux or (2, layers // 2, layers - 3)
    states = ll.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states  # [i]: input of layer i
    hidden = list(torch.cat([states[b][0] for b in aux], -1) @ w["fc.weight"].T)
    embed = ll.model.model.embed_tokens.weight
    after = list(tokens[1:])
    drafts = []
    m = "midlayer."
    for _ in range(k):
        n = len(after)
        h = torch.stack(hidden)
        e = rms(embed[after], w[m + "input_layernorm.weight"], eps)
        x = torch.cat([e, rms(h, w[m + "hidden_norm.weight"], eps)], -1)
        pos = torch.arange(n)[None]
        a = head.attn(hidden_states=x[None], position_embeddings=head.rotary(x[None], pos), attention_mask=causal(n))[
            0
        ][0]
        h = h + a
        z = rms(h, w[m + "post_attention_layernorm.weight"], eps)
        gated = F.silu(z @ w[m + "mlp.gate_proj.weight"].T) * (z @ w[m + "mlp.up_proj.weight"].T)
        h = h + gated @ w[m + "mlp.down_proj.weight"].T
        d = int((rms(h[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        drafts.append(d + int(w["d2t"][d]))
        hidden.append(h[-1])
        after.append(drafts[-1])
    return drafts


def record_drafts(engine) -> list[tuple[list[int], list[int]]]:
    """(the sequence so far, the drafts proposed after it) for every draft the proposer makes."""
    records = []
    proposer = engine.runner.proposer
    original = proposer.propose

    def propose(inp):
        out = original(inp)
        for seq, new, d in zip(inp.seqs, inp.new_token_ids, out):
            if d is not None and d.token_ids:
                assert d.probs is None  # argmax drafts: one-hot
                records.append((list(seq.token_ids) + list(new), list(d.token_ids)))
        return out

    proposer.propose = propose
    return records


def check_drafts(target, reference, **config):
    """Every draft of a run with chunked prompts, a cached prefix and verification in between
    equals the reference on the whole sequence: the draft KV kept by the runner is right."""
    spec = dict(target.spec, num_speculative_tokens=3, min_acceptance_rate=0)
    engine = LLMEngine(
        target.folder,
        dtype="float32",
        max_model_len=256,
        num_kvcache_blocks=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        speculative_config=spec,
        **config,
    )
    records = record_drafts(engine)
    out = engine.generate(prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert any(r["num_cached_tokens"] for r in out)
    assert len(records) > len(out) and any(len(d) == 3 for _, d in records)
    firsts = [(tokens, drafts[:1]) for tokens, drafts in records]
    with torch.no_grad():
        assert [reference(tokens, 1) for tokens, _ in firsts] == [d for _, d in firsts]  # the first draft
        assert [reference(tokens, len(d)) for tokens, d in records] == [d for _, d in records]  # and the chain


def test_mtp_drafts_equal_the_formula_on_the_checkpoint(deepseek):
    weights = load_file(deepseek.folder / "model.safetensors")
    check_drafts(deepseek, lambda tokens, k: mtp_drafts(deepseek, weights, tokens, k))


@pytest.mark.parametrize("head", ["default", "named"])
def test_eagle3_drafts_equal_a_direct_computation(llama, head):
    ref = eagle3_reference(llama.heads[head])
    target = SimpleNamespace(folder=llama.folder, spec=dict(method="eagle3", model=str(llama.heads[head])))
    check_drafts(target, lambda tokens, k: eagle3_drafts(llama, ref, tokens, k))


def test_eagle3_reads_the_named_boundaries(llama):
    for head, layers in (("default", (1, 3, 4)), ("named", (0, 3, 5))):  # boundary b = output of layer b - 1
        spec = dict(method="eagle3", model=str(llama.heads[head]))
        engine = LLMEngine(
            llama.folder, dtype="float32", num_kvcache_blocks=16, max_model_len=64, speculative_config=spec
        )
        assert engine.runner.proposer.aux_hidden_layers == layers
        assert engine.runner.proposer.num_draft_layers == 1


def test_draft_errors_name_the_problem(llama, tmp_path):
    with pytest.raises(ValueError, match="multi-token-prediction layer, and LlamaForCausalLM has none"):
        LLMEngine(llama.folder, num_kvcache_blocks=16, speculative_config=dict(method="mtp"))
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLMEngine(llama.folder, num_kvcache_blocks=16, speculative_config=dict(method="eagle3"))
    folder = tmp_path / "no_mtp"
    build_tiny_model("deepseek_v3", folder)
    with pytest.raises(ValueError, match=r"no tensors of the draft model DeepseekMTP \(none named model.layers.3.\*\)"):
        LLMEngine(folder, num_kvcache_blocks=16, speculative_config=dict(method="mtp"))
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(conf, num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM: this checkpoint has no multi-token-prediction layer"):
        LLMEngine(folder, num_kvcache_blocks=16, speculative_config=dict(method="mtp"))
    head = tmp_path / "other_vocab"  # a head made for another target
    build_eagle3_head(head, llama.folder, list(range(128)))
    conf = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(dict(conf, vocab_size=512)))
    with pytest.raises(ValueError, match="hidden size 64 and vocabulary 512; the target has 64 and 256"):
        LLMEngine(llama.folder, num_kvcache_blocks=16, speculative_config=dict(method="eagle3", model=str(head)))
