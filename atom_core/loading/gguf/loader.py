"""Turn a GGUF file (llama.cpp's format) into Hugging Face-format weights and config.

Atom's models read Hugging Face folders (config.json + model.safetensors + tokenizer), and
small models are easiest to ship as GGUF. This module bridges the two with the `gguf`
package: `gguf.quants.dequantize` for every tensor type it knows, gguf's own tensor kinds
and names for the file's side, so the result equals what transformers itself loads from
the same file. What is particular to one architecture (its config keys, its tensor names,
the tensors llama.cpp permutes, stacks or splits) is not here: the model plugin that runs
it registers a `GGUFArchitecture` (atom_core/gguf_arch.py) under the file's
`general.architecture` name, through the `atom_register_gguf_architectures` hook.

Not imported by `atom_core/__init__.py`: the core imports without torch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, Keys, MODEL_TENSOR
from safetensors.torch import save_file

from atom_core.loading.gguf.architecture import GGUFArchitecture, GGUFFile, Joined
from atom_core.layers.quant import QuantizedWeight, save_blocks
from atom_core.loading.checkpoint import GGUF_BLOCKS_FILE

__all__ = ["gguf_to_hf_folder", "load_gguf", "supported_architectures", "write_gguf_blocks"]


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


def gguf_to_hf_folder(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a GGUF model as a Hugging Face folder at `out_dir` and return its path.

    Writes config.json, model.safetensors, generation_config.json and the tokenizer
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Weights are float32,
    except float16/bfloat16 when every matrix in the file is stored that way (then the
    narrower type loses nothing); the quantized blocks go to `GGUF_BLOCKS_FILE` as well.
    Everything is written into a hidden sibling folder that is renamed to `out_dir` at the
    end, so a crash never leaves a half-written `out_dir`.
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
        _write_blocks(reader, gguf_path.name, tmp)  # what `quantization="auto"` loads
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


# The per-dimension rope factors of llama3-style scaling: read into the config, not a weight.
ROPE_FREQS_TENSOR = gguf.TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"


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
    if file.has(MODEL_TENSOR.ROPE_FREQS):
        # llama3-style rope scaling (Llama 3.1 / 3.2): the file keeps the per-dimension factors
        # the rope frequencies are divided by, not the HF rope_scaling parameters they came
        # from; Atom's rotary embedding divides by them as llama.cpp does (`rotary.get_rope`).
        freqs = next(t for t in file.reader.tensors if t.name == ROPE_FREQS_TENSOR)
        config["rope_freq_factors"] = [float(v) for v in _dequantize(freqs).reshape(-1)]
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
        template = entry.get(suffix) if isinstance(entry, Mapping) else f"{entry}.{suffix}"
        if template is None:
            continue
        heads = int(config[arch.permuted_rows[kind]]) if kind in arch.permuted_rows else None
        plan[name] = _Target(template.format(bid=bid, xid="{xid}"), kind, heads)
    return plan


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


def _per_expert(hf_name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for a plain tensor; one per expert for a stack (a name with `{xid}`)."""
    if "{xid}" not in hf_name:
        yield hf_name, stacked
        return
    for xid in range(stacked.shape[0]):
        yield hf_name.format(xid=xid), stacked[xid].clone()  # its own storage, for safetensors


def _load(reader: gguf.GGUFReader, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    arch, config, plan = _describe(reader, dtype)
    if unknown := [t.name for t in reader.tensors if t.name not in plan and t.name != ROPE_FREQS_TENSOR]:
        raise ValueError(f"GGUF tensors with no {config['architectures'][0]} counterpart: {unknown[:8]}")

    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[MODEL_TENSOR, torch.Tensor]] = {}  # joined tensors still waiting for a part

    def put(hf_name: str, weight: torch.Tensor) -> None:
        if hf_name in state:
            raise ValueError(f"two GGUF tensors map to {hf_name!r}")
        state[hf_name] = weight.to(dtype).contiguous()

    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:  # in the config (`rope_freq_factors`)
            continue
        target = plan[tensor.name]
        weight = torch.from_numpy(_dequantize(tensor))
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


# Block layouts (ggml-common.h): an fp16 scale d (and min m for Q4_1), then the values.
# Q4_0/Q4_1/Q5_0 keep element j of a block of 32 in the low nibble of byte j, element j + 16
# in its high nibble (Q5_0: the fifth bits in a uint32 ahead of them). Q4_K: super-blocks of
# 256, eight groups of 32 with 6-bit scales and mins; each 32 bytes of nibbles hold two groups.
_BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: (32, 18), GGMLQuantizationType.Q4_1: (32, 20), GGMLQuantizationType.Q8_0: (32, 34),
    GGMLQuantizationType.Q5_0: (32, 22), GGMLQuantizationType.Q4_K: (256, 144),
}  # fmt: skip


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _quantized_weight(tensor: Any) -> QuantizedWeight | None:
    """The tensor's blocks as a `QuantizedWeight` in groups of 32 for Q4_0, Q4_1, Q4_K (4 bits)
    and Q8_0, Q5_0 (8 bits); else None. The integers exactly; scales and zeros in float32,
    exact but for Q4_K's (d * scale) and (8 d scale - dmin * min), rounded once where their
    bits exceed float32's 24.

    A stack of matrices (a layer's experts, [experts, rows, K]) comes as one [experts * rows, K]
    weight, whose row blocks are the experts."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in _BLOCK_BYTES or len(tensor.shape) < 2:
        return None
    k, n = int(tensor.shape[0]), math.prod(int(d) for d in tensor.shape[1:])  # innermost first
    block, nbytes = _BLOCK_BYTES[qtype]
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // block, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantizedWeight(8, 32, torch.from_numpy(q), torch.from_numpy(d), None, qtype.name)
    if qtype == GGMLQuantizationType.Q5_0:  # d * (q5 - 16): 8 bits, symmetric
        high = blocks[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
        q5 = _nibbles(blocks[..., 6:]) | ((high & 1).astype(np.uint8) << 4)
        q = (q5.astype(np.int8) - 16).reshape(n, k)
        return QuantizedWeight(8, 32, torch.from_numpy(q), torch.from_numpy(d), None, qtype.name)
    if qtype == GGMLQuantizationType.Q4_K:  # group g: d * sc_g * q - dmin * m_g
        dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        scales = d[..., None] * sc.reshape(n, k // 256, 8).astype(np.float32)
        zeros = 8 * scales - dmin[..., None] * mn.reshape(n, k // 256, 8).astype(np.float32)
        qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)  # 32 bytes: groups 2j (low nibbles) and 2j + 1
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
        return QuantizedWeight(
            4, 32, torch.from_numpy(q), torch.from_numpy(scales.reshape(n, -1)),
            torch.from_numpy(zeros.reshape(n, -1)), qtype.name,
        )  # fmt: skip
    if qtype == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d  # d * q + m == (q - 8) * d + (m + 8 * d), exact in float32
        packed = blocks[..., 4:]
    else:
        zeros = np.zeros_like(d)  # d * (q - 8)
        packed = blocks[..., 2:]
    q = _nibbles(packed).reshape(n, k)
    return QuantizedWeight(4, 32, torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros), qtype.name)


def write_gguf_blocks(gguf_path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Save the GGUF file's quantized blocks next to its converted weights (`GGUF_BLOCKS_FILE`).

    Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0 matrices are stored as `quant.save_blocks` lays them out, with
    llama.cpp's Q/K row permutation undone as `load_gguf` does; every matrix's GGUF type is
    recorded, so `quantization="auto"` knows which others to requantize. Written to a
    temporary name and renamed, so a reader never sees half a file.
    """
    return _write_blocks(gguf.GGUFReader(gguf_path), Path(gguf_path).name, Path(folder))


def _write_blocks(reader: gguf.GGUFReader, source: str, folder: Path) -> Path:
    _, config, plan = _describe(reader, torch.float32)
    weights: dict[str, tuple[str, QuantizedWeight | None]] = {}
    for tensor in reader.tensors:
        target = plan.get(tensor.name)
        if target is None or len(tensor.shape) < 2:
            continue
        gguf_type = GGMLQuantizationType(tensor.tensor_type).name
        if target.joined is not None:  # rebuilt from float parts: its type only, the first part's
            weights.setdefault(target.hf_name, (gguf_type, None))
            continue
        qw = _quantized_weight(tensor)
        if qw is not None and target.heads is not None:
            qw = qw.map_rows(lambda t, h=target.heads: _unpermute(t, h).contiguous())
        for hf_name, part in _expert_blocks(target.hf_name, qw, int(tensor.shape[-1]) if len(tensor.shape) > 2 else 1):
            weights[hf_name] = (gguf_type, part)
    target = folder / GGUF_BLOCKS_FILE
    tmp = folder / f".{GGUF_BLOCKS_FILE}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_blocks(weights, tmp, source=source)
        os.chmod(tmp, (folder / "config.json").stat().st_mode & 0o777)  # written 0600, like the weights
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _expert_blocks(
    hf_name: str, qw: QuantizedWeight | None, experts: int
) -> Iterator[tuple[str, QuantizedWeight | None]]:
    """`_per_expert` for blocks: a stack's row blocks, one per expert."""
    if "{xid}" not in hf_name:
        yield hf_name, qw
        return
    rows = qw.shape[0] // experts if qw is not None else 0
    for xid in range(experts):
        part = None if qw is None else qw.map_rows(lambda t, a=xid * rows: t[a : a + rows].contiguous())
        yield hf_name.format(xid=xid), part


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
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError:
        # transformers reads the tokenizer of any GGUF file, but picks its class from a config it
        # rebuilds only for the architectures it knows (not deepseek2): the generic class then.
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
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
