"""Qwen3.5 text models (dense and MoE): their layout, and the multimodal checkpoint layout.

Token parity under every policy, chunking and preemption is in `test_gdn_parity.py`.

Float32 greedy tokens, and the logits that produced them, for tiny random models whose layers
0-2 are Gated DeltaNet with Qwen3.5's flat projections (`in_proj_qkv` / `in_proj_z` /
`in_proj_b` / `in_proj_a`) and layer 3 gated full attention. Dense MLPs (`Qwen3_5ForCausalLM`)
or routed + shared experts on every layer (`Qwen3_5MoeForCausalLM`). GDN state must carry
across chunked-prefill cuts (mid-block too) and through preemption; pools start as NaN. A copy
of the checkpoint laid out as the multimodal releases are (`model.language_model.*` plus a
`model.visual.*` tower) must load, log the skipped vision tensors once, and match too.
transformers' pure-torch GDN path ignores packed sequences, so the oracle runs one prompt at a time.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest

torch = pytest.importorskip("torch")

from model_utils import build_tiny_model, check_against_hf, random_prompts, run_with_logits  # noqa: E402
from model_utils import make_gdn_engine as make_engine  # noqa: E402

NEW = 10


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_tiny_model(request.param, folder)


def test_model_is_what_the_parity_is_about(tiny):
    name, folder, hf = tiny
    engine = make_engine(folder)
    runner = engine.runner
    assert set(runner.attn_builders) == {"gdn", "mha"}
    assert len(runner.attn_builders["gdn"].layers) == 3 and len(runner.attn_builders["mha"].layers) == 1
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert len(hf.config.rope_parameters["mrope_section"]) == 3  # rope as the real configs write it
    from atom_core.runner.direct_calls import plain_type
    from atom_models.llama import LlamaMLP
    from atom_models.qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5MoeSparseMoeBlock

    layers = runner.model.model.layers
    assert [isinstance(getattr(la, "linear_attn", None), Qwen3_5GatedDeltaNet) for la in layers] == [True] * 3 + [False]
    mlp = Qwen3_5MoeSparseMoeBlock if name == "qwen3_5_moe" else LlamaMLP
    assert all(plain_type(la.mlp) is mlp for la in layers)


def test_multimodal_checkpoint_layout_loads_text_model(tiny, tmp_path, caplog):
    """Text weights under `model.language_model.*` (as the multimodal releases store them), a vision
    tower in an extra file and an `mtp.*` tensor: the text model loads, one log line counts the
    skipped vision tensors, and the output still matches."""
    from safetensors.torch import load_file, save_file

    _, folder, model = tiny
    copy = tmp_path / "multimodal"
    shutil.copytree(folder, copy)
    weights = load_file(str(copy / "model.safetensors"))
    renamed = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    save_file(renamed, str(copy / "model.safetensors"), metadata={"format": "pt"})
    vision = {
        "model.visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 2, 2),
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(24, 8),
        "model.visual.merger.linear_fc1.weight": torch.randn(16, 32),
        "mtp.fc.weight": torch.randn(64, 128),
    }
    save_file(vision, str(copy / "model-visual.safetensors"), metadata={"format": "pt"})
    # The released config: the text model's settings nested under `text_config`.
    text = json.loads((copy / "config.json").read_text())
    arch = text.pop("architectures")[0].replace("ForCausalLM", "ForConditionalGeneration")
    outer_type = text["model_type"].removesuffix("_text")  # the tiny model is saved as the text model
    nested = {"architectures": [arch], "model_type": outer_type, "tie_word_embeddings": text["tie_word_embeddings"]}
    text["model_type"] = outer_type + "_text"
    (copy / "config.json").write_text(json.dumps({**nested, "text_config": text, "vision_config": {}}))
    with caplog.at_level(logging.INFO, logger="atom"):
        engine = make_engine(copy)
    assert engine.runner.model.__class__.__name__ == arch.replace("ForConditionalGeneration", "ForCausalLM")
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "3 " in lines[0], lines
    prompts = random_prompts((9, 40), seed=11)
    results, logits = run_with_logits(engine, prompts, max_tokens=NEW)
    check_against_hf(model, prompts, results, logits)
