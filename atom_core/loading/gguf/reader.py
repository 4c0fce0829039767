"""Read a GGUF file (llama.cpp's format) as Hugging Face-format weights and config.

Atom's models read Hugging Face folders (config.json + model.safetensors + tokenizer), and
small models are easiest to ship as GGUF. This module bridges the two with the `gguf`
package: `gguf.quants.dequantize` for every tensor type it knows, gguf's own tensor kinds
and names for the file's side, so the result equals what transformers itself loads from
the same file. What is particular to one architecture (its config keys, its tensor names,
the tensors llama.cpp permutes, stacks or splits) is not here: the model plugin that runs
it registers a `GGUFArchitecture` (`architecture.py`) under the file's
`general.architecture` name, through the `atom_register_gguf_architectures` hook.

Not imported by `atom_core/__init__.py`: the core imports without torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import MODEL_TENSOR, Keys

from atom_core.loading.gguf.architecture import GGUFArchitecture, GGUFFile, Joined, dequantize_tensor

__all__ = ["load_gguf", "supported_architectures"]


def supported_architectures() -> list[str]:
    """The GGUF architectures (`general.architecture` names) the installed plugins describe."""
    from atom_core.plugins.manager import get_registry

    return get_registry("gguf_architectures").names()


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a GGUF file as (HF config dict, HF state dict), dequantized to `dtype`.

    The config is what transformers writes to config.json for the architecture; the state
    dict uses the tensor names and layout of checkpoints on the hub (one tensor per expert),
    so `model.load_state_dict(state)` works on a transformers model of a dense architecture
    built from that config. Tied embeddings (no `output.weight` in the file) give no
    `lm_head.weight`.
    """
    reader = gguf.GGUFReader(path)
    return _load(reader, dtype)


# --- reading -------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stores (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _architecture(file: GGUFFile) -> GGUFArchitecture:
    """The registered description of the file's architecture (a ValueError naming the known ones if none)."""
    from atom_core.plugins.manager import get_registry
    from atom_core.plugins.registry import RegistryError

    try:
        description = get_registry("gguf_architectures").get(file.architecture)
    except RegistryError as exc:
        raise ValueError(f"cannot read this GGUF file: {exc}") from None
    if not isinstance(description, GGUFArchitecture):
        raise TypeError(
            f"GGUF architecture {file.architecture!r} is registered as {description!r}, "
            "not an atom_core.loading.gguf.architecture.GGUFArchitecture"
        )
    return description.for_file(file)


def _config_tensor_names(arch: GGUFArchitecture) -> set[str]:
    """The tensors read into the config, not weights: llama3-style scaling's per-dimension
    rope factors in every file, and those the description names."""
    return {f"{gguf.TENSOR_NAMES[kind]}.weight" for kind in {MODEL_TENSOR.ROPE_FREQS, *arch.config_tensors}}


def _common_config(file: GGUFFile) -> dict:
    """What every decoder's HF config reads alike; the architecture's description does the rest."""
    name = file.architecture

    vocab = file.get(Keys.LLM.VOCAB_SIZE)
    if vocab is None:
        embd = gguf.TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight"
        # GGUF shapes are innermost-first: [hidden, vocab]
        vocab = int(next(t for t in file.reader.tensors if t.name == embd).shape[-1])
    theta = _f32(file.get(Keys.Rope.FREQ_BASE, 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = file.get(Keys.Rope.SCALING_TYPE)
    if scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": _f32(file.get(Keys.Rope.SCALING_FACTOR, 1.0))}
    elif scaling == "yarn":  # what the keys say; a description refuses it or adds its family's parameters
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": _f32(file.get(Keys.Rope.SCALING_FACTOR, required=True)),
            "original_max_position_embeddings": int(file.get(Keys.Rope.SCALING_ORIG_CTX_LEN, required=True)),
        }
        betas = {Keys.Rope.SCALING_YARN_BETA_FAST: "beta_fast", Keys.Rope.SCALING_YARN_BETA_SLOW: "beta_slow"}
        rope |= {hf_key: _f32(file.get(key)) for key, hf_key in betas.items() if file.get(key) is not None}
        for key in (Keys.Rope.SCALING_YARN_EXT_FACTOR, Keys.Rope.SCALING_YARN_ATTN_FACTOR):
            if file.get(key) is not None:  # llama.cpp's meaning differs from transformers' attention_factor
                raise ValueError(f"{name!r} GGUF with {key.format(arch=name)!r} is not supported")
    elif scaling not in (None, "none"):
        raise ValueError(f"{name!r} GGUF with rope scaling {scaling!r} is not supported")

    def token_id(key: str) -> int | None:
        value = file.get(key)
        return None if value is None else int(value)

    config: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": int(file.get(Keys.LLM.EMBEDDING_LENGTH, required=True)),
        "num_hidden_layers": file.block_count,
        "num_attention_heads": int(file.get(Keys.Attention.HEAD_COUNT, required=True)),
        "hidden_act": "silu",
        "max_position_embeddings": int(file.get(Keys.LLM.CONTEXT_LENGTH, 2048)),
        "rms_norm_eps": _f32(file.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "rope_theta": theta,
        "rope_parameters": rope,
        "tie_word_embeddings": not file.has(MODEL_TENSOR.OUTPUT),
        "bos_token_id": token_id(Keys.Tokenizer.BOS_ID),
        "eos_token_id": token_id(Keys.Tokenizer.EOS_ID),
        "pad_token_id": token_id(Keys.Tokenizer.PAD_ID),
        "use_cache": True,
    }
    if (ffn := file.get(Keys.LLM.FEED_FORWARD_LENGTH)) is not None:
        config["intermediate_size"] = int(ffn)
    if (factors := file.values(MODEL_TENSOR.ROPE_FREQS)) is not None:
        # llama3-style rope scaling (Llama 3.1 / 3.2): the file keeps the per-dimension factors
        # the rope frequencies are divided by, not the HF rope_scaling parameters they came
        # from; Atom's rotary embedding divides by them as llama.cpp does (`rotary.get_rope`).
        config["rope_freq_factors"] = factors
    return config


def _describe(reader: gguf.GGUFReader, dtype: torch.dtype) -> tuple[GGUFArchitecture, dict, dict[str, _Target]]:
    """The file's architecture description, its HF config and where each of its tensors goes."""
    file = GGUFFile(reader)
    arch = _architecture(file)
    config = arch.config(file, _common_config(file))
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return arch, config, _plan(file, arch, config)


@dataclass(frozen=True)
class _Target:
    """Where one GGUF tensor goes: an HF name (with `{xid}` if it stacks experts), the head
    count of llama.cpp's rope permutation to undo, or the `Joined` tensor it is part of."""

    hf_name: str
    kind: MODEL_TENSOR
    heads: int | None = None
    joined: Joined | None = None


def _plan(file: GGUFFile, arch: GGUFArchitecture, config: dict) -> dict[str, _Target]:
    """GGUF tensor name -> `_Target`, for the tensors the description names (others are unknown)."""
    joined = {kind: (name, j) for name, j in arch.joined.items() for kind in j.parts}
    if both := set(joined) & set(arch.tensors):
        both_names = sorted(k.name for k in both)
        raise ValueError(f"GGUF architecture {file.architecture!r}: {both_names} are both named and joined")
    kinds: dict[str, tuple[MODEL_TENSOR, int | None]] = {}  # GGUF name without suffix -> (kind, layer)
    for kind in [*arch.tensors, *joined]:
        template = gguf.TENSOR_NAMES[kind]
        for bid in range(file.block_count) if "{bid}" in template else [None]:
            kinds[template.format(bid=bid)] = (kind, bid)

    plan: dict[str, _Target] = {}
    for name in file.tensor_names:
        base, _, suffix = name.rpartition(".")
        if base not in kinds:
            continue
        kind, bid = kinds[base]
        if kind in joined:
            if suffix == "weight":
                plan[name] = _Target(joined[kind][0].format(bid=bid), kind, joined=joined[kind][1])
            continue
        entry = arch.tensors[kind]
        hf_template = entry.get(suffix) if isinstance(entry, Mapping) else f"{entry}.{suffix}"
        if hf_template is None:
            continue
        heads = int(config[arch.permuted_rows[kind]]) if kind in arch.permuted_rows else None
        plan[name] = _Target(hf_template.format(bid=bid, xid="{xid}"), kind, heads)
    return plan


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of Q/K rows (weights or biases).

    llama.cpp views each head's rows as (2, head_dim/2) halves and interleaves them to
    (head_dim/2, 2); swapping those axes back restores transformers' row order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _per_expert(hf_name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for a plain tensor; one per expert for a stack (a name with `{xid}`)."""
    if "{xid}" not in hf_name:
        yield hf_name, stacked
        return
    for xid in range(stacked.shape[0]):
        yield hf_name.format(xid=xid), stacked[xid].clone()  # its own storage, for safetensors


def _load(reader: gguf.GGUFReader, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    arch, config, plan = _describe(reader, dtype)
    in_config = _config_tensor_names(arch)
    if unknown := [t.name for t in reader.tensors if t.name not in plan and t.name not in in_config]:
        raise ValueError(f"GGUF tensors with no {config['architectures'][0]} counterpart: {unknown[:8]}")

    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[MODEL_TENSOR, torch.Tensor]] = {}  # joined tensors still waiting for a part

    def put(hf_name: str, weight: torch.Tensor) -> None:
        if hf_name in state:
            raise ValueError(f"two GGUF tensors map to {hf_name!r}")
        state[hf_name] = weight.to(dtype).contiguous()

    for tensor in reader.tensors:
        if tensor.name in in_config:
            continue
        target = plan[tensor.name]
        weight = torch.from_numpy(dequantize_tensor(tensor))
        if target.joined is not None:
            got = parts.setdefault(target.hf_name, {})
            got[target.kind] = weight
            if len(got) == len(target.joined.parts):
                put(target.hf_name, target.joined.join(config, *(got[k] for k in target.joined.parts)))
                del parts[target.hf_name]
            continue
        if target.heads is not None:
            weight = _unpermute(weight, target.heads)
        for hf_name, w in _per_expert(target.hf_name, weight):
            put(hf_name, w)
    if parts:
        raise ValueError(f"GGUF file lacks parts of {sorted(parts)[:8]}")
    _check_complete(config, state)
    return config, state


def _check_complete(config: dict, state: dict[str, torch.Tensor]) -> None:
    """The weights fill transformers' model of this config (counted on the meta device, so a
    missing tensor or a misread config shows here, not when a model loads the folder)."""
    if config["model_type"] not in transformers.CONFIG_MAPPING:
        return  # an architecture transformers does not know: its plugin's model checks at load
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    saved = model.state_dict()
    expected = sum(p.numel() for p in model.parameters())  # a tied head once
    expected += sum(b.numel() for n, b in model.named_buffers() if n in saved)
    found = sum(t.numel() for t in state.values())
    if found != expected:
        raise ValueError(
            f"the GGUF file holds {found:,} weights where {config['architectures'][0]} with the config read "
            f"from it has {expected:,}: tensors are missing, or the file's metadata was misread"
        )


# --- writing -------------------------------------------------------------------------------
