"""The benchmark scripts run: each answers --help (so it imports against today's API), and the
ones that take seconds run whole, as a user would start them."""

from __future__ import annotations

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


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_answers_help(script):
    assert "usage:" in run(script, "--help")


def test_kv_capacity_runs():
    out = run(BENCHMARKS / "kv_capacity.py")
    assert "DeepSeek-V2-Lite" in out and "mla builder" in out


def test_mla_paths_decode_runs():
    out = run(BENCHMARKS / "mla_paths.py", "--decode-only", "--threads", "2")
    assert out.count("requests x") == 4


def test_decode_attention_runs_or_says_the_kernel_is_off():
    from atom_attention import cpu_kernels

    args = ["--shapes", "smollm2,mla", "--batch", "1", "--contexts", "600", "--rounds", "1", "--layers", "2"]
    if cpu_kernels.load() is None:  # ATOM_CPU_KERNELS=0: one clear line, no traceback
        result = launch(BENCHMARKS / "decode_attention.py", *args)
        assert result.returncode != 0 and "not built here" in result.stderr and "Traceback" not in result.stderr
        return
    out = run(BENCHMARKS / "decode_attention.py", *args)
    assert "| smollm2 | 1 | 600 |" in out and "| mla | 1 | 600 |" in out
