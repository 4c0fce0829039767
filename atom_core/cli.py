"""The `atom` command: `atom generate`, `atom fetch`, `atom plugins`, `atom env`, `atom kernels`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from atom_core.platform.cpu_features import VARIANT_NAMES
from atom_core.serve.server import SERVE_DEFAULTS

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
)


def _json_object(text: str) -> dict:
    """argparse type: a JSON object, its parse error named (argparse would say only "invalid loads value")."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'must be a JSON object such as \'{{"method": "ngram"}}\', got {text!r}')
    return value


# One-shot commands answer on the torch path while the C++ kernels build in the background
# (the first run on a fresh install); a server or benchmark waits for them (atom_core.layers.cpp).
BACKGROUND_BUILD_COMMANDS = ("generate", "chat")


@contextlib.contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """`name=value` in the environment (children inherit it) unless set, as before afterwards."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atom", description="Atom: a small, pluggable LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {len(DEFAULT_PROMPTS)} sample questions)")
    gen.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = none; > 1 discourages repeats")
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none", "int8", "int4"],
        help="weights: auto (the default: a GGUF keeps its 4/8-bit blocks), none, int8, int4",
    )
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument(
        "--scheduling-policy", default=None, help="prefill_first, mixed (the default), spyre, or a plugin's"
    )
    gen.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default 16384)")
    gen.add_argument("--sampler", default=None, help="a samplers registry name (default: 'default'), e.g. a plugin's")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
    gen.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="ranks to split the model across (default 1)"
    )
    gen.add_argument("--enable-expert-parallel", action="store_true", default=None, help="MoE: whole experts per rank")
    gen.add_argument("--distributed-executor", default=None, help="mp (the default), torchrun, or a plugin's")
    gen.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='draft-and-verify decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    gen.add_argument(
        "--additional-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="settings a plugin declares, e.g. '{\"max_batch_tkv_limit\": 8192}' for the spyre policy",
    )

    fetch = sub.add_parser("fetch", help="install the default model (SmolLM2-135M-Instruct) into the cache")
    fetch.add_argument("--cache-dir", default=None, help="default: $ATOM_CACHE_DIR or ~/.cache/atom")

    sub.add_parser("plugins", help="list installed plugins and what they register")
    sub.add_parser("env", help="this CPU's features, torch's CPU level, and which variant each C++ kernel runs")
    kernels = sub.add_parser("kernels", help="build the C++ CPU kernels now (scripts/setup.sh runs this)")
    kernels.add_argument(
        "--variant",
        action="append",
        choices=["all", *VARIANT_NAMES],
        default=None,
        help="a variant to build (repeatable; default: this CPU's; all: every one it can run)",
    )
    kernels.add_argument(
        "--idle",
        action="store_true",
        help="compile only on cores nothing else wants (SCHED_IDLE): the background build a first "
        "`atom generate` or `atom chat` starts, so it does not slow the run that started it",
    )

    worker = sub.add_parser(
        "worker",
        help="a tensor-parallel rank other than 0 under torchrun (rank 0 runs the engine with "
        "--distributed-executor torchrun); its config comes from rank 0",
    )
    worker.add_argument(
        "--model", default=None, help="the model folder on this host, if not where rank 0 has it (default: rank 0's)"
    )
    worker.add_argument("--distributed-backend", default="auto", help="as rank 0's: auto (gloo on CPU), gloo, nccl")

    serve = sub.add_parser("serve", help="an OpenAI-compatible server (POST /v1/completions, /v1/chat/completions)")
    serve.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* and /tokenize")
    serve.add_argument(
        "--health-timeout", type=float, default=5.0,
        help="/health answers 503 once an engine core has been silent this long (it sends a heartbeat every 0.5 s)",
    )  # fmt: skip
    serve.add_argument(
        "--core-threads", type=int, default=None,
        help="torch threads of each engine core (default: this machine's cores / --data-parallel-size)",
    )  # fmt: skip
    serve.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='answer tool_choice "auto" (the default with tools) by reading the calls the model writes',
    )  # fmt: skip
    serve.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), "
        "qwen3_coder (Qwen3-Coder, Qwen3-Next, Qwen3.5), mistral (Mistral, Mixtral), pythonic (Llama 3.2, Llama 4), "
        "deepseek_v3 (DeepSeek-V3, V3.1, R1-0528), or a plugin's (atom plugins lists them)",
    )  # fmt: skip
    serve.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="split replies into `reasoning` and `content`: qwen3 (Qwen3 in thinking mode), deepseek_r1 "
        "(DeepSeek-R1, QwQ, Qwen3 Thinking-2507), or a plugin's",
    )  # fmt: skip
    add_config_flags(serve, SERVE_DEFAULTS)

    talk = sub.add_parser("chat", help="a streamed chat on the terminal, with a local model or a server (--url)")
    talk.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: SmolLM2)")
    talk.add_argument("--url", default=None, help="an `atom serve` (or any OpenAI-compatible) server's base URL")
    talk.add_argument("--api-key", default=None)
    talk.add_argument("--max-tokens", type=int, default=None, help="per reply (default: up to the context)")
    talk.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")

    bench = sub.add_parser("bench", help="measure a server (bench serve) or the engine in-process (bench offline)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="load an OpenAI-compatible server; TTFT, TPOT, ITL, throughput")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default=None, help="default: the server's first model")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    bo = bench_sub.add_parser("offline", help="the same load through an in-process LLMEngine (add_request / step)")
    bo.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: SmolLM2)")
    add_config_flags(bo)
    for b in (bs, bo):
        b.add_argument("--num-prompts", type=int, default=32)
        b.add_argument("--input-len", type=int, default=128, help="tokens per random prompt")
        b.add_argument("--output-len", type=int, default=128, help="tokens per reply (ignore_eos)")
        b.add_argument("--max-concurrency", default="1,8,32", help="comma-separated levels, run in turn")
        b.add_argument("--dataset", default=None, help='a JSONL file of {"prompt": ...} lines')
        if b is bs:  # offline's --seed is the Config field (the engine's seed), prompts' too
            b.add_argument("--seed", type=int, default=0)
        b.add_argument(
            "--goodput", nargs="+", default=None, metavar="METRIC:MS",
            help="latency targets (ttft, tpot, e2el in ms, e.g. ttft:500 tpot:50): report requests/s meeting all",
        )  # fmt: skip
        b.add_argument("--json", action="store_true", help="print the figures as JSON")

    args = parser.parse_args(argv)
    try:
        commands = {
            "generate": _generate, "fetch": _fetch, "plugins": _plugins, "env": _env, "kernels": _kernels,
            "serve": _serve, "chat": _chat, "bench": _bench, "worker": _worker,
        }  # fmt: skip
        if args.command in BACKGROUND_BUILD_COMMANDS:
            from atom_core.layers.cpp import BUILD_ENV

            with _env_default(BUILD_ENV, "background"):
                return commands[args.command](args)
        return commands[args.command](args)
    except BrokenPipeError:  # the reader of our output left (`| head`): stop quietly, as `cat` does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # 128 + SIGPIPE, what a process the signal ended reports
    except (ValueError, TypeError, OSError, KeyError) as e:  # OSError: an unreadable model folder
        print(f"atom: error: {e}", file=sys.stderr)
        return 2


def add_config_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """Every `Config` field of a plain type as a kebab-case flag, its default in --help
    (`defaults`: a command's own, over `Config`'s)."""
    import attrs

    from atom_core.config import Config

    for field in attrs.fields(Config):
        if field.name in ("model", "stop_token_ids", "speculative_config", "additional_config"):
            continue
        default: Any = field.default
        if hasattr(default, "factory"):  # attrs.Factory
            default = default.factory()
        default = (defaults or {}).get(field.name, default)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default: {default})")
            continue
        kind = type(default) if default is not None else (float if "memory_utilization" in field.name else int)
        if field.name in ("dtype", "device", "quantization", "quantize_lm_head", "sampler", "scheduling_policy"):
            kind = str
        parser.add_argument(flag, type=kind, default=None, help=f"(default: {default})")
    parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON")
    parser.add_argument("--additional-config", type=_json_object, default=None, metavar="JSON")


def config_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    import attrs

    from atom_core.config import Config

    names = {f.name for f in attrs.fields(Config)} - {"model"}
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _worker(args: argparse.Namespace) -> int:
    from atom_core.executor.worker import run_worker

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("atom worker runs under torchrun (it reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    os.environ.setdefault("ATOM_DISTRIBUTED_BACKEND", args.distributed_backend)
    return run_worker(args.model)


def _serve(args: argparse.Namespace) -> int:
    from atom_core.serve.server import serve

    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):  # vLLM asks for both together
        print("atom serve: --enable-auto-tool-choice and --tool-call-parser go together: give both", file=sys.stderr)
        return 2
    serve(
        args.model, config_from_flags(args), host=args.host, port=args.port,
        served_model_name=args.served_model_name, api_key=args.api_key, health_timeout=args.health_timeout,
        core_threads=args.core_threads, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )  # fmt: skip
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    from atom_core.serve.bench import bench_offline, bench_serve, parse_goodput, print_table

    levels_arg = [int(c) for c in args.max_concurrency.split(",")]
    if any(c < 1 for c in levels_arg):
        raise ValueError(f"--max-concurrency levels must be >= 1, got {args.max_concurrency}")
    goodput = parse_goodput(args.goodput)
    if args.bench_command == "serve":
        levels = bench_serve(
            args.base_url, args.model, args.num_prompts, args.input_len, args.output_len, levels_arg,
            args.request_rate, args.dataset, args.seed, api_key=args.api_key, goodput=goodput,
        )  # fmt: skip
    else:
        from atom_core.engine.llm_engine import LLMEngine

        engine = LLMEngine(args.model, **config_from_flags(args))
        levels = bench_offline(
            engine, args.num_prompts, args.input_len, args.output_len, levels_arg, args.dataset, args.seed or 0, goodput
        )
    if args.json:
        print(json.dumps(levels, indent=2))
    else:
        print_table(levels)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from atom_core.serve.chat import chat, local_reply, remote_reply

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1 (or left out: up to the context), got {args.max_tokens}")

    if args.url:
        reply = remote_reply(args.url, args.api_key, args.max_tokens, args.temperature)
    else:
        from atom_core.engine.llm_engine import LLMEngine

        reply = local_reply(LLMEngine(args.model), args.max_tokens, args.temperature)
    chat(reply)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from atom_core.engine.fetch import fetch_default_model

    print(fetch_default_model(args.cache_dir))
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from atom_core.plugins.manager import REGISTRY_HOOKS, failed_plugins, get_plugin_manager, get_registry, list_plugins

    for row in list_plugins():
        print(f"{row['name']:<12} {row['distribution'] or '(in-process)'}  hooks: {', '.join(row['hooks'])}")
    get_plugin_manager()  # loads the entry points, filling failed_plugins
    for name, why in sorted(failed_plugins.items()):
        print(f"{name:<12} FAILED TO LOAD: {why}")
    for kind in REGISTRY_HOOKS:
        registry = get_registry(kind)
        print(f"{kind}: {', '.join(registry.names()) or '-'}")
        for name, why in sorted(registry.failed_plugins.items() - failed_plugins.items()):
            print(f"  (plugin {name!r} left out: {why})")
    from atom_core.platform.cpu_features import cpu_features

    print(f"cpu: {cpu_features().summary()} (`atom env` for each kernel)")
    return 0


def _env(args: argparse.Namespace) -> int:
    import platform

    import torch

    from atom_core.layers.cpp import build_all, compiler, kernels_enabled
    from atom_core.platform.cpu_features import ENV_ISA, VARIANTS, cpu_features, detect

    features, host = cpu_features(), detect(isa="")
    shown = sorted({f for v in VARIANTS for f in v.requires} | {"avx_vnni", "avx_ne_convert", "amx_bf16"})
    print(f"cpu:             {features.model} ({features.machine}, {os.cpu_count()} cores)")
    print(f"features:        {' '.join(f if f in host.flags else '-' + f for f in shown)}")
    capped = f" ({ENV_ISA}={os.environ[ENV_ISA]}; this CPU: {host.variant.name})" if features.capped else ""
    print(f"kernel variant:  {features.variant.name}{capped}; can run: {', '.join(features.variants)}")
    # 16-bit weights oneDNN has no kernels for stay 16-bit in Atom's tiled kernel (gemm.pick_gemm)
    tiled = "stay 16-bit in the tiled kernel" if kernels_enabled() else "torch's GEMM (kernels off)"
    print(f"oneDNN bfloat16: {'yes' if features.onednn_bf16 else f'no (bfloat16 weights: {tiled})'}")
    print(f"float16 weights: {tiled}")
    print(f"torch:           {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    names = (ENV_ISA, "ATOM_CPU_KERNELS", "ATOM_STREAM_PREFETCH", *features.variant.caps())
    env = [f"{v}={os.environ[v]}" for v in names if os.environ.get(v)]
    if env:
        print(f"environment:     {' '.join(env)}")
    print(f"compiler:        {compiler() or 'none on PATH'}; python {platform.python_version()}")
    if not kernels_enabled():
        print("kernels:         off (ATOM_CPU_KERNELS=0): the torch path runs")
        return 0
    for name, status in build_all()[features.variant.name].items():
        print(f"  {name:<26} {status}")
    from atom_core.layers.gemm import gemv_ops, streaming_rows, streams_every_row

    if (ops := gemv_ops()) is not None:  # the decode-row GEMMs' choices on this CPU (gemm.py, simd.h)

        def rows(dtype: torch.dtype) -> str:
            if streams_every_row(dtype, ops):
                return "every row count"
            tiles = f" (AMX tiles from {ops.AMX_MIN_ROWS})" if dtype == torch.bfloat16 and ops.amx_tiles() else ""
            return f"1 to {streaming_rows(dtype, ops)} rows{tiles} beside oneDNN"

        print(f"weight streams:  prefetched {ops.STREAM_PREFETCH}; float32 {rows(torch.float32)}; "
              f"bfloat16 {rows(torch.bfloat16)}")  # fmt: skip
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from atom_core.layers.cpp import BuildLock, build_all, declared_kernels
    from atom_core.platform.cpu_features import cpu_features
    from atom_core.platform.memory import idle_priority

    if args.idle:  # before any thread or compiler starts: they inherit it
        idle_priority()
    variants = args.variant or [cpu_features().variant.name]
    if "all" in variants:
        variants = list(cpu_features().variants)
    failed = 0
    kernels = {k.name: k for k in declared_kernels().values()}
    with BuildLock():  # a background-mode run seeing it held starts no second build
        built = build_all(variants)
    for variant, statuses in built.items():
        for name, status in statuses.items():
            print(f"{variant:<12} {name:<26} {status}")
            failed += status != kernels[name].build_of(variant)  # (a base build counts as its own)
    return 1 if failed else 0


def _generate(args: argparse.Namespace) -> int:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

    options: dict[str, Any] = {"dtype": args.dtype}
    for name in (
        "max_model_len",
        "scheduling_policy",
        "max_num_batched_tokens",
        "quantization",
        "speculative_config",
        "sampler",
        "additional_config",
        "tensor_parallel_size",
        "enable_expert_parallel",
        "distributed_executor",
    ):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    params = SamplingParams(  # bad sampling flags fail before the model loads
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    with LLMEngine(args.model, **options) as engine:
        prompts = args.prompts or list(DEFAULT_PROMPTS)
        chat = not args.no_chat and engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None)
        inputs = [engine.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
        if len(prompts) == 1:
            _stream(engine, inputs[0], params)
            return 0
        for prompt, result in zip(prompts, engine.generate(inputs, params, use_tqdm=sys.stderr.isatty())):
            print(f"> {prompt}\n{result['text'].strip()}\n")
    return 0


def _stream(engine, prompt, params) -> None:
    """Print tokens as they arrive (`TextStream`: multi-token characters come out whole)."""
    from atom_core.serve.text_stream import TextStream

    stream = TextStream(engine.tokenizer, [])
    closed: list[BrokenPipeError] = []  # the reader went away (`atom generate ... | head`)

    def on_tokens(out) -> None:
        piece = stream.add(out.output_tokens, out.finished, out.finish_reason)
        if closed or not piece:
            return
        try:
            print(piece, end="", flush=True)
        except BrokenPipeError as e:
            closed.append(e)
            engine.abort(rid)  # nobody reads the rest: stop generating it

    rid = engine.add_request(prompt, params, stream_callback=on_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    if closed:
        raise closed[0]
    print()


if __name__ == "__main__":  # python -m atom_core.cli
    raise SystemExit(main())
