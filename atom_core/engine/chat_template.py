"""OpenAI-style chat messages through a model's chat template: one reading for `LLMEngine.chat`,
`atom chat` and the server's chat completions."""

from __future__ import annotations

import json
from typing import Any


def text_content(content: Any, index: int) -> str:
    """A message's content as the chat template reads it: a string; OpenAI's list of content
    parts (`[{"type": "text", "text": ...}, ...]`) joined into one string, as vLLM does; none
    (an assistant turn that only called tools) as empty text. A part of another type (an
    image) is a ValueError."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of parts, got {content!r}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{index}].content: only text parts are supported, got a {kind!r} part")
        texts.append(part["text"])
    return "\n".join(texts)


def tool_calls_of(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's `tool_calls` with each call's `arguments` as the object its JSON text
    is, as vLLM hands them to a template: Llama's and Qwen2.5's write `arguments | tojson`,
    which would quote the text once more. {} for a turn without calls."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return {}
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(function, dict) and isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except json.JSONDecodeError:
                pass  # left as the text it is
        out.append(call)
    return {"tool_calls": out}


def chat_text(
    tokenizer: Any, messages: Any, tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:  # fmt: skip
    """The prompt `messages` make through the tokenizer's chat template, ready for the reply
    (`tools`: OpenAI's, for a template that lists them; `template_kwargs`: the template's own
    variables, vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), or with
    `continue_final_message` open at the end of the last message, for the model to go on with
    it; ValueError naming the message a template could not take (rather than jinja's error)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role' string, got {m!r}")
    messages = [{**m, "content": text_content(m.get("content"), i), **tool_calls_of(m)} for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}),
        )  # fmt: skip
    except Exception as e:  # the template's own checks (jinja2's errors, raise_exception)
        raise ValueError(f"the model's chat template cannot render these messages: {e}") from None
