"""The plugin system: entry points, in-process plugins, registries and their errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from atom_core import RegistryError, get_plugin_manager, get_registry, hookimpl
from atom_core.layers.cpp import CppKernel, declared_kernels
from atom_core.plugins.manager import REGISTRY_HOOKS, list_plugins

FIXTURE = Path(__file__).parent / "fixtures" / "atom_example_plugin"


class InProcessPlugin:
    @hookimpl
    def atom_register_models(self, registry):
        registry.register("ExampleForCausalLM", "atom_example_plugin.model:ExampleForCausalLM")

    @hookimpl
    def atom_register_attention_builders(self, registry):
        registry.register("example", "atom_example_plugin.attention:ExampleAttentionBuilder")

    @hookimpl
    def atom_register_samplers(self, registry):
        registry.register("constant", Constant)

    @hookimpl
    def atom_register_proposers(self, registry):
        registry.register("noop", Constant)

    @hookimpl
    def atom_register_scheduler_policies(self, registry):
        registry.register("noop", Constant)

    @hookimpl
    def atom_register_gguf_architectures(self, registry):
        registry.register("example", Constant)

    @hookimpl
    def atom_register_cpp_kernels(self, registry):
        registry.register("example", EXAMPLE_KERNEL)

    @hookimpl
    def atom_register_structured_output_backends(self, registry):
        registry.register("inproc", "tests.test_plugins:Constant")

    @hookimpl
    def atom_register_distributed_executors(self, registry):
        registry.register("inproc", Constant)

    @hookimpl
    def atom_register_hf_configs(self, registry):
        registry.register("inproc", Constant)

    @hookimpl
    def atom_register_tool_parsers(self, registry):
        registry.register("inproc", Constant)

    @hookimpl
    def atom_register_reasoning_parsers(self, registry):
        registry.register("inproc", Constant)


class Constant:
    pass


EXAMPLE_KERNEL = CppKernel("atom_example", Path(__file__).parent / "example.cpp")  # declared, never built


def test_get_plugin_manager_is_one_object_with_the_atom_hooks():
    pm = get_plugin_manager()
    assert pm is get_plugin_manager()
    assert pm.project_name == "atom"
    for hook_name, _ in REGISTRY_HOOKS.values():
        assert hasattr(pm.hook, hook_name)


def test_in_process_plugin_adds_every_kind(plugin_manager, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE))
    plugin_manager.register(InProcessPlugin(), name="in-process")
    models = get_registry("models")
    assert "ExampleForCausalLM" in models
    assert models.plugin_of("ExampleForCausalLM") == "in-process"
    # Lazy: listing names imports nothing; `get` imports the class.
    sys.modules.pop("atom_example_plugin.model", None)
    assert models.names().count("ExampleForCausalLM") == 1
    assert "atom_example_plugin.model" not in sys.modules
    cls = models.get("ExampleForCausalLM")
    assert cls.__name__ == "ExampleForCausalLM" and cls.attention_type == "example"
    assert get_registry("attention_builders").get("example").__name__ == "ExampleAttentionBuilder"
    assert get_registry("samplers").get("constant") is Constant
    assert get_registry("proposers").get("noop") is Constant
    assert get_registry("gguf_architectures").get("example") is Constant
    assert get_registry("distributed_executors").get("inproc") is Constant
    assert {"mp", "torchrun"} <= set(get_registry("distributed_executors").names())
    assert get_registry("tool_parsers").get("inproc") is Constant
    assert {"hermes", "llama3_json", "qwen3_coder"} <= set(get_registry("tool_parsers").names())
    assert get_registry("reasoning_parsers").get("inproc") is Constant
    assert {"qwen3", "deepseek_r1"} <= set(get_registry("reasoning_parsers").names())
    assert declared_kernels()["example"] is EXAMPLE_KERNEL and "cpu_ops" in declared_kernels()


def test_unregistering_removes_the_names(plugin_manager):
    plugin = InProcessPlugin()
    plugin_manager.register(plugin)
    assert "constant" in get_registry("samplers")
    plugin_manager.unregister(plugin)
    assert "constant" not in get_registry("samplers")


def test_unknown_name_lists_known_names_and_points_to_plugins(plugin_manager):
    plugin_manager.register(InProcessPlugin())
    with pytest.raises(RegistryError) as e:
        get_registry("models").get("MambaForCausalLM")
    message = str(e.value)
    assert "unknown model architecture 'MambaForCausalLM'" in message
    assert "ExampleForCausalLM" in message
    assert "plugin package" in message and "atom_register_models" in message
    assert isinstance(e.value, KeyError)


def test_two_plugins_registering_one_name_is_an_error_naming_both(plugin_manager):
    class Other:
        @hookimpl
        def atom_register_models(self, registry):
            registry.register("ExampleForCausalLM", "other_pkg.models:Example")

    plugin_manager.register(InProcessPlugin(), name="first-plugin")
    plugin_manager.register(Other(), name="second-plugin")
    models = get_registry("models")  # every other name still resolves
    assert models.get("LlamaForCausalLM") is not None
    with pytest.raises(RegistryError, match="registered twice") as e:
        models.get("ExampleForCausalLM")
    assert "first-plugin" in str(e.value) and "second-plugin" in str(e.value)
    assert "other_pkg.models:Example" in str(e.value)


def test_a_plugin_whose_hook_raises_is_left_out_and_named(plugin_manager):
    class Raising:
        @hookimpl
        def atom_register_samplers(self, registry):
            raise RuntimeError("boom in my hook")

    plugin_manager.register(Raising(), name="raising-plugin")
    with pytest.warns(UserWarning, match="'raising-plugin'.*RuntimeError: boom in my hook"):
        samplers = get_registry("samplers")
    assert samplers.get("default") is not None  # the other plugins' entries are all there
    with pytest.raises(RegistryError, match="raising-plugin.*boom in my hook"):
        samplers.get("whatever-it-meant-to-add")


def test_a_misspelled_hook_is_reported(plugin_manager):
    from atom_core.plugins.manager import unknown_hooks

    class Typo:
        @hookimpl
        def atom_register_sampler(self, registry):  # no "s"
            registry.register("never", "x:Y")

    plugin_manager.register(Typo(), name="typo-plugin")
    assert ("atom_register_sampler", "typo-plugin") in unknown_hooks(plugin_manager)
    # registered in-process, not through an entry point: warned at the next registry lookup, once
    with pytest.warns(UserWarning, match="'typo-plugin' implements 'atom_register_sampler'.*a typo"):
        get_registry("samplers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_registry("samplers")


def test_bad_registrations_are_rejected(plugin_manager):
    class Bad:
        @hookimpl
        def atom_register_samplers(self, registry):
            registry.register("x", "no_colon_here")

    plugin_manager.register(Bad())
    with pytest.raises(ValueError, match="must read 'module:Class'"):
        get_registry("samplers")


def test_target_that_cannot_be_imported_names_plugin_and_target(plugin_manager):
    class Dangling:
        @hookimpl
        def atom_register_samplers(self, registry):
            registry.register("ghost", "atom_no_such_module:Ghost")

    plugin_manager.register(Dangling(), name="dangling")
    with pytest.raises(ImportError, match="'ghost' from plugin 'dangling' points to 'atom_no_such_module:Ghost'"):
        get_registry("samplers").get("ghost")


def test_unknown_registry_kind():
    with pytest.raises(ValueError, match="unknown registry kind 'tokenizers'"):
        get_registry("tokenizers")


def _run(code: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_out_of_tree_package_installed_with_pip_is_found_through_entry_points(tmp_path):
    """A third party's package adds a model and an attention type; the core is untouched."""
    target = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(FIXTURE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    result = _run(
        """
        import sys
        from atom_core import get_registry
        from atom_core.plugins.manager import list_plugins
        models = get_registry("models")
        attention = get_registry("attention_builders")
        print(models.plugin_of("ExampleForCausalLM"))
        print(models.get("ExampleForCausalLM").__module__)
        print(attention.get("example").__name__)
        print([p["distribution"] for p in list_plugins() if p["name"] == "example"])
        """,
        target,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:4] == [
        "example",
        "atom_example_plugin.model",
        "ExampleAttentionBuilder",
        "['atom-example-plugin 0.1.0']",
    ]


def test_a_broken_plugin_warns_and_leaves_the_others_working(tmp_path):
    (tmp_path / "broken_pkg.py").write_text("raise RuntimeError('missing native library')\n")
    dist = tmp_path / "broken_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[atom]\nbroken = broken_pkg\n")
    result = _run(
        """
        import warnings
        from atom_core import get_registry, get_plugin_manager
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            get_plugin_manager()
        print(any("broken" in str(x.message) and "missing native library" in str(x.message) for x in w))
        try:
            get_registry("models").get("Nope")
        except KeyError as e:
            print("failed to load: broken" in str(e))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_list_plugins_reports_hooks(plugin_manager):
    plugin_manager.register(InProcessPlugin(), name="lister")
    row = next(p for p in list_plugins() if p["name"] == "lister")
    assert row["hooks"] == sorted(h for h, _ in REGISTRY_HOOKS.values())
