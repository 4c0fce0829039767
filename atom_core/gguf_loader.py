"""Turn a GGUF file (llama.cpp's format) into Hugging Face-format weights and config.

Atom's models read Hugging Face folders (config.json + model.safetensors + tokenizer), and
small models are easiest to ship as GGUF. This module bridges the two with the `gguf`
package: `gguf.quants.dequantize` for every tensor type it knows, gguf's own tensor name
maps for names, and the inverse of llama.cpp's Q/K row permutation for llama-arch files,
so the result equals what transformers itself loads from the same file.

Not imported by `atom_core/__init__.py`: the core imports without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, Keys, MODEL_TENSOR
from safetensors.torch import save_file

__all__ = ["SUPPORTED_ARCHITECTURES", "gguf_to_hf_folder", "load_gguf"]


@dataclass(frozen=True)
class _Arch:
    model_type: str  # transformers' model_type
    hf_class: str  # transformers' class, written to config.json "architectures"
    # llama.cpp's converter reorders Q/K rows of llama-arch models for its rope layout
    # (LlamaModel.permute); qwen2/qwen3 are converted without it (Qwen2Model/Qwen3Model).
    permuted_qk: bool


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a GGUF file as (HF config dict, HF state dict), dequantized to `dtype`.

    The config is what transformers writes to config.json for the architecture; the state
    dict uses transformers' tensor names and layout, so `model.load_state_dict(state)`
    works on a transformers model built from that config. Tied embeddings (no
    `output.weight` in the file) give no `lm_head.weight`.
    """
    reader = gguf.GGUFReader(path)
    return _load(reader, dtype)


def gguf_to_hf_folder(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a GGUF model as a Hugging Face folder at `out_dir` and return its path.

    Writes config.json, model.safetensors, generation_config.json and the tokenizer
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Weights are float32,
    except float16/bfloat16 when every matrix in the file is stored that way (then the
    narrower type loses nothing). Everything is written into a hidden sibling folder that
    is renamed to `out_dir` at the end, so a crash never leaves a half-written `out_dir`.
    Raises FileExistsError if `out_dir` already exists and is not empty.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    reader = gguf.GGUFReader(gguf_path)
    dtype = _storage_dtype(reader)
    config, state = _load(reader, dtype)

    # Hidden and unique: never mistaken for the finished folder, never shared by two writers.
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # unlike tempfile.mkdtemp, keeps the umask's permissions for a shared cache
    try:
        _write_json(tmp / "config.json", config)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)  # written 0600
        del state
        _write_json(tmp / "generation_config.json", _generation_config(reader, config))
        _save_tokenizer(gguf_path, reader, config, tmp)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces only an empty directory
        except OSError as exc:
            raise FileExistsError(f"{out_dir} appeared while converting {gguf_path.name}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --- reading -------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stores (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _architecture(reader: gguf.GGUFReader) -> tuple[str, _Arch]:
    name = _field(reader, Keys.General.ARCHITECTURE)
    if name not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return name, _ARCHS[name]


def _build_config(reader: gguf.GGUFReader, dtype: torch.dtype) -> dict:
    """The HF config for the file's hyperparameters, as transformers would write it."""
    name, arch = _architecture(reader)

    def key(template: str, default: Any = None, required: bool = False) -> Any:
        value = _field(reader, template.format(arch=name), default)
        if required and value is None:
            raise ValueError(f"GGUF file lacks {template.format(arch=name)!r}")
        if isinstance(value, list):
            raise ValueError(f"per-layer {template.format(arch=name)!r} is not supported")
        return value

    tensor_names = {t.name for t in reader.tensors}
    if gguf.TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight" in tensor_names:
        # llama3-style rope scaling: GGUF keeps only the resulting per-dimension factors, not
        # the rope_scaling parameters an HF config needs.
        raise ValueError(f"{name!r} GGUF with rope_freqs (llama3-style rope scaling) is not supported")

    hidden = int(key(Keys.LLM.EMBEDDING_LENGTH, required=True))
    heads = int(key(Keys.Attention.HEAD_COUNT, required=True))
    kv_heads = int(key(Keys.Attention.HEAD_COUNT_KV, heads))
    head_dim = int(key(Keys.Attention.KEY_LENGTH, hidden // heads))
    if int(key(Keys.Attention.VALUE_LENGTH, head_dim)) != head_dim:
        raise ValueError(f"{name!r} GGUF with key_length != value_length is not supported")
    if int(key(Keys.Rope.DIMENSION_COUNT, head_dim)) != head_dim:
        raise ValueError(f"{name!r} GGUF with partial rotary embeddings is not supported")
    vocab = key(Keys.LLM.VOCAB_SIZE)
    if vocab is None:
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embd.shape[-1])  # GGUF shapes are innermost-first: [hidden, vocab]
    theta = _f32(key(Keys.Rope.FREQ_BASE, 10000.0))

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = key(Keys.Rope.SCALING_TYPE)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"{name!r} GGUF with rope scaling {scaling!r} is not supported")
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": _f32(key(Keys.Rope.SCALING_FACTOR, 1.0))}

    def token_id(k: str) -> int | None:
        value = _field(reader, k)
        return None if value is None else int(value)

    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key(Keys.LLM.FEED_FORWARD_LENGTH, required=True)),
        "num_hidden_layers": int(key(Keys.LLM.BLOCK_COUNT, required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key(Keys.LLM.CONTEXT_LENGTH, 2048)),
        "rms_norm_eps": _f32(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "rope_theta": theta,
        "rope_parameters": rope,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": token_id(Keys.Tokenizer.BOS_ID),
        "eos_token_id": token_id(Keys.Tokenizer.EOS_ID),
        "pad_token_id": token_id(Keys.Tokenizer.PAD_ID),
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch.model_type == "qwen3":
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def _hf_names(gguf_arch_name: str, config: dict) -> dict[str, tuple[str, MODEL_TENSOR]]:
    """GGUF tensor name -> (HF tensor name, tensor kind), from gguf's own name map.

    gguf's TensorNameMap knows many HF spellings per GGUF tensor; the HF model class on the
    meta device (no memory) says which ones this architecture really uses.
    """
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch_name)
    name_map = gguf.get_tensor_name_map(gguf_arch, config["num_hidden_layers"])
    names: dict[str, tuple[str, MODEL_TENSOR]] = {}
    for hf_name in model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        found = name_map.get_type_and_name(module)
        if found is None:
            raise ValueError(f"gguf's name map has no GGUF name for {hf_name!r}")
        kind, gguf_name = found
        names[f"{gguf_name}.{suffix}"] = (hf_name, kind)
    return names


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 array in numpy (row-major, outermost-first) order."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        if qtype == GGMLQuantizationType.F64:
            array = np.asarray(tensor.data, dtype=np.float32)
        else:
            array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(
            f"tensor {tensor.name!r} has type {qtype.name}, which gguf {_gguf_version()} cannot dequantize"
        ) from exc
    array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    return array if array.flags.writeable else array.copy()


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # pragma: no cover - only decorates an error message
        return "(unknown version)"


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of Q/K rows (weights or biases).

    llama.cpp views each head's rows as (2, head_dim/2) halves and interleaves them to
    (head_dim/2, 2); swapping those axes back restores transformers' row order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _load(reader: gguf.GGUFReader, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    name, arch = _architecture(reader)
    config = _build_config(reader, dtype)
    names = _hf_names(name, config)

    state: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for tensor in reader.tensors:
        if tensor.name not in names:
            unknown.append(tensor.name)
            continue
        hf_name, kind = names[tensor.name]
        weight = torch.from_numpy(_dequantize(tensor))
        if arch.permuted_qk and kind == MODEL_TENSOR.ATTN_Q:
            weight = _unpermute(weight, config["num_attention_heads"])
        elif arch.permuted_qk and kind == MODEL_TENSOR.ATTN_K:
            weight = _unpermute(weight, config["num_key_value_heads"])
        state[hf_name] = weight.to(dtype).contiguous()
    if unknown:
        raise ValueError(f"GGUF tensors with no {config['architectures'][0]} counterpart: {unknown[:8]}")

    expected = {hf for hf, _ in names.values()}
    if config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
    if missing := sorted(expected - state.keys()):
        raise ValueError(f"GGUF file lacks tensors for: {missing[:8]}")
    return config, state


def _storage_dtype(reader: gguf.GGUFReader) -> torch.dtype:
    """float16/bfloat16 if every matrix is stored that way, else float32 (quantized sources)."""
    types = {GGMLQuantizationType(t.tensor_type) for t in reader.tensors if len(t.shape) >= 2}
    if types == {GGMLQuantizationType.F16}:
        return torch.float16
    if types == {GGMLQuantizationType.BF16}:
        return torch.bfloat16
    return torch.float32


# --- writing -------------------------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _generation_config(reader: gguf.GGUFReader, config: dict) -> dict:
    """bos/eos/pad from the file; end-of-turn/-message tokens also stop generation."""
    eos = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    for key in (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        value = _field(reader, key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if config["pad_token_id"] is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


def _save_tokenizer(gguf_path: Path, reader: gguf.GGUFReader, config: dict, out_dir: Path) -> None:
    """transformers' own GGUF tokenizer conversion, with the chat template checked on disk."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config["max_position_embeddings"]
    template = _field(reader, Keys.Tokenizer.CHAT_TEMPLATE)
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    if template is not None:
        saved = [out_dir / "chat_template.jinja", out_dir / "tokenizer_config.json"]
        on_disk = (p.read_text() for p in saved if p.exists())
        if not any(template in text or json.dumps(template) in text for text in on_disk):
            raise RuntimeError(f"the chat template of {gguf_path.name} was lost when saving the tokenizer")
