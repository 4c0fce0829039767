"""Per-request sampling settings, validated where the user sets them."""

from __future__ import annotations

import math
import numbers
from typing import Any

import attrs

from atom_core._validators import boolean, in_unit_interval, is_number, token_id_list, token_ids_of

GREEDY_TEMPERATURE = 1e-5


def _int_like(value: object) -> object:
    """A numpy or other integral number becomes an int (bools stay, for the validators to refuse)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _float_like(value: object) -> object:
    """A numpy or other real number (np.float32 is no float) becomes a float; bools stay."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)
    return value


def _temperature(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {value!r}")


def _top_k(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {value!r}")


def _repetition_penalty(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 means none), got {value!r}")


def _additive_penalty(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not is_number(value) or not -2 <= value <= 2:
        raise ValueError(f"{attr.name} must be in [-2, 2] (0 means none), got {value!r}")


def _min_p(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 means none), got {value!r}")


def _max_tokens(inst: object, attr: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_tokens must be an integer >= 1, or None (up to max_model_len), got {value!r}")


def _seed(inst: object, attr: attrs.Attribute, value: object) -> None:
    # torch's `manual_seed` range (a negative seed stands for 2**64 + seed, as there): past
    # it, seeds would wrap around and silently repeat one another's tokens
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**64):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {value!r}")


# The most completions one request may ask for (`n`), here and on the server.
MAX_N = 64


def _n(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_N:
        raise ValueError(f"n must be an integer between 1 and {MAX_N}, got {value!r}")


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of a request's completion j of n: the request's own for the first, seed + j
    after it (wrapped into torch's seed range), so that seeded completions differ and repeat."""
    return seed if seed is None or j == 0 else (seed + j) % 2**64


def _num_logprobs(inst: object, attr: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
        raise ValueError(
            f"{attr.name} must be None, an integer >= 0 (how many top tokens to report) "
            f"or -1 (the whole vocabulary), got {value!r}"
        )


def _min_tokens(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {value!r}")
    max_tokens = getattr(inst, "max_tokens", None)
    if max_tokens is not None and value > max_tokens:
        raise ValueError(f"min_tokens={value} exceeds max_tokens={max_tokens}")


LOGIT_BIAS_LIMIT = 100.0


def _logit_bias(value: object) -> dict[int, float] | None:
    """Token id -> bias in [-100, 100] (OpenAI's range); JSON's string keys ("50256") become ints."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to a number, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if not isinstance(key, bool) and str(key).lstrip("-").isdigit() else -1
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        bias = _float_like(bias)
        if not is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(
                f"logit_bias[{key!r}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias!r}"
            )
        out[token] = float(bias)
    return out or None


def _structured_output(value: object) -> StructuredOutputParams | None:
    if value is None or isinstance(value, StructuredOutputParams):
        return value
    if isinstance(value, dict):
        known = {f.name for f in attrs.fields(StructuredOutputParams)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_output has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return StructuredOutputParams(**value)
    raise ValueError(f"structured_output must be a StructuredOutputParams or a mapping, got {value!r}")


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@attrs.define(kw_only=True)
class StructuredOutputParams:
    """What the output must match (vLLM's `structured_outputs`): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a regular
    expression, a `choice` of strings, or a Lark grammar (`grammar`). `backend` names a
    `structured_output_backends` entry; None takes the default ("guidance", llguidance)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    backend: str | None = None

    def __attrs_post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_output needs exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_output.json must be a JSON schema (an object or its text), got {self.json!r}")
        for name in ("regex", "grammar", "backend"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_output.choice must be a non-empty list of strings, got {self.choice!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be True or False, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _stop_strings(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"stop_strings must be a string or a list of strings, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_strings must be non-empty strings, got {s!r}")
    return items


def _allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    ids = token_ids_of("allowed_token_ids", value)
    if not ids:
        raise ValueError("allowed_token_ids must name at least one token id (None allows every token)")
    return ids


def _bad_words(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {value!r}")
    for word in value:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must hold words (non-blank strings), got {word!r}")
    return list(value)


def _truncate_prompt_tokens(inst: object, attr: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -1):
        raise ValueError(
            f"truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last k tokens), -1 (its last "
            f"max_model_len) or None, got {value!r}"
        )


def truncate_prompt(ids: Any, keep: int | None, max_model_len: int) -> Any:
    """`ids` left-truncated as `truncate_prompt_tokens` asks: its last `keep` tokens (-1: its last
    `max_model_len`); a `keep` over `max_model_len` is an error, as in vLLM."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_model_len}")
    keep = max_model_len if keep == -1 else keep
    return list(ids)[-keep:]


@attrs.define(kw_only=True, init=False)
class SamplingParams:
    temperature: float = attrs.field(default=1.0, converter=_float_like, validator=_temperature)
    top_k: int = attrs.field(default=-1, converter=_int_like, validator=_top_k)
    top_p: float = attrs.field(default=1.0, converter=_float_like, validator=in_unit_interval)
    # Tokens below min_p times the most likely one's probability are dropped (after
    # temperature, before top-k and top-p, as in vLLM).
    min_p: float = attrs.field(default=0.0, converter=_float_like, validator=_min_p)
    # vLLM's (and transformers') penalties, on the raw logits before temperature, greedy rows
    # too: repetition divides a positive logit (multiplies a negative one) of every token in
    # the prompt or the output; presence subtracts itself from every token in the output,
    # frequency itself times the token's count there. A request with one of them drafts nothing
    # under speculative decoding (each draft would need the penalties of the ones before it).
    repetition_penalty: float = attrs.field(default=1.0, converter=_float_like, validator=_repetition_penalty)
    presence_penalty: float = attrs.field(default=0.0, converter=_float_like, validator=_additive_penalty)
    frequency_penalty: float = attrs.field(default=0.0, converter=_float_like, validator=_additive_penalty)
    # None: until a stop condition or max_model_len (vLLM's None)
    max_tokens: int | None = attrs.field(default=64, converter=_int_like, validator=_max_tokens)
    # No EOS, stop token or stop string ends the request before it has this many tokens
    # (their logits are masked until then), as vLLM's min_tokens.
    min_tokens: int = attrs.field(default=0, converter=_int_like, validator=_min_tokens)
    ignore_eos: bool = attrs.field(default=False, validator=boolean)
    stop_strings: list[str] = attrs.field(factory=list, converter=_stop_strings)
    # The text ends after its stop string (or stop token's text) rather than before it (vLLM's field).
    include_stop_str_in_output: bool = attrs.field(default=False, validator=boolean)
    # End this request on any of these ids (kept in token_ids, its text only with
    # include_stop_str_in_output; finish_reason "stop_<id>"),
    # ignore_eos or not: vLLM's per-request stop_token_ids.
    stop_token_ids: list[int] = attrs.field(factory=list, converter=token_id_list)
    seed: int | None = attrs.field(default=None, converter=_int_like, validator=_seed)
    # Completions of the prompt (vLLM's n): `generate` and `chat` run n requests, completion j
    # seeded `choice_seed(seed, j)`, and return them together (a result's "outputs").
    n: int = attrs.field(default=1, converter=_int_like, validator=_n)
    # Log probabilities (vLLM's): for each generated token its own and the top n; for each
    # prompt token after the first likewise. Raw logits' log-softmax, before temperature.
    # -1: the whole vocabulary (within the engine's `max_logprobs`, as in vLLM).
    logprobs: int | None = attrs.field(default=None, converter=_int_like, validator=_num_logprobs)
    prompt_logprobs: int | None = attrs.field(default=None, converter=_int_like, validator=_num_logprobs)
    # Added to the raw logits of these token ids (before penalties and temperature): -100 all
    # but bans one, +100 all but forces it (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = attrs.field(default=None, converter=_logit_bias)
    # A grammar the output must match; its mask applies before sampling. Such a request drafts nothing.
    structured_output: StructuredOutputParams | None = attrs.field(default=None, converter=_structured_output)
    # Only these token ids may be sampled (vLLM's allowed_token_ids), before every other mask.
    allowed_token_ids: list[int] | None = attrs.field(default=None, converter=_allowed_token_ids)
    # Words the output may not contain (vLLM's bad_words): each word's tokens, with and without a
    # leading space; the last token of one is banned wherever the output ends with the rest.
    bad_words: list[str] = attrs.field(factory=list, converter=_bad_words)
    # Keep only the prompt's last k tokens (-1: its last max_model_len), vLLM's left truncation.
    truncate_prompt_tokens: int | None = attrs.field(
        default=None, converter=_int_like, validator=_truncate_prompt_tokens
    )
    # Special tokens (EOS, chat markers) left out of the text, as vLLM and transformers' decode do
    # by default; the token ids keep them either way.
    skip_special_tokens: bool = attrs.field(default=True, validator=boolean)

    def __init__(self, *, stop: str | list[str] | None = None, **fields: Any) -> None:
        """The fields by name; `stop` is vLLM's name for `stop_strings`, taken as well."""
        if stop is not None:
            if fields.get("stop_strings"):
                raise TypeError("give stop or stop_strings (the same field), not both")
            fields["stop_strings"] = stop
        unknown = sorted(set(fields) - {f.alias for f in attrs.fields(type(self))})
        if unknown:
            names = ", ".join(f.alias for f in attrs.fields(type(self)))
            raise TypeError(f"SamplingParams has no field {', '.join(map(repr, unknown))}; its fields: stop, {names}")
        self.__attrs_init__(**fields)

    def for_choice(self, j: int) -> SamplingParams:
        """The settings of completion j of `n`: one completion, seeded `choice_seed(seed, j)`."""
        child = attrs.evolve(self)
        child.n, child.seed = 1, choice_seed(self.seed, j)
        return child

    @property
    def stop(self) -> list[str]:
        """vLLM's name for `stop_strings`."""
        return self.stop_strings

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def modifies_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling: then its greedy token
        is not the raw argmax (no screened LM head), and it drafts nothing (each draft's logits
        would depend on the drafts before it)."""
        return (
            self.has_penalties
            or self.logit_bias is not None
            or self.min_tokens > 0
            or self.structured_output is not None
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def is_greedy(self) -> bool:
        """Temperature below `GREEDY_TEMPERATURE` (vLLM's 1e-5) or top_k 1: the argmax. Dividing
        float32 logits by a temperature near 1e-38 overflows them, and the softmax to NaN."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
