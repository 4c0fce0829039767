"""Engine configuration: one attrs class whose fields and defaults follow AMD ATOM's Config."""

from __future__ import annotations

from typing import Any

import attrs

from atom_core._validators import (
    boolean,
    in_unit_interval,
    is_number,
    name,
    non_negative_float,
    non_negative_int,
    one_of,
    option_names,
    optional_token_id,
    positive,
    token_id_list,
)


def _block_size(inst: object, attr: attrs.Attribute, value: object) -> None:
    # Paged-attention kernels tile the block in 16-token steps; 1 is the degenerate
    # "one token per page" layout that AMD ATOM also allows.
    if not isinstance(value, int) or isinstance(value, bool) or not (value == 1 or (value > 0 and value % 16 == 0)):
        raise ValueError(f"{attr.name} must be a positive multiple of 16 or exactly 1, got {value!r}")


DTYPES = ("auto", "float32", "bfloat16", "float16")


def _dtype(inst: object, attr: attrs.Attribute, value: object) -> None:
    if value not in DTYPES:
        raise ValueError(f"{attr.name} must be one of {', '.join(DTYPES)}, got {value!r}")


def _name(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"speculative_config.{attr.name} must be a non-empty name, got {value!r}")


def _rate(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"speculative_config.{attr.name} must be in [0, 1], got {value!r}")


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def _device(inst: object, attr: attrs.Attribute, value: object) -> None:
    # The type only: the core imports no torch; `check_device` asks torch when a model loads.
    if not isinstance(value, str) or not value:
        raise ValueError(f"device must be a torch device string such as 'cpu' or 'cuda:0', got {value!r}")


def check_device(value: str) -> None:
    """A device this torch can use: named here, not as an assertion deep inside a layer."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device string such as 'cpu' or 'cuda:0', got {value!r}") from e
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise ValueError(f"device={value!r} holds no data (shapes only); run models on 'cpu' or an accelerator")
    is_available = getattr(getattr(torch, device.type, None), "is_available", None)
    if not callable(is_available) or is_available() is not True:
        raise ValueError(
            f"device={value!r}, but this torch has no {device.type.upper()} device "
            f"(torch.{device.type}.is_available() is not True)"
        )


def _max_logprobs(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {value!r}")


def _positive_seconds(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not is_number(value) or not value > 0:
        raise ValueError(f"{attr.name} must be a positive number of seconds, got {value!r}")


@attrs.define(kw_only=True)
class SpeculativeConfig:
    """Draft-and-verify decoding: each decode step checks up to `num_speculative_tokens` drafts.

    `method` names a proposer ("mtp", "eagle3", "ngram", or a plugin's), `verifier` the
    rejection sampler. Each request drafts only the positions whose recent acceptance (its
    own) is at least `min_acceptance_rate`; when even the first falls below it, drafting
    stops for `draft_retry_after` tokens, longer after each failed retry (0 disables the
    gate: always k). 0.5 keeps copy-heavy requests drafting and pauses free text's, whose
    verify rows cost more than they return once a step holds several requests; pauses of
    64 tokens (then 128, 256, ...) keep the probes of a request whose drafts do not pay
    to a few rows.

    `disable_by_batch_size` (vLLM's): greedy requests do not draft after a step that ran at
    least this many requests. Once a step's GEMMs are compute-bound (on a CPU, from a few
    rows) a verified draft costs about a token's compute, accepted or not, and only
    requests whose drafts are nearly always right still pay. Greedy tokens do not depend
    on drafting, so looking at the batch cannot change them; sampled requests keep
    deciding from their own history alone, so a seeded one still gives the same tokens
    alone or batched. None: never.
    """

    method: str = attrs.field(default="mtp", validator=_name)
    model: str | None = None
    num_speculative_tokens: int = attrs.field(default=1, validator=positive)
    # n-gram prompt lookup: suffix lengths tried, longest first.
    prompt_lookup_min: int = attrs.field(default=1, validator=positive)
    prompt_lookup_max: int = attrs.field(default=4, validator=positive)
    verifier: str = attrs.field(default="rejection", validator=_name)
    min_acceptance_rate: float = attrs.field(default=0.5, validator=_rate)
    draft_retry_after: int = attrs.field(default=64, validator=positive)
    disable_by_batch_size: int | None = attrs.field(default=None, validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )


def _speculative_config(value: object) -> SpeculativeConfig | None:
    """A plain dict is accepted as well, as vLLM does."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in attrs.fields(SpeculativeConfig)})
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(map(repr, unknown))}")
        return SpeculativeConfig(**value)
    if value is not None and not isinstance(value, SpeculativeConfig):
        raise ValueError(f"speculative_config must be a SpeculativeConfig, a dict or None, got {value!r}")
    return value


@attrs.define(kw_only=True)
class Config:
    """Everything the scheduler, block manager, model runner and engine read.

    A Config needs no model: `Config(num_kvcache_blocks=64)` is enough to drive a
    Scheduler. `num_kvcache_blocks=None` means "size the pool from memory", which
    only a model runner can do.
    """

    model: str | None = None
    max_num_seqs: int = attrs.field(default=512, validator=positive)
    max_num_batched_tokens: int = attrs.field(default=16384, validator=positive)
    kv_cache_block_size: int = attrs.field(default=16, validator=_block_size)
    enable_prefix_caching: bool = attrs.field(default=False, validator=boolean)
    scheduler_delay_factor: float = attrs.field(default=0.0, validator=non_negative_float)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=in_unit_interval)
    num_kvcache_blocks: int | None = attrs.field(default=None, validator=positive)
    max_model_len: int | None = attrs.field(default=None, validator=positive)
    bos_token_id: int | None = attrs.field(default=None, validator=optional_token_id)
    eos_token_id: int | None = attrs.field(default=None, validator=optional_token_id)
    stop_token_ids: list[int] = attrs.field(factory=list, converter=token_id_list)
    speculative_config: SpeculativeConfig | None = attrs.field(default=None, converter=_speculative_config)
    # Per-request state groups for stateful attention (GDN); 0 = the model keeps none.
    num_per_req_cache_groups: int = attrs.field(default=0, validator=non_negative_int)
    # State checkpoints for prefix caching on a model with per-request state (GDN hybrids):
    # copies of the state at block boundaries, kept least recently used first, each as big
    # as a group and paid from the same budget. Used only with enable_prefix_caching on such
    # a model, where 0 is refused (no prefix could ever be resumed). Named after its only
    # user today; the mechanism serves any attention builder with per-request state.
    gdn_checkpoint_slots: int = attrs.field(default=16, validator=non_negative_int)
    # -- model execution (read by the model runner and the engine) --
    # "auto" takes the checkpoint's dtype; "float32", "bfloat16" or "float16" force one.
    dtype: str = attrs.field(default="auto", validator=_dtype)
    # The paged K/V caches' dtype (vLLM's kv_cache_dtype): "auto" the model's; "bfloat16" or
    # "float16" halve a float32 model's cache bytes (a decode step over long contexts reads
    # all of them), rounding each K/V value once when it is written. Per-request state
    # (GDN) keeps its own (`gdn_state_dtype`).
    kv_cache_dtype: str = attrs.field(default="auto", validator=_dtype)
    device: str = attrs.field(default="cpu", validator=_device)
    # Bytes for the KV pool; None = a quarter of free RAM on CPU, or
    # gpu_memory_utilization of free device memory. `num_kvcache_blocks` overrides both.
    kv_cache_memory: int | None = attrs.field(default=None, validator=positive)
    sampler: str = attrs.field(default="default", validator=name)
    # -- weight quantization (atom_core/loading/quantize.py) --
    # "auto": a model converted from GGUF keeps its Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 blocks (other quantized
    # types are requantized to the nearest of those), other checkpoints load as they are;
    # "none": everything dequantized; "int8" / "int4": every Linear quantized at load.
    quantization: str = attrs.field(default="auto", validator=one_of(QUANTIZATIONS))
    # int4 / int8: weights per scale (and zero) along the input dimension; torch's int4
    # kernel, which runs both, takes these.
    quantization_group_size: int = attrs.field(default=32, validator=one_of((32, 64, 128, 256)))
    # The LM head under "int8"/"int4": "int8" (on SmolLM2 an int4 head cost 6% perplexity),
    # "same" as the other layers, or "none" (floating point; also under "auto").
    quantize_lm_head: str = attrs.field(default="int8", validator=one_of(("int8", "same", "none")))
    # What 4-bit weights in groups of 32 multiply: activations rounded per group of 32 to 16-bit
    # integers (the float product to ~1e-4; perplexity as float32's) or 8-bit (as llama.cpp's
    # Q8_1 and OpenVINO's dynamic quantization: twice the integer rate, +1.9% perplexity on
    # SmolLM2, whose chat answers it changes). 8-bit weights and LM heads always take 16.
    activation_bits: int = attrs.field(default=16, validator=one_of((8, 16)))
    # -- scheduling policy (a name from the "scheduler_policies" registry) --
    scheduling_policy: str = attrs.field(default="mixed", validator=name)
    # Split a prompt longer than what is left of a step's token budget across steps.
    enable_chunked_prefill: bool = attrs.field(default=True, validator=boolean)
    # Cap on one request's prefill chunk per step; 0 = no cap.
    long_prefill_token_threshold: int = attrs.field(default=0, validator=non_negative_int)
    # Most top tokens a request may ask for in `logprobs` / `prompt_logprobs` (vLLM's
    # max_logprobs); -1: no limit but the vocabulary.
    max_logprobs: int = attrs.field(default=20, validator=_max_logprobs)
    # True (default): run the model module by module. False: steps of up to 8 tokens take
    # the torch.compile'd forward (atom_core/runner/compile.py; compiled on first use, cached on
    # disk). On CPU it measured no faster than eager here (docs/performance.md), hence the default.
    enforce_eager: bool = attrs.field(default=True, validator=boolean)
    # Decode steps of up to this many requests replay a recorded graph of their kernel calls
    # instead of running the model's Python (atom_core/runner/decode_graph.py; vLLM's
    # max_cudagraph_capture_size). Their intermediate buffers share one arena
    # (runner/graph_arena.py), so each row count's graph costs little memory. 0: every step runs
    # module by module.
    max_graph_capture_size: int = attrs.field(default=32, validator=non_negative_int)
    # Seed for requests that bring none of their own.
    seed: int = attrs.field(default=0, validator=non_negative_int)
    # `atom serve`: engine-core processes, each with the whole model and a share of the cores
    # and of the KV budget; requests go to the one with the fewest outstanding.
    data_parallel_size: int = attrs.field(default=1, validator=positive)
    # -- tensor and expert parallel (docs/parallel.md) --
    # Ranks one model is split across (1: nothing touches torch.distributed). Each engine core
    # of `data_parallel_size` owns its own group of this many.
    tensor_parallel_size: int = attrs.field(default=1, validator=positive)
    # MoE layers: whole experts per rank instead of every expert's intermediate size split.
    enable_expert_parallel: bool = attrs.field(default=False, validator=boolean)
    # "auto": gloo on CPU, NCCL on CUDA; or "gloo", "nccl", "mpi".
    distributed_backend: str = attrs.field(default="auto", validator=one_of(("auto", "gloo", "nccl", "mpi")))
    # How the other ranks start, a name from the "distributed_executors" registry: "mp" (rank 0
    # starts them on this host), "torchrun" (torchrun started every rank; ranks other than 0
    # run `atom worker`), or a plugin's.
    distributed_executor: str = attrs.field(default="mp", validator=name)
    # Seconds a model collective may wait for the slowest rank before the step fails.
    distributed_timeout: float = attrs.field(default=300.0, validator=_positive_seconds)
    # Settings that belong to a plugin (a scheduling policy's, an attention builder's), by
    # name: each plugin class declares and validates its own (`options_class`, see
    # atom_core/plugins/options.py). `LLMEngine(...)` and the CLI take them by name too.
    additional_config: dict[str, Any] = attrs.field(factory=dict, converter=dict, validator=option_names)

    def __attrs_post_init__(self) -> None:
        bs = self.kv_cache_block_size
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < bs:
            # Chunks are floored to whole blocks: a cap under one block would never advance a prompt.
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or at least kv_cache_block_size={bs}, got {threshold}"
            )

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0
