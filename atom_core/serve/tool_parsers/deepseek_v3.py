"""DeepSeek-V3's format (vLLM's `deepseek_v3`, and `deepseek_v31`'s): the calls between
`<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each between `<｜tool▁call▁begin｜>` and
`<｜tool▁call▁end｜>` as

    function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```

(V3, R1-0528), or `NAME<｜tool▁sep｜>{...}` (V3.1 on). The markers are special tokens, which the
reply's text keeps under this parser."""

from __future__ import annotations

import json

from atom_core.serve.text_stream import held
from atom_core.serve.tool_parser import ParsedCall, TaggedToolParser, call_of

CALLS_BEGIN, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(TaggedToolParser):
    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    skip_special_tokens = False

    def calls_begin(self, text: str) -> int:
        found = [i for i in (text.find(CALLS_BEGIN), text.find(self.start)) if i >= 0]
        return min(found, default=-1)

    def held_back(self, text: str) -> int:
        return max(held(CALLS_BEGIN, text), held(self.start, text))

    def call(self, body: str) -> ParsedCall | None:
        kind, sep, rest = body.partition(SEP)
        if not sep:
            return None
        if kind.strip() == "function":  # V3: the name, then its arguments in a ```json fence
            name, _, fenced = rest.partition("\n")
            arguments = fenced.strip().removeprefix("```json").removesuffix("```").strip()
        else:
            name, arguments = kind, rest.strip()
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return call_of({"name": name.strip(), "arguments": value})
