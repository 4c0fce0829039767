"""A model folder's Hugging Face config, as every rank of an engine reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def text_config_of(hf_config: Any) -> Any:
    """The language model's config of a multimodal checkpoint (Atom runs its text model), under the
    checkpoint's own `architectures`, by which a model plugin registers it; a text config as is."""
    text = hf_config.get_text_config()
    if text is not hf_config:
        text.architectures = hf_config.architectures
    return text


def read_json(path: Path) -> Any:
    """A JSON file of a model folder; ValueError naming the file where it does not parse."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def read_hf_config(folder: str | Path) -> Any:
    """The folder's transformers config (its text model's); a `model_type` transformers does not
    know is read by the reader a plugin registers under it ("hf_configs")."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = read_json(Path(folder) / "config.json")
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in CONFIG_MAPPING:
        from atom_core.plugins.manager import get_registry

        readers = get_registry("hf_configs")
        if model_type in readers:
            return text_config_of(readers.get(model_type)(raw))
    return text_config_of(AutoConfig.from_pretrained(folder))
