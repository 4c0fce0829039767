"""The built-in structured-output backend: llguidance (JSON schema, regex, choice, Lark).

No compile step ahead of time and no dependencies beyond its wheel; a matcher is built per
request at `add_request`. JSON is compact (no optional whitespace: a small model could
otherwise pad its output with blanks until max_tokens).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from atom_core.sampling_params import StructuredOutputParams
from atom_core.structured_output.backend import Grammar, StructuredOutputBackend

COMPACT_JSON: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: Any):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        try:
            import llguidance.hf
        except ImportError as e:  # an optional dependency: say how to get it
            raise ValueError("structured output needs llguidance: pip install llguidance") from e
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model folder has none")
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids[0] if eos_token_ids else None
        )

    def compile(self, params: StructuredOutputParams) -> Grammar:
        import llguidance

        matcher_cls = llguidance.LLMatcher
        kind = params.kind
        if kind == "json" or kind == "json_object":
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_output.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_output.json must be a JSON schema object, got {schema!r}")
            try:
                grammar = matcher_cls.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
            except ValueError as e:
                raise ValueError(f"structured_output.json is not a JSON schema llguidance reads: {e}") from None
        elif kind == "regex":
            grammar = matcher_cls.grammar_from_regex(params.regex or "")
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(params.choice))
        else:
            grammar = llguidance.grammar_from("grammar", params.grammar or "")
        error = matcher_cls.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_output.{kind} does not compile: {error.strip()}")
        matcher = matcher_cls(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_output.{kind} does not compile: {matcher.get_error().strip()}")
        return GuidanceGrammar(matcher)
