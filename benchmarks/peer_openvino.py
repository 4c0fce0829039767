"""OpenVINO GenAI's side of `benchmarks/vs_peers.py`: run in the openvino venv, driven over
peer_protocol.

The engine is `openvino_genai.ContinuousBatchingPipeline(<IR folder>, SchedulerConfig, "CPU",
{INFERENCE_NUM_THREADS: threads, INFERENCE_PRECISION_HINT: ...})` on the model exported by
`optimum-cli export openvino` (benchmarks/peers_setup.py). The scheduler gets a 2 GB KV cache,
the prefix cache off (the prompts repeat between rounds) and a token budget that prefills every
prompt of the largest batch in one step, as Atom and llama.cpp do; OpenVINO's defaults otherwise
(its CPU plugin picks the KV cache precision, and for int4 weights quantizes activations
dynamically). The measurement uses `add_request` (token ids as an `ov.Tensor`) + `step`, the way
vs_llamacpp.py drives Atom:

* batch N: N prompts, `max_new_tokens = new_tokens + 1`, EOS ignored, greedy. `step()` until
  every request has its first token (the prefill, untimed), then the clock runs until no
  request is left; tokens/s = decode tokens produced in that window / its time.
* pp512: one 512-token prompt, `max_new_tokens=1`; 512 / (time from `add_request` to its end).

Only the standard library, numpy and OpenVINO are imported: this file runs in the peer's venv.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_protocol import ISAS, PEER_ISA, serve  # noqa: E402

# INFERENCE_PRECISION_HINT per precision; None leaves the CPU plugin's default (bf16 on CPUs
# with AVX512_BF16 or AMX, else f32), what a user of an int4 export gets.
PRECISION_HINTS = {"f32": "f32", "bf16": "bf16", "f16": "f32", "q4": None}
KV_CACHE_GB = 2


def load(job: dict[str, Any]) -> tuple[Any, str]:
    import openvino as ov
    import openvino_genai as genai

    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = KV_CACHE_GB
    scheduler.enable_prefix_caching = False
    scheduler.max_num_seqs = max(job["batches"])
    scheduler.max_num_batched_tokens = max(max(job["batches"]) * job["prompt_tokens"], job["pp_tokens"])
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": job["threads"]}
    hint = PRECISION_HINTS[job["precision"]]
    isa = os.environ.get(PEER_ISA)
    if isa in ISAS:
        # The CPU plugin chooses bfloat16 from CPUID, not from oneDNN's cap (it then fails to
        # create its primitives): f32 is what it runs on an AVX2 CPU, for either hint. Its 4-bit
        # layers' dynamic quantization needs VNNI (not in AVX2) and also fails under the cap.
        hint = "f32"
        if isa == "avx2":
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    core = ov.Core()
    native_bf16 = "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if hint == "bf16" and not native_bf16:
        # Without AVX512_BF16 or AMX the CPU plugin lists no BF16 capability and its paged
        # attention refuses a bf16 hint (it requires f32 KV types): f32 is what it runs there.
        hint = "f32"
    if hint:
        properties["INFERENCE_PRECISION_HINT"] = hint
    pipe = genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)
    default_hint = _type_name(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
    setup = (f"OpenVINO {ov.get_version().split('-')[0]}, GenAI {genai.__version__.split('-')[0]}, "
             f"IR {Path(job['model']).name}, INFERENCE_PRECISION_HINT {hint or f'{default_hint} (CPU default)'}, "
             f"KV cache {_type_name(core.get_property('CPU', 'KV_CACHE_PRECISION'))} (CPU default), "
             f"INFERENCE_NUM_THREADS {job['threads']}")  # fmt: skip
    if job["precision"] == "bf16" and not native_bf16:
        setup += " (no BF16 in the CPU's OPTIMIZATION_CAPABILITIES: f32 for the bf16 cell)"
    if isa:
        dq = "no dynamic quantization (it needs VNNI)" if isa == "avx2" else "dynamic quantization on"
        setup += (f", at {isa}: ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}, hint f32 "
                  f"(its bf16 needs AVX-512), {dq}; its float32 GEMMs (MLAS) choose by CPUID, not capped")  # fmt: skip
    decode_rate(pipe, [[100] * 16] * 2, 4)  # warm-up
    return pipe, setup


def _type_name(element_type: Any) -> str:
    return element_type.get_type_name() if hasattr(element_type, "get_type_name") else str(element_type)


def _config(max_new_tokens: int) -> Any:
    import openvino_genai as genai

    config = genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def _tensor(prompt: list[int]) -> Any:
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([prompt], dtype=np.int64))


def _read(handles: list[Any], produced: list[int]) -> None:
    """Add the tokens each handle has produced since the last read to `produced`."""
    for i, handle in enumerate(handles):
        if handle.can_read():
            for output in handle.read().values():
                produced[i] += len(output.generated_ids)


_next_id = iter(range(1 << 62))


def decode_rate(pipe: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of len(prompts) sequences: the steps after every first token, timed."""
    config = _config(new_tokens + 1)
    handles = [pipe.add_request(next(_next_id), _tensor(p), config) for p in prompts]
    produced = [0] * len(handles)
    while min(produced) == 0:
        pipe.step()
        _read(handles, produced)
    at_start = sum(produced)
    start = time.perf_counter()
    while pipe.has_non_finished_requests():
        pipe.step()
        _read(handles, produced)
    elapsed = time.perf_counter() - start
    _read(handles, produced)
    total = sum(produced)
    if total != len(prompts) * (new_tokens + 1):
        raise RuntimeError(f"expected {len(prompts) * (new_tokens + 1)} tokens in all, OpenVINO produced {total}")
    return (total - at_start) / elapsed


def pp_rate(pipe: Any, prompt: list[int]) -> float:
    start = time.perf_counter()
    handle = pipe.add_request(next(_next_id), _tensor(prompt), _config(1))
    while pipe.has_non_finished_requests():
        pipe.step()
    elapsed = time.perf_counter() - start
    handle.read_all()
    return len(prompt) / elapsed


def measure(pipe: Any, job: dict[str, Any]) -> dict[str, Any]:
    prompts = job["prompts"]
    decode = {b: decode_rate(pipe, prompts[:b], job["new_tokens"]) for b in job["batches"]}
    return {"decode": decode, "pp": pp_rate(pipe, job["long_prompt"])}


if __name__ == "__main__":
    serve(load, measure)
