"""The quantized blocks of a converted GGUF file, kept on disk beside the converted
checkpoint so a model loads its 4- and 8-bit weights as the file has them.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from atom_core.layers.quantized_weight import QuantizedWeight
from atom_core.loading.gguf import GGUF_BLOCKS_FILE
from atom_core.loading.gguf.reader import _describe, _unpermute

_BLOCKS_FORMAT = "atom-gguf-blocks/1"


def save_blocks(weights: dict[str, tuple[str, QuantizedWeight | None]], path: str | Path, source: str) -> None:
    """Write `name -> (GGUF type, weight or None)` as safetensors: `{name}.qweight` (4-bit values
    two to a byte, low nibble first, or int8), `{name}.scales`, `{name}.zeros`; every name's
    type goes into the metadata, with or without a weight."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, (_, qw) in weights.items():
        if qw is None:
            continue
        q = qw.qweight
        tensors[f"{name}.qweight"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if qw.bits == 4 else q.contiguous()
        tensors[f"{name}.scales"] = qw.scales.contiguous()
        if qw.zeros is not None:
            tensors[f"{name}.zeros"] = qw.zeros.contiguous()
    types = {name: gguf_type for name, (gguf_type, _) in weights.items()}
    metadata = {"format": _BLOCKS_FORMAT, "source": source, "gguf_types": json.dumps(types)}
    save_file(tensors, str(path), metadata=metadata)


def load_blocks(path: str | Path) -> tuple[str, dict[str, tuple[str, QuantizedWeight | None]]]:
    """What `save_blocks` wrote: (source file name, name -> (GGUF type, weight or None))."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != _BLOCKS_FORMAT:
            raise ValueError(f"{path} is not a {_BLOCKS_FORMAT} file (format {metadata.get('format')!r})")
        out: dict[str, tuple[str, QuantizedWeight | None]] = {}
        keys = set(f.keys())
        for name, gguf_type in json.loads(metadata["gguf_types"]).items():
            if f"{name}.qweight" not in keys:
                out[name] = (gguf_type, None)
                continue
            # Copies, not views of the file's mapping: a weight kept as it is (a tied Q8_0
            # embedding) would otherwise keep the whole file mapped and resident (76 MiB of
            # the default model's 106 MiB file, beside the packed copies the kernels use).
            q, scales = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales").clone()
            zeros = f.get_tensor(f"{name}.zeros").clone() if f"{name}.zeros" in keys else None
            if q.dtype == torch.uint8:  # 4 bits, two to a byte
                q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)
            else:
                q = q.clone()
            group = q.shape[1] // scales.shape[1]
            out[name] = (gguf_type, QuantizedWeight(4 if zeros is not None else 8, group, q, scales, zeros, gguf_type))
    return metadata.get("source", Path(path).name), out


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
            heads = target.heads
            qw = qw.map_rows(lambda t: _unpermute(t, heads).contiguous())
        for hf_name, part in _expert_blocks(target.hf_name, qw, int(tensor.shape[-1]) if len(tensor.shape) > 2 else 1):
            weights[hf_name] = (gguf_type, part)
    path = folder / GGUF_BLOCKS_FILE
    tmp = folder / f".{GGUF_BLOCKS_FILE}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_blocks(weights, tmp, source=source)
        os.chmod(tmp, (folder / "config.json").stat().st_mode & 0o777)  # written 0600, like the weights
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _expert_blocks(
    hf_name: str, qw: QuantizedWeight | None, experts: int
) -> Iterator[tuple[str, QuantizedWeight | None]]:
    """`_per_expert` for blocks: a stack's row blocks, one per expert."""
    if "{xid}" not in hf_name:
        yield hf_name, qw
        return
    rows = qw.shape[0] // experts if qw is not None else 0
    for xid in range(experts):
        a = xid * rows
        part = None if qw is None else qw.map_rows(lambda t: t[a : a + rows].contiguous())
        yield hf_name.format(xid=xid), part
