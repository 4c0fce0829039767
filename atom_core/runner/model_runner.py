"""Loads a model plugin, sizes and binds the KV pool through the attention builders, runs steps.

Blind to model and attention type: the "models" registry maps the checkpoint's
architecture to a class, each attention layer's `attn_type` picks a builder from the
"attention_builders" registry, and the builders own every byte of the cache.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from atom_core.config import Config
from atom_core.distributed.communication import broadcast_ints
from atom_core.distributed.parallel_state import get_tp_group, set_expert_parallel
from atom_core.forward_context import Context, reset_forward_context, set_forward_context
from atom_core.kv.layout import KVPoolPlan
from atom_core.layers.cpp import give_cores_back
from atom_core.layers.linear import batch_invariant_gemms, mark_lm_heads, prepare_lm_head_screens, process_weights
from atom_core.loading.checkpoint import load_model_weights, zeros_for_random_init
from atom_core.loading.quantize import quantize_model
from atom_core.platform.memory import keep_freed_memory_mapped, release_freed_heap, weight_arena
from atom_core.plugins.manager import get_registry
from atom_core.runner.attention_builder import AttentionMetadataBuilder, BuilderContext
from atom_core.runner.compile import compile_model
from atom_core.runner.decode_graph import decode_graphs
from atom_core.runner.direct_calls import direct_calls
from atom_core.runner.kv_pool import allocate_kv_pool, plan_kv_pool
from atom_core.runner.logprobs import token_logprobs
from atom_core.runner.proposer import ProposalInput, Proposer, ProposerContext
from atom_core.runner.sampler import SamplingMetadata, reads_argmax_only
from atom_core.sched.batch import ScheduledBatch, ScheduledBatchOutput
from atom_core.sched.policy import policy_class
from atom_core.sched.speculative import crowded, wanted_drafts
from atom_core.sequence import Sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(found, torch.dtype):
        return found if found in _DTYPES.values() else torch.float32
    return _DTYPES.get(str(found).removeprefix("torch."), torch.float32)


def _ranges(spans) -> np.ndarray:
    """The positions of each half-open [start, end) span, concatenated (int64)."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in spans]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@attrs.define
class StepRows:
    """What every tensor-parallel rank needs of a step: its batch, the rows whose logits are
    computed (the sampling positions, then prompt-logprob positions), and the drafts each row
    of the previous batch had accepted (row -> count) for builders with per-request state."""

    batch: ScheduledBatch
    sample_index: np.ndarray
    prompt_index: np.ndarray
    accepted_before: dict[int, int] = attrs.field(factory=dict)


@attrs.define
class ModelOutput:
    hidden: torch.Tensor
    scored: torch.Tensor | None  # the sampling rows' hidden states
    logits: torch.Tensor | None  # theirs, in the model's dtype
    prompt_logits: torch.Tensor | None  # float32, the prompt-logprob rows'
    input_ids: torch.Tensor
    meta: Any  # the first attention builder's metadata


class ModelRunner:
    def __init__(self, config: Config, hf_config: Any, pm=None):
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config)
        self.block_size = config.kv_cache_block_size
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(
                f"{config.model}: the checkpoint is pre-quantized (config.json quantization_config, quant_method="
                f"{method!r}), which Atom does not load; it loads float checkpoints (quantized at load by "
                "Config.quantization) and GGUF files (Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 kept, other types converted)"
            )
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{config.model}: config.json names no 'architectures'; Atom picks the model class by it")
        model_cls = get_registry("models", pm).get(archs[0])
        tp = get_tp_group()
        if tp.world_size > 1 and not getattr(model_cls, "supports_tensor_parallel", False):
            raise ValueError(
                f"{archs[0]} ({model_cls.__module__}.{model_cls.__qualname__}) does not support tensor parallel: "
                f"its class does not set supports_tensor_parallel = True (it builds no parallel layers); "
                f"use tensor_parallel_size=1"
            )
        spec = config.speculative_config
        proposer_cls = get_registry("proposers", pm).get(spec.method) if spec else None
        if tp.world_size > 1 and proposer_cls is not None and not proposer_cls.supports_tensor_parallel:
            assert spec is not None
            raise ValueError(
                f"speculative_config.method={spec.method!r} runs a draft model, which does not run under "
                f"tensor_parallel_size={tp.world_size} yet; 'ngram' does (or set tensor_parallel_size=1)"
            )
        # A proposer with weights (a draft layer, an EAGLE head) builds them here; its
        # attention layers join the target's below and take KV from the same pool.
        set_expert_parallel(config.enable_expert_parallel)
        self.model = self._build_model(model_cls)
        if spec:  # verify steps must round as plain decode steps do
            batch_invariant_gemms(self.model)
        # Filled below once the proposer's layers are known; the proposer holds the same mapping.
        self.attn_builders: dict[str, AttentionMetadataBuilder] = {}
        proposer_context = ProposerContext(
            config=config, hf_config=hf_config, model=self.model, instantiate=self.instantiate,
            load_weights=self.load_weights, attn_builders=self.attn_builders,
        )  # fmt: skip
        self.proposer: Proposer | None = proposer_cls(proposer_context, spec) if proposer_cls else None
        self.verifier = get_registry("samplers", pm).get(spec.verifier)(config) if spec else None
        draft_modules = self.proposer.draft_modules() if self.proposer else []
        self._aux_hidden: dict[int, torch.Tensor] = {}  # slot in `aux_hidden_layers` -> that layer's output
        # the last step's logits and the row each request sampled from (`last_logits`)
        self._last_logits: torch.Tensor | None = None
        self._last_hidden: torch.Tensor | None = None
        self._last_rows: np.ndarray | None = None
        self._previous_batch: ScheduledBatch | None = None  # for drafts accepted after it (`execute_model`)
        if self.proposer and self.proposer.aux_hidden_layers:
            self._capture_aux_hidden(self.proposer.aux_hidden_layers)
        self.attn_layers = [
            m for root in [self.model, *draft_modules] for m in root.modules() if getattr(m, "attn_type", None)
        ]
        if not self.attn_layers:
            raise ValueError(f"{archs[0]} has no attention layers (modules with an `attn_type`)")
        by_type: dict[str, list[torch.nn.Module]] = {}
        for m in self.attn_layers:
            by_type.setdefault(m.attn_type, []).append(m)
        builders = get_registry("attention_builders", pm)
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, hf_config)
        context = BuilderContext(config=config, hf_config=hf_config, device=self.device, dtype=kv_dtype)
        self.attn_builders.update({t: builders.get(t)(context, layers) for t, layers in by_type.items()})
        self.sampler = get_registry("samplers", pm).get(config.sampler)(config)
        # Whether an argmax-only step can save anything: a screened LM head (made now, not in the
        # first request's first token), a sampler that takes its rows, and no drafts to verify
        # (their GEMMs are batch-invariant, which no screen serves).
        # (One rank only: a split LM head's rows are gathered whole first.)
        self.screens_lm_head = (
            tp.world_size == 1 and not spec and reads_argmax_only(self.sampler) and prepare_lm_head_screens(self.model)
        )
        policy = policy_class(config.scheduling_policy, pm)
        with_options = [m.layer_id for m in self.attn_layers if not getattr(m, "plain", True)]
        if policy.pads_batches and with_options:
            raise ValueError(
                f"scheduling_policy={config.scheduling_policy!r} pads batches into a rectangular layout, which "
                f"attention with sliding windows, sinks or soft-capping (layers {with_options[:8]}) does not run; "
                f"use scheduling_policy='mixed' or 'prefill_first'"
            )
        # Blocks the scheduling policy keeps out of requests' reach (spyre's padding block).
        reserved = policy.reserved_blocks
        layouts = {t: b.kv_layout() for t, b in self.attn_builders.items()}
        self.kv_plan: KVPoolPlan = plan_kv_pool(layouts, config, self.device, len(reserved))
        if tp.world_size > 1:  # every rank allocates rank 0's block count
            (num_blocks,) = broadcast_ints([self.kv_plan.num_blocks] if tp.is_first else None, 1)
            if num_blocks != self.kv_plan.num_blocks:
                fixed = attrs.evolve(config, num_kvcache_blocks=num_blocks)
                self.kv_plan = plan_kv_pool(layouts, fixed, self.device, len(reserved))
        self.kv_cache_tensors, self.per_req_cache_tensors, self.kv_cache_data = allocate_kv_pool(
            self.attn_builders, self.attn_layers, self.kv_plan, getattr(hf_config, "num_key_value_heads", None)
        )
        # The compiled path traces one rank's graph; with collectives in it, ranks run eagerly.
        self.run_model = compile_model(self.model, config, self.device) if tp.world_size == 1 else self.model
        # Eager modules skip nn.Module.__call__'s hook checks (a compiled model is traced as it is;
        # a proposer's own layers always run eagerly).
        for root in ([self.model] if self.run_model is self.model else []) + draft_modules:
            direct_calls(root)
        self.run_model = decode_graphs(self.model, self.run_model, config, self.attn_builders, tp.world_size > 1)
        self.timings: dict[str, float] = defaultdict(float)
        # Set by a multi-rank executor: called on rank 0 with each step's batch, its logit rows and
        # the previous step's accepted drafts, before the model runs, to send them to the other ranks.
        self.announce: Callable[[StepRows], None] | None = None
        self._accepted: dict[int, int] = {}  # the last step's accepted drafts per row, not yet announced
        release_freed_heap()  # what loading freed: the checkpoint's tensors, kernels' staging copies

    def _build_model(self, model_cls: type) -> torch.nn.Module:
        model = self.instantiate(lambda: model_cls(self.hf_config, self.config))
        assert self.config.model is not None  # the engine's Config names the model folder
        return self.load_weights(model, self.config.model, quantize=True)

    def instantiate(self, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """`make()` with its parameters in the runner's dtype, on its device (a target or a draft
        model), zeros until `load_weights` fills them."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), zeros_for_random_init():
                return make()
        finally:
            torch.set_default_dtype(previous)

    def load_weights(self, module: torch.nn.Module, folder: str, quantize: bool = False) -> torch.nn.Module:
        """Load `module` from `folder`, quantized per `Config.quantization` if asked, with kernels
        chosen for the loaded weights' device and dtype."""
        load_model_weights(module, folder)
        mark_lm_heads(module)
        if quantize:
            quantize_model(module, self.config)  # Config.quantization: which Linears run quantized
        # What the kernels stream goes into huge pages, except where speculative decoding's
        # batch-invariant GEMMs (`batch_invariant_gemms`) will drop the streamed copies.
        with weight_arena(enabled=not self.config.speculative_config):
            process_weights(module)
        return module.eval()

    def _capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """Keep the outputs of the named decoder layers each step (EAGLE-3 reads three of them).

        A layer returns its output whole or, carrying the residual stream as vLLM's do, as a pair
        (h, residual) whose sum it is; either way what is kept is the residual stream itself."""
        stacks = [
            m
            for name, m in self.model.named_modules()
            if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)
        ]
        if not stacks:
            raise ValueError(f"{type(self.model).__name__} has no `layers` ModuleList to read hidden states from")
        layers = max(stacks, key=len)
        store = self._aux_hidden

        def keep(slot: int):
            def hook(module, args, output):
                store[slot] = output[0] + output[1] if isinstance(output, tuple) else output

            return hook

        for slot, i in enumerate(layer_ids):  # kept in the order named, whatever order the layers run in
            if not 0 <= i < len(layers):
                raise ValueError(f"the proposer reads hidden states of layer {i}; the model has {len(layers)} layers")
            layers[i].register_forward_hook(keep(slot))

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatchOutput:
        """Run one scheduled batch (decode rows and prompt chunks alike); sample where a request reaches its end.

        A decode row carrying drafts is scored at each of its positions and verified; the
        proposer then drafts the next step's tokens from what was accepted. Rank 0's work:
        the other tensor-parallel ranks run only `execute_model`.
        """
        rows = [i for i, s in enumerate(batch.do_sample) if s]
        sample_ids = [batch.req_ids[i] for i in rows]
        spec = batch.scheduled_spec_decode_tokens
        drafts = [spec.get(rid, []) for rid in sample_ids]
        query_start = np.concatenate(([0], np.cumsum(batch.num_scheduled_tokens, dtype=np.int64)))
        ends = query_start[1:][rows]  # one past each sampling row's last token
        # Only the positions that sample reach the lm_head: a request's last token, or its last
        # token and each draft; middle chunks and prompt tokens never do (but for prompt logprobs).
        sample_index = _ranges((e - 1 - len(d), e) for e, d in zip(ends, drafts))
        spans = self._prompt_logprob_spans(batch, seqs, query_start)
        step = StepRows(batch, sample_index, _ranges((at, at + n) for _, _, at, n in spans), self._accepted)
        if self.announce is not None:
            self.announce(step)
        self._accepted = {}
        argmax_only = self.screens_lm_head and self._argmax_only(sample_ids, seqs)
        out = self.execute_model(step, argmax_only)
        logits = out.logits
        t2 = time.perf_counter()
        tokens: list[list[int]] = []
        # Where each sampling row's scored positions start in `logits` (its last token, then its drafts).
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]) if rows else np.zeros(0, dtype=np.int64)
        if rows:
            tokens = self._sample(logits, sample_ids, seqs, drafts, starts)
            accepted = {row: len(t) - 1 for row, d, t in zip(rows, drafts, tokens) if d}
            if accepted:
                for builder in self.attn_builders.values():
                    builder.commit_speculation(batch, accepted)
                self._accepted = accepted  # the other ranks' builders commit it before the next step
        logprobs = self._logprobs(sample_ids, seqs, starts, tokens, logits) if rows else {}
        prompt_logprobs = self._prompt_logprobs(spans, seqs, out.prompt_logits)
        t3 = time.perf_counter()
        proposals = self._propose(batch, seqs, rows, ends, drafts, tokens, out.input_ids, out.meta, out.hidden)
        timings = self.timings
        timings["sample"] += t3 - t2
        timings["propose"] += time.perf_counter() - t3
        # The logits each request sampled its last token from, a row per request of
        # `last_req_ids`: for parity checks and debugging. An argmax-only step's logits may
        # be mostly -inf, so its hidden states are kept instead, to compute them whole when asked.
        self.last_req_ids = sample_ids
        self._last_logits = logits if rows and not argmax_only else None
        self._last_hidden = out.scored if rows and argmax_only else None
        self._last_rows = starts + [len(t) - 1 for t in tokens] if rows else None
        result = ScheduledBatchOutput({rid: tuple(t) for rid, t in zip(sample_ids, tokens)})
        result.logprobs, result.prompt_logprobs = logprobs, prompt_logprobs
        if proposals:
            result.draft_token_ids = {rid: d.token_ids for rid, d in proposals.items()}
            result.draft_probs = {rid: d.probs for rid, d in proposals.items() if d.probs is not None}
        return result

    @torch.inference_mode()
    def execute_model(self, step: StepRows, argmax_only: bool = False) -> ModelOutput:
        """The model on `step.batch`, and the logits of the rows `step` names: what every
        tensor-parallel rank runs, in the same order, so their collectives meet."""
        give_cores_back()  # torch's threads, once a background kernel build is over
        t0 = time.perf_counter()
        batch = step.batch
        if step.accepted_before and self._previous_batch is not None:  # rank 0 did this after sampling
            for builder in self.attn_builders.values():
                builder.commit_speculation(self._previous_batch, step.accepted_before)
        self._previous_batch = batch
        metas = {t: b.build(batch) for t, b in self.attn_builders.items()}
        meta = next(iter(metas.values()))
        input_ids = torch.tensor(batch.scheduled_tokens, dtype=torch.int64, device=self.device)
        set_forward_context(
            attn_metadata_by_type=metas,
            atom_config=self.config,
            context=Context(
                positions=meta.positions, is_prefill=batch.total_seqs_num_prefill > 0, batch_size=meta.num_reqs
            ),
            argmax_only=argmax_only,
            kv_cache_data=self.kv_cache_data,
        )
        t1 = time.perf_counter()
        self._aux_hidden.clear()
        scored = logits = None
        try:
            hidden = self.run_model(input_ids, meta.positions)
            if len(step.sample_index):
                # In the model's dtype; the sampler, the verifier and log probabilities widen them.
                scored = hidden[torch.from_numpy(step.sample_index).to(self.device)]
                # (the model's own method; torch's nn.Module stubs type attributes Tensor | Module)
                logits = self.model.compute_logits(scored)  # type: ignore[operator]
        finally:
            reset_forward_context()
        prompt_logits = None
        if len(step.prompt_index):  # outside the forward context: never screened
            rows = hidden[torch.from_numpy(step.prompt_index).to(self.device)]
            prompt_logits = self.model.compute_logits(rows).float()  # type: ignore[operator]
        self.timings["prepare"] += t1 - t0
        self.timings["forward"] += time.perf_counter() - t1
        return ModelOutput(hidden, scored, logits, prompt_logits, input_ids, meta)

    def _sample(self, logits, sample_ids, seqs, drafts, starts) -> list[list[int]]:
        """Per sampling request its tokens: the verifier's (accepted drafts, then one) for rows
        with drafts, the configured sampler's for the others, so a plugin sampler keeps every
        row it can serve and a seeded request draws alike whatever its neighbours drafted."""
        drafting = [i for i, d in enumerate(drafts) if d]
        plain = [i for i, d in enumerate(drafts) if not d]
        tokens: list[list[int]] = [[] for _ in drafts]
        if plain:
            rows = logits if not drafting else logits[torch.as_tensor(starts[plain], device=logits.device)]
            sampled = self.sampler(
                rows, SamplingMetadata.from_seqs((seqs[sample_ids[i]] for i in plain), rows.shape[-1])
            )
            sampled = sampled.tolist()
            if len(sampled) != len(plain):
                raise RuntimeError(
                    f"sampler {self.config.sampler!r} returned {len(sampled)} token ids for {len(plain)} rows; "
                    "a sampler returns one token id per row of logits"
                )
            for i, t in zip(plain, sampled):
                tokens[i] = [t]
        if drafting:
            if plain:  # the drafting rows' positions only
                parts = [torch.arange(starts[i], starts[i] + len(drafts[i]) + 1) for i in drafting]
                rows = logits[torch.cat(parts).to(logits.device)]
            else:
                rows = logits
            assert self.verifier is not None  # drafts only come with speculative decoding
            verified = self.verifier(
                rows.float(),
                [drafts[i] for i in drafting],
                [seqs[sample_ids[i]].spec_token_probs for i in drafting],
                SamplingMetadata.from_seqs((seqs[sample_ids[i]] for i in drafting), rows.shape[-1]),
            )
            for i, t in zip(drafting, verified):
                tokens[i] = t
        return tokens

    @property
    def last_logits(self) -> torch.Tensor:
        """float32 [requests, vocab]: the logits each request of `last_req_ids` sampled its last
        token from (selected when asked: parity checks and debugging, not every step)."""
        logits = self._last_logits
        if self._last_hidden is not None:
            with torch.inference_mode():
                # all rows at once: the step's kernel (the model's own method; torch's nn.Module
                # stubs type attributes Tensor | Module)
                logits = self.model.compute_logits(self._last_hidden)  # type: ignore[operator]
        if logits is None:
            return torch.empty((0, 0))
        return logits[torch.from_numpy(self._last_rows)].float()

    @staticmethod
    def _argmax_only(sample_ids: list[int], seqs: dict[int, Sequence]) -> bool:
        """Whether this step reads nothing of its logits but each row's argmax: every sampling
        request greedy without log probabilities or anything that changes its logits (penalties,
        a bias, a grammar: they move other logits past the maximum; the sampler's part is
        `screens_lm_head`)."""
        if not sample_ids:
            return False
        for rid in sample_ids:
            params = seqs[rid].sampling_params
            if not params.is_greedy or params.logprobs is not None or params.modifies_logits:
                return False
        return True

    def _logprobs(self, sample_ids, seqs, starts, tokens, logits) -> dict[int, list]:
        """Each emitted token's log probability (and the top n) from the raw logits that scored it."""
        out = {}
        for rid, start, t in zip(sample_ids, starts.tolist(), tokens):
            n = seqs[rid].sampling_params.logprobs
            if n is not None:
                out[rid] = token_logprobs(logits[start : start + len(t)], t, n)
        return out

    @staticmethod
    def _prompt_logprob_spans(batch, seqs, query_start) -> list[tuple[int, int, int, int]]:
        """(request id, first prompt token scored, its row in the batch, rows) for this step's
        chunk of each request that asked for prompt logprobs.

        Position p scores prompt token p + 1; tokens already scored before a preemption are skipped.
        """
        out = []
        for i, (rid, first, n) in enumerate(zip(batch.req_ids, batch.num_computed_tokens, batch.num_scheduled_tokens)):
            seq = seqs[rid]
            if seq.sampling_params.prompt_logprobs is None:
                continue
            lo = max(first, len(seq.prompt_logprobs) - 1)
            hi = min(first + n, seq.num_prompt_tokens - 1)
            if lo < hi:
                out.append((rid, lo + 1, int(query_start[i]) - first + lo, hi - lo))
        return out

    @staticmethod
    def _prompt_logprobs(spans, seqs, logits) -> dict[int, tuple[int, list]]:
        """For requests that asked: (index of the first prompt token scored, entries) for this step's chunk."""
        out, at = {}, 0
        for rid, scored, _, n in spans:
            seq = seqs[rid]
            ids = seq.token_ids[scored : scored + n]
            out[rid] = (scored, token_logprobs(logits[at : at + n], ids, seq.sampling_params.prompt_logprobs))
            at += n
        return out

    def _propose(self, batch, seqs, rows, ends, drafts, tokens, input_ids, meta, hidden) -> dict:
        """The proposer's drafts for the requests that sampled, within each one's limit.

        Called after every step, sampling or not: a proposer with KV layers of its own
        writes them for every token the target kept (middle prompt chunks too).
        """
        if self.proposer is None:
            return {}
        row_seqs = [seqs[batch.req_ids[i]] for i in rows]
        k, max_len = self.proposer.k, self.config.max_model_len
        busy = crowded(self.config.speculative_config, len(batch.req_ids))
        limits = [wanted_drafts(s, len(t), k, max_len, busy) for s, t in zip(row_seqs, tokens)]
        if self.proposer.skips_idle_steps and not any(limits):
            return {}
        query_start_loc = meta.query_start_loc_cpu
        # A sampling row's verified tokens end after its last accepted draft (whose successor
        # is the token just sampled); every other row keeps all its tokens.
        verified_end = query_start_loc[1:].copy()
        verified_end[rows] = [int(e) - len(d) + len(t) - 1 for e, d, t in zip(ends, drafts, tokens)]
        # The token after each row's last verified one: the next prompt token of a middle
        # chunk, the token just emitted where the row sampled.
        sampled = dict(zip(rows, tokens))
        rows_info = zip(batch.req_ids, batch.num_computed_tokens, batch.num_scheduled_tokens)
        next_token_ids = [
            sampled[r][-1] if r in sampled else seqs[rid].token_ids[first + n]
            for r, (rid, first, n) in enumerate(rows_info)
        ]
        inp = ProposalInput(
            seqs=row_seqs,
            new_token_ids=tokens,
            max_drafts=limits,
            batch=batch,
            batch_rows=rows,
            input_ids=input_ids,
            positions=meta.positions,
            hidden_states=hidden,
            aux_hidden_states=[self._aux_hidden[j] for j in range(len(self._aux_hidden))],
            query_start_loc=query_start_loc,
            verified_end=verified_end,
            next_token_ids=next_token_ids,
        )
        proposed = self.proposer.propose(inp)
        assert self.config.speculative_config is not None  # a proposer runs
        method = self.config.speculative_config.method
        if len(proposed) != len(row_seqs):
            raise RuntimeError(
                f"proposer {method!r} returned {len(proposed)} entries for {len(row_seqs)} drafting rows; "
                "propose() returns one Drafts (or None) per row of ProposalInput.seqs"
            )
        vocab = self.hf_config.vocab_size
        out = {}
        for seq, limit, d in zip(row_seqs, limits, proposed):
            if d is not None and d.token_ids and limit:
                if not all(0 <= t < vocab for t in d.token_ids):
                    raise ValueError(
                        f"proposer {method!r} drafted {d.token_ids} for request {seq.id}, outside [0, {vocab})"
                    )
                d.token_ids = list(d.token_ids[:limit])
                if d.probs is not None:
                    d.probs = d.probs[:limit]
                out[seq.id] = d
        return out
