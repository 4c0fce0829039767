"""Reading an OpenAI-compatible server's stream (server-sent events), for `atom chat` and `atom bench serve`."""

from __future__ import annotations

import json
from typing import Any


class StreamError(RuntimeError):
    """The server sent an error event mid-stream."""


def sse_event(line: str) -> dict[str, Any] | None:
    """One `data: {...}` line's event; None for other lines and `[DONE]`; StreamError for an error event."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event = json.loads(line[len("data: ") :])
    if "error" in event:
        raise StreamError(event["error"]["message"])
    return event
