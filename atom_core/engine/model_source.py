"""From what the user names (a folder, a .gguf file, nothing) to what an engine is built from:
the model's folder, its `Config` (the checkpoint's defaults filled in, plugin settings routed
into `additional_config`), its Hugging Face config and its tokenizer."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import attrs

from atom_core.config import Config, check_device
from atom_core.loading.hf_config import read_hf_config, read_json
from atom_core.plugins.options import check_plugin_options, declared_options, settings_of_other_policies

logger = logging.getLogger("atom")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_CONFIG_FIELDS = {f.name for f in attrs.fields(Config)}


@attrs.define
class ModelSource:
    """Everything an engine core is built from."""

    config: Config
    hf_config: Any
    tokenizer: Any  # None for a folder without tokenizer files (token-id prompts still work)


def load_model_source(model: str | Path | None, **kwargs: Any) -> ModelSource:
    """`kwargs` are `Config` fields or plugin settings (checked before any GGUF file is converted)."""
    kwargs = route_plugin_settings(kwargs)
    given = Config(**kwargs)
    check_device(given.device)
    check_registered_names(given)
    unread = settings_of_other_policies(given.additional_config or {}, given.scheduling_policy)
    if unread:
        what = "is a setting" if len(unread) == 1 else "are settings"
        logger.warning(
            "atom: %s %s of other scheduling policies: scheduling_policy=%r does not read it",
            ", ".join(unread), what, given.scheduling_policy,
        )  # fmt: skip
    folder = resolve_model(model)
    hf_config = read_hf_config(folder)
    config = Config(model=str(folder), **kwargs)
    config = attrs.evolve(config, **model_defaults(config, hf_config, folder))
    return ModelSource(config, hf_config, load_tokenizer(folder))


def resolve_model(model: str | Path | None) -> Path:
    """A folder with config.json: the given one, a .gguf file converted once, or the default model."""
    if model is None:
        from atom_core.engine.fetch import fetch_default_model

        return fetch_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from atom_core.engine.fetch import default_cache_dir
        from atom_core.loading.gguf import GGUF_BLOCKS_FILE
        from atom_core.loading.gguf.blocks import write_gguf_blocks
        from atom_core.loading.gguf.convert import gguf_to_hf_folder

        # Named by the file's full path as well as its size and modification time (in ns):
        # two files of one name, size and copied timestamp (two fine-tunes at one quant type,
        # `cp -p`) must not share a converted folder.
        stat = path.stat()
        where = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        out = default_cache_dir() / "models" / f"{path.stem}-{stat.st_size:x}-{stat.st_mtime_ns:x}-{where}"
        try:
            if not (out / "config.json").exists():
                return gguf_to_hf_folder(path, out)
            if not (out / GGUF_BLOCKS_FILE).exists():  # converted before Atom kept the quantized blocks
                write_gguf_blocks(path, out)
        except Exception as e:  # gguf's and numpy's messages ("GGUF magic invalid", an IndexError
            # from a cut-off header, a reshape of a cut-off tensor) do not name the file
            raise ValueError(
                f"{path}: not a GGUF file Atom can read (truncated or corrupt?): {type(e).__name__}: {e}"
            ) from e
        return out
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"model {str(model)!r} is neither a folder with config.json nor a .gguf file "
        "(Atom does not download from a model hub; `atom fetch` installs the default model)"
    )


def route_plugin_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the names that are no `Config` field moved into `additional_config`,
    each checked against the settings the installed plugins declare (before any model loads)."""
    extra = {k: kwargs[k] for k in kwargs if k not in _CONFIG_FIELDS}
    settings = {**(kwargs.get("additional_config") or {}), **extra}
    try:
        check_plugin_options(settings)
    except TypeError:
        declared = sorted(declared_options())
        unknown = sorted(set(settings) - set(declared))
        raise TypeError(
            f"unknown LLMEngine option(s) {', '.join(map(repr, unknown))}; options are Config fields: "
            f"{', '.join(sorted(_CONFIG_FIELDS - {'model'}))}; and plugin settings: {', '.join(declared)}"
        ) from None
    kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_FIELDS}
    if settings:
        kwargs["additional_config"] = settings
    return kwargs


def model_defaults(config: Config, hf_config: Any, folder: Path) -> dict[str, Any]:
    """max_model_len and stop ids from the checkpoint, where the user set none."""
    out: dict[str, Any] = {}
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        out["max_model_len"] = max_pos or 4096
    elif max_pos is not None and config.max_model_len > max_pos:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={max_pos}")
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if config.eos_token_id is None and eos_ids:
        out["eos_token_id"] = eos_ids[0]
    if not config.stop_token_ids and len(eos_ids) > 1:
        out["stop_token_ids"] = eos_ids[1:]
    bos = gen.get("bos_token_id", getattr(hf_config, "bos_token_id", None))
    if config.bos_token_id is None and isinstance(bos, int):
        out["bos_token_id"] = bos
    vocab = getattr(hf_config, "vocab_size", None)
    given = [("eos_token_id", config.eos_token_id), ("bos_token_id", config.bos_token_id)]
    for name, t in given + [("stop_token_ids", t) for t in config.stop_token_ids]:
        if vocab and t is not None and t >= vocab:
            raise ValueError(f"{name} names token {t}, outside the model's vocabulary [0, {vocab})")
    return out


def check_registered_names(config: Config) -> None:
    """Every plugin name the config gives is registered (RegistryError naming the ones that are),
    checked before a model loads rather than after."""
    from atom_core.plugins.manager import get_registry

    spec = config.speculative_config
    names = [
        ("samplers", config.sampler), ("scheduler_policies", config.scheduling_policy),
        ("distributed_executors", config.distributed_executor),
    ]  # fmt: skip
    if spec is not None:
        names += [("proposers", spec.method), ("samplers", spec.verifier)]
    for registry, name in names:
        get_registry(registry).get(name)


def load_tokenizer(folder: Path):
    if not any((folder / name).exists() for name in _TOKENIZER_FILES):
        return None  # token-id prompts still work
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # tokenizers raises a bare Exception on a corrupt vocabulary
        raise ValueError(f"{folder}: its tokenizer files cannot be loaded: {type(e).__name__}: {e}") from e
