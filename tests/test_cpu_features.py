"""Which kernel variant a CPU gets, ATOM_CPU_ISA, and what a kernel that cannot build does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest

from atom_core.platform.cpu_features import ENV_ISA, VARIANTS, detect, inductor_cache_dir, variant

ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN5 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}  # and Ice Lake: VNNI, no bfloat16
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # Intel client cores since Alder Lake: AVX-VNNI, no AVX-512


@pytest.mark.parametrize(
    "flags,machine,best,bf16",
    [
        (ZEN5, "x86_64", "avx512_bf16", True),
        (SKYLAKE_SP, "x86_64", "avx512", False),  # AVX-512 without avx512_bf16: oneDNN emulates bfloat16
        (CASCADE_LAKE, "x86_64", "avx512_vnni", False),
        (CASCADE_LAKE | {"amx_bf16"}, "x86_64", "avx512_vnni", True),
        (ZEN3, "x86_64", "avx2", False),
        (ALDER_LAKE, "x86_64", "avx2_vnni", False),
        (ALDER_LAKE | {"avx_ne_convert"}, "x86_64", "avx2_vnni", True),  # Intel client CPUs with AVX-NE-CONVERT
        (ZEN5 | {"avx_vnni"}, "x86_64", "avx512_bf16", True),  # Zen 5 has AVX-VNNI too: AVX-512 still wins
        (frozenset({"sse2"}), "x86_64", "portable", False),
        (frozenset({"fp", "asimd"}), "aarch64", "portable", False),
        (ZEN5, "aarch64", "portable", True),  # x86 flags never pick an x86 build on another machine
    ],
)
def test_the_best_variant_the_cpu_has(flags, machine, best, bf16):
    f = detect(flags, isa="", machine=machine)
    assert f.variant.name == best and not f.capped
    assert f.variants[0] == best and f.variants[-1] == "portable"
    assert f.onednn_bf16 is bf16


def test_atom_cpu_isa_chooses_as_a_cpu_of_that_level_and_refuses_one_above():
    f = detect(ZEN5, isa="avx2", machine="x86_64")
    assert f.variant.name == "avx2" and f.capped and f.variants == ("avx2", "portable")
    assert not f.onednn_bf16 and not any(x.startswith("avx512") for x in f.flags)
    assert detect(ZEN5, isa="portable", machine="x86_64").variants == ("portable",)
    assert detect(ZEN5, isa="AVX512", machine="x86_64").variants == ("avx512", "avx2", "portable")
    # a CPU with AVX-VNNI held to AVX2 loses it (Zen 3 has none); held to avx2_vnni, keeps it
    assert detect(ZEN5 | {"avx_vnni"}, isa="avx2", machine="x86_64").variants == ("avx2", "portable")
    f = detect(ZEN5 | {"avx_vnni"}, isa="avx2_vnni", machine="x86_64")
    assert f.variants == ("avx2_vnni", "avx2", "portable") and f.capped and not f.onednn_bf16
    assert detect(ALDER_LAKE, isa="avx2_vnni", machine="x86_64").capped is False
    with pytest.raises(ValueError, match=r"ATOM_CPU_ISA=avx2_vnni: this CPU cannot run it \(it lacks avx_vnni\)"):
        detect(ZEN3, isa="avx2_vnni", machine="x86_64")
    with pytest.raises(ValueError, match=r"ATOM_CPU_ISA=avx512: this CPU cannot run it \(it lacks avx512bw"):
        detect(ZEN3, isa="avx512", machine="x86_64")
    with pytest.raises(
        ValueError,
        match="ATOM_CPU_ISA=sse9: unknown kernel variant 'sse9'; known: avx512_bf16, avx512_vnni, avx512, avx2_vnni, avx2, portable",
    ):
        detect(ZEN3, isa="sse9", machine="x86_64")


def test_the_description_names_the_cpus_own_flags_and_the_variant_atom_runs():
    """A benchmark's report line: the flags as the CPU has them, the variant as capped."""
    line = detect(ZEN5, isa="avx2", machine="x86_64").description()
    assert "avx512f yes, avx512_bf16 yes" in line and "avx_vnni no" in line
    assert line.endswith("Atom's kernels avx2 (ATOM_CPU_ISA=avx2)")
    line = detect(ZEN3, isa="", machine="x86_64").description()
    assert "avx2 yes, avx_vnni no, avx512f no" in line and line.endswith("Atom's kernels avx2")
    line = detect(frozenset({"fp", "asimd"}), isa="", machine="aarch64").description()
    assert "avx2" not in line and line.endswith("Atom's kernels portable")


def test_variants_are_ordered_best_first():
    """No variant is listed after one whose features it has all of and more; AVX-512 ones come
    first (AVX-VNNI is a branch of its own: AVX-512 CPUs carry VNNI as avx512_vnni)."""
    for i, better in enumerate(VARIANTS):
        for worse in VARIANTS[i + 1 :]:
            assert not better.requires < worse.requires, (better.name, worse.name)
    assert variant("avx2").requires < variant("avx2_vnni").requires
    assert variant("avx2").requires < variant("avx512").requires < variant("avx512_vnni").requires
    assert variant("avx512_vnni").requires < variant("avx512_bf16").requires
    assert all("-march=native" not in v.cflags for v in VARIANTS)


torch = pytest.importorskip("torch")


@pytest.fixture
def declared_build_done(monkeypatch):
    """Where portable is this CPU's own variant (aarch64), a kernel's first load there builds
    every declared kernel too, under the test's compiler settings: count it as done."""
    from atom_core.layers import cpp

    done = threading.Event()
    done.set()
    monkeypatch.setattr(cpp, "_declared_built", done)


def test_a_kernel_that_cannot_build_says_so_once_and_is_not_retried(tmp_path, monkeypatch, caplog, declared_build_done):
    from atom_core.layers import cpp
    from atom_core.layers.cpp import FAILED_FILE, LOG_FILE, CppKernel

    if cpp.compiler() is None:
        pytest.skip("no C++ compiler on this host")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ATOM_CPU_KERNELS", "1")  # also in the suite's kernels-off run
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        assert CppKernel("atom_broken", source).load("portable") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "C++ kernel atom_broken (portable) unavailable" in lines[0]
    assert "error" in lines[0] and str(tmp_path / "ext") in lines[0] and len(lines[0]) < 800
    build = CppKernel("atom_broken", source).build_dir("portable")
    assert (build / FAILED_FILE).is_file() and "error" in (build / LOG_FILE).read_text()

    # A new process (a new kernel object): remembered, not compiled again.
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    caplog.clear()
    kernel = CppKernel("atom_broken", source)
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        assert kernel.load("portable") is None
    assert calls == [] and "an earlier build" in caplog.records[0].getMessage()
    assert kernel.status("portable").startswith("torch path (")
    # The source changes: built again.
    source.write_text("still not C++ either;\n")
    CppKernel("atom_broken", source).load("portable")
    assert len(calls) == 1


# A module of Python's C API alone: it builds in a second, where ATen's headers take a minute.
TINY_SOURCE = r"""
#include <Python.h>
#define TINY_STR2(x) #x
#define TINY_STR(x) TINY_STR2(x)
#define TINY_CAT2(a, b) a##b
#define TINY_CAT(a, b) TINY_CAT2(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, TINY_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC TINY_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


def test_a_checkout_elsewhere_with_the_same_sources_loads_the_build_without_compiling(
    tmp_path, monkeypatch, declared_build_done
):
    """A build's folder is named by its sources, not the checkout's path: a fresh clone (CI's)
    or a new environment loads what another one built, and torch's builder, which compiles
    again for a source at another path, is not asked. Other sources get a folder of their own."""
    from torch.utils import cpp_extension

    from atom_core.layers import cpp

    if cpp.compiler() is None:
        pytest.skip("no C++ compiler on this host")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ATOM_CPU_KERNELS", "1")  # also in the suite's kernels-off run
    here, there = tmp_path / "here" / "tiny.cpp", tmp_path / "there" / "tiny.cpp"
    for source in (here, there):
        source.parent.mkdir()
        source.write_text(TINY_SOURCE)
    built = cpp.CppKernel("atom_tiny", here).load("portable")
    assert built is not None and built.answer() == 42

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    elsewhere = cpp.CppKernel("atom_tiny", there)
    assert elsewhere.build_dir("portable") == cpp.CppKernel("atom_tiny", here).build_dir("portable")
    loaded = elsewhere.load("portable")
    assert calls == [] and loaded is not None and loaded.answer() == 42
    assert elsewhere.status("portable") == "portable"

    there.write_text(TINY_SOURCE + "// changed\n")
    changed = cpp.CppKernel("atom_tiny", there)
    assert changed.build_dir("portable") != cpp.CppKernel("atom_tiny", here).build_dir("portable")
    changed.load("portable")
    assert len(calls) == 1  # built, in its own folder


def test_kernels_off_and_no_compiler(tmp_path, monkeypatch, declared_build_done):
    from atom_core.layers.cpp import CppKernel

    source = tmp_path / "k.cpp"
    source.write_text("int x;\n")
    monkeypatch.setenv("ATOM_CPU_KERNELS", "0")
    kernel = CppKernel("atom_off", source)
    assert kernel.load() is None and kernel.status() == "off (ATOM_CPU_KERNELS=0)"
    monkeypatch.setenv("ATOM_CPU_KERNELS", "1")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert kernel.load("portable") is None
    assert "no C++ compiler (no-such-compiler-here is not on PATH)" in kernel.status("portable")


def test_atom_env_names_the_variant_of_each_kernel(capsys):
    from atom_core.cli import main
    from atom_core.layers.cpp import declared_kernels, kernels_enabled
    from atom_core.platform.cpu_features import cpu_features

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    variant = cpu_features().variant.name
    assert f"kernel variant:  {variant}" in out and "torch:" in out and "CPU capability" in out
    if not kernels_enabled():
        assert "kernels:         off (ATOM_CPU_KERNELS=0)" in out
        assert "float16 weights: torch's GEMM (kernels off)" in out
        return
    assert "float16 weights: stay 16-bit in the tiled kernel" in out
    kernels = {k.name: k for k in declared_kernels().values()}
    for name in ("atom_cpu_ops", "atom_gemv", "atom_moe_ops", "atom_paged_attention_cpu"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert line.split()[1] == kernels[name].build_of(variant), line  # at avx2_vnni: gemv's own, others avx2


def test_atom_cpu_isa_caps_onednn_mkl_and_torch_at_import():
    """What torch, oneDNN and MKL pick must match the level too (set before torch chooses), and
    what the user set stays as set; on a CPU of that level already nothing is capped."""
    best = detect(isa="").variants
    if "avx2" not in best:
        pytest.skip("the CPU cannot run AVX2: ATOM_CPU_ISA=avx2 is refused here (tested above)")
    caps = (*variant("avx2").caps(), "TORCHINDUCTOR_CACHE_DIR")  # the variables a level is held by
    code = (
        "import json, os, atom_core, torch; "
        f"print(json.dumps({{**{{n: os.environ.get(n) for n in {caps!r}}}, "
        "'capability': torch.backends.cpu.get_cpu_capability()}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENV_ISA, *caps)}  # as a user starts it
    run = lambda **extra: json.loads(  # noqa: E731
        subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                       check=True).stdout.strip().splitlines()[-1])  # fmt: skip
    capped = run(ATOM_CPU_ISA="avx2")
    assert capped["capability"] == "AVX2"
    if best[0] == "avx2":  # an AVX2 CPU: nothing to cap
        assert capped["MKL_ENABLE_INSTRUCTIONS"] is capped["ONEDNN_MAX_CPU_ISA"] is None
        return
    # Inductor compiles into the level's own cache: a capped compile found by an uncapped
    # process aborted it (the cache does not key on ATEN_CPU_CAPABILITY)
    assert capped == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX2", "capability": "AVX2",
                      "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir("avx2"))}  # fmt: skip
    assert run(ATOM_CPU_ISA="avx2", MKL_ENABLE_INSTRUCTIONS="SSE4_2")["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    uncapped = run()
    assert (
        uncapped["MKL_ENABLE_INSTRUCTIONS"] is uncapped["TORCHINDUCTOR_CACHE_DIR"] is None
    )  # nothing without ATOM_CPU_ISA


@pytest.fixture
def one_declared_kernel(tmp_path, monkeypatch):
    """A fresh process's view of the kernel cache: one declared kernel (whose build is faked:
    `cpp_extension.load` returns a stand-in module), nothing loaded yet, an empty build root."""
    import threading
    import types

    from torch.utils import cpp_extension

    from atom_core.layers import cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ATOM_CPU_KERNELS", "1")  # also in the suite's kernels-off run
    source = tmp_path / "k.cpp"
    source.write_text("int x;\n")
    builds, spawned = [], []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: builds.append(kw) or types.ModuleType(kw["name"]))
    # the module's `subprocess` with Popen recording what it would start (`subprocess.run` stays)
    fake = types.SimpleNamespace(**{**vars(subprocess), "Popen": lambda args, **kw: spawned.append((args, kw))})
    monkeypatch.setattr(cpp, "subprocess", fake)

    def new_process() -> cpp.CppKernel:
        kernel = cpp.CppKernel("atom_bg", source)
        monkeypatch.setattr(cpp, "declared_kernels", lambda: {"atom_bg": kernel})
        monkeypatch.setattr(cpp, "_declared_built", threading.Event())
        monkeypatch.setattr(cpp, "_deferred", {})
        monkeypatch.setattr(cpp, "_lent", [])
        return kernel

    threads = torch.get_num_threads()  # a background build takes some of them (leave_cores_to_compilers)
    yield types.SimpleNamespace(new_process=new_process, builds=builds, spawned=spawned, root=tmp_path / "ext")
    torch.set_num_threads(threads)


class FakeBuild:
    """A started build's process: running until `done`."""

    done = False

    def poll(self) -> int | None:
        return 0 if self.done else None


def test_the_torch_path_gets_its_threads_back_when_the_build_is_over(one_declared_kernel, monkeypatch, caplog):
    """`give_cores_back` (before every model step) returns the threads a background build took,
    once the build this process started has exited, or once another process's has let go of
    the build lock; until then the threads stay lent."""
    import types

    from atom_core.layers import cpp
    from atom_core.layers.cpp import BUILD_ENV, BuildLock

    k = one_declared_kernel
    monkeypatch.setenv(BUILD_ENV, "background")
    monkeypatch.setattr(cpp, "GIVE_BACK_POLL_S", 0.0)
    build = FakeBuild()
    monkeypatch.setattr(
        cpp, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": lambda a, **kw: build})
    )
    torch.set_num_threads(4)
    assert k.new_process().load() is None and torch.get_num_threads() == 3
    cpp.give_cores_back()
    assert torch.get_num_threads() == 3  # still compiling
    build.done = True
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        cpp.give_cores_back()
    assert torch.get_num_threads() == 4 and "runs on 4 threads again" in caplog.text

    torch.set_num_threads(4)
    lock = BuildLock()
    assert lock.acquire(wait=False)  # another process builds
    try:
        assert k.new_process().load() is None and torch.get_num_threads() == 3
        cpp.give_cores_back()
        assert torch.get_num_threads() == 3
    finally:
        lock.close()
    cpp.give_cores_back()
    assert torch.get_num_threads() == 4 and not cpp._lent


def test_a_model_step_gives_the_threads_back(tiny_folder, monkeypatch):
    """The runner calls `give_cores_back` before each step (every rank passes `execute_model`)."""
    from atom_core import SamplingParams
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.layers import cpp

    engine = LLMEngine(str(tiny_folder("llama")), max_model_len=64, kv_cache_memory=1 << 24)
    threads = torch.get_num_threads()
    build = FakeBuild()
    build.done = True
    monkeypatch.setattr(cpp, "_lent", [(threads, build, 0.0)])
    torch.set_num_threads(1)
    try:
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert torch.get_num_threads() == threads and not cpp._lent
    finally:
        torch.set_num_threads(threads)


def test_background_build_answers_on_the_torch_path_and_builds_once_in_another_process(
    one_declared_kernel, monkeypatch, caplog
):
    from atom_core.layers.cpp import BACKGROUND_LOG, BUILD_ENV, BuildLock, cpu_features

    k = one_declared_kernel
    cpu = cpu_features().variant.name
    monkeypatch.setenv(BUILD_ENV, "background")
    kernel = k.new_process()
    torch.set_num_threads(4)  # (the fixture puts the suite's number back)
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        assert kernel.load() is None  # this process: the torch path, no compiler run
    # the build's one compiler (one kernel declared) gets a core of torch's
    assert torch.get_num_threads() == 3 and "runs on 3 thread(s)" in caplog.records[0].getMessage()
    assert k.builds == []
    ((args, kw),) = k.spawned
    # at idle priority (SCHED_IDLE, set by `atom kernels --idle` before any compiler starts)
    assert args[-7:] == [sys.executable, "-m", "atom_core.cli", "kernels", "--variant", cpu, "--idle"]
    assert kw["env"][BUILD_ENV] == "wait" and kw["start_new_session"] is True
    assert kernel.status().startswith("torch path (building in the background")
    assert str(k.root / BACKGROUND_LOG) in caplog.records[0].getMessage()

    # Another process while that build runs (it holds the lock): no second build started.
    with BuildLock():
        kernel = k.new_process()
        assert kernel.load() is None
    assert len(k.spawned) == 1 and "a build runs in another process" in kernel.status()

    # An explicit variant (a test's, `atom kernels`') is built in the foreground, as in wait mode.
    assert kernel.load(cpu) is not None and len(k.builds) == 1
    # Built: the next process loads it (no compiler run here, no build started).
    kernel = k.new_process()
    assert kernel.load() is not None and kernel.status() == kernel.build_of(cpu) and len(k.spawned) == 1


def test_wait_mode_builds_in_the_process_and_a_bad_mode_is_named(one_declared_kernel, monkeypatch, caplog):
    from atom_core.layers.cpp import BUILD_ENV, build_mode

    k = one_declared_kernel
    monkeypatch.delenv(BUILD_ENV, raising=False)
    kernel = k.new_process()
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        assert kernel.load() is not None and len(k.builds) == 1 and k.spawned == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert "building the C++ kernels atom_bg" in line  # the pause is said, once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atom_core.layers.cpp"):
        assert k.new_process().load() is not None and len(k.builds) == 2  # (the faked build runs again)
    assert caplog.records == []  # built: nothing to say
    monkeypatch.setenv(BUILD_ENV, "later")
    with pytest.raises(ValueError, match="ATOM_KERNEL_BUILD='later': expected one of wait, background"):
        build_mode()


def test_the_build_lock_on_an_unwritable_cache_is_no_lock(tmp_path, monkeypatch):
    from atom_core.layers.cpp import BuildLock

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "ext"))  # under a file: cannot be made
    with BuildLock() as lock:  # `atom kernels` goes on; each kernel then says why it cannot build
        assert lock.file is None and lock.acquire(wait=False)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's scheduling class")
def test_kernels_idle_builds_at_idle_priority(monkeypatch):
    """`atom kernels --idle`, the background build's command, takes SCHED_IDLE before it builds
    (the compilers it starts inherit it); without --idle the priority is left alone."""
    import contextlib
    import threading

    from atom_core import cli
    from atom_core.layers import cpp

    seen = []
    monkeypatch.setattr(cpp, "build_all", lambda variants: seen.append(os.sched_getscheduler(0)) or {})
    monkeypatch.setattr(cpp, "BuildLock", contextlib.nullcontext)
    for argv in (["kernels"], ["kernels", "--idle"]):  # each in a thread of its own: the policy is per thread
        t = threading.Thread(target=cli.main, args=(argv,))
        t.start()
        t.join()
    assert seen == [os.SCHED_OTHER, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_kernel_runs_its_base_build_at_a_variant_it_has_no_code_for(tmp_path):
    """avx2_vnni adds what only the group kernels use: the others run their avx2 build there
    (one build fewer each), and `atom env` says so."""
    from atom_core.layers.cpp import CppKernel
    from atom_core.layers.gemm import GEMV_KERNEL
    from atom_core.layers.ops import CPU_OPS_KERNEL

    source = tmp_path / "k.cpp"
    assert CppKernel("atom_k", source).build_of("avx2_vnni") == "avx2"
    assert CppKernel("atom_k", source, uses=("avx2_vnni",)).build_of("avx2_vnni") == "avx2_vnni"
    assert [CppKernel("atom_k", source).build_of(v.name) for v in VARIANTS if v.base is None] == [
        v.name for v in VARIANTS if v.base is None
    ]
    with pytest.raises(ValueError, match="unknown kernel variant 'avx2vnni'; known: avx512_bf16"):
        CppKernel("atom_k", source, uses=("avx2vnni",))  # a misspelt level, not a silent base build
    with pytest.raises(ValueError, match="atom_k: uses='avx2' has no base build"):
        CppKernel("atom_k", source, uses=("avx2",))
    assert GEMV_KERNEL.build_of("avx2_vnni") == "avx2_vnni" and CPU_OPS_KERNEL.build_of("avx2_vnni") == "avx2"
    assert GEMV_KERNEL.build_of("avx512_vnni") == "avx512_vnni" and CPU_OPS_KERNEL.build_of("avx512_vnni") == "avx512"
    if "avx2_vnni" in detect().variants and os.environ.get("ATOM_CPU_KERNELS") != "0":
        assert CPU_OPS_KERNEL.load("avx2_vnni") is CPU_OPS_KERNEL.load("avx2") is not None
        assert CPU_OPS_KERNEL.status("avx2_vnni") == "avx2"
        gemv = GEMV_KERNEL.load("avx2_vnni")
        assert gemv is not None and gemv is not GEMV_KERNEL.load("avx2") and gemv.VARIANT == "avx2_vnni"


def test_atom_kernels_counts_a_base_build_as_built_and_a_missing_one_as_failed(monkeypatch, capsys):
    """`atom kernels --variant avx512_vnni`: the kernels with no code of their own for it run
    their avx512 build, which is success (exit 0); a kernel left on the torch path is not."""
    import contextlib

    from atom_core import cli
    from atom_core.layers import cpp
    from atom_core.layers.gemm import GEMV_KERNEL
    from atom_core.layers.ops import CPU_OPS_KERNEL

    kernels = {"gemv": GEMV_KERNEL, "cpu_ops": CPU_OPS_KERNEL}
    monkeypatch.setattr(cpp, "declared_kernels", lambda: kernels)
    monkeypatch.setattr(cpp, "BuildLock", contextlib.nullcontext)
    built = {GEMV_KERNEL.name: "avx512_vnni", CPU_OPS_KERNEL.name: "avx512"}
    monkeypatch.setattr(cpp, "build_all", lambda variants: {"avx512_vnni": dict(built)})
    assert cli.main(["kernels", "--variant", "avx512_vnni"]) == 0
    built[CPU_OPS_KERNEL.name] = "torch path (a build error)"
    assert cli.main(["kernels", "--variant", "avx512_vnni"]) == 1
    assert "avx512_vnni  atom_cpu_ops               torch path (a build error)" in capsys.readouterr().out


def test_a_build_killed_part_way_leaves_no_lock_that_stops_the_next(tmp_path, monkeypatch, declared_build_done):
    """torch's builder keeps a lock file in the build folder that only its own process removes:
    one killed mid-build (the suite stopping its background build, a machine going down) left
    it, and the next load waited for ever. The next build finds it and goes on; while a build
    runs, its folder's own lock (which the OS drops with a dead process) is held."""
    import fcntl
    import types

    from torch.utils import cpp_extension

    from atom_core.layers import cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ATOM_CPU_KERNELS", "1")  # also in the suite's kernels-off run
    source = tmp_path / "k.cpp"
    source.write_text("int x;\n")
    kernel = cpp.CppKernel("atom_k", source)
    build_dir = kernel.build_dir("portable")
    (build_dir / cpp.TORCH_BATON).touch()  # a killed build's leftover
    seen = []

    def load(**kw):
        with open(build_dir / cpp.BUILDING_FILE) as other:  # another process's attempt, meanwhile
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        seen.append((build_dir / cpp.TORCH_BATON).exists())
        return types.ModuleType(kw["name"])

    monkeypatch.setattr(cpp_extension, "load", load)
    assert kernel.load("portable") is not None
    assert seen == [False]
    with open(build_dir / cpp.BUILDING_FILE) as after:  # and let go once built
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)
