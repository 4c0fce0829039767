"""`atom serve`: the engine core in a process of its own, the OpenAI API in this one (uvicorn).

Binds 127.0.0.1 unless told otherwise. The core loads the model and builds its kernels
before the API takes requests; a core that fails to start stops the server with its error.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("atom")

# `Config` defaults a server changes, as vLLM's `serve` does for CPUs: the prefix cache on,
# and a step's token budget small enough that a long prompt, split into chunks of it, holds
# up the other requests' streams for one chunk at a time.
SERVE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": True, "max_num_batched_tokens": 2048}


def serve(
    model: str | None,
    config: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    health_timeout: float = 5.0,
    core_threads: int | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> None:
    """`tool_call_parser`: a tool_parsers registry name, for requests whose tool_choice is "auto"
    (`--enable-auto-tool-choice --tool-call-parser NAME`); `reasoning_parser`: a
    reasoning_parsers one, to split replies into `reasoning` and `content`."""
    from atom_core.engine.model_source import resolve_model
    from atom_core.plugins.manager import get_registry
    from atom_core.serve.client import EngineClient

    parser = get_registry("tool_parsers").get(tool_call_parser) if tool_call_parser else None  # unknown: fail now
    thinker = get_registry("reasoning_parsers").get(reasoning_parser) if reasoning_parser else None
    folder = resolve_model(model)  # a .gguf is converted here, once, before the core starts
    client = EngineClient(str(folder), {**SERVE_DEFAULTS, **config}, threads=core_threads)
    client.launch()  # the cores load the model while this process loads the tokenizer and the app
    try:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from transformers import AutoTokenizer

        from atom_core.serve.openai_api import build_app, error_body

        tokenizer = AutoTokenizer.from_pretrained(folder)
    except BaseException:
        client.kill()
        raise
    name = served_model_name or (Path(model).stem if model else folder.name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        api = build_app(client, tokenizer, name, health_timeout, parser, thinker)
        app.mount("/", api)
        logger.warning("atom: serving %s on http://%s:%d", name, host, port)
        yield
        await client.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None)
    if api_key:

        @app.middleware("http")
        async def check_key(request: Request, call_next: Any) -> Any:
            guarded = request.url.path.startswith("/v1/") or request.url.path in ("/tokenize", "/detokenize")
            given = request.headers.get("authorization", "")
            if guarded and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(error_body(401, "a valid API key is needed: Authorization: Bearer <key>"), 401)
            return await call_next(request)

    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", loop="asyncio")
    finally:
        if client.ready is None:  # the cores never came up (or the app never started them): none stays behind
            client.kill()
