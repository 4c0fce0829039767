"""Weight-only quantization: the quantized GEMMs against float64, GGUF blocks kept exactly, models
loaded quantized against the same file dequantized, and the config's errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from conftest import require_kernel  # noqa: E402
from model_utils import ARCHS, build_tiny_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from atom_core import Config, SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.layers import quantized_gemm  # noqa: E402
from atom_core.layers.embedding import QuantizedEmbedding  # noqa: E402
from atom_core.layers.gemm import gemv_ops  # noqa: E402
from atom_core.layers.linear import Linear, MergedLinear  # noqa: E402
from atom_core.layers.ops import near_max  # noqa: E402
from atom_core.layers.quantized_gemm import (  # noqa: E402
    NEVER,
    ExactTopLogits,
    Int4PackGemm,
    Int8PackGemm,
    StreamingGroupGemm,
    quantized_linear,
    streaming_error_bound,
)
from atom_core.layers.quantized_weight import QuantizedWeight, quantize_int4, quantize_int8  # noqa: E402
from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE, safetensors_files  # noqa: E402
from atom_core.loading.gguf.blocks import (  # noqa: E402
    _quantized_weight,
    load_blocks,  # noqa: E402
    write_gguf_blocks,
)
from atom_core.loading.gguf.reader import load_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
ROWS = (1, 3, 64, 700)
BF16_U = 2.0**-8  # bfloat16 unit roundoff (8 significant bits): one rounding moves a value by at most this much


def within_bf16(
    out: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    qw: QuantizedWeight | None = None,
) -> None:
    """`out` is x @ w.T (float64) up to rounding x, the result and (for `qw`'s kernel) its scales
    and zeros to bfloat16: |error| <= u (2 |x| @ |w|.T + |x| @ scale_magnitudes.T), u bfloat16's
    unit roundoff."""
    ref = x.double() @ w.double().T
    magnitudes = 2 * w.double().abs() + (0 if qw is None else qw.scale_magnitudes().double())
    bound = BF16_U * 1.01 * (x.double().abs() @ magnitudes.T) + 1e-6
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + BF16_U * bias.double().abs()
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, where the bound is {bound[err > bound][0]:.3g}"


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, :5] *= 8  # a few outlier columns, as real weights have
    return w


@pytest.mark.parametrize(
    ("make", "n", "k"),
    [
        (lambda w: quantize_int8(w), 80, 96),  # per channel: _weight_int8pack_mm
        (lambda w: quantize_int4(w, 32), 96, 128),
        (lambda w: quantize_int4(w, 64), 80, 192),  # 80 rows: padded to the kernel's 16
        (lambda w: quantize_int4(w, 128), 48, 256),
        (lambda w: quantize_int4(w, 32, symmetric=True), 32, 64),
        (lambda w: quantize_int8(w, 32), 80, 96),  # 8-bit groups: two 4-bit halves
        (lambda w: quantize_int8(w, 64), 16, 128),
        (lambda w: quantize_int8(w, 32), 4096 + 88, 64),  # packed in row blocks, the last one padded
    ],
    ids=["int8", "int4-g32", "int4-g64", "int4-g128", "int4-sym", "int8-g32", "int8-g64", "int8-g32-tall"],
)
def test_quantized_gemm_matches_float64_of_the_dequantized_weight(make, n, k):
    qw = make(weight(n, k))
    kernel = Int8PackGemm(qw) if qw.bits == 8 and qw.group_size == k else Int4PackGemm(qw)
    w = qw.dequantize(torch.float64)
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        out = kernel(x)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        within_bf16(out, x, w, qw=qw)


def test_quantization_error_is_half_a_step_and_quantized_weights_come_back_exactly():
    w = weight(64, 256)
    for qw, step in [(quantize_int4(w, 32), 1 / 15), (quantize_int8(w, 32), 1 / 254)]:
        groups = w.reshape(64, -1, 32)
        span = (groups.amax(-1) - groups.amin(-1)) if qw.bits == 4 else groups.abs().amax(-1) * 2
        err = (qw.dequantize() - w).abs().reshape(64, -1, 32).amax(-1)
        assert (err <= span * step / 2 * 1.001 + 1e-7).all()
        # Quantizing the dequantized weight again finds the same integers (a Q4_1 / Q8_0 file under "int4").
        again = quantize_int4(qw.dequantize(), 32) if qw.bits == 4 else quantize_int8(qw.dequantize(), 32)
        assert torch.equal(again.qweight, qw.qweight)
        torch.testing.assert_close(again.dequantize(), qw.dequantize(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_runs_its_quantized_weight_in_the_models_dtype(mode, bias, dtype):
    layer = MergedLinear(128, {"a": 64, "b": 32}, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight(96, 128))
        if bias:
            layer.bias.copy_(torch.randn(96))
    b = None if layer.bias is None else layer.bias.detach().clone()
    qw = layer.quant = quantize_int8(layer.weight) if mode == "int8" else quantize_int4(layer.weight, 32)
    w = qw.dequantize(torch.float64)
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.quant is None
    for rows in ROWS:
        x = torch.randn(rows, 128, dtype=dtype)
        out = layer(x)
        assert out.dtype == dtype
        within_bf16(out, x, w, b, qw)
    a, bb = layer.split(layer(torch.randn(2, 128, dtype=dtype)))
    assert a.shape == (2, 64) and bb.shape == (2, 32)


def test_exact_top_logits_equal_float32_near_the_maximum():
    qw = quantize_int8(weight(512, 64, seed=3), 32)
    head = ExactTopLogits(Int4PackGemm(qw), qw)
    w = qw.dequantize(torch.float32)
    x = torch.randn(5, 64) * 8  # logits of tens: bfloat16 steps of 0.06-0.25
    out = head(x)
    exact = x @ w.T
    assert out.dtype == torch.float32
    assert torch.equal(out.argmax(1), exact.argmax(1))
    for r in range(5):
        top = exact[r].argmax()
        torch.testing.assert_close(out[r, top], exact[r, top], atol=1e-4, rtol=1e-6)
    within_bf16(out, x, w, qw=qw)  # the rest: the kernel's own values


@pytest.mark.parametrize(("bits", "activation_bits"), [(8, 16), (4, 16), (4, 8)])
def test_the_streaming_kernels_error_bound_holds_and_narrows_the_exact_recompute(bits, activation_bits, kernel_variant):
    """`streaming_error_bound` bounds every output of the kernel against the exact float64 product
    (x with outliers, as hidden states have, and plain), and `ExactTopLogits` on the kernel
    recomputes only what it cannot rule out: a row's top logit and a few beside it, where the
    bfloat16 bound kept about 80 of SmolLM2's 49,152."""
    ops = require_kernel(gemv_ops(kernel_variant))
    gen = torch.Generator().manual_seed(bits + activation_bits)
    w = torch.randn(4096, 256, generator=gen) * 0.05
    qw = quantize_int8(w, 32) if bits == 8 else quantize_int4(w, 32)
    kernel = StreamingGroupGemm(qw, ops, activation_bits)
    per_norm, per_max = streaming_error_bound(lambda block: qw.map_rows(lambda t: t[block]).dequantize(), kernel, qw)
    exact_w = qw.dequantize().double()
    x = torch.randn(9, 256, generator=gen) * 3
    x[:3, 17] = 80.0  # an outlier channel
    out = kernel.ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, 4096, None, activation_bits).double()
    bound = x.double().norm(dim=1) * per_norm + x.double().abs().amax(dim=1) * per_max
    assert ((out - x.double() @ exact_w.T).abs() <= bound[:, None]).all()
    if activation_bits == 16:  # the LM head's kernel
        head = ExactTopLogits(kernel, qw)
        assert head.streaming_bound == (per_norm, per_max)
        logits = head(x)
        exact = x @ qw.dequantize().T
        assert torch.equal(logits.argmax(1), exact.argmax(1))
        kept = near_max(kernel(x), bound.float().mul(1 / head.FLOAT32_EPS + 2), head.FLOAT32_EPS)[1]
        assert kept.numel() <= 8 * 9  # a few a row


def test_embedding_rows_from_a_quantized_table():
    qw = quantize_int8(weight(100, 64), 32)
    emb = QuantizedEmbedding(qw, torch.float32)
    ids = torch.tensor([[3, 99], [0, 3]])
    assert torch.equal(emb(ids), qw.dequantize()[ids])
    with pytest.raises(IndexError, match="token id -1 is outside the embedding table's 100 rows"):
        emb(torch.tensor([-1, 3]))  # would have wrapped around to row 99


def test_fallback_dequantizes_where_there_is_no_kernel(monkeypatch, caplog):
    monkeypatch.setattr(quantized_gemm, "_cpu_kernels_available", lambda: False)
    layer = Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight(32, 64))
    layer.quant = quantize_int4(layer.weight, 32)
    w = layer.quant.dequantize()
    with caplog.at_level("WARNING", logger="atom"):
        layer.process_weights_after_loading()
    assert "dequantized" in caplog.text
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ w.T, atol=1e-5, rtol=1e-5)


# --- GGUF blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_map_exactly(qtype, tmp_path):
    w = weight(48, 96).numpy()
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(path).tensors
    qw = _quantized_weight(tensor)
    assert (qw.bits, qw.group_size, qw.origin) == (8 if qtype == Q.Q8_0 else 4, 32, qtype.name)
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype)))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K blocks for w [N, K] (K a multiple of 256), which gguf cannot write: per
    group of 32 a 6-bit scale and minimum of the super-block's float16 d and dmin, w ~ d sc q - dmin m."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 8, 32).astype(np.float64)
    low = np.minimum(g.min(-1), 0)
    step = np.maximum(g.max(-1) - low, 1e-8) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(step / np.maximum(d.astype(np.float64), 1e-12)[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.maximum(dmin.astype(np.float64), 1e-12)[..., None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float64)[..., None] * sc
    q = np.clip(np.rint((g + (dmin.astype(np.float64)[..., None] * mn)[..., None]) / scale[..., None]), 0, 15).astype(
        np.uint8
    )
    packed = np.zeros((n, k // 256, 12), np.uint8)  # get_scale_min's layout, inverted
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    q = q.reshape(n, k // 256, 4, 2, 32)  # groups 2j and 2j + 1 share 32 bytes: low and high nibbles
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate(
        [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs], axis=-1
    )  # fmt: skip
    return blocks.reshape(n, -1)


def test_q4_k_blocks_map_exactly_onto_4_bit_groups():
    w = np.random.default_rng(1).standard_normal((24, 512)).astype(np.float32) * 0.1
    blocks = quantize_q4_k(w)
    ref = gguf.quants.dequantize(blocks, Q.Q4_K)
    assert np.abs(ref - w).max() < 0.25 * np.abs(w).max()  # a real quantization of w, not noise
    writer_tensor = SimpleNamespace(tensor_type=Q.Q4_K, shape=[512, 24], data=blocks)
    qw = _quantized_weight(writer_tensor)
    assert (qw.bits, qw.group_size) == (4, 32) and int(qw.qweight.max()) <= 15
    assert torch.equal(qw.dequantize(), torch.from_numpy(ref))  # gguf's own float32 dequantization


def test_q5_0_blocks_map_exactly_onto_8_bit_groups():
    w = np.random.default_rng(2).standard_normal((24, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, Q.Q5_0)
    qw = _quantized_weight(SimpleNamespace(tensor_type=Q.Q5_0, shape=[96, 24], data=blocks))
    assert (qw.bits, qw.group_size) == (8, 32) and qw.qweight.min() >= -16 and qw.qweight.max() <= 15
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q5_0)))


def write_tiny_llama(path: Path, types: dict[str, Q], *, tied: bool, hidden=64, heads=4, kv_heads=2, ffn=128,
                     vocab=256, layers=2) -> None:  # fmt: skip
    """A small llama GGUF laid out as llama.cpp writes it; `types` maps a tensor kind (q, k, v,
    o, gate, up, down, embd, output) to its quantization type."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, 256),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)]:  # fmt: skip
        add(value)

    def add(name: str, kind: str, shape: tuple[int, ...], scale: float, permute: int | None = None) -> None:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, (1 + 0.1 * w).astype(np.float32))
            return
        if permute:
            w = _llama_cpp_permute(w, permute)
        qtype = types[kind]
        blocks = quantize_q4_k(w) if qtype == Q.Q4_K else gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)

    add("token_embd.weight", "embd", (vocab, hidden), 1.0)
    for i in range(layers):
        b = f"blk.{i}"
        add(f"{b}.attn_norm.weight", "", (hidden,), 1.0)
        add(f"{b}.attn_q.weight", "q", (hidden, hidden), 0.15, heads)
        add(f"{b}.attn_k.weight", "k", (kv_heads * hidden // heads, hidden), 0.15, kv_heads)
        add(f"{b}.attn_v.weight", "v", (kv_heads * hidden // heads, hidden), 0.15)
        add(f"{b}.attn_output.weight", "o", (hidden, hidden), 0.1)
        add(f"{b}.ffn_norm.weight", "", (hidden,), 1.0)
        add(f"{b}.ffn_gate.weight", "gate", (ffn, hidden), 0.15)
        add(f"{b}.ffn_up.weight", "up", (ffn, hidden), 0.15)
        add(f"{b}.ffn_down.weight", "down", (hidden, ffn), 0.1)
    add("output_norm.weight", "", (hidden,), 1.0)
    if not tied:
        add("output.weight", "output", (vocab, hidden), 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def folder_from_gguf(path: Path) -> Path:
    """The HF folder `gguf_to_hf_folder` writes, without the tokenizer (the tiny file has none)."""
    config, state = load_gguf(path)
    folder = path.parent / path.stem
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    write_gguf_blocks(path, folder)
    return folder


def last_logits(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return engine.runner.last_logits.double()


PROMPTS = [[5, 17, 33, 9, 101, 250, 7], [3, 4], list(range(10, 60))]
LINEAR_KINDS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.parametrize(
    ("qtype", "tied"),
    [(Q.Q4_1, True), (Q.Q4_0, False), (Q.Q8_0, True), (Q.Q8_0, False), (Q.Q4_K, True), (Q.Q5_0, False)],
    ids=str,
)
def test_gguf_loaded_quantized_gives_the_logits_of_the_dequantized_file(tmp_path, qtype, tied, caplog):
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    types = dict.fromkeys(LINEAR_KINDS, qtype) | {"embd": Q.Q8_0, "output": Q.Q8_0}
    path = tmp_path / "tiny.gguf"
    width = dict(hidden=256, ffn=256) if qtype == Q.Q4_K else {}  # super-blocks of 256 along K
    write_tiny_llama(path, types, tied=tied, **width)
    folder = folder_from_gguf(path)
    kw = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    with caplog.at_level("INFO", logger="atom"):
        # x kept to 16 bits (the default, said here): what is checked is the blocks (int8
        # activations: the kernel test and the decode test below)
        engine = LLMEngine(folder, activation_bits=16, **kw)
    kept = "kept 15 Q8_0" if qtype == Q.Q8_0 else f"kept 14 {qtype.name}, 1 Q8_0"  # 7 tensors a layer, the head
    assert kept in caplog.text, caplog.text
    ref = last_logits(LLMEngine(folder, quantization="none", **kw), PROMPTS)
    model = engine.runner.model
    layer = model.model.layers[0]
    # groups of 32 stream through Atom's kernel at every row count
    kernel = layer.self_attn.qkv_proj.packed_weight
    assert isinstance(kernel, StreamingGroupGemm) and kernel.bits == (8 if qtype in (Q.Q8_0, Q.Q5_0) else 4)
    assert "requantized" not in caplog.text
    assert isinstance(model.lm_head.packed_weight, ExactTopLogits)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) is tied
    out = last_logits(engine, PROMPTS)
    # Two layers of activations rounded to bfloat16 at every GEMM: a few bfloat16 steps of the logits' scale.
    scale = ref.abs().amax(dim=1, keepdim=True)
    assert ((out - ref).abs() <= 4 * BF16_U * scale).all(), (out - ref).abs().max()
    assert torch.equal(out.argmax(1), ref.argmax(1))
    top = ref.argmax(1, keepdim=True)
    torch.testing.assert_close(out.gather(1, top), ref.gather(1, top), atol=2 * BF16_U * scale.max(), rtol=0)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0], ids=str)
def test_gguf_4bit_decode_steps_give_the_logits_of_the_dequantized_file(tmp_path, qtype, activation_bits):
    """Decode rows (1-8 a step) take the streaming 4-bit kernel, x rounded per group of 32 to
    int16 (the default) or int8; the Q8_0 head keeps 16 bits either way."""
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, dict.fromkeys(LINEAR_KINDS, qtype) | {"embd": Q.Q8_0, "output": Q.Q8_0}, tied=True)
    folder = folder_from_gguf(path)
    kw = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    bits = {} if activation_bits == 16 else dict(activation_bits=activation_bits)  # 16: the default
    engines = [LLMEngine(folder, **bits, **kw), LLMEngine(folder, quantization="none", **kw)]
    model = engines[0].runner.model
    kernel = model.model.layers[0].mlp.down_proj.packed_weight
    assert isinstance(kernel, StreamingGroupGemm) and (kernel.bits, kernel.activation_bits) == (4, activation_bits)
    assert model.lm_head.packed_weight.kernel.activation_bits == 16
    # int16: a few bfloat16 steps of the logits' scale. int8 moves each activation by up to
    # half a step of its group's largest (1/254 of it), where bfloat16 moves it by 1/256 of
    # itself, and two random layers carry it over 6 steps: here it came to 7-17 such steps (the
    # AVX2 build's, whose norms and attention round their last bits otherwise, the most).
    tol = (4 if activation_bits == 16 else 32) * BF16_U
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for engine in engines:
        for p in PROMPTS[:2]:
            engine.add_request(p, params)
        engine.step()  # the prompts
    for _ in range(6):  # both engines decode the 4-bit engine's tokens (teacher forced)
        engines[0].step()
        out = engines[0].runner.last_logits.double()
        for seq, new in zip(engines[1].scheduler.running, [s.token_ids[-1] for s in engines[0].scheduler.running]):
            seq.token_ids[-1] = seq.last_token = new  # the float engine scores the same continuation
        engines[1].step()
        ref = engines[1].runner.last_logits.double()
        scale = ref.abs().amax(dim=1, keepdim=True)
        assert ((out - ref).abs() <= tol * scale).all(), (out - ref).abs().max()
        assert torch.equal(out.argmax(1), ref.argmax(1))


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as `qgemm` rounds it at activation_bits 8: per group of 32, to nearest (even) of
    max|x| / 127 steps, in float32 as the kernel computes it."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    return (torch.round(groups * inv).double() * (top.double() / 127)).reshape(x.shape)


@pytest.mark.parametrize(("bits", "activation_bits"), [(4, 16), (4, 8), (8, 16)])
def test_streaming_group_kernel_against_float64(bits, activation_bits, kernel_variant):
    """The kernel at every row count of a pass and past it (1-9, 17, 64, 700), an odd number of
    groups, a bias, float32, bfloat16 and float16 activations: against the float64 product of
    x and the weight it holds (float16 scales and mins), in each variant this host runs; with
    int8 activations also against x rounded as the kernel rounds it, the products exact."""
    from atom_core.layers.gemm import gemv_ops

    ops = require_kernel(gemv_ops(kernel_variant))
    gen = torch.Generator().manual_seed(3)
    for n, k in [(5, 32), (100, 96), (131, 576), (37, 1536)]:
        w = torch.randn(n, k, generator=gen) * 0.05
        qw = quantize_int4(w, 32) if bits == 4 else quantize_int8(w, 32)
        kernel = StreamingGroupGemm(qw, ops, activation_bits, NEVER)  # qgemm at every row count (AMX: below)
        assert kernel.activation_bits == activation_bits
        q = qw.qweight.reshape(n, k // 32, 32).double() + (128 if bits == 8 else 0)
        scales = qw.scales.half().double()  # the kernel's float16 scale and min per group
        mins = (qw.zeros - 8 * qw.scales).half().double() if bits == 4 else (-128 * scales).half().double()
        w = (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(n, k)
        qd = (q * scales.unsqueeze(-1)).reshape(n, k)  # w less the mins
        for rows in [*range(1, 10), 17, 64, 700][: None if n * k < 50_000 else 11]:  # any number, a pass at a time
            x = torch.randn(rows, k, generator=gen)
            ref = x.double() @ w.T
            out = kernel.ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, n, None, activation_bits)
            if activation_bits == 16:
                # x is rounded to int16 per group: about 16 bits of each group's largest value
                tol = 1e-4 * (x.double().abs().amax() * w.abs().sum(1).amax()) * (1 if bits == 4 else 16)
            else:
                # the rounded x's products (integers, exact) and the mins times each group's own
                # sum come out as float32 sums
                rounded = int8_rounded(x) @ qd.T + x.double().reshape(rows, -1, 32).sum(-1) @ mins.T
                assert (out.double() - rounded).abs().max() <= 1e-5 * rounded.abs().max()
                # each value moves by at most half a step, 1/254 of its group's largest (the
                # mins multiply x's own sums)
                step = x.double().reshape(rows, -1, 32).abs().amax(-1) / 254
                bound = step @ qd.abs().reshape(n, -1, 32).sum(-1).T * 1.001 + 1e-5 * rounded.abs().max()
                assert ((out.double() - ref).abs() <= bound).all()
                tol = float(bound.max())
            assert (out.double() - ref).abs().max() <= tol
            # batch-invariant: each row alone gives its row of the batch, bit for bit, and so do
            # the last two rows (one and two rows lay x out apart from larger batches)
            assert torch.equal(kernel(x[-1:]), out[-1:])
            assert torch.equal(kernel(x[-2:]), out[-2:])
            assert torch.equal(kernel(x), out)  # the layer's route to it
            xb = x.bfloat16()  # bfloat16 activations: the same arithmetic, the output rounded once
            outb = kernel(xb)
            refb = kernel(xb.float())
            assert outb.dtype == torch.bfloat16 and torch.equal(outb, refb.bfloat16())
            xh = x.half()  # float16 activations (a float16 model's) likewise
            outh = kernel(xh)
            assert outh.dtype == torch.float16 and torch.equal(outh, kernel(xh.float()).half())
        bias = torch.randn(n, generator=gen)
        out = quantized_linear(x, kernel, bias)
        torch.testing.assert_close(out.double(), x.double() @ w.T + bias.double(), atol=float(tol), rtol=0)
        with_bias = kernel.ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, n, bias, activation_bits)
        torch.testing.assert_close(with_bias.double(), x.double() @ w.T + bias.double(), atol=float(tol), rtol=0)
        assert kernel(x[:0]).shape == (0, n)


def test_int8_activations_are_for_4_bit_weights(kernel_variant):
    """8-bit weights keep int16 activations (u8 codes to 255 against int8 would overflow
    vpmaddubsw's int16 sums); the op refuses the pair by name."""
    from atom_core.layers.gemm import gemv_ops

    ops = require_kernel(gemv_ops(kernel_variant))
    qw = quantize_int8(torch.randn(16, 64) * 0.05, 32)
    kernel = StreamingGroupGemm(qw, ops, activation_bits=8)
    assert kernel.activation_bits == 16
    with pytest.raises(RuntimeError, match="act_bits must be 16, or 8 with 4-bit weights; got act_bits 8 with 8-bit"):
        ops.qgemm(torch.randn(2, 64), kernel.qweight, kernel.scales, kernel.mins, 16, None, 8)
    with pytest.raises(ValueError, match="activation_bits must be 8 or 16, got 4"):
        StreamingGroupGemm(quantize_int4(torch.randn(16, 64), 32), ops, activation_bits=4)
    with pytest.raises(ValueError, match="activation_bits must be one of 8, 16, got 12"):
        Config(activation_bits=12)


def test_gguf_exact_blocks_are_the_folders_weights_and_k_quants_requantize(tmp_path, caplog):
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    types = {"q": Q.Q4_1, "k": Q.Q4_1, "v": Q.Q8_0,  # one fused qkv with two formats: requantized to 8 bits
             "o": Q.Q4_0, "gate": Q.Q5_1, "up": Q.Q5_1, "down": Q.F16, "embd": Q.Q8_0, "output": Q.Q4_1}  # fmt: skip
    path = tmp_path / "mixed.gguf"
    write_tiny_llama(path, types, tied=False)
    folder = folder_from_gguf(path)
    _, state = load_gguf(path)
    source, weights = load_blocks(folder / GGUF_BLOCKS_FILE)
    assert source == "mixed.gguf" and sorted(weights) == sorted(n for n, t in state.items() if t.dim() == 2)
    for name, (gguf_type, qw) in weights.items():
        if qw is not None:  # Q/K rows unpermuted like the float weights
            assert torch.equal(qw.dequantize(), state[name]), name
        else:
            assert gguf_type in ("Q5_1", "F16"), name
    assert [p.name for p in safetensors_files(folder)] == ["model.safetensors"]  # the blocks are no shard

    with caplog.at_level("INFO", logger="atom"):
        engine = LLMEngine(folder, dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    assert "requantized" in caplog.text and "Q5_1" in caplog.text and "Q4_1/Q8_0" in caplog.text
    assert "no kernel takes their blocks as they are" in caplog.text  # Q5_1
    assert "their shards' formats differ" in caplog.text  # Q4_1 has zero offsets, 8 bits none
    layer = engine.runner.model.model.layers[0]
    assert not isinstance(layer.mlp.down_proj.packed_weight, (Int4PackGemm, Int8PackGemm))  # F16: a float weight
    assert isinstance(layer.self_attn.o_proj.packed_weight, StreamingGroupGemm)  # Q4_0 kept
    assert layer.mlp.gate_up_proj.packed_weight.bits == 8  # Q5_1 -> 8-bit groups of 32
    assert layer.self_attn.qkv_proj.packed_weight.bits == 8
    ref = last_logits(LLMEngine(folder, quantization="none", dtype="float32", num_kvcache_blocks=32,
                                max_model_len=128), PROMPTS)  # fmt: skip
    out = last_logits(engine, PROMPTS)
    assert torch.equal(out.argmax(1), ref.argmax(1))


def test_a_fused_layer_of_q4_0_and_q8_0_shards_goes_to_8_bits_exactly(tmp_path, caplog):
    """llama.cpp's quantizer gives attn_v more bits than q and k: Q4_0 shards (no zero offset)
    widen to 8 bits exactly, so the fused qkv keeps the file's values instead of requantizing."""
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    types = dict.fromkeys(LINEAR_KINDS, Q.Q4_0) | {"v": Q.Q8_0, "embd": Q.Q8_0, "output": Q.Q8_0}
    path = tmp_path / "mixed.gguf"
    write_tiny_llama(path, types, tied=True)
    folder = folder_from_gguf(path)
    kw = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    with caplog.at_level("INFO", logger="atom"):
        engine = LLMEngine(folder, **kw)
    assert "requantized" not in caplog.text and "kept 12 Q4_0, 3 Q8_0" in caplog.text, caplog.text
    attn = engine.runner.model.model.layers[0].self_attn
    assert (
        attn.qkv_proj.packed_weight.bits == 8
        and engine.runner.model.model.layers[0].mlp.down_proj.packed_weight.bits == 4
    )
    _, state = load_gguf(path)
    qkv = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    kernel = attn.qkv_proj.packed_weight
    x = torch.randn(3, qkv.shape[1])
    out = kernel.ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, kernel.out_features, None)
    # the file's weights (x rounded per group to int16, as in the kernel test above)
    tol = 16e-4 * float(x.abs().max() * qkv.abs().sum(1).max())
    torch.testing.assert_close(out.double(), x.double() @ qkv.double().T, atol=tol, rtol=0)
    ref = last_logits(LLMEngine(folder, quantization="none", **kw), PROMPTS)
    assert torch.equal(last_logits(engine, PROMPTS).argmax(1), ref.argmax(1))


def test_auto_loads_a_folder_without_blocks_as_it_is(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, dict.fromkeys((*LINEAR_KINDS, "embd", "output"), Q.Q4_0), tied=True)
    folder = folder_from_gguf(path)
    (folder / GGUF_BLOCKS_FILE).unlink()
    engine = LLMEngine(folder, num_kvcache_blocks=32, max_model_len=128)
    assert not isinstance(engine.runner.model.model.embed_tokens, QuantizedEmbedding)
    assert not isinstance(engine.runner.model.lm_head.packed_weight, ExactTopLogits)


# --- quantizing any checkpoint --------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "head", "head_bits"),
    [("int4", "int8", 8), ("int4", "same", 4), ("int8", "none", None), ("int8", "int8", 8)],
)
def test_int4_and_int8_quantize_every_linear_and_the_head_as_asked(tmp_path, mode, head, head_bits):
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, dict.fromkeys((*LINEAR_KINDS, "embd", "output"), Q.F32), tied=True)
    folder = folder_from_gguf(path)
    kw = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    engine = LLMEngine(folder, quantization=mode, quantize_lm_head=head, **kw)
    model = engine.runner.model
    body = model.model.layers[1].mlp.down_proj.packed_weight
    if mode == "int8":
        assert isinstance(body, StreamingGroupGemm) and body.bits == 8
    else:
        assert isinstance(body, StreamingGroupGemm) and body.bits == 4
    if head_bits is None:
        assert not isinstance(model.model.embed_tokens, QuantizedEmbedding)  # a float head's (streamed) table
        assert not isinstance(model.lm_head.packed_weight, ExactTopLogits)
    else:
        head_kernel = model.lm_head.packed_weight.kernel
        assert isinstance(head_kernel, StreamingGroupGemm) and head_kernel.bits == head_bits
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)  # tied: rows from the head's weight
    ref = last_logits(LLMEngine(folder, **kw), PROMPTS)  # F32 file under "auto": as it is
    out = last_logits(engine, PROMPTS)
    rel = ((out - ref).norm(dim=1) / ref.norm(dim=1)).max()
    assert rel < (0.3 if mode == "int4" else 0.03), rel  # random weights: int4 groups of 32 are 8% noise a layer


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_int4_quantizes_moe_experts_expert_by_expert(tmp_path, arch):
    require_kernel(gemv_ops())  # what it checks is the streaming kernel's
    from atom_core.layers import FusedMoE

    build_tiny_model(arch, tmp_path)
    kw = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)
    engine = LLMEngine(tmp_path, quantization="int4", **kw)
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.w13 is None and m.w2 is None and len(m.expert_gemms) == m.num_experts for m in moes)
    kernels = [kernel for m in moes for pair in m.expert_gemms for _, kernel in pair]
    assert all(isinstance(k, StreamingGroupGemm) and k.bits == 4 for k in kernels)
    ref = last_logits(LLMEngine(tmp_path, **kw), PROMPTS)
    out = last_logits(engine, PROMPTS)
    rel = ((out - ref).norm(dim=1) / ref.norm(dim=1)).max()
    assert rel < 0.3, rel  # random weights: int4 groups of 32 are 8% noise a layer


def test_layers_the_group_does_not_divide_go_per_channel(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, dict.fromkeys((*LINEAR_KINDS, "embd", "output"), Q.F32), tied=False)
    folder = folder_from_gguf(path)
    with caplog.at_level("WARNING", logger="atom"):
        engine = LLMEngine(folder, quantization="int4", quantization_group_size=128, num_kvcache_blocks=32,
                           max_model_len=128)  # fmt: skip
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj.packed_weight, Int8PackGemm)  # in_features 64
    assert isinstance(layer.mlp.down_proj.packed_weight, Int4PackGemm)  # in_features 128
    expected = "not a multiple of quantization_group_size 128: model.layers.0.self_attn.qkv_proj (in_features 64)"
    assert expected in caplog.text


@pytest.mark.parametrize("k", [8, 12, 40, 136, 48])
def test_per_channel_int8_at_any_width(k):
    """torch's int8 kernel reads K in steps of 16 (other widths gave garbage or crashed): the
    weight and x are padded with zeros, so any width matches the dequantized product."""
    qw = quantize_int8(weight(24, k, seed=k))
    kernel = Int8PackGemm(qw)
    x = torch.randn(5, k)
    ref = x.bfloat16().double() @ qw.dequantize().double().T  # the kernel takes bfloat16 activations
    out = kernel(x).double()
    assert out.shape == (5, 24)
    assert (out - ref).abs().max() <= 2 * BF16_U * ref.abs().max() * 4, (out - ref).abs().max()


def test_bad_quantization_settings_name_the_field():
    with pytest.raises(ValueError, match=r"quantization must be one of 'auto', 'none', 'int8', 'int4', got 'int3'"):
        Config(quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_group_size must be one of 32, 64, 128, 256, got 48"):
        Config(quantization_group_size=48)
    with pytest.raises(ValueError, match=r"quantize_lm_head must be one of 'int8', 'same', 'none', got 'int4'"):
        Config(quantize_lm_head="int4")
    c = Config()
    assert (c.quantization, c.quantization_group_size, c.quantize_lm_head) == ("auto", 32, "int8")


def test_a_layer_the_group_size_does_not_divide_is_an_error_naming_both():
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of quantization_group_size 64"):
        quantize_int4(weight(16, 96), 64)


def test_stacking_shards_of_different_formats_is_refused():
    with pytest.raises(ValueError, match="cannot stack 4-bit groups of 32, 8-bit per channel"):
        QuantizedWeight.cat([quantize_int4(weight(16, 64)), quantize_int8(weight(16, 64))])


# --- every family quantized -----------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(ARCHS))
def family(request, tmp_path_factory):
    """(arch, folder, float32 logits of PROMPTS) of each tiny family in model_utils.ARCHS."""
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny_model(request.param, folder)
    return request.param, folder, last_logits(LLMEngine(folder, **FAMILY_KW), PROMPTS)


def kernel_bits(kernel) -> int | None:
    if isinstance(kernel, Int8PackGemm):
        return 8
    return kernel.bits if isinstance(kernel, StreamingGroupGemm) else None


FAMILY_KW = dict(dtype="float32", num_kvcache_blocks=32, max_model_len=128)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_family_runs_quantized_with_every_linear_and_expert_quantized(family, mode):
    """int8 / int4 apply to every family: each quantizable Linear and every routed expert runs a
    group kernel of those bits, and the logits stay near the float model's."""
    require_kernel(gemv_ops())
    from atom_core.layers import FusedMoE

    arch, folder, ref = family
    engine = LLMEngine(folder, quantization=mode, **FAMILY_KW)
    model = engine.runner.model
    bits = 8 if mode == "int8" else 4
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.quantizable and not m.is_lm_head}
    kernels = {n: getattr(m.packed_weight, "kernel", m.packed_weight) for n, m in linears.items()}
    for moe_name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)):
        assert moe.w13 is None and len(moe.expert_gemms) == moe.num_experts
        kernels |= {
            f"{moe_name}.{e}.{i}": k for e, pair in enumerate(moe.expert_gemms) for i, (_, k) in enumerate(pair)
        }
    # a layer the group does not divide goes to int8 per output channel (warned at load)
    widths = {n: m.in_features for n, m in linears.items()}
    wrong = {
        n: type(k).__name__
        for n, k in kernels.items()
        if kernel_bits(k) != (bits if widths.get(n, 32) % 32 == 0 else 8)
    }
    assert linears and not wrong, wrong
    out = last_logits(engine, PROMPTS)
    rel = ((out - ref).norm(dim=1) / ref.norm(dim=1)).max()
    # random weights: int4 groups of 32 are 8% noise a layer; noise that flips a near-tied
    # expert moves a routed family's logits further (up to 0.99 here, Qwen3-Next at int4)
    limit = (0.5 if mode == "int4" else 0.1) * (3 if ARCHS[arch].get("bf16_routing_flips") else 1)
    assert rel < limit, rel


def test_dense_prefill_kernel_against_float64(kernel_variant, monkeypatch):
    """`qgemm_dense` (4-bit weights, 8-bit activations, a prompt's rows on CPUs with AMX): x and
    the weight each rounded to bfloat16 and summed in float32, against the float64 product of
    those rounded factors and against the exact one; the layer takes it from `dense_rows` rows on,
    qgemm below and at every row count once made batch-invariant; where oneDNN's bfloat16
    micro-kernel does not run (CPUs without AVX-512 BF16 support), the op raises and no CPU
    takes it."""
    ops = require_kernel(gemv_ops(kernel_variant))
    gen = torch.Generator().manual_seed(5)
    amx = SimpleNamespace(amx_bf16=True)
    monkeypatch.setattr(quantized_gemm, "cpu_features", lambda: amx)
    monkeypatch.setattr(quantized_gemm, "_dense_usable", {})
    qw = quantize_int4(torch.randn(100, 96, generator=gen) * 0.05, 32)
    if not ops.dense_usable():
        kernel = StreamingGroupGemm(qw, ops, 8)
        with pytest.raises(RuntimeError):
            ops.qgemm_dense(torch.randn(4, 96), kernel.qweight, kernel.scales, kernel.mins, 100, None)
        assert not quantized_gemm.dense_prefill(ops) and kernel.dense_rows == NEVER
        return
    assert quantized_gemm.dense_prefill(ops)
    monkeypatch.setenv("ATOM_DISABLE_DENSE_PREFILL", "1")
    assert not quantized_gemm.dense_prefill(ops)
    monkeypatch.delenv("ATOM_DISABLE_DENSE_PREFILL")
    assert StreamingGroupGemm(qw, ops, 16).dense_rows == NEVER  # 16-bit activations keep qgemm
    with pytest.raises(ValueError, match="stands in for 8-bit activations"):
        StreamingGroupGemm(qw, ops, 16, 64)
    assert StreamingGroupGemm(qw, ops, 8).dense_rows == StreamingGroupGemm.DENSE_ROWS
    for n, k in [(5, 32), (100, 96), (131, 576), (37, 1536)]:
        qw = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 32)
        kernel = StreamingGroupGemm(qw, ops, 8, 64)
        held = kernel.scales.double().repeat_interleave(32, 1), kernel.mins.double().repeat_interleave(32, 1)
        q = qw.qweight.double()
        t = -(-n // 16) * 16
        w = (q * held[0].reshape(t // 16, k, 16).transpose(1, 2).reshape(t, k)[:n]
             + held[1].reshape(t // 16, k, 16).transpose(1, 2).reshape(t, k)[:n])  # fmt: skip
        wb = w.float().bfloat16().double()  # the weight as the op widens it: exact in float32, then rounded
        for rows in (1, 17, 64, 700):
            x = torch.randn(rows, k, generator=gen)
            xb = x.bfloat16().double()
            out = ops.qgemm_dense(x, kernel.qweight, kernel.scales, kernel.mins, n, None)
            assert out.dtype == torch.float32 and out.shape == (rows, n)
            rounded = xb @ wb.T
            sums = xb.abs() @ wb.abs().T
            assert ((out.double() - rounded).abs() <= 1e-6 * sums + 1e-30).all()  # float32 sums of exact products
            # each factor within 2^-9 of itself: no coarser than x rounded per group to int8
            exact = x.double() @ w.T
            assert ((out.double() - exact).abs() <= (2.0**-8 + 2.0**-17) * (x.double().abs() @ w.abs().T) * 1.01).all()
            routed = kernel(x)
            qgemm = ops.qgemm(x, kernel.qweight, kernel.scales, kernel.mins, n, None, 8)
            assert torch.equal(routed, out if rows >= 64 else qgemm)
            outb = ops.qgemm_dense(x.bfloat16(), kernel.qweight, kernel.scales, kernel.mins, n, None)
            assert outb.dtype == torch.bfloat16 and torch.equal(outb, out.bfloat16())
            outh = ops.qgemm_dense(x.half(), kernel.qweight, kernel.scales, kernel.mins, n, None)
            xh = x.half().bfloat16().float()  # (x rounds to float16 first, then to bfloat16)
            assert outh.dtype == torch.float16
            assert torch.equal(outh, ops.qgemm_dense(xh, kernel.qweight, kernel.scales, kernel.mins, n, None).half())
        bias = torch.randn(n, generator=gen)
        with_bias = ops.qgemm_dense(x, kernel.qweight, kernel.scales, kernel.mins, n, bias)
        assert torch.equal(with_bias, out + bias)  # the float32 sums, then the bias: one rounding each
        with_bias = ops.qgemm_dense(x.bfloat16(), kernel.qweight, kernel.scales, kernel.mins, n, bias)
        assert torch.equal(with_bias, (out + bias).bfloat16())
        assert kernel(x[:0]).shape == (0, n)
        assert not kernel.batch_invariant
        kernel.make_batch_invariant()
        assert kernel.batch_invariant and torch.equal(kernel(x), qgemm)
