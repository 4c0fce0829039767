"""The LM head's greedy screen: an 8-bit pass, then the plain kernel on the logits that may be the maximum."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402
from model_utils import build_tiny_model, random_prompts  # noqa: E402

from atom_core import SamplingParams, get_plugin_manager, hookimpl  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.forward_context import reset_forward_context, set_forward_context  # noqa: E402
from atom_core.layers.argmax_screen import ArgmaxScreen, screen_lm_head  # noqa: E402
from atom_core.layers.gemm import StreamingGemm, gemv_ops, pick_gemm  # noqa: E402
from atom_core.layers.linear import Linear, mark_lm_heads  # noqa: E402
from atom_core.runner.sampler import Sampler  # noqa: E402

ops = gemv_ops()


@pytest.fixture
def kernels():
    return require_kernel(gemv_ops())


needs_kernels = pytest.mark.usefixtures("kernels")


def near_tie_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, and pairs of rows a hair apart: the 8-bit pass cannot tell them apart."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    for i in range(0, n // 2, 2):
        w[i + 1] = w[i] + torch.randn(k, generator=g, dtype=torch.float64) * 1e-5
    w[n // 2 + 1] = w[n // 2]  # an exact tie: the first of the two wins, as in torch.argmax
    return w.to(dtype).contiguous()


def screen_of(w: torch.Tensor) -> tuple[ArgmaxScreen, torch.Tensor]:
    """An LM head's screen, and the packed weight its plain head takes past MAX_ROWS rows."""
    gemm, packed = pick_gemm(w)
    return ArgmaxScreen(gemm), packed


def screened(screen: ArgmaxScreen, x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    set_forward_context(argmax_only=True)
    try:
        return screen(x, packed, bias)
    finally:
        reset_forward_context()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_screened_argmax_and_kept_logits_are_the_plain_heads(dtype, with_bias):
    n, k = 700, 96
    w = near_tie_weight(n, k, dtype, seed=0)
    bias = torch.randn(n).to(dtype) if with_bias else None
    screen, packed = screen_of(w)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 33):
        for _trial in range(20):
            # rows aimed at a near-tie pair (and the exact tie), plus a random one
            targets = torch.randint(0, n, (rows,), generator=g)
            targets[0] = n // 2
            x = (w[targets].double() * 40 + torch.randn(rows, k, generator=g, dtype=torch.float64)).to(dtype)
            full = screen.inner(x, packed, bias)
            out = screened(screen, x, packed, bias)
            kept = torch.isfinite(out)
            assert kept.any(dim=1).all()
            assert torch.equal(out[kept], full[kept])  # bit for bit where kept
            assert torch.equal(out.float().argmax(dim=1), full.float().argmax(dim=1))
            assert torch.equal(screen(x, packed, bias), full)  # without the flag: the plain head


@needs_kernels
def test_a_bound_of_zero_would_pick_wrong_tokens():
    """The near-ties above do need the bound: with it zeroed, the screen's argmax goes wrong."""
    n, k = 700, 96
    w = near_tie_weight(n, k, torch.float32, seed=0)
    screen, packed = screen_of(w)
    screen.build(None)
    screen.per_norm = screen.per_max = 0.0
    g = torch.Generator().manual_seed(1)
    wrong = 0
    for pair in range(0, n // 2, 2):
        x = (w[pair].double() * 40 + torch.randn(1, k, generator=g, dtype=torch.float64)).float()
        wrong += int(screened(screen, x, packed).argmax()) != int(screen.inner(x, packed, None).argmax())
    assert wrong > 0


@needs_kernels
def test_rows_it_cannot_serve_take_the_plain_head():
    w = near_tie_weight(300, 64, torch.float32, seed=2)
    screen, packed = screen_of(w)
    x = torch.randn(screen.max_rows + 1, 64)  # more rows than the screen takes
    assert torch.equal(screened(screen, x, packed), screen.inner(x, packed, None))
    x = torch.randn(1, 64)
    x[0, 3] = float("nan")
    assert screened(screen, x, packed).isnan().all()  # a NaN row: the plain head's NaN logits, not -inf
    x = torch.zeros(1, 64)  # a flat row: every logit may be the maximum
    assert torch.equal(screened(screen, x, packed), screen.inner(x, packed, None))
    screen.make_batch_invariant()  # speculative decoding: one kernel at every row count
    assert screen.batch_invariant and screen.kernel is None
    assert not torch.isinf(screened(screen, torch.randn(1, 64), packed)).any()


@needs_kernels
def test_a_head_whose_rows_keep_coming_out_flat_skips_the_screen_for_a_while(monkeypatch):
    """FLAT_STREAK flat rows in a row: the next BACKOFF calls go straight to the plain head
    (an untrained model's flat logits would otherwise pay both passes at every step); then
    the screen is tried again, and a row it can serve resets the streak."""
    from atom_core.layers import argmax_screen

    w = near_tie_weight(300, 64, torch.float32, seed=2)
    screen, packed = screen_of(w)
    calls = []
    real = ArgmaxScreen.screened
    monkeypatch.setattr(ArgmaxScreen, "screened", lambda self, x, b: calls.append(1) or real(self, x, b))
    flat = torch.zeros(1, 64)
    for _ in range(argmax_screen.FLAT_STREAK + argmax_screen.BACKOFF):
        assert torch.equal(screened(screen, flat, packed), screen.inner(flat, packed, None))
    assert len(calls) == argmax_screen.FLAT_STREAK  # then BACKOFF calls without it
    x = torch.randn(1, 64) * 10
    out = screened(screen, x, packed)  # tried again: a row it serves, -inf off the maximum
    assert len(calls) == argmax_screen.FLAT_STREAK + 1 and torch.isinf(out).any()
    assert out.argmax() == screen.inner(x, packed, None).argmax() and screen.flat_streak == 0


@needs_kernels
def test_a_bias_that_is_not_finite_takes_the_plain_head():
    w = near_tie_weight(300, 64, torch.float32, seed=3)
    bias = torch.zeros(300)
    bias[10] = float("inf")
    screen, packed = screen_of(w)
    x = torch.randn(1, 64)
    assert torch.equal(screened(screen, x, packed, bias), screen.inner(x, packed, bias))
    assert int(screened(screen, x, packed, bias).argmax()) == 10


@needs_kernels
def test_bfloat16_ties_survive_a_large_bound():
    """Weights whose float16 scales round to 0 make the 8-bit copy all zeros (an error as large
    as the bound allows), and logits far below 0 with a bound of tens: the first of two plain
    logits that round to the same bfloat16 value must stay in."""
    k, n = 32, 16
    v = (torch.full((k,), 3e-6) * torch.tensor([1.0, -1.0]).repeat(k // 2)).to(torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[0], w[1] = v, -v
    screen, packed = screen_of(w)
    x = (v.float() * 2.0**38).to(torch.bfloat16)[None]
    for bias_1 in torch.arange(-1.5, 0.0, 0.0625):
        for bias_0 in torch.arange(-170.0, -150.0, 0.5):
            bias = torch.full((n,), -1e4)
            bias[0], bias[1] = bias_0, bias_1
            bias = bias.to(torch.bfloat16)
            full = screen.inner(x, packed, bias)
            out = screened(screen, x, packed, bias)
            kept = torch.isfinite(out)
            assert torch.equal(out[kept], full[kept])
            assert int(out.float().argmax()) == int(full.float().argmax())


def test_only_lm_heads_are_screened(monkeypatch):
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(256, 64)
    model.proj = Linear(64, 64, bias=False)
    model.tied = Linear(64, 256, bias=False)
    model.tied.weight = model.embed.weight
    model.lm_head = Linear(64, 256, bias=False)
    mark_lm_heads(model)
    assert [model.proj.is_lm_head, model.tied.is_lm_head, model.lm_head.is_lm_head] == [False, True, True]
    if ops is not None:
        screen = screen_lm_head(StreamingGemm(torch.randn(256, 64), ops))
        assert isinstance(screen, ArgmaxScreen) and screen.kernel is None  # the 8-bit copy waits for a greedy step
        assert not isinstance(screen_lm_head(StreamingGemm(torch.randn(256, 48), ops)), ArgmaxScreen)  # K % 32
        # bfloat16 weights: the 8-bit copy reads little less and computes more (not screened)
        assert not isinstance(screen_lm_head(StreamingGemm(torch.randn(256, 64).to(torch.bfloat16), ops)), ArgmaxScreen)
        monkeypatch.setenv("ATOM_DISABLE_ARGMAX_SCREEN", "1")
        assert not isinstance(screen_lm_head(StreamingGemm(torch.randn(256, 64), ops)), ArgmaxScreen)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", folder)
    return folder


def count_screened(monkeypatch) -> list[int]:
    calls = []
    original = ArgmaxScreen.screened

    def spy(self, x, bias):
        out = original(self, x, bias)
        calls.append(int(torch.isfinite(out).sum()) if out is not None else -1)
        return out

    monkeypatch.setattr(ArgmaxScreen, "screened", spy)
    return calls


@needs_kernels
def test_engine_screens_greedy_steps_only_and_gives_the_plain_tokens(tiny, monkeypatch):
    kw = dict(dtype="float32", num_kvcache_blocks=64, max_model_len=256, enable_prefix_caching=True)
    prompts = random_prompts((5, 17, 33, 8))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    monkeypatch.setenv("ATOM_DISABLE_ARGMAX_SCREEN", "1")
    plain = LLMEngine(tiny, **kw)
    expected = [r["token_ids"] for r in plain.generate(prompts, greedy, use_tqdm=False)]
    plain.generate(prompts[:1], greedy, use_tqdm=False)
    plain_logits = plain.runner.last_logits
    monkeypatch.delenv("ATOM_DISABLE_ARGMAX_SCREEN")
    engine = LLMEngine(tiny, **kw)
    head = engine.runner.model.lm_head.gemm
    assert isinstance(head, ArgmaxScreen) and head.kernel is not None  # the 8-bit copy made at load
    calls = count_screened(monkeypatch)
    assert [r["token_ids"] for r in engine.generate(prompts, greedy, use_tqdm=False)] == expected
    assert calls and all(0 < c < 256 * 8 for c in calls)  # screened, and most logits left out
    engine.generate(prompts[:1], greedy, use_tqdm=False)
    assert torch.equal(engine.runner.last_logits, plain_logits)  # computed whole when asked

    # Steps that read more than the argmax take the plain head.
    calls.clear()
    with_logprobs = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=4)
    out = engine.generate(prompts[:2], [with_logprobs, sampled], use_tqdm=False)
    assert not calls and all(len(e) >= 2 for e in out[0]["logprobs"])
    monkeypatch.setattr(Sampler, "greedy_reads_argmax_only", False)  # as a sampler plugin that reads rows whole
    engine = LLMEngine(tiny, **kw)
    assert not engine.runner.screens_lm_head
    engine.generate(prompts[:1], greedy, use_tqdm=False)
    assert not calls


class BanWords(Sampler):
    """A sampler plugin that masks tokens for greedy rows too: it inherits the attribute, not the promise."""

    def __call__(self, logits, meta):
        logits = logits.float().clone()
        logits[:, ::3] = float("-inf")
        return super().__call__(logits, meta)


class BanWordsPlugin:
    @hookimpl
    def atom_register_samplers(self, registry):
        registry.register("ban-words", BanWords)


@needs_kernels
def test_a_sampler_subclass_gets_whole_logits_unless_it_says_otherwise(tiny, monkeypatch):
    pm = get_plugin_manager()
    plugin = BanWordsPlugin()
    pm.register(plugin, name="ban-words-test")
    try:
        calls = count_screened(monkeypatch)
        engine = LLMEngine(tiny, dtype="float32", num_kvcache_blocks=64, max_model_len=256, sampler="ban-words")
        out = engine.generate(
            random_prompts((9, 14)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
        assert not calls
        assert all(t % 3 for r in out for t in r["token_ids"])
    finally:
        pm.unregister(plugin)


@needs_kernels
def test_under_speculative_decoding_the_head_makes_no_copy(tiny, monkeypatch):
    calls = count_screened(monkeypatch)
    spec = dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = LLMEngine(tiny, dtype="float32", num_kvcache_blocks=64, max_model_len=256, speculative_config=spec)
    engine.generate(
        random_prompts((9, 14)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    head = engine.runner.model.lm_head.gemm
    assert isinstance(head, ArgmaxScreen) and head.kernel is None and head.batch_invariant and not calls
    assert not engine.runner.screens_lm_head
