"""A GGUF file as a Hugging Face folder: config.json, generation_config.json, the tokenizer,
and model.safetensors with the weights dequantized (`reader.py` reads them), so that
transformers and Atom's models load the file like any checkpoint. The quantized blocks
go beside them (`blocks.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import gguf
import torch
import transformers
from gguf import GGMLQuantizationType, Keys
from safetensors.torch import save_file

from atom_core.loading.gguf.blocks import _write_blocks
from atom_core.loading.gguf.reader import _field, _load


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


def _storage_dtype(reader: gguf.GGUFReader) -> torch.dtype:
    """float16/bfloat16 if every matrix is stored that way, else float32 (quantized sources)."""
    types = {GGMLQuantizationType(t.tensor_type) for t in reader.tensors if len(t.shape) >= 2}
    if types == {GGMLQuantizationType.F16}:
        return torch.float16
    if types == {GGMLQuantizationType.BF16}:
        return torch.bfloat16
    return torch.float32


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
