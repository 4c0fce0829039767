"""Tensor and expert parallel at 2 ranks: gloo on loopback, one thread a rank, the "mp" executor
(rank 0 is this process, rank 1 a worker it starts).

Greedy tokens equal 1 rank's and transformers', logits within 1e-4 of 1 rank's, with chunked
prefill and prefix caching on, for every family's way of splitting: attention heads (and one KV
head, replicated), MoE experts' intermediate size or whole experts (expert parallel), MLA by
heads with the latent whole, GDN by key-head groups. Also: each rank's parameters are the
checkpoint's expected slices; both ranks' pools hold the same blocks and half the bytes; a rank
that raises mid-step fails the engine within seconds and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.multiprocessing as mp  # noqa: E402
from model_utils import build_tiny_model, check_against_hf, random_prompts, run_with_logits  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from atom_core import SamplingParams  # noqa: E402
from atom_core.engine.llm_engine import LLMEngine  # noqa: E402
from atom_core.executor.executor import TensorParallelError  # noqa: E402
from atom_core.layers import FusedMoE  # noqa: E402

TESTS = Path(__file__).parent
ENGINE = dict(
    dtype="float32", num_kvcache_blocks=64, max_model_len=256, enable_prefix_caching=True, max_num_batched_tokens=32
)
# case -> (tiny architecture, extra engine settings)
CASES = {
    "llama": ("llama", {}),  # 4 heads and 2 KV heads: both split
    "llama-one-kv-head": ("llama_tied_rope3", {}),  # 1 KV head, replicated; tied embedding
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),  # each expert's intermediate size split
    "qwen3_moe-expert-parallel": ("qwen3_moe", {"enable_expert_parallel": True}),  # 4 whole experts a rank
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),  # MLA by heads; routed and shared experts in one all-reduce
    "qwen3_next": ("qwen3_next", {}),  # GDN by key-head groups, gated attention, shared expert
    "qwen3_5": ("qwen3_5", {}),  # GDN with flat projections: q, k and v in one tensor, split by sections
    "deepseek_v2": ("deepseek_v2_greedy", {}),  # MLA without a query latent: q split beside a whole kv_a
    "gemma3": ("gemma3", {}),  # a sliding window, rope per layer type, one KV head replicated
    "gpt_oss-expert-parallel": ("gpt_oss", {"enable_expert_parallel": True}),  # sinks split by heads, biased experts
    "glm4": ("glm4", {}),  # gate/up fused on disk, split per shard; interleaved partial rope; post-norms
    "minimax_m2": ("minimax_m2", {}),  # q/k norms over the whole projection: their mean of squares all-reduced
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # each of the 2 ranks takes half: one thread a rank
    yield
    torch.set_num_threads(threads)


def waves() -> tuple[list[list[int]], list[list[int]]]:
    """Five prompts (one longer than a step's 32 tokens: chunked), then three that share 48 and
    64 tokens with them, which the prefix cache serves."""
    first = random_prompts((1, 15, 17, 40, 70))
    tails = random_prompts((5, 9, 2), seed=2)
    return first, [first[4][:48] + tails[0], first[4][:64] + tails[1], first[3] + tails[2]]


def run(engine, prompts_waves):
    results, logits = [], []
    for prompts in prompts_waves:
        r, lg = run_with_logits(engine, prompts)
        results += r
        logits += lg
    return results, logits


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_rank_and_transformers(case, tmp_path_factory):
    arch, extra = CASES[case]
    folder = tmp_path_factory.mktemp(arch)
    model = build_tiny_model(arch, folder)
    prompts = waves()
    one = LLMEngine(folder, **ENGINE)
    expected, expected_logits = run(one, prompts)
    with LLMEngine(folder, tensor_parallel_size=2, **ENGINE, **extra) as two:
        results, logits = run(two, prompts)
        assert two.scheduler.block_manager.num_free_blocks == one.scheduler.block_manager.num_free_blocks
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    cached = [r["num_cached_tokens"] for r in results]
    assert cached == [r["num_cached_tokens"] for r in expected] and any(cached[5:]), cached
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    check_against_hf(model, prompts[0] + prompts[1], results, logits)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, build_tiny_model("llama", folder)


def test_both_ranks_hold_the_same_blocks_and_half_the_bytes(llama):
    folder, _ = llama
    one = LLMEngine(folder, **ENGINE)
    whole = sum(t.nbytes for t in one.runner.kv_cache_tensors.values())
    shm = Path("/dev/shm")
    with LLMEngine(folder, tensor_parallel_size=2, **ENGINE) as two:
        assert two.core.executor.rank_pools == [(64, whole // 2), (64, whole // 2)]
        # both ranks on this host: the collectives go through one shared segment, already unlinked
        assert two.core.executor.group.shm is not None
        assert not list(shm.glob("atom-tp-*")) if shm.is_dir() else True
    # Sized from a byte budget: per rank, so twice the blocks of one rank's pool (2 of 4 KV heads)
    budget = dict(ENGINE, num_kvcache_blocks=None, kv_cache_memory=whole)
    with LLMEngine(folder, tensor_parallel_size=2, **budget) as two:
        [(blocks, nbytes), other] = two.core.executor.rank_pools
        assert other == (blocks, nbytes) and two.kv_plan.num_blocks == blocks
        assert blocks >= 2 * 64  # (plus the null block past the pool, as at one rank)


def test_a_one_rank_engine_beside_a_two_rank_one_in_the_same_process(llama):
    """Each engine builds and steps its model in its own group: interleaved steps of a one-rank
    engine and a tensor-parallel one both give one rank's tokens."""
    folder, _ = llama
    prompts = random_prompts((5, 40), seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLMEngine(folder, tensor_parallel_size=2, **ENGINE) as two:
        one = LLMEngine(folder, **ENGINE)
        ids = [(e, e.add_request(p, params)) for p in prompts for e in (one, two)]
        done: dict = {}
        while one.has_unfinished_requests() or two.has_unfinished_requests():
            for e in (two, one):
                for r in e.step():
                    done[(id(e), r["request_id"])] = r["token_ids"]
    tokens = {e: [done[(id(e), rid)] for f, rid in ids if f is e] for e in (one, two)}
    assert tokens[one] == tokens[two] and len(tokens[one]) == 2


def _load_rank(rank: int, rendezvous: str, folder: str, out: str) -> None:
    """One rank of the shard test: build and load the model as a runner would, save its parameters."""
    from atom_core.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from atom_core.loading.checkpoint import load_model_weights
    from atom_core.loading.hf_config import read_hf_config
    from atom_models.llama import LlamaForCausalLM

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, init_method=rendezvous, backend="gloo", timeout_s=60)
    try:
        model = LlamaForCausalLM(read_hf_config(folder))
        load_model_weights(model, folder)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.safetensors")
    finally:
        destroy_tensor_parallel()


def test_each_rank_holds_its_slices_and_they_make_the_whole(llama, tmp_path):
    folder, hf = llama
    mp.start_processes(
        _load_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(folder), str(tmp_path)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    ckpt = {k: v for k, v in hf.state_dict().items()}
    d = hf.config.head_dim
    q, kv = 2 * d, 1 * d  # per rank: 2 of 4 query heads, 1 of 2 KV heads

    def rows(t, r, n):
        return t[r * n : (r + 1) * n]

    for r, params in enumerate(ranks):
        for name, got in params.items():
            if ".qkv_proj." in name:
                base = name.replace("qkv_proj.weight", "")
                want = torch.cat([
                    rows(ckpt[base + "q_proj.weight"], r, q), rows(ckpt[base + "k_proj.weight"], r, kv),
                    rows(ckpt[base + "v_proj.weight"], r, kv),
                ])  # fmt: skip
            elif ".gate_up_proj." in name:
                base = name.replace("gate_up_proj.weight", "")
                n = hf.config.intermediate_size // 2
                want = torch.cat(
                    [rows(ckpt[base + "gate_proj.weight"], r, n), rows(ckpt[base + "up_proj.weight"], r, n)]
                )
            elif name.endswith(("o_proj.weight", "down_proj.weight")):  # columns
                whole = ckpt[name]
                n = whole.shape[1] // 2
                want = whole[:, r * n : (r + 1) * n]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):  # the vocabulary's rows
                want = rows(ckpt[name], r, hf.config.vocab_size // 2)
            else:  # norms: whole on every rank
                want = ckpt[name]
            assert torch.equal(got, want), (r, name)
    # put together, the shards give the whole weights
    for name in ("lm_head.weight", "model.layers.1.self_attn.o_proj.weight"):
        dim = 0 if name.startswith("lm_head") else 1
        assert torch.equal(torch.cat([ranks[0][name], ranks[1][name]], dim=dim), ckpt[name])


@pytest.fixture(params=["SIGCHLD default", "SIGCHLD ignored"])
def sigchld(request):
    """The host program's SIGCHLD: ignored, the kernel reaps the ranks and their exit codes read 0."""
    if request.param == "SIGCHLD default":
        yield
        return
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_a_rank_that_raises_fails_the_engine_and_leaves_no_process(llama, tmp_path, monkeypatch, sigchld):
    from tp_fault_plugin import FAULT_TOKEN

    folder, _ = llama
    faulty = tmp_path / "faulty"
    shutil.copytree(folder, faulty)
    config = json.loads((faulty / "config.json").read_text())
    config["architectures"] = ["FaultyRankLlamaForCausalLM"]
    (faulty / "config.json").write_text(json.dumps(config))
    from atom_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()  # before ATOM_PLUGINS is set: a manager made after it would load the plugin too
    # the worker rank loads the plugin from the environment; this process registers it itself
    monkeypatch.setenv("ATOM_PLUGINS", "tp_fault_plugin")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    import tp_fault_plugin

    pm.register(tp_fault_plugin)
    try:
        engine = LLMEngine(faulty, tensor_parallel_size=2, **ENGINE)
        workers = engine.core.executor.processes
        assert len(workers) == 1 and workers[0].poll() is None
        from atom_core import SamplingParams

        params = SamplingParams(max_tokens=4, ignore_eos=True)
        assert len(engine.generate([[1, 2, 3]], params)[0]["token_ids"]) == 4  # healthy first
        engine.add_request([FAULT_TOKEN] * 3, params)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 failed: RuntimeError: injected fault"):
            engine.step()
        assert time.monotonic() - start < 15
        assert workers[0].poll() is not None  # no process left behind
        results = engine.step()  # the failed step's request ends with "error"; nothing else runs
        assert [r["finish_reason"] for r in results] == ["error"]
        engine.add_request([1, 2], params)
        with pytest.raises(TensorParallelError, match="the tensor-parallel group is down"):
            engine.step()
        engine.close()
    finally:
        pm.unregister(tp_fault_plugin)
    # a second engine in the same process forms its own group
    with LLMEngine(folder, tensor_parallel_size=2, **ENGINE) as again:
        assert len(again.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]["token_ids"]) == 3
        worker = again.core.executor.processes[0]
    assert worker.poll() == 0  # closing ends the worker cleanly


def test_a_split_that_does_not_divide_is_named_before_any_weight_loads(tmp_path):
    folder = tmp_path / "odd"
    build_tiny_model("llama", folder, num_attention_heads=3, num_key_value_heads=1, hidden_size=48)
    with pytest.raises(ValueError, match="attention heads: 3 does not divide among 2 tensor-parallel ranks"):
        LLMEngine(folder, tensor_parallel_size=2, **ENGINE)


def test_a_model_plugin_that_builds_no_parallel_layers_is_refused_by_name(llama, tmp_path):
    from atom_core.plugins.manager import get_plugin_manager
    from atom_models.llama import LlamaForCausalLM

    class PlainLlama(LlamaForCausalLM):
        supports_tensor_parallel = False

    class Plugin:
        @staticmethod
        def atom_register_models(registry):
            registry.register("PlainLlamaForCausalLM", PlainLlama)

    from atom_core.plugin_api import hookimpl

    Plugin.atom_register_models = hookimpl(Plugin.atom_register_models)
    folder, _ = llama
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(config | {"architectures": ["PlainLlamaForCausalLM"]}))
    pm = get_plugin_manager()
    pm.register(Plugin)
    try:
        with pytest.raises(ValueError, match="PlainLlamaForCausalLM .*does not support tensor parallel"):
            LLMEngine(plain, tensor_parallel_size=2, **ENGINE)
    finally:
        pm.unregister(Plugin)


def test_a_draft_model_is_refused_by_name_and_ngram_runs(llama):
    folder, _ = llama
    with pytest.raises(ValueError, match="method=.mtp. runs a draft model"):
        LLMEngine(folder, tensor_parallel_size=2, speculative_config={"method": "mtp"}, **ENGINE)
    prompts = random_prompts((20, 33, 7), seed=3)
    from atom_core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLMEngine(folder, **ENGINE).generate(prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0}
    with LLMEngine(folder, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as two:
        assert [r["token_ids"] for r in two.generate(prompts, params)] == [r["token_ids"] for r in plain]
        assert two.get_spec_stats()["num_draft_tokens"] > 0


def test_torchrun_on_two_simulated_hosts_gives_one_ranks_tokens(llama, tmp_path):
    """Two `torchrun --nnodes 2` commands on loopback: node 0 runs the engine, node 1 `atom worker`."""
    import subprocess

    from test_serve import free_port

    folder, _ = llama
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        "from atom_core import SamplingParams\n"
        "from atom_core.engine.llm_engine import LLMEngine\n"
        f"with LLMEngine({str(folder)!r}, tensor_parallel_size=2, distributed_executor='torchrun', **{ENGINE!r}) as e:\n"
        "    out = e.generate([[1, 2, 3], list(range(40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print('TOKENS', json.dumps([r['token_ids'] for r in out]))\n"
    )
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    atom = [sys.executable, "-m", "atom_core.cli", "worker"]
    node1 = subprocess.Popen(torchrun + ["--node-rank", "1", "--no-python"] + atom, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    node0 = subprocess.run(torchrun + ["--node-rank", "0", str(script)], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    log1, _ = node1.communicate(timeout=60)
    assert node0.returncode == 0, node0.stdout + node0.stderr + log1
    assert node1.returncode == 0, log1
    [line] = [x for x in node0.stdout.splitlines() if x.startswith("TOKENS")]
    from atom_core import SamplingParams

    one = LLMEngine(folder, **ENGINE).generate(
        [[1, 2, 3], list(range(40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert json.loads(line.removeprefix("TOKENS ")) == [r["token_ids"] for r in one]


def test_serve_with_two_engine_cores_of_two_ranks_each(tmp_path):
    """Data parallel composes: `atom serve --data-parallel-size 2 --tensor-parallel-size 2` runs 2
    engine cores of 2 ranks each, answers as one offline rank does, and leaves no rank behind."""
    import httpx
    from test_serve import start_server, stop_server

    from atom_core import SamplingParams
    from atom_core.engine.fetch import fetch_default_model

    folder = tmp_path / "llama"
    build_tiny_model("llama", folder, vocab_size=49152)  # SmolLM2's vocabulary, for its tokenizer
    for f in fetch_default_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    prompts = ["Once upon a time", "The sea is", "1, 2, 3,", "My favourite colour is"]
    want = LLMEngine(folder, **ENGINE).generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    proc, url = start_server(str(folder), "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                             "--num-kvcache-blocks", "64", "--max-model-len", "256")  # fmt: skip
    try:
        got = [
            httpx.post(
                f"{url}/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0}, timeout=120
            ).json()["choices"][0]["text"]
            for p in prompts
        ]
        pids = worker_pids(proc.pid)
    finally:
        stop_server(proc)
    assert got == [w["text"] for w in want]
    assert len(pids) >= 2  # a worker rank in each engine core
    time.sleep(1)
    assert not [pid for pid in pids if is_worker(pid)]  # none outlived the server


def worker_pids(root: int) -> list[int]:
    """The worker ranks among `root`'s descendants (not another test run's, on a shared host)."""
    import subprocess

    found, todo = [], [root]
    while todo:
        children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        todo += map(int, children)
        found += [pid for pid in map(int, children) if is_worker(pid)]
    return found


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"atom_core.executor.worker" in f.read()
    except OSError:  # gone
        return False


RAY_SCRIPT = """
import json, os, sys
import ray
from ray.cluster_utils import Cluster
from atom_core import SamplingParams
from atom_core.engine.llm_engine import LLMEngine


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone
        return b""


# each rank actor's niceness over this process's (Ray's workers run at +15 unless told otherwise):
# the actors among this process's descendants (the raylets' workers), not another run's
def ranks_niceness():
    stats = {int(p): read(f"/proc/{p}/stat").rsplit(b")", 1)[-1].split() for p in os.listdir("/proc") if p.isdigit()}
    ours, grown = {os.getpid()}, True
    while grown:  # fields after the name: state, ppid, ..., nice (the 17th)
        grown = {p for p, s in stats.items() if len(s) > 16 and int(s[1]) in ours} - ours
        ours |= grown
    return [int(stats[p][16]) - os.nice(0) for p in sorted(ours) if b"RankActor" in read(f"/proc/{p}/cmdline")]


folder, engine = sys.argv[1], json.loads(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
cluster.add_node(num_cpus=1)  # a second node: the worker rank lands wherever the placement group puts it
ray.init(address=cluster.address)
try:
    with LLMEngine(folder, tensor_parallel_size=2, distributed_executor="ray", **engine) as e:
        out = e.generate([[1, 2, 3], list(range(40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print("NICE", json.dumps(ranks_niceness()), flush=True)
    print("TOKENS", json.dumps([r["token_ids"] for r in out]), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_ray_on_a_two_node_cluster_gives_one_ranks_tokens(llama, tmp_path):
    """The "ray" executor on a two-node `ray.cluster_utils.Cluster`, in a network namespace with
    only loopback (`unshare -n`: Ray binds a non-loopback address where it finds one). The rank
    actor runs at rank 0's priority, not at the +15 Ray gives its workers."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'atom-engine[ray]')")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode or shutil.which("ip") is None:
        pytest.skip(f"cannot make a loopback-only network namespace here (unshare -n: {probe.stderr.strip()!r})")
    folder, _ = llama
    script = tmp_path / "ray_run.py"
    script.write_text(RAY_SCRIPT)
    command = f"ip link set lo up && {sys.executable} {script} {folder} '{json.dumps(ENGINE)}'"
    done = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("TOKENS")]
    [nice] = [x for x in done.stdout.splitlines() if x.startswith("NICE")]
    assert json.loads(nice.removeprefix("NICE ")) == [0]
    from atom_core import SamplingParams

    one = LLMEngine(folder, **ENGINE).generate(
        [[1, 2, 3], list(range(40))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert json.loads(line.removeprefix("TOKENS ")) == [r["token_ids"] for r in one]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    """Tiny Llama and Mixtral written as Q8_0 GGUF files by llama.cpp's own converter."""
    from gguf_convert import convert_many, write_tiny_tokenizer

    root = tmp_path_factory.mktemp("tp-gguf")
    jobs = []
    for arch in ("llama", "mixtral"):
        build_tiny_model(arch, root / arch)
        write_tiny_tokenizer(root / arch)
        jobs.append((root / arch, root / f"{arch}.gguf"))
    convert_many(jobs, "q8_0")
    return {arch: path for arch, (_, path) in zip(("llama", "mixtral"), jobs)}


def test_gguf_blocks_are_kept_and_split_along_their_groups(q8_gguf, tmp_path, monkeypatch):
    """A GGUF file's Q8_0 blocks at 2 ranks, each rank's cut as its float weight is: the same
    tokens as 1 rank on the same file; a split that would cut a group of 32 is named."""
    from atom_core.layers.quantized_gemm import Int4PackGemm, Int8PackGemm, StreamingGroupGemm

    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "atom-cache"))
    prompts = random_prompts((5, 23, 47), seed=3)
    engine = dict(ENGINE, dtype="float32")

    def kept(e) -> bool:
        kernels = [getattr(m, "packed_weight", None) for m in e.runner.model.modules()]
        return any(isinstance(k, (Int8PackGemm, StreamingGroupGemm, Int4PackGemm)) for k in kernels)

    # Mixtral's experts have an intermediate size of 32: expert parallel keeps them whole
    for arch, extra in (("llama", {}), ("mixtral", {"enable_expert_parallel": True})):
        one = LLMEngine(q8_gguf[arch], **engine)
        with LLMEngine(q8_gguf[arch], tensor_parallel_size=2, **engine, **extra) as two:
            assert kept(one) and kept(two)
            assert_quantized_ranks_agree(one, two, prompts)
    cut = r"experts, shard \('down', 0\) \(Q8_0\) at 2 ranks: .* cannot split columns \[0, 16\) of 32: .*groups of 32"
    with pytest.raises(ValueError, match=cut):
        LLMEngine(q8_gguf["mixtral"], tensor_parallel_size=2, **engine)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weights_quantized_at_load_are_each_ranks_slice_quantized(llama, quantization):
    """int8 / int4 quantize each rank's slice after loading, in groups of 32 along its own columns
    (whole groups here: 64 columns a rank), so both ranks run the same 8/4-bit kernels as one."""
    folder, _ = llama
    prompts = random_prompts((5, 23, 47), seed=3)
    engine = dict(ENGINE, quantization=quantization)
    with LLMEngine(folder, tensor_parallel_size=2, **engine) as two:
        assert_quantized_ranks_agree(LLMEngine(folder, **engine), two, prompts)


def assert_quantized_ranks_agree(one, two, prompts) -> None:
    """2 ranks against 1 on 4/8-bit weights. Atom's streaming group kernel rounds each row alike
    however its columns are split: the same 12 greedy tokens, logits within 5e-2. torch's int4
    kernel (the path with Atom's C++ kernels off) rounds activations per call, and a
    row-parallel rank holds half the row: the first step's logits within 0.1, and the same
    token wherever 1 rank's top two logits are further apart than that."""
    from atom_core.layers.gemm import gemv_ops

    if gemv_ops() is not None:
        expected, expected_logits = run_with_logits(one, prompts, 12)
        results, logits = run_with_logits(two, prompts, 12)
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
        for got, want in zip(logits, expected_logits):
            torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
        return
    _, expected_logits = run_with_logits(one, prompts, 1)
    _, logits = run_with_logits(two, prompts, 1)
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0)
        top = want[0].topk(2).values
        if top[0] - top[1] > 0.2:
            assert got[0].argmax() == want[0].argmax()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_experts_kept_as_8_bit_groups_per_rank(tmp_path, expert_parallel):
    """GPT-OSS's MXFP4 experts at 2 ranks: each rank keeps its cut of the blocks as 8-bit groups
    (split experts: 32 of each expert's 64 intermediate columns; expert parallel: whole
    experts) and agrees with one rank as any quantized model does."""
    from test_moe_parity import mxfp4_gpt_oss

    mxfp4_gpt_oss(tmp_path, intermediate_size=64)
    with LLMEngine(tmp_path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE) as two:
        moes = [m for m in two.runner.model.modules() if isinstance(m, FusedMoE)]
        local = 2 if expert_parallel else 4  # rank 0's experts a layer: whole ones, or a cut of each
        assert all(m.expert_gemms is not None and len(m.expert_gemms) == local for m in moes)
        if not expert_parallel:
            [(_, k13), (_, k2)] = moes[0].expert_gemms[0]
            assert (k13.out_features, k2.in_features) == (64, 32)  # half of gate and of up; half of down's input
        assert_quantized_ranks_agree(LLMEngine(tmp_path, **ENGINE), two, random_prompts((5, 23, 47), seed=3))


def test_mxfp4_experts_a_rank_cannot_cut_in_whole_groups_run_in_float(tmp_path, caplog):
    """32 intermediate columns at 2 ranks leave 16 of down's input a rank: no whole groups of 32,
    so those experts are dequantized (the log says why) and still give one rank's tokens."""
    from test_moe_parity import mxfp4_gpt_oss

    mxfp4_gpt_oss(tmp_path, intermediate_size=32)
    with caplog.at_level("INFO", logger="atom"), LLMEngine(tmp_path, tensor_parallel_size=2, **ENGINE) as two:
        assert all(m.expert_gemms is None for m in two.runner.model.modules() if isinstance(m, FusedMoE))
        assert "not kept as 8-bit groups" in caplog.text and "groups of 32" in caplog.text
        assert "dequantized 4 MXFP4 expert tensors" in caplog.text
        prompts = random_prompts((5, 23), seed=3)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        tokens = [r["token_ids"] for r in two.generate(prompts, params, use_tqdm=False)]
    one = LLMEngine(tmp_path, quantization="none", **ENGINE)
    assert tokens == [r["token_ids"] for r in one.generate(prompts, params, use_tqdm=False)]
