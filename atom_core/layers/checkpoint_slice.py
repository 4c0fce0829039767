"""A checkpoint tensor not yet read, for the loaders of split parameters: its shape, and
`narrow` reads only the rows or columns a rank keeps (safetensors' `get_slice`)."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSlice:
    """What `load_model_weights` hands a parameter whose loader sets `reads_slices`; it answers
    `shape`, `dim()` and `narrow()` as a tensor does, so a loader serves both."""

    def __init__(self, safe_slice: Any):
        self._slice = safe_slice
        self.shape = torch.Size(safe_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]


def materialize(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The whole tensor (read now, if it was not)."""
    return loaded.narrow(0, 0, loaded.shape[0]) if isinstance(loaded, CheckpointSlice) else loaded


def reads_slices(param: torch.nn.Parameter) -> None:
    """Mark a split parameter: its loader takes a `CheckpointSlice` and reads only its part."""
    param.reads_slices = True  # type: ignore[attr-defined]
