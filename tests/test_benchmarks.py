"""The benchmark scripts run: each answers --help (so it imports against today's API), and the
ones that take seconds run whole, as a user would start them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# Driven by vs_peers.py over a pipe, not started by hand.
WORKERS = {"peer_openvino", "peer_vllm", "peer_protocol"}
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.stem not in WORKERS)


def launch(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent
    )


def run(script: Path, *args: str) -> str:
    result = launch(script, *args)
    assert result.returncode == 0, f"{script.name} {' '.join(args)}: {result.stderr[-2000:]}"
    return result.stdout


# Every script's `--help` in one interpreter, each run as `python script.py --help` runs it
# (`runpy`, its folder first on sys.path): one import of torch for all of them, not one each.
HELP_ALL = r"""
import contextlib, io, json, os, runpy, sys, traceback
answers = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0], out, code = [path, "--help"], os.path.dirname(path), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (e.code is not None)
        except BaseException:
            code = 1
            traceback.print_exc()
    answers[os.path.basename(path)] = (code, out.getvalue())
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict[str, tuple[int, str]]:
    result = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], capture_output=True, text=True,
                            timeout=600, cwd=BENCHMARKS.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_answers_help(script, help_answers):
    code, out = help_answers[script.name]
    assert code == 0 and "usage:" in out, f"{script.name} --help: exit {code}: {out[-2000:]}"


def test_kv_capacity_runs():
    out = run(BENCHMARKS / "kv_capacity.py")
    assert "DeepSeek-V2-Lite" in out and "mla builder" in out


def test_mla_paths_decode_runs():
    out = run(BENCHMARKS / "mla_paths.py", "--decode-only", "--threads", "2", "--decode", "1x256,4x256,2x512")
    assert out.count("requests x") == 3 and "  4 requests x   256 tokens" in out


def test_decode_attention_runs_or_says_the_kernel_is_off():
    from atom_attention import cpu_kernels

    args = ["--shapes", "smollm2,mla", "--batch", "1", "--contexts", "600", "--rounds", "1", "--layers", "2"]
    if cpu_kernels.load() is None:  # ATOM_CPU_KERNELS=0: one clear line, no traceback
        result = launch(BENCHMARKS / "decode_attention.py", *args)
        assert result.returncode != 0 and "not built here" in result.stderr and "Traceback" not in result.stderr
        return
    out = run(BENCHMARKS / "decode_attention.py", *args)
    assert "| smollm2 | 1 | 600 |" in out and "| mla | 1 | 600 |" in out


def test_gemv_bandwidth_runs_bfloat16_on_any_cpu():
    """Its peer column is oneDNN's packed GEMM where oneDNN packs bfloat16 (AVX-512, AVX-NE-CONVERT)
    and torch's linear elsewhere: an AVX2-only CPU once raised oneDNN's error here."""
    from atom_core.layers.gemm import gemv_ops

    args = ["--rows", "1", "--repeats", "1", "--weights", "bfloat16"]  # (torch's bfloat16 linear is slow at more rows)
    if gemv_ops() is None:  # ATOM_CPU_KERNELS=0: one clear line, no traceback
        result = launch(BENCHMARKS / "gemv_bandwidth.py", *args)
        assert result.returncode != 0 and "unavailable" in result.stderr and "Traceback" not in result.stderr
        return
    out = run(BENCHMARKS / "gemv_bandwidth.py", *args)
    assert "| bfloat16 (" in out and "| 1 |" in out
