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


def run(script: Path, *args: str, timeout: int = 300) -> str:
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=BENCHMARKS.parent
    )
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
