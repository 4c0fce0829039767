"""GGUF files written by llama.cpp's own converter load in Atom, for every family Atom runs
and llama.cpp writes: Llama (with Llama 3's rope scaling too; Mistral is written as Llama),
Qwen2, Qwen3, Qwen3-MoE, Mixtral, SmolLM3, GLM-4, Phi-3, Gemma 2, DeepSeek-V2 and -V3.

Tiny random transformers models (tests/model_utils.py) are converted by
`convert_hf_to_gguf.py` from the llama-cpp-python sdist (tests/gguf_convert.py fetches it
once; without it these tests fail, they do not skip). Atom must then give, from the .gguf
file, the weights, the greedy tokens and the logits it gives from the HF folder itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_convert import convert_many, write_tiny_sentencepiece_tokenizer, write_tiny_tokenizer  # noqa: E402
from model_utils import ARCHS, build_tiny_model, random_prompts, run_with_logits  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from atom_core import SamplingParams, hookimpl  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers import FusedMoE  # noqa: E402
from atom_core.layers.quantized_gemm import Int8PackGemm, StreamingGroupGemm  # noqa: E402
from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE  # noqa: E402
from atom_core.loading.gguf.architecture import GGUFArchitecture  # noqa: E402
from atom_core.loading.gguf.blocks import load_blocks  # noqa: E402
from atom_core.loading.gguf.convert import gguf_to_hf_folder  # noqa: E402
from atom_core.loading.gguf.reader import load_gguf  # noqa: E402

# family -> (tiny model in model_utils.ARCHS, config overrides, converter --outtype)
FAMILIES = {
    "llama": ("llama", {}, "f32"),  # Q/K rows permuted by the converter
    # Llama 3.1 / 3.2 rope scaling: the file keeps only the per-dimension factors (rope_freqs)
    "llama3_rope": ("llama_tied_rope3", {}, "f32"),
    # written as "llama" (llama.cpp keeps no window): a Mistral without one is a Llama
    "mistral": ("mistral", dict(sliding_window=None), "f32"),
    "qwen2": ("qwen2", dict(use_sliding_window=False), "f32"),  # q/k/v biases (llama.cpp keeps no window)
    "qwen3": ("qwen3", {}, "f32"),  # tied embeddings, head_dim != hidden / heads
    "glm4": ("glm4", {}, "f32"),
    # soft-capped scores and logits, sliding and full layers, (1 + w) norms; a SentencePiece vocabulary
    "gemma2": ("gemma2", {}, "f32"),
    # q/k/v and gate/up fused; half of each head roped; LongRoPE's factors as tensors; a window
    "phi3": ("phi3", {}, "f32"),  # half of each head roped in interleaved pairs; gate/up fused; post-norms
    # NoPE in every fourth layer: llama.cpp's rule (transformers' default), not the file's
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layers=None), "f32"),
    # llama.cpp's qwen3moe has no dense layers and always renormalises the top-k weights
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[], norm_topk_prob=True), "f32"),
    "mixtral": ("mixtral", {}, "f32"),  # written as "llama" with stacked experts
    "deepseek_v2": ("deepseek_v2_greedy", {}, "f32"),  # kv_b_proj written as k_b and v_b
    "deepseek_v3": ("deepseek_v3", {}, "f32"),  # q_lora, grouped sigmoid routing, exp_probs_b
    # YaRN: llama.cpp keeps mscale_all_dim only, so the model has mscale == mscale_all_dim
    "deepseek_v3_yarn": (
        "deepseek_v3_yarn",
        dict(rope_parameters={**ARCHS["deepseek_v3_yarn"]["kwargs"]["rope_parameters"], "mscale": 0.7}),
        "f32",
    ),
    # Q8_0 blocks: the quantized export of permuted Q/K and of stacked experts
    "mixtral_q8_0": ("mixtral", {}, "q8_0"),
    "glm4_q8_0": ("glm4", {}, "q8_0"),  # gate and up in one tensor of blocks
}
PROMPTS = random_prompts([5, 23, 47], seed=3)
NEW_TOKENS = 12
ENGINE = dict(num_kvcache_blocks=48, max_model_len=128, kv_cache_block_size=16)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (its tiny HF folder, the GGUF file llama.cpp's converter wrote from it)."""
    root = tmp_path_factory.mktemp("gguf-families")
    jobs, out = [], {}
    for family, (arch, overrides, outtype) in FAMILIES.items():
        folder = root / family
        build_tiny_model(arch, folder, **overrides)
        if arch == "gemma2":
            write_tiny_sentencepiece_tokenizer(folder)
        else:
            write_tiny_tokenizer(folder, tokenizer_class="GPT2Tokenizer" if arch == "phi3" else None)
        path = root / f"{family}.gguf"
        jobs.append((folder, path, outtype))
        out[family] = (folder, path)
    for outtype in sorted({j[2] for j in jobs}):
        convert_many([(folder, path) for folder, path, t in jobs if t == outtype], outtype)
    return out


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "atom-cache"))  # where LLMEngine converts a .gguf


def _greedy(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    results, logits = run_with_logits(engine, PROMPTS, NEW_TOKENS)
    return [r["token_ids"] for r in results], logits


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f][2] == "f32"])
def test_llama_cpp_gguf_gives_the_hf_folders_tokens(converted, family, tmp_path):
    folder, path = converted[family]
    arch = ARCHS[FAMILIES[family][0]]

    # The weights are the checkpoint's, bit for bit (F32), under the hub's names.
    config, state = load_gguf(path)
    expected = load_file(str(folder / "model.safetensors"))
    cls = "LlamaForCausalLM" if family == "mistral" else arch["cls"]
    assert config["architectures"] == [cls]
    if family == "llama3_rope":  # factor 8 for the low frequencies, 1 for the high ones
        factors = config["rope_freq_factors"]
        assert (max(factors), min(factors), len(factors)) == (
            8.0,
            1.0,
            config["hidden_size"] // config["num_attention_heads"] // 2,
        )
    if family == "phi3":  # LongRoPE's factors, kept as tensors in the file, back in the config
        hf_rope = ARCHS["phi3"]["kwargs"]["rope_parameters"]
        for key in ("long_factor", "short_factor"):
            assert config["rope_parameters"][key] == pytest.approx(hf_rope[key]), key
        assert config["original_max_position_embeddings"] == 256 and config["sliding_window"] == 24
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        if arch["cls"].startswith("Gemma") and name.endswith("norm.weight"):  # (1 + w) - 1 in the file
            torch.testing.assert_close(state[name], tensor, atol=1e-7, rtol=0, msg=name)
        else:
            assert torch.equal(state[name], tensor), name

    kw = dict(dtype="float32", quantization="none", **ENGINE)
    engine = LLMEngine(path, **kw)
    assert Path(engine.config.model).parent == tmp_path / "atom-cache" / "models"  # converted once, cached
    assert type(engine.runner.model).__name__ == cls
    reference = LLMEngine(folder, **kw)
    tokens, logits = _greedy(engine)
    ref_tokens, ref_logits = _greedy(reference)
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    # The tokenizer survives the round trip through the file.
    text = "The capital of France is Paris. def add(a, b): return a + b"
    original = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert engine.tokenizer(text).input_ids == original(text).input_ids


def test_expert_and_permuted_blocks_are_exported_exactly(converted, tmp_path):
    from atom_core.layers.gemm import gemv_ops

    require_kernel(gemv_ops())
    """A Q8_0 Mixtral: every expert's blocks and the unpermuted Q/K blocks, beside float weights
    that match them, and the model runs from them with `quantization="auto"`."""
    _, path = converted["mixtral_q8_0"]
    folder = gguf_to_hf_folder(path, tmp_path / "mixtral-q8")
    state = load_file(str(folder / "model.safetensors"))
    source, blocks = load_blocks(folder / GGUF_BLOCKS_FILE)
    assert source == path.name
    matrices = sorted(n for n, t in state.items() if t.dim() == 2)
    assert sorted(blocks) == matrices
    for name, (gguf_type, qw) in blocks.items():
        if gguf_type in ("F32", "F16"):  # what llama.cpp keeps in float (the router)
            assert qw is None, name
            continue
        assert gguf_type == "Q8_0", name
        assert torch.equal(qw.dequantize(), state[name]), name
    quantized = {n for n, (t, _) in blocks.items() if t == "Q8_0"}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"} <= quantized
    experts = {f"model.layers.1.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)}
    assert experts <= quantized

    engine = LLMEngine(path, dtype="float32", quantization="auto", **ENGINE)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(r["token_ids"]) == 4 for r in out)
    # the experts run from their Q8_0 blocks too, expert by expert
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.w13 is None for m in moes)
    kernels = [kernel for m in moes for pair in m.expert_gemms for _, kernel in pair]
    # groups of 32 stream through Atom's kernel; a K of 32 is one group a row: torch's per-channel one
    assert all(isinstance(k, Int8PackGemm) or (isinstance(k, StreamingGroupGemm) and k.bits == 8) for k in kernels)


def test_blocks_of_a_tensor_fused_on_disk_are_cut_into_the_layers_shards(converted):
    """GLM-4's gate and up are one Q8_0 tensor in the file: its blocks are cut into the
    layer's shards and kept, and the model gives the dequantized file's logits."""
    from atom_core.layers.gemm import gemv_ops

    require_kernel(gemv_ops())
    _, path = converted["glm4_q8_0"]
    auto = LLMEngine(path, dtype="float32", quantization="auto", **ENGINE)
    fused = [m.packed_weight for n, m in auto.runner.model.named_modules() if n.endswith("mlp.gate_up_proj")]
    assert len(fused) == 2 and all(isinstance(k, StreamingGroupGemm) and k.bits == 8 for k in fused)
    plain = LLMEngine(path, dtype="float32", quantization="none", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=1)
    logits = []
    for engine in (auto, plain):
        engine.generate(PROMPTS, params, use_tqdm=False)
        logits.append(engine.runner.last_logits.clone())
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=2e-3)


def test_a_plugin_adds_a_gguf_architecture(converted, tmp_path, plugin_manager):
    """An architecture no plugin describes is refused, naming the ones there are; one a plugin
    registers through `atom_register_gguf_architectures` loads."""
    _, llama_path = converted["llama"]
    path = tmp_path / "fork.gguf"
    _rename_architecture(llama_path, path, "llamafork")
    with pytest.raises(
        ValueError, match=r"'llamafork'.*deepseek2, gemma2, gemma3, glm4, llama, phi3, qwen2, qwen3, qwen3moe, smollm3"
    ) as e:
        load_gguf(path)
    assert "atom_register_gguf_architectures" in str(e.value)

    from atom_models.llama import GGUF_LLAMA

    class Fork:
        @hookimpl
        def atom_register_gguf_architectures(self, registry):
            fork = GGUFArchitecture(GGUF_LLAMA.config, GGUF_LLAMA.tensors, GGUF_LLAMA.permuted_rows)
            registry.register("llamafork", fork)

    plugin_manager.register(Fork(), name="fork")
    config, state = load_gguf(path)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[q], load_gguf(llama_path)[1][q])
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_missing_tensors_and_odd_metadata_are_named(converted, tmp_path):
    _, path = converted["deepseek_v3"]
    lacking = tmp_path / "lacking.gguf"
    _rename_architecture(path, lacking, "deepseek2", drop={"blk.2.attn_v_b.weight"})
    with pytest.raises(ValueError, match=r"lacks parts of \['model\.layers\.2\.self_attn\.kv_b_proj\.weight'\]"):
        load_gguf(lacking)
    lacking = tmp_path / "lacking2.gguf"
    _rename_architecture(path, lacking, "deepseek2", drop={"blk.1.ffn_up_shexp.weight"})
    with pytest.raises(ValueError, match="tensors are missing"):
        load_gguf(lacking)


def _rename_architecture(src: Path, dst: Path, arch: str, drop: set[str] = frozenset()) -> None:
    """Copy a GGUF file under another `general.architecture` (keys renamed), leaving out `drop`."""
    reader = gguf.GGUFReader(src)
    old = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_descriptions_agree_with_gguf_own_name_maps():
    """Each family's table names what gguf's TensorNameMap (the converter's own) maps to that kind."""
    from atom_core.plugins.manager import get_registry

    registry = get_registry("gguf_architectures")
    checked = 0
    for name in ("llama", "qwen3", "qwen3moe", "deepseek2"):
        descriptions = [registry.get(name)]
        if name == "llama":
            from atom_models.mixtral import GGUF_MIXTRAL

            descriptions.append(GGUF_MIXTRAL)
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
        name_map = gguf.get_tensor_name_map(arch, 4)
        for description in descriptions:
            for kind, hf in description.tensors.items():
                if kind not in gguf.MODEL_TENSORS[arch]:  # never written for this architecture (dense Qwen3-MoE layers)
                    continue
                hf = hf if isinstance(hf, str) else next(iter(hf.values())).rpartition("_")[0]
                merged = hf.format(bid=2, xid="{xid}").replace(".{xid}", "")  # how the converter stacks experts
                found = name_map.get_type(merged) or name_map.get_type(merged.replace("model.layers.", "layers."))
                assert found == kind, (name, kind, hf, found)
                checked += 1
    assert checked > 50
