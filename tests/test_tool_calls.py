"""What a model writes in its own format, read by the parsers the server was started with:
tool calls for tool_choice "auto" (`--enable-auto-tool-choice --tool-call-parser`) and
reasoning (`--reasoning-parser`), whole and streamed; each parser on its own, every way a
stream can cut its text, and the server end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
from test_serve import start_server, stop_server
from transformers import AutoTokenizer

from atom_core.engine.chat_template import chat_text
from atom_core.engine.fetch import fetch_default_model
from atom_core.plugins.manager import get_registry
from atom_core.serve.reasoning_parser import ReasoningStream
from atom_core.serve.tool_parser import ParsedCall
from atom_core.serve.tools import AutoToolCalls, tool_calls_for, tool_functions

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}, "exact": {"type": "boolean"},
                                         "where": {"type": "object"}}}}},
]  # fmt: skip

FUNCTIONS = tool_functions(TOOLS)

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
LLAMA = (
    '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "time", "parameters": {"zone": "CET"}}'
)
QWEN3_CODER = (
    "Let me look.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=time>\n"
    "<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
MISTRAL = (
    'Let me look.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "time", "arguments": {"zone": "CET"}}]'
)
MISTRAL_V11 = 'Let me look.[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]time[ARGS]{"zone": "CET"}'
PYTHONIC = '[weather(city="Paris", days=2), time(zone="CET")]'
DEEPSEEK_V3 = (
    "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"
    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n'
    '```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
CALLS = [
    ParsedCall("weather", json.dumps({"city": "Paris", "days": 2})),
    ParsedCall("time", json.dumps({"zone": "CET"})),
]
CASES = [
    ("hermes", HERMES, "Let me look.\n"),
    ("llama3_json", LLAMA, None),
    ("qwen3_coder", QWEN3_CODER, "Let me look.\n"),
    ("mistral", MISTRAL, "Let me look."),
    ("mistral", MISTRAL_V11, "Let me look."),
    ("pythonic", PYTHONIC, None),
    ("pythonic", "<|python_start|>" + PYTHONIC + "<|python_end|>", None),
    ("deepseek_v3", DEEPSEEK_V3, "Let me look."),
    ("deepseek_v3", DEEPSEEK_V31, "Let me look."),
]


def parser(name: str):
    return get_registry("tool_parsers").get(name)(FUNCTIONS)


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_each_parser_reads_the_content_and_calls_of_a_whole_reply(name, text, content):
    reply = parser(name).parse(text, final=True)
    assert (reply.content, reply.calls, reply.malformed) == (content, CALLS, False)
    plain = "Paris is in France; {it} is <b>nice</b>."
    assert parser(name).parse(plain, final=True).calls == []


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_a_streamed_reply_gives_the_same_content_and_calls_wherever_its_text_is_cut(name, text, content):
    """Each call goes out whole, once, in order, and no piece of a call's markup reaches the content."""
    for cut in range(1, len(text)):  # two pieces, cut at every character
        for pieces in ([text[:cut], text[cut:]], list(text) if cut == 1 else None):
            if pieces is None:
                continue
            stream = AutoToolCalls(type(parser(name)), FUNCTIONS).stream()
            sent, calls, so_far = "", [], ""
            for k, piece in enumerate(pieces):
                so_far += piece
                delta = stream.delta(piece, so_far, k == len(pieces) - 1)
                sent += delta.get("content", "")
                calls += delta.get("tool_calls", [])
            assert sent == (content or ""), (cut, sent)
            assert [c["index"] for c in calls] == [0, 1]
            assert [ParsedCall(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS
            assert stream.reason("stop") == "tool_calls"


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "deepseek_v3"])
def test_text_that_only_looks_like_the_start_of_a_call_is_streamed_as_text(name):
    text = {"llama3_json": "  The answer", "pythonic": "  The answer", "mistral": "  The tag is [TOOL_CA"}.get(
        name, "  The tag is <tool_ca" if name != "deepseek_v3" else "  The tag is <｜tool▁call"
    )
    stream = AutoToolCalls(type(parser(name)), FUNCTIONS).stream()
    first = stream.delta(text, text, False).get("content", "")
    rest = stream.delta("", text, True).get("content", "")
    assert first + rest == text and stream.reason("stop") == "stop"


def test_hermes_calls_that_do_not_read_are_text_and_a_cut_last_call_leaves_the_others():
    broken = '<tool_call>\n{"name": "weather", "arguments": {"city": \n</tool_call>'
    assert AutoToolCalls(type(parser("hermes")), FUNCTIONS).message(broken) is None  # the server sends the text
    stream = AutoToolCalls(type(parser("hermes")), FUNCTIONS).stream()
    assert stream.delta(broken, broken, True) == {"content": broken} and stream.reason("stop") == "stop"
    cut = HERMES[: HERMES.rindex('"zone"')]  # max_tokens ended the second call
    assert parser("hermes").parse(cut, final=True).calls == CALLS[:1]
    # A last call that was written whole but never closed is read at the end (vLLM's reading).
    unclosed = HERMES.removesuffix("</tool_call>")
    assert parser("hermes").parse(unclosed, final=False).calls == CALLS[:1]
    assert parser("hermes").parse(unclosed, final=True).calls == CALLS


def test_a_tagged_parser_reads_on_from_its_last_closed_call_and_only_on_the_same_reply():
    """One parser per reply, handed its text as it grows: what follows the calls already read is
    read (not the whole again); a text that is not that reply grown is read from its start."""
    one = parser("hermes")
    calls = [ParsedCall("weather", json.dumps({"city": f"c{i}"})) for i in range(40)]
    body = "".join(f'<tool_call>\n{{"name": "weather", "arguments": {c.arguments}}}\n</tool_call>\n' for c in calls)
    for end in range(0, len(body) + 1, 7):
        got = one.parse(body[:end], final=False).calls
        assert got == calls[: body[:end].count("</tool_call>")]
    assert one.parse(body, final=True).calls == calls
    assert one.parse(HERMES, final=True).calls == CALLS  # another reply: read whole
    bad = body + '<tool_call>\n{"name": "weather", "arguments": {"city": \n</tool_call>'
    assert one.parse(body, final=False).calls == calls and one.parse(bad, final=False).malformed
    assert one.parse(bad, final=True).malformed


def test_llama3_json_reads_on_from_its_last_whole_call_and_only_on_the_same_reply():
    one = parser("llama3_json")
    calls = [ParsedCall("weather", json.dumps({"city": f"c{i}"})) for i in range(40)]
    body = "; ".join(f'{{"name": "weather", "parameters": {c.arguments}}}' for c in calls)
    for end in range(0, len(body) + 1, 5):
        whole = parser("llama3_json").parse(body[:end], final=False)
        assert one.parse(body[:end], final=False) == whole, end
    assert one.parse(body, final=True).calls == calls
    assert one.parse(LLAMA, final=True).calls == CALLS  # another reply: read whole
    assert one.parse(body + '; {"city": "x"}', final=True).malformed  # a value that is no call


@pytest.mark.parametrize(
    ("name", "write", "joiner", "opening", "closing"),
    [
        ("pythonic", lambda i: f'weather(city="c, {i}]", days={i})', ", ", "[", "]"),
        ("pythonic", lambda i: f'weather(city="c{i}", days={i})', ",\n ", "<|python_start|>[", "]<|python_end|>"),
        ("mistral", lambda i: f'{{"name": "weather", "arguments": {{"city": "c, {i}]", "days": {i}}}}}', ", ",
         "Sure.[TOOL_CALLS] [", "]"),
        ("mistral", lambda i: f'[TOOL_CALLS]weather[ARGS]{{"city": "c, {i}]", "days": {i}}}', "", "Sure.", ""),
    ],
)  # fmt: skip
def test_list_and_named_calls_stream_one_by_one_reading_on_from_the_last(name, write, joiner, opening, closing):
    """Pythonic and Mistral replies: each call is read once written whole (not when the list
    closes), on from the calls already read, and a text that is not that reply grown is read
    from its start; separators inside strings do not end a call."""
    one = parser(name)
    calls = [ParsedCall("weather", json.dumps({"city": f"c, {i}]" if "c, " in write(0) else f"c{i}", "days": i}))
             for i in range(30)]  # fmt: skip
    body = opening + joiner.join(write(i) for i in range(30)) + closing
    ends = [len(opening + joiner.join(write(i) for i in range(n + 1))) for n in range(30)]
    for end in range(0, len(body) + 1, 3):
        got = one.parse(body[:end], final=False)
        assert got == parser(name).parse(body[:end], final=False), end
        assert not got.malformed and len(got.calls) >= sum(e < end for e in ends) - 1, end  # at most the last waits
        assert got.calls == calls[: len(got.calls)]
    assert one.parse(body, final=True).calls == calls
    other = {"pythonic": PYTHONIC, "mistral": MISTRAL}[name]
    assert one.parse(other, final=True).calls == CALLS  # another reply: read whole
    if closing:  # a value that is no call, after calls that are
        bad = body.removesuffix(closing) + joiner + "3" + closing
        assert one.parse(bad, final=True).malformed and parser(name).parse(bad, final=True).malformed
        # a list still open at the end (max_tokens) streamed its calls, but is no calls as a whole
        cut = body[: ends[3] + len(joiner) + 5]
        assert parser(name).parse(cut, final=False).calls == calls[:4]
        assert parser(name).parse(cut, final=True) == type(got)(cut, [], malformed=True)


def test_llama3_json_takes_the_python_tag_and_arguments_written_as_text():
    tagged = '<|python_tag|>{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}'
    assert parser("llama3_json").parse(tagged, final=True).calls == CALLS[:1]
    assert parser("llama3_json").parse('{"city": "Paris"}', final=True).malformed  # JSON, but no call


def test_mistral_pythonic_and_deepseek_replies_that_are_no_calls_are_text():
    for name, text in (
        ("mistral", 'Sure.[TOOL_CALLS] [{"name": "weather", "arguments": {"city": '),  # cut in the first call
        ("mistral", "Sure.[TOOL_CALLS]weather"),
        ("pythonic", "[1, 2, 3] are the numbers."),
        ("pythonic", "[weather(city=Paris)]"),  # a name, not a literal
        ("pythonic", "[weather('Paris')]"),  # positional
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{bad}\n```"
                        "<｜tool▁call▁end｜>"),
    ):  # fmt: skip
        reply = parser(name).parse(text, final=True)
        assert (reply.content, reply.calls, reply.malformed) == (text, [], True), (name, text)
        assert AutoToolCalls(type(parser(name)), FUNCTIONS).message(text) is None
    # a call cut short at the end leaves the ones before it
    cut = 'Hi[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]time[ARGS]{"zo'
    assert parser("mistral").parse(cut, final=True).calls == CALLS[:1]
    dotted = parser("pythonic").parse('[brave_search.call(query="x", n=None, tags=["a", 1.5])]', final=True)
    assert dotted.calls == [ParsedCall("brave_search.call", json.dumps({"query": "x", "n": None, "tags": ["a", 1.5]}))]


def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text():
    keeps = {name for name in ("hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "deepseek_v3")
             if not type(parser(name)).skip_special_tokens}  # fmt: skip
    assert keeps == {"mistral", "deepseek_v3"}


def test_qwen3_coder_types_parameters_by_the_tools_schema():
    text = (
        "<tool_call>\n<function=time>\n<parameter=zone>\n007\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
        '<parameter=where>\n{"lat": 1.5}\n</parameter>\n<parameter=extra>\ntwo\nlines\n</parameter>\n</function>\n</tool_call>'
    )
    (call,) = parser("qwen3_coder").parse(text, final=True).calls
    assert call.name == "time"
    assert json.loads(call.arguments) == {"zone": "007", "exact": True, "where": {"lat": 1.5}, "extra": "two\nlines"}


def test_auto_needs_a_parser_and_says_which_flags_give_one():
    body = {"tools": TOOLS, "messages": []}
    with pytest.raises(ValueError, match="--enable-auto-tool-choice and --tool-call-parser"):
        tool_calls_for(body)
    assert isinstance(tool_calls_for({**body, "tool_choice": "auto"}, type(parser("hermes"))), AutoToolCalls)
    assert tool_calls_for({**body, "tool_choice": "none"}, type(parser("hermes"))) is None


def test_history_tool_call_arguments_reach_the_template_as_objects():
    """Templates that write `arguments | tojson` (Llama 3.1's, Qwen2.5's) must not quote the text again."""
    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model(quiet=True))
    tokenizer.chat_template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{{ m.content }}|{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "2", "type": "function", "function": {"name": "time", "arguments": "not json"}},
        ]},
    ]  # fmt: skip
    assert chat_text(tokenizer, messages) == 'weather?|weather{"city": "Paris"}time"not json"|'


def test_the_two_flags_go_together_and_an_unknown_parser_is_named():
    run = [sys.executable, "-m", "atom_core.cli", "serve", "--port", "1"]
    r = subprocess.run([*run, "--enable-auto-tool-choice"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "go together" in r.stderr
    r = subprocess.run([*run, "--enable-auto-tool-choice", "--tool-call-parser", "nope"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "unknown tool-call parser 'nope'" in r.stderr and "hermes" in r.stderr


THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\n"


def split_whole(name: str, text: str) -> tuple[str, str]:
    return get_registry("reasoning_parsers").get(name)().split(text, final=True)


@pytest.mark.parametrize(
    ("name", "text", "want"),
    [
        ("qwen3", THOUGHT + "It is sunny.", ("\nThe user wants Paris.\n", "It is sunny.")),
        ("qwen3", "It is sunny, <think> aside.", ("", "It is sunny, <think> aside.")),  # thinking off
        ("qwen3", "<think>\nStill thinking", ("\nStill thinking", "")),  # cut by max_tokens
        ("deepseek_r1", "The user wants Paris.\n</think>\n\nIt is sunny.", ("The user wants Paris.\n", "It is sunny.")),
        ("deepseek_r1", THOUGHT + "It is sunny.", ("\nThe user wants Paris.\n", "It is sunny.")),
        ("deepseek_r1", "Still thinking", ("Still thinking", "")),
    ],
)
def test_reasoning_parsers_split_a_whole_reply_and_every_cut_stream_alike(name, text, want):
    assert split_whole(name, text) == want
    for cut in range(len(text) + 1):
        stream = ReasoningStream(get_registry("reasoning_parsers").get(name)())
        said, answers = "", []
        for k, so_far in enumerate((text[:cut], text)):
            new, answer = stream.add(so_far, final=k == 1)
            said += new
            assert not answers or answer.startswith(answers[-1])  # the answer only grows
            answers.append(answer)
        assert (said, answers[-1]) == want, cut
        assert "think>" not in said  # no piece of a tag is ever sent as reasoning


def test_chat_template_kwargs_reach_the_template():
    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model(quiet=True))
    tokenizer.chat_template = "{% if enable_thinking is false %}no-think {% endif %}{{ messages[0].content }}"
    messages = [{"role": "user", "content": "hi"}]
    assert chat_text(tokenizer, messages, template_kwargs={"enable_thinking": False}) == "no-think hi"
    assert chat_text(tokenizer, messages) == "hi"


SEED_CALLS, SEED_TEXT, SEED_THINK = 4242, 4343, 4444
PLAIN = "Paris is sunny <today>."


def scripted_server(folder, parser: str, replies: dict[int, str], *flags: str):
    """A server reading `parser`'s calls whose scripted sampler writes replies[seed] for a request
    seeded `seed`; yields its client."""
    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model(quiet=True))
    script = folder / "replies.json"
    script.write_text(json.dumps({
        "eos": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "replies": {str(s): tokenizer.encode(t, add_special_tokens=False) for s, t in replies.items()},
    }))  # fmt: skip
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc, url = start_server(
        "--sampler", "scripted", "--enable-auto-tool-choice", "--tool-call-parser", parser, *flags,
        env={"ATOM_PLUGINS": "script_plugin", "ATOM_SCRIPT_FILE": str(script),
             "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(proc)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A server reading Hermes calls and Qwen3's reasoning, whose scripted sampler writes HERMES
    for requests seeded SEED_CALLS, PLAIN for SEED_TEXT and THOUGHT + HERMES for SEED_THINK."""
    replies = {SEED_CALLS: HERMES, SEED_TEXT: PLAIN, SEED_THINK: THOUGHT + HERMES}
    yield from scripted_server(tmp_path_factory.mktemp("script"), "hermes", replies, "--reasoning-parser", "qwen3")


def ask(client, seed: int, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, seed=seed, temperature=0, max_tokens=100, **extra,
    )  # fmt: skip


def test_the_server_answers_auto_with_the_calls_the_model_wrote_whole_and_streamed(tool_server):
    r = ask(tool_server, SEED_CALLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("function", c.name, c.arguments) for c in CALLS
    ]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and len({c.id for c in calls}) == 2
    chunks = [c for c in ask(tool_server, SEED_CALLS, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look.\n" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (k, c.name, c.arguments) for k, c in enumerate(CALLS)
    ]


def test_a_reply_without_calls_is_plain_text_whole_and_streamed(tool_server):
    r = ask(tool_server, SEED_TEXT)
    assert r.choices[0].message.content == PLAIN and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = [c for c in ask(tool_server, SEED_TEXT, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == PLAIN
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_reasoning_is_split_from_the_answer_and_its_calls_whole_and_streamed(tool_server):
    r = ask(tool_server, SEED_THINK)
    message = r.choices[0].message
    assert message.reasoning == message.reasoning_content == "\nThe user wants Paris.\n"
    assert message.content == "Let me look.\n" and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in CALLS
    ]
    chunks = [c for c in ask(tool_server, SEED_THINK, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == "Let me look.\n"
    assert [(t.function.name, t.function.arguments) for d in deltas for t in (d.tool_calls or [])] == [
        (c.name, c.arguments) for c in CALLS
    ]
    plain = ask(tool_server, SEED_TEXT).choices[0].message  # no <think>: all answer
    assert plain.content == PLAIN and plain.reasoning is None


def test_chat_template_kwargs_are_taken_and_reserved_names_refused(tool_server):
    r = ask(tool_server, SEED_TEXT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == PLAIN
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set tools"):
        ask(tool_server, SEED_TEXT, extra_body={"chat_template_kwargs": {"tools": []}})


CONTINUED = [
    {"role": "user", "content": "Name a city."},
    {"role": "assistant", "content": "The capital of France is"},
]


def test_offline_chat_takes_vllms_template_keywords():
    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine

    engine = LLMEngine(fetch_default_model(quiet=True), max_model_len=512)
    ids = engine.apply_chat_template(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert engine.tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    continued = engine.chat(CONTINUED, greedy, False, add_generation_prompt=False, continue_final_message=True)
    assert continued[0]["token_ids"] == engine.generate(ids, greedy, use_tqdm=False)[0]["token_ids"]
    with pytest.raises(ValueError, match="cannot both be true"):
        engine.apply_chat_template(CONTINUED, continue_final_message=True)
    opened = engine.apply_chat_template(CONTINUED)  # the default: a closed turn, then the reply's opening
    assert engine.tokenizer.decode(opened).endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")


def test_the_server_continues_a_final_message_when_asked(tool_server):
    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model(quiet=True))
    want = len(tokenizer.encode(chat_text(tokenizer, CONTINUED, None, None, False, True), add_special_tokens=False))
    r = tool_server.chat.completions.create(
        model=tool_server.models.list().data[0].id, messages=CONTINUED, max_tokens=2, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    assert r.usage.prompt_tokens == want
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs add_generation_prompt=false"):
        tool_server.chat.completions.create(
            model=tool_server.models.list().data[0].id, messages=CONTINUED, max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip


def test_a_parser_whose_markers_are_special_tokens_gets_the_text_that_keeps_them(tmp_path):
    """Under `mistral` the reply's text keeps special tokens (its `[TOOL_CALLS]` is one in
    Mistral's vocabulary; here `<|im_start|>`, one of SmolLM2's, shows it is kept)."""
    reply = "<|im_start|>" + MISTRAL
    for client in scripted_server(tmp_path, "mistral", {SEED_CALLS: reply}):
        for stream in (False, True):
            if stream:
                chunks = [c for c in ask(client, SEED_CALLS, stream=True) if c.choices]
                content = "".join(c.choices[0].delta.content or "" for c in chunks)
                calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            else:
                message = ask(client, SEED_CALLS).choices[0].message
                content, calls = message.content, message.tool_calls
            assert content == "<|im_start|>Let me look."
            assert [ParsedCall(c.function.name, c.function.arguments) for c in calls] == CALLS
