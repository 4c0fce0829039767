"""llama.cpp's own HF -> GGUF converter, for tests: GGUF files written exactly as users get them.

`convert_hf_to_gguf.py` (with its `conversion/` package and the `gguf-py` it is written
against) ships inside the `llama-cpp-python` sdist, under `vendor/llama.cpp/`. The sdist
comes from PyPI through pip (the only network the CI machine has) once; those files are
kept under `<cache>/llama-cpp-converter/<version>/` (`$ATOM_CACHE_DIR` or `~/.cache/atom`).
Nothing is skipped when that fails: a test needing the converter fails, saying why.

    python tests/gguf_convert.py     # fetch it now (scripts/test.sh does), print its folder
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Callable

# Pinned: what the converter writes (tensor layout, metadata keys) changes between releases,
# and the tests check Atom against one known writer. Bump it deliberately.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_VENDORED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs the converter in a fresh interpreter with the vendored gguf-py first on the path (it
# may be newer than the installed `gguf`). One patch, to the tokenizer metadata only: llama.cpp
# names a BPE pre-tokenizer by hashing a known model's tokens of a test string, which a
# 256-token test vocabulary cannot reproduce; the tiny tokenizers here use GPT-2's
# pre-tokenizer, so an unrecognised hash is labelled "gpt-2" instead of aborting.
_RUNNER = """
import json, runpy, sys
root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [root + "/gguf-py", root]
from conversion import base
recognise = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
for args in jobs:  # one interpreter for all: torch and transformers are imported once
    sys.argv = [root + "/convert_hf_to_gguf.py", *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def cache_dir() -> Path:
    env = os.environ.get("ATOM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "atom"


def converter_dir(cache: Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/, fetched on first use."""
    root = (cache or cache_dir()) / "llama-cpp-converter" / version
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    return unpack_sdist(root, _extract, version)


def unpack_sdist(dest: Path, extract: Callable[[Path, Path], None], version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """`dest` filled by `extract(sdist, folder)` from the llama-cpp-python sdist, fetched from PyPI.

    Extracted beside `dest` and renamed into place, so a reader never sees half a tree and
    two processes racing both end with the complete one.
    """
    with tempfile.TemporaryDirectory(prefix="atom-llama-cpp-") as tmp:
        sdist = _download_sdist(version, Path(tmp))
        return fill_atomically(dest, lambda folder: extract(sdist, folder))


def fill_atomically(dest: Path, fill: Callable[[Path], None]) -> Path:
    """`dest` made by `fill(folder)` in a folder beside it, then renamed into place: a reader
    never sees half a tree, and two processes racing both end with a complete one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fill(partial)
        try:
            os.rename(partial, dest)  # atomic; another process may have finished first
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def _download_sdist(version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--no-binary", "llama-cpp-python", "-d", str(into), f"llama-cpp-python=={version}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch llama.cpp's converter: `{' '.join(cmd)}` failed (exit {done.returncode}):\n"
            f"{done.stderr.strip()[-2000:]}"
        )
    return found[0]


def _extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rest = m.name.partition("/")[2]
            if not rest.startswith("vendor/llama.cpp/"):
                continue
            rel = rest.removeprefix("vendor/llama.cpp/")
            if m.isfile() and any(rel == v or (v.endswith("/") and rel.startswith(v)) for v in _VENDORED):
                m.name = rel
                members.append(m)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(dest, members=members, **safe)


def convert(hf_folder: Path, out_file: Path, outtype: str = "f32") -> Path:
    """`convert_hf_to_gguf.py hf_folder --outfile out_file --outtype outtype`; raises with its log on failure."""
    return convert_many([(hf_folder, out_file)], outtype)[0]


def convert_many(jobs: list[tuple[Path, Path]], outtype: str = "f32") -> list[Path]:
    """`convert` for several (HF folder, GGUF file) pairs, in one subprocess."""
    root = converter_dir()
    args = [[str(folder), "--outfile", str(out), "--outtype", outtype] for folder, out in jobs]
    cmd = [sys.executable, "-c", _RUNNER, str(root), json.dumps(args)]
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    missing = [str(out) for _, out in jobs if not out.is_file()]
    if done.returncode != 0 or missing:
        raise RuntimeError(
            f"llama.cpp's convert_hf_to_gguf.py failed (exit {done.returncode}; not written: {missing}):\n"
            f"{(done.stdout + done.stderr).strip()[-4000:]}"
        )
    return [out for _, out in jobs]


# Text to learn merges from: the tokenizer only has to exist (test prompts are token ids).
_SENTENCES = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small model that answered every question.",
    "def add(a, b):\n    return a + b\n",
    "1 + 1 = 2, 2 + 2 = 4, 10 * 10 = 100.",
]
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|user|>",
]  # ids 0, 1, 2, 3 (GLM's converter asks for <|user|>)


def _corpus() -> list[str]:
    rng = random.Random(0)  # made-up words, enough distinct pairs to fill any small vocabulary
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "pa", "ve", "dri", "nu", "ga", "shi", "or", "el"]
    words = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12)) for _ in range(200)]
    return _SENTENCES * 5 + words


def write_tiny_sentencepiece_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """A SentencePiece BPE model of `vocab_size` pieces as Gemma's is made (<pad>, <eos>, <bos>,
    <unk> first; no dummy prefix, no normalisation), with the Gemma tokenizer transformers
    builds from it: llama.cpp's converter reads Gemma 2's vocabulary from tokenizer.model only."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", character_coverage=1.0, add_dummy_prefix=False, normalization_rule_name="identity",
        split_by_whitespace=False, remove_extra_whitespaces=False, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    special = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer", **special}))
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))  # its tokenizer.json too


def write_tiny_tokenizer(folder: Path, vocab_size: int = 256, tokenizer_class: str | None = None) -> None:
    """A byte-level BPE (GPT-2's pre-tokenizer) of exactly `vocab_size` tokens, saved into `folder`.

    `tokenizer_class`: what tokenizer_config.json calls it (the converter reads Phi-3's vocabulary
    as GPT-2's only when it says "GPT2Tokenizer", as Phi-4-mini's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:  # a corpus too small to fill the vocabulary
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, not {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    if tokenizer_class is not None:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"tokenizer_class": tokenizer_class}, indent=2))


if __name__ == "__main__":
    print(converter_dir())
