"""How a model plugin describes one GGUF architecture to `atom_core.loading.gguf.reader`.

llama.cpp's converter writes every architecture its own way: which metadata keys hold the
hyperparameters, what each tensor is called, which tensors it permutes, stacks or splits.
The plugin that runs an architecture knows this, so it says it, with a `GGUFArchitecture`
registered under the file's `general.architecture` name through the
`atom_register_gguf_architectures` hook. The loader keeps the generic part: reading,
dequantizing, the quantized blocks, writing the Hugging Face folder.

Imports gguf (and numpy), not torch: a description module may, for its `Joined.join`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType

__all__ = ["GGUFArchitecture", "GGUFFile", "Joined", "moe_tensors"]


def dequantize_tensor(tensor: Any) -> np.ndarray:
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


class GGUFFile:
    """What a description reads from a GGUF file: its metadata and which tensors it holds."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader
        self.architecture: str = str(self._field(gguf.Keys.General.ARCHITECTURE))
        self.tensor_names: frozenset[str] = frozenset(t.name for t in reader.tensors)

    def _field(self, key: str, default: Any = None) -> Any:
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """The value of metadata `key`, where "{arch}" (as in `gguf.Keys` templates) stands
        for this file's architecture; `default` if absent (a ValueError if `required`).
        Per-layer arrays (a different value for each layer) are refused."""
        name = key.format(arch=self.architecture)
        value = self._field(name, default)
        if required and value is None:
            raise ValueError(f"{self.architecture!r} GGUF file lacks {name!r}")
        if isinstance(value, list) and not name.startswith("tokenizer."):
            raise ValueError(f"{self.architecture!r} GGUF file: per-layer {name!r} is not supported")
        return value

    @property
    def block_count(self) -> int:
        return int(self.get(gguf.Keys.LLM.BLOCK_COUNT, required=True))

    def has(self, kind: MODEL_TENSOR, bid: int | None = None, suffix: str = "weight") -> bool:
        """Whether the file holds tensor `kind` (of layer `bid`), e.g. `has(ATTN_Q, 0, "bias")`."""
        return f"{gguf.TENSOR_NAMES[kind].format(bid=bid)}.{suffix}" in self.tensor_names

    def layers_with(self, kind: MODEL_TENSOR, suffix: str = "weight") -> list[int]:
        """The layers holding tensor `kind` (the MoE layers: `layers_with(FFN_GATE_INP)`)."""
        return [b for b in range(self.block_count) if self.has(kind, b, suffix)]

    def values(self, kind: MODEL_TENSOR) -> list[float] | None:
        """The values of a small per-model tensor that belongs in the config (rope factors),
        or None where the file has none."""
        name = f"{gguf.TENSOR_NAMES[kind]}.weight"
        tensor = next((t for t in self.reader.tensors if t.name == name), None)
        if tensor is None:
            return None
        return [float(v) for v in dequantize_tensor(tensor).reshape(-1)]


@dataclass(frozen=True)
class Joined:
    """One Hugging Face tensor that llama.cpp wrote as several tensors of one layer
    (DeepSeek's `kv_b_proj` as `attn_k_b` and `attn_v_b`).

    `join(config, *parts)` gets the parts as float torch tensors in `parts` order, shaped as
    the GGUF file says (outermost dimension first), and returns the HF tensor. No quantized
    blocks are kept for a joined tensor; `quantization="auto"` requantizes it if anything.
    """

    parts: tuple[MODEL_TENSOR, ...]
    join: Callable[..., Any]


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF file of one architecture becomes a Hugging Face checkpoint.

    - `config(file, common) -> dict`: the HF config (config.json). `common` holds what every
      decoder reads alike (vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
      intermediate_size when present, max_position_embeddings, rms_norm_eps, rope, token ids,
      tie_word_embeddings, hidden_act); the description adds `architectures`, `model_type`
      and the rest (attention shape, experts, ...), and may override any of it.
    - `tensors`: GGUF tensor kind -> HF name without its ".weight"/".bias", with `{bid}` for
      the layer and `{xid}` for the expert of a stacked expert tensor (llama.cpp stores a
      layer's experts as one 3-D tensor, `ffn_gate_exps`; it is split into one HF tensor per
      expert, as checkpoints on the hub name them). A mapping {suffix: full HF name} instead
      names tensors whose HF name does not end in their GGUF suffix.
    - `permuted_rows`: kind -> the config key holding its head count, for the tensors
      llama.cpp reorders for its rope (`LlamaModel.permute`: Q and K of llama-arch files);
      the loader undoes it, on float weights and on quantized blocks alike.
    - `joined`: HF tensor name (with `{bid}`) -> `Joined`, for tensors llama.cpp split.
    - `select(file)`: another description for this file, or None for this one; for a GGUF
      architecture that stands for several HF ones (llama.cpp writes Mixtral as "llama").
    - `config_tensors`: tensors that `config` reads into the config (`GGUFFile.values`),
      not weights: Phi-3's LongRoPE factors. Llama 3's `rope_freqs` is read for every file.
    """

    config: Callable[[GGUFFile, dict], dict]
    tensors: Mapping[MODEL_TENSOR, str | Mapping[str, str]]
    permuted_rows: Mapping[MODEL_TENSOR, str] = field(default_factory=dict)
    joined: Mapping[str, Joined] = field(default_factory=dict)
    select: Callable[[GGUFFile], GGUFArchitecture | None] | None = None
    config_tensors: frozenset[MODEL_TENSOR] = frozenset()

    def for_file(self, file: GGUFFile) -> GGUFArchitecture:
        chosen = self.select(file) if self.select is not None else None
        return self if chosen is None else chosen.for_file(file)


def moe_tensors(block: str, expert_names: Mapping[str, str]) -> dict[MODEL_TENSOR, str]:
    """The router and the per-expert tensors of a MoE block at `model.layers.{bid}.<block>`,
    as the hub names them: `expert_names` maps the hub's per-expert tensor names to "gate",
    "up" and "down" (what `FusedMoE.checkpoint_mapping` takes)."""
    hub = {shard: name for name, shard in expert_names.items()}
    prefix = f"model.layers.{{bid}}.{block}"
    return {
        MODEL_TENSOR.FFN_GATE_INP: f"{prefix}.gate",
        MODEL_TENSOR.FFN_GATE_EXP: f"{prefix}.experts.{{xid}}.{hub['gate']}",
        MODEL_TENSOR.FFN_UP_EXP: f"{prefix}.experts.{{xid}}.{hub['up']}",
        MODEL_TENSOR.FFN_DOWN_EXP: f"{prefix}.experts.{{xid}}.{hub['down']}",
    }
