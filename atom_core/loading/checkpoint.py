"""Checkpoint tensors -> model parameters, driven by the model's `packed_modules_mapping`.

Adding a model never touches this file: a model names which checkpoint tensors fill
which fused parameter, and fused parameters carry a `weight_loader`. A model whose
names need more than substring replacement (per-expert tensors stacked into one
parameter) defines `map_checkpoint_name(name) -> (parameter name, shard) | None`,
consulted first; it returns `SKIP` for tensors the model does not use (a checkpoint's
MTP layer, which a draft model loads), so they are never read. A fused parameter expects
the shards in its `expected_shards` if it has them, else every shard of its owner's
`shard_offsets`. A parameter split across tensor-parallel ranks (`reads_slices`) gets a
`CheckpointSlice` through its `weight_loader`, which reads only its rank's part.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from atom_core.layers.checkpoint_slice import CheckpointSlice, materialize
from atom_core.loading.gguf import GGUF_BLOCKS_FILE

# What `map_checkpoint_name` returns for a tensor the model leaves unread.
SKIP = ("", "skip")

# Buffers some checkpoints carry that models recompute.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


# torch's random initializers, which `nn.Linear`, `nn.Embedding` and the like call as they are built.
RANDOM_INITS = (
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def zeros_for_random_init() -> Iterator[None]:
    """Build a model whose weights a checkpoint fills: torch's random initializers write zeros.

    `load_model_weights` refuses a model any parameter of which the checkpoint leaves unfilled,
    so the random values are never used, and drawing them was most of building a model, at
    every start (it grows with the parameter count). Zeros, not `torch.empty`'s leftovers: a
    part a loader leaves alone (a padding row) reads the same in every process. As
    transformers' `no_init_weights`, this swaps `torch.nn.init`'s functions for the duration."""
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    zeros = nn.init.zeros_
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: zeros(tensor))
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(p for p in folder.glob("*.safetensors") if p.name != GGUF_BLOCKS_FILE)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}; Atom loads safetensors checkpoints "
            "(or a .gguf file passed as the model)"
        )
    return files


def open_safetensors(path: Path) -> Any:
    """`safe_open` of a checkpoint file; ValueError naming it where it is not one (cut short)."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a safetensors file Atom can read (truncated or corrupt?): {e}") from None


def load_model_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter; missing or extra tensors are errors."""
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    mapper = getattr(model, "map_checkpoint_name", None)
    skipped = tuple(getattr(model, "skipped_checkpoint_suffixes", ())) + SKIPPED_SUFFIXES
    loaded: dict[int, set] = {}
    for path in safetensors_files(folder):
        with open_safetensors(path) as f:
            for name in f.keys():
                if name.endswith(skipped):
                    continue
                found = _target(name, mapping, mapper)
                if found is None:
                    continue
                target, shard = found
                param = params.get(target)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} ({path.name}) matches no parameter of {type(model).__name__}"
                    )
                # a split parameter reads only its rank's part
                tensor = (
                    CheckpointSlice(f.get_slice(name)) if getattr(param, "reads_slices", False) else f.get_tensor(name)
                )
                if shard is None and not hasattr(param, "weight_loader"):
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"parameter {target!r} expects {tuple(param.shape)}"
                        )
                    with torch.no_grad():
                        param.data.copy_(materialize(tensor))
                else:
                    try:
                        # set by the layer (MergedLinear, FusedMoE); torch's Parameter stubs do not declare it;
                        # a tensor fused on disk says which shards it filled
                        filled = param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                    except ValueError as e:
                        raise ValueError(f"checkpoint tensor {name!r} ({path.name}): {e}") from e
                    if filled:
                        loaded.setdefault(id(param), set()).update(filled)
                loaded.setdefault(id(param), set()).add(shard)
    missing = []
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        shards = loaded.get(id(param), set())
        owner = getattr(getattr(param, "weight_loader", None), "__self__", None)
        # a fused parameter expects its shards; a split one (tensor parallel) its one tensor
        fused = getattr(param, "expected_shards", None) or getattr(owner, "shard_offsets", None)
        expected = set(fused) if fused else {None}
        if not expected <= shards:
            missing.append(_missing_shards(name, expected - shards, mapping) if fused else name)
    if missing:
        raise ValueError(f"the checkpoint in {folder} lacks tensors for: {', '.join(missing)}")


def _missing_shards(name: str, shards: set, mapping: dict[str, tuple[str, str]]) -> str:
    """A fused parameter's missing shards, by the checkpoint names they load from where the
    model's `packed_modules_mapping` says (q/k/v, gate/up); else by shard."""
    names = [
        name.replace(f".{fused}.", f".{ckpt}.")
        for shard in sorted(shards, key=str)
        for ckpt, (fused, s) in mapping.items()
        if s == shard and f".{fused}." in name
    ]
    if len(names) == len(shards):
        return ", ".join(names)
    return f"{name} (shards {sorted(shards, key=str)})"


def _target(
    name: str, mapping: dict[str, tuple[str, str]], mapper: Callable[[str], tuple[str, object] | None] | None
) -> tuple[str, object] | None:
    mapped = mapper(name) if mapper is not None else None
    if mapped == SKIP:
        return None
    return mapped if mapped is not None else packed_target(name, mapping)


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, object] | None:
    """(parameter name, shard) a checkpoint tensor loads into, as `load_model_weights` maps it;
    None for a tensor the model skips. For loaders of other formats (GGUF's quantized blocks)."""
    return _target(name, getattr(model, "packed_modules_mapping", {}), getattr(model, "map_checkpoint_name", None))


def packed_target(name: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """(parameter name, shard) for a checkpoint tensor through `packed_modules_mapping`;
    public so a model's `map_checkpoint_name` can rename first and map the rest as usual."""
    for ckpt, (fused, shard) in mapping.items():
        key = f".{ckpt}."
        if key in name:
            return name.replace(key, f".{fused}."), shard
    return name, None
