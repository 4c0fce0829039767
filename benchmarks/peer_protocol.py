"""The line protocol between `benchmarks/vs_peers.py` and a peer's worker script.

A worker (`peer_vllm.py`, `peer_openvino.py`) runs in the peer's own venv, so this module uses
the standard library only. The parent writes one JSON line to the worker's stdin, the job
(model, precision, threads, the token-id prompts); the worker loads the engine and answers
`{"ready": <setup text>}`; then each `{"cmd": "run"}` line is answered with one round's speeds,
`{"decode": {batch: tokens/s}, "pp": tokens/s}`; `{"cmd": "quit"}` or EOF ends it. A failure
is answered `{"error": <text>}`. Answers go to the original stdout, while everything the
engine prints (to stdout or stderr, from Python or C++) goes to stderr, the parent's log file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

MARK = "@@peer "
# `vs_peers.py --isa`: the levels every engine can be held to (AVX2 CPUs, with AVX-VNNI or
# without), and the variable that tells a worker which one it runs at
ISAS = ("avx2", "avx2_vnni")
PEER_ISA = "ATOM_PEER_ISA"


def _protocol_stdout() -> TextIO:
    """A private copy of fd 1 for answers; fd 1 itself then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _one_line(exc: BaseException) -> str:
    """The exception on one line (less OpenVINO's "Exception from <source>:<line>:" lines)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip() and not x.startswith("Exception from ")]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:400]


def serve(load: Callable[[dict[str, Any]], tuple[Any, str]],
          measure: Callable[[Any, dict[str, Any]], dict[str, Any]],
          close: Callable[[Any], None] = lambda engine: None) -> None:  # fmt: skip
    """Answer the parent: `load(job)` -> (engine, setup text) once, `measure(engine, job)` per
    run, `close(engine)` at the end (an engine's helper processes must not outlive it)."""
    out = _protocol_stdout()
    engine, status = None, 0

    def reply(message: dict[str, Any]) -> None:
        out.write(MARK + json.dumps(message) + "\n")
        out.flush()

    try:
        job = json.loads(sys.stdin.readline())
        engine, setup = load(job)
        reply({"ready": setup})
        for line in sys.stdin:
            if json.loads(line).get("cmd") != "run":
                break
            reply(measure(engine, job))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        traceback.print_exc()
        reply({"error": _one_line(exc)})
        status = 1
    try:
        if engine is not None:
            close(engine)
    finally:
        sys.stderr.flush()
        os._exit(status)  # engines' background threads must not keep the process alive
