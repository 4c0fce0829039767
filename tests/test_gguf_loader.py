"""GGUF -> Hugging Face conversion: exact against transformers' own GGUF loading, and exact
against gguf's dequantization on small synthetic files written with every quantizable type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from model_utils import transformers_from_gguf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from atom_core.engine.fetch import DEFAULT_MODEL_NAME, default_model_gguf, fetch_default_model  # noqa: E402
from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE  # noqa: E402
from atom_core.loading.gguf.blocks import load_blocks  # noqa: E402
from atom_core.loading.gguf.convert import gguf_to_hf_folder  # noqa: E402
from atom_core.loading.gguf.reader import load_gguf  # noqa: E402

torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    """(the installed SmolLM2 GGUF, its converted folder), converted once through fetch."""
    gguf_file = default_model_gguf()
    cache = tmp_path_factory.mktemp("atom-cache")
    folder = fetch_default_model(cache_dir=cache, quiet=True)
    assert folder == cache / "models" / DEFAULT_MODEL_NAME
    assert not (cache / "packages").exists()  # took the installed distribution, no pip
    assert [p.name for p in folder.parent.iterdir()] == [DEFAULT_MODEL_NAME]  # no partial folder left
    assert fetch_default_model(cache_dir=cache, quiet=True) == folder  # second call: cached
    return gguf_file, folder


def test_smollm2_weights_and_config_equal_transformers_gguf_loading(smollm2):
    gguf_file, folder = smollm2
    # The folder's files are load_gguf's output (same code path; reading the GGUF again costs ~5 s).
    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    ref = transformers_from_gguf(gguf_file)
    ref_state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(state) == sorted(ref_state)
    assert len(state) == 2 + 30 * 9
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref_state[name]), name
    assert "lm_head.weight" not in state  # tied

    # The quantized blocks beside them (what quantization="auto" loads) give the same weights.
    source, blocks = load_blocks(folder / GGUF_BLOCKS_FILE)
    assert source == gguf_file.name and sorted(blocks) == sorted(n for n, t in state.items() if t.dim() == 2)
    assert sorted({t for t, _ in blocks.values()}) == ["Q4_1", "Q8_0"]
    for name, (_, qw) in blocks.items():
        assert torch.equal(qw.dequantize(), state[name]), name

    ref_config = ref.config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):  # fmt: skip
        assert config[field] == getattr(ref_config, field), field
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"] == 100000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["rms_norm_eps"] == 1e-05 == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)
    assert config["tie_word_embeddings"] is True and ref_config.tie_word_embeddings is True
    assert config["eos_token_id"] == ref_config.eos_token_id == 2
    assert config["bos_token_id"] == 1
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"  # quantized source


def test_converted_tokenizer_is_transformers_own_from_the_file(smollm2):
    """The folder's tokenizer (its class named from the converted config) encodes and decodes as
    transformers' AutoTokenizer does reading the GGUF file itself."""
    gguf_file, folder = smollm2
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(theirs)
    text = "The capital of France is Paris.\n  def add(a, b): return a + b <|im_end|> é ü 東京"
    assert ours(text).input_ids == theirs(text).input_ids
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, add_generation_prompt=True
    )
    ids = ours(text).input_ids
    assert ours.decode(ids) == theirs.decode(ids)


def test_converted_folder_loads_in_transformers_and_answers(smollm2):
    _, folder = smollm2
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert "<|im_start|>" in (folder / "chat_template.jinja").read_text()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- synthetic files ------------------------------------------------------------------------

MATRIX_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute, written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _roundtrip(w: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).copy())


def _write_synthetic(path: Path, arch: str, *, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                     vocab=96, layers=2, tied=False, odd_type=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write a small GGUF the way llama.cpp lays it out; return the HF-named tensors a
    correct loader must produce (dequantize(quantize(hf weight)))."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    expected: dict[str, torch.Tensor] = {}
    types = iter(MATRIX_TYPES * 100)

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None):
        w = rng.standard_normal(shape).astype(np.float32)
        qtype = next(types) if len(shape) == 2 else Q.F32  # llama.cpp keeps norms in F32
        if odd_type is not None and gguf_name == "blk.1.attn_norm.weight":
            writer.add_tensor(gguf_name, (w * 100).astype(np.int32))
            return
        stored = _llama_cpp_permute(w, permute_heads) if permute_heads and arch == "llama" else w
        writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        # Quantization blocks run along rows, so permuting rows commutes with it.
        expected[hf_name] = _roundtrip(w, qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (hidden,))
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (heads * head_dim, hidden), heads)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden), kv_heads)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        if arch == "qwen2":  # q/k/v biases
            add(f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (heads * head_dim,))
            add(f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv_heads * head_dim,))
            add(f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv_heads * head_dim,))
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (hidden, heads * head_dim))
        if arch == "qwen3":
            add(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (head_dim,))
            add(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (head_dim,))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (hidden,))
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (ffn, hidden))
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (ffn, hidden))
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (hidden, ffn))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize(
    ("arch", "dims"),
    [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32, "tied": True})],  # qwen3: head_dim != hidden/heads
)
def test_synthetic_gguf_loads_exactly(tmp_path, arch, dims):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_synthetic(path, arch, **dims)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert set(MATRIX_TYPES) <= types

    config, state = load_gguf(path)
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    tied = dims.get("tied", False)
    assert config["model_type"] == arch
    assert config["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
    assert config["attention_bias"] is (arch == "qwen2")
    assert config["head_dim"] == dims.get("head_dim", 16)
    assert config["vocab_size"] == 96  # from token_embd: the file has no vocab_size key
    assert config["tie_word_embeddings"] is tied and ("lm_head.weight" in state) is not tied
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert (config["rms_norm_eps"], config["bos_token_id"], config["eos_token_id"]) == (1e-6, 1, 2)

    # The transformers model built from our config takes our state dict as is.
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    loaded = model.load_state_dict(state, strict=False)
    assert loaded.unexpected_keys == []
    assert set(loaded.missing_keys) <= ({"lm_head.weight"} if tied else set())  # tied: from the embedding
    assert torch.equal(model.lm_head.weight, state["lm_head.weight" if not tied else "model.embed_tokens.weight"])

    half = load_gguf(path, dtype=torch.bfloat16)[1]
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["model.norm.weight"], expected["model.norm.weight"].bfloat16())


def test_llama_qk_unpermutation_is_not_the_identity(tmp_path):
    """Guards the test above: the permutation really moves rows for these shapes."""
    w = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    assert not np.array_equal(_llama_cpp_permute(w, 4), w)


def test_unsupported_architecture_and_type_raise_clear_errors(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'"):
        load_gguf(path)
    with pytest.raises(ValueError, match="'gpt2'"):
        gguf_to_hf_folder(path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [path]  # nothing written, not even a partial folder

    odd = tmp_path / "odd.gguf"
    _write_synthetic(odd, "llama", odd_type=True)
    with pytest.raises(ValueError, match=r"'blk\.1\.attn_norm\.weight' has type I32"):
        load_gguf(odd)


def test_two_files_of_one_name_size_and_time_convert_apart(tmp_path, monkeypatch):
    """The conversion cache is keyed by the file's path too: two fine-tunes named alike, of one
    size, with copied timestamps, must not load as whichever was converted first."""
    import os
    import shutil

    import atom_core.loading.gguf.convert
    from atom_core.engine.model_source import resolve_model

    def convert(path: Path, out: Path) -> Path:  # what a conversion leaves, and which file it was
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"from": str(path)}))
        (out / GGUF_BLOCKS_FILE).touch()
        return out

    monkeypatch.setattr(atom_core.loading.gguf.convert, "gguf_to_hf_folder", convert)
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"x")
    shutil.copystat(a, b)
    assert a.stat().st_mtime_ns == b.stat().st_mtime_ns
    fa, fb = resolve_model(a), resolve_model(b)
    assert fa != fb and json.loads((fb / "config.json").read_text())["from"] == str(b)
    assert resolve_model(a) == fa  # converted once
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 1))  # rewritten within the second
    assert resolve_model(b) != fb


def test_unreadable_gguf_files_are_named_and_settings_checked_first(tmp_path, monkeypatch):
    import struct

    from atom_core import LLMEngine

    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    good = tmp_path / "good.gguf"
    _write_synthetic(good, "llama")
    data = good.read_bytes()
    cases = {
        "cut.gguf": data[:2000],  # inside the header
        "counts.gguf": data[:8] + struct.pack("<Q", 1 << 40) + data[16:],  # an absurd tensor count
    }
    for name, content in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}: not a GGUF file Atom can read \(truncated or corrupt\?\)"):
            LLMEngine(bad)
    # A bad setting is named before the file is converted (minutes, for a big one).
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLMEngine(good, quantization="q4_0")
    with pytest.raises(ValueError, match="quantization_group_size must be one of .* got 32.0"):
        LLMEngine(good, quantization_group_size=32.0)
    with pytest.raises(ValueError, match="device='cuda', but this torch has no CUDA device"):
        LLMEngine(good, device="cuda")
    with pytest.raises(ValueError, match="device must be a torch device string .* got 'gpu'"):
        LLMEngine(good, device="gpu")
    with pytest.raises(ValueError, match=r"device='meta' holds no data \(shapes only\)"):
        LLMEngine(good, device="meta")
    if not torch.xpu.is_available():
        with pytest.raises(ValueError, match="device='xpu:0', but this torch has no XPU device"):
            LLMEngine(good, device="xpu:0")
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []  # no partial conversion either
