"""`POST /v1/responses` (OpenAI's Responses API) as the `openai` client sees it: the same
replies as chat completions, function calls and reasoning as output items, typed stream events
that the client's own accumulator reads back into the whole response."""

from __future__ import annotations

import json

import openai
import pytest
from test_tool_calls import CALLS, SEED_THINK, tool_server  # noqa: F401 (a fixture)

QUESTION = "What is the capital of France?"
FLAT_TOOLS = [
    {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "function", "name": "time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]  # fmt: skip


def model(client) -> str:
    return client.models.list().data[0].id


def test_a_text_response_is_the_chat_reply_with_its_usage(tool_server):  # noqa: F811
    chat = tool_server.chat.completions.create(
        model=model(tool_server), messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    r = tool_server.responses.create(
        model=model(tool_server), instructions="Be brief.", input=QUESTION, max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == chat.usage.total_tokens and r.instructions == "Be brief."
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want and (want == "completed" or r.incomplete_details.reason == "max_output_tokens")
    as_items = tool_server.responses.create(
        model=model(tool_server), max_output_tokens=12, temperature=0,
        input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )  # fmt: skip
    assert as_items.output_text == r.output_text


def test_calls_and_reasoning_are_output_items_whole_and_streamed(tool_server):  # noqa: F811
    ask = dict(
        model=model(tool_server),
        input="Weather in Paris?",
        tools=FLAT_TOOLS,
        extra_body={"seed": SEED_THINK},
        max_output_tokens=100,
    )
    r = tool_server.responses.create(**ask)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert (
        r.output[0].content[0].text == "\nThe user wants Paris.\n" and r.output[1].content[0].text == "Let me look.\n"
    )
    assert [(i.name, i.arguments) for i in r.output[2:]] == [(c.name, c.arguments) for c in CALLS]
    assert all(i.call_id.startswith("chatcmpl-tool-") and i.status == "completed" for i in r.output[2:])
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens > 0

    events = list(tool_server.responses.create(stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (r.output[0].content[0].text, r.output_text)
    final = events[-1].response
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in r.output
    ]
    with tool_server.responses.stream(**ask) as stream:  # the client's accumulator reads the events back
        whole = stream.get_final_response()
    assert whole.output_text == r.output_text and [i.type for i in whole.output] == [i.type for i in r.output]


def test_function_call_outputs_go_back_as_tool_turns(tool_server):  # noqa: F811
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
    ]
    r = tool_server.responses.create(model=model(tool_server), input=turn, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=4, temperature=0)  # fmt: skip
    chat = tool_server.chat.completions.create(
        model=model(tool_server), tools=[{"type": "function", "function": {k: t[k] for k in ("name", "parameters")}} for t in FLAT_TOOLS],
        tool_choice="none", max_tokens=4, temperature=0,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": '{"zone": "CET"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        ],
    )  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content


def test_json_schema_output_and_a_cut_reply(tool_server):  # noqa: F811
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}  # fmt: skip
    r = tool_server.responses.create(
        model=model(tool_server), input=QUESTION, max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(r.output_text)) == {"city"}
    cut = tool_server.responses.create(model=model(tool_server), input=QUESTION, max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2


def test_log_probabilities_whole_and_streamed_are_the_chat_replys(tool_server):  # noqa: F811
    """`include` with message.output_text.logprobs: each token's entry, with `top_logprobs`
    alternatives, as chat completions give them; streamed, the text's deltas carry them."""
    ask = dict(model=model(tool_server), input=QUESTION, max_output_tokens=12, temperature=0)
    chat = tool_server.chat.completions.create(
        model=ask["model"], messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(want) == chat.usage.completion_tokens and all(len(e["top_logprobs"]) == 3 for e in want)
    r = tool_server.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3)
    assert r.output_text == chat.choices[0].message.content and r.top_logprobs == 3
    assert [e.model_dump() for e in r.output[0].content[0].logprobs] == want
    assert tool_server.responses.create(**ask).output[0].content[0].logprobs == []  # not asked for

    events = list(tool_server.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3, stream=True))  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [e.model_dump() for d in deltas for e in d.logprobs] == want
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [e.model_dump() for e in done.logprobs] == want
    assert [e.model_dump() for e in events[-1].response.output[0].content[0].logprobs] == want


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id", "responses kept on the server"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "'input_image' are not supported"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({"include": ["output_text.logprobs"]}, "include", "'output_text.logprobs' is not one of"),
        ({"include": "message.output_text.logprobs"}, "include", "include must be a list"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(tool_server, extra, param, says):  # noqa: F811
    ask = {"model": model(tool_server), "input": QUESTION, "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        tool_server.responses.create(**ask)
    assert says in str(e.value) and e.value.body["param"] == param, e.value.body


def test_a_client_that_leaves_a_response_stream_frees_its_request(tool_server):  # noqa: F811
    import httpx
    from test_serve import settles_idle

    url = str(tool_server.base_url).rstrip("/").removesuffix("/v1")
    body = {"input": QUESTION, "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break  # leave mid-reply: the server aborts the request
    # its blocks are back within a few steps, even on a loaded host (the 900-token reply would take far longer)
    assert settles_idle(url, 5)
