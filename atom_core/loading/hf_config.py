"""A model folder's Hugging Face config, as every rank of an engine reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def text_config_of(hf_config: Any) -> Any:
    """The language model's config of a multimodal checkpoint (Atom runs its text model), under the
    checkpoint's own `architectures`, by which a model plugin registers it; a text config as is."""
    text = hf_config.get_text_config()
    if text is not hf_config:
        text.architectures = hf_config.architectures
    return text


def read_hf_config(folder: str | Path) -> Any:
    from transformers import AutoConfig

    return text_config_of(AutoConfig.from_pretrained(folder))
