"""The one plugin manager, and the registries built from its hooks.

Built-in plugins (atom_models, atom_attention, atom_spec) are found exactly like third
party ones, through the "atom" entry-point group, so the core imports none of them.
Tests add an in-process plugin with `get_plugin_manager().register(obj)`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from typing import Any

import pluggy

from atom_core.plugins import hookspecs
from atom_core.plugins.registry import PluginRegistry, Registry

ENTRY_POINT_GROUP = "atom"
# Modules to load as plugins besides the entry points, comma-separated (as pytest's
# PYTEST_PLUGINS): a plugin under development, or a test's, without packaging it. Child
# processes (`atom serve`'s engine cores) inherit it.
PLUGINS_ENV = "ATOM_PLUGINS"

# registry kind -> (hook that fills it, what one entry is called in messages)
REGISTRY_HOOKS: dict[str, tuple[str, str]] = {
    "models": ("atom_register_models", "model architecture"),
    "attention_builders": ("atom_register_attention_builders", "attention type"),
    "samplers": ("atom_register_samplers", "sampler"),
    "proposers": ("atom_register_proposers", "proposer"),
    "scheduler_policies": ("atom_register_scheduler_policies", "scheduling policy"),
    "gguf_architectures": ("atom_register_gguf_architectures", "GGUF architecture"),
    "cpp_kernels": ("atom_register_cpp_kernels", "C++ kernel"),
    "structured_output_backends": ("atom_register_structured_output_backends", "structured-output backend"),
    "distributed_executors": ("atom_register_distributed_executors", "distributed executor"),
    "hf_configs": ("atom_register_hf_configs", "checkpoint model_type"),
    "tool_parsers": ("atom_register_tool_parsers", "tool-call parser"),
    "reasoning_parsers": ("atom_register_reasoning_parsers", "reasoning parser"),
}

_plugin_manager: pluggy.PluginManager | None = None
# entry-point name -> why it failed to load; shown so a user sees the broken plugin.
failed_plugins: dict[str, str] = {}
# entry-point name -> "distribution version" it came from.
plugin_distributions: dict[str, str] = {}


def get_plugin_manager(*, reload: bool = False) -> pluggy.PluginManager:
    """The process-wide plugin manager; entry points are loaded on first use only.

    `reload=True` scans the entry points again (after a `pip install` in-process).
    """
    global _plugin_manager
    if _plugin_manager is None or reload:
        pm = pluggy.PluginManager("atom")
        pm.add_hookspecs(hookspecs)
        _load_entry_points(pm)
        _plugin_manager = pm
    return _plugin_manager


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    failed_plugins.clear()
    plugin_distributions.clear()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        name = ep.name if pm.get_plugin(ep.name) is None else f"{dist}:{ep.name}"
        if pm.get_plugin(name) is not None or pm.is_blocked(name):
            continue
        try:
            plugin = ep.load()
            if pm.is_registered(plugin):  # the same module published twice
                continue
            pm.register(plugin, name=name)
        except Exception as e:  # one broken package must not take the others down
            failed_plugins[name] = f"{ep.value} from {dist}: {type(e).__name__}: {e}"
            warnings.warn(f"atom plugin {name!r} ({ep.value}, from {dist}) failed to load: {e}", stacklevel=2)
            continue
        plugin_distributions[name] = f"{dist} {ep.dist.version}" if ep.dist is not None else "?"
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if pm.get_plugin(module) is not None:
            continue
        try:
            pm.register(importlib.import_module(module), name=module)
        except Exception as e:
            failed_plugins[module] = f"{module} from {PLUGINS_ENV}: {type(e).__name__}: {e}"
            warnings.warn(f"atom plugin {module!r} (from {PLUGINS_ENV}) failed to load: {e}", stacklevel=2)
            continue
        plugin_distributions[module] = PLUGINS_ENV
    _warn_unknown_hooks(pm)


_warned_hooks: set[tuple[str, str]] = set()


def _warn_unknown_hooks(pm: pluggy.PluginManager) -> None:
    """Once per (hook, plugin), whether it came from an entry point or `pm.register`."""
    for hook, plugin in unknown_hooks(pm):
        if (hook, plugin) in _warned_hooks:
            continue
        _warned_hooks.add((hook, plugin))
        warnings.warn(
            f"atom plugin {plugin!r} implements {hook!r}, which is not an Atom hook (a typo?); it is never "
            f"called. The hooks: {', '.join(sorted(hook for hook, _ in REGISTRY_HOOKS.values()))}",
            stacklevel=3,
        )


def unknown_hooks(pm: pluggy.PluginManager) -> list[tuple[str, str]]:
    """(hook name, plugin) for every `@hookimpl` no hook specification declares."""
    out = []
    for name in dir(pm.hook):
        caller = getattr(pm.hook, name)
        if name.startswith("_") or not isinstance(caller, pluggy.HookCaller) or caller.spec is not None:
            continue
        out += [(name, impl.plugin_name) for impl in caller.get_hookimpls() if not impl.optionalhook]
    return out


def get_registry(kind: str, pm: pluggy.PluginManager | None = None) -> Registry:
    """A fresh registry of `kind` (a key of `REGISTRY_HOOKS`: "models", "attention_builders", ...).

    Built on each call from whatever plugins are registered now; cheap, because
    plugins register "module:Class" strings and nothing is imported until `get`.
    """
    if kind not in REGISTRY_HOOKS:
        raise ValueError(f"unknown registry kind {kind!r}; known kinds: {', '.join(REGISTRY_HOOKS)}")
    pm = pm or get_plugin_manager()
    _warn_unknown_hooks(pm)  # a plugin registered in-process (`pm.register`) gets the same warning
    hook_name, label = REGISTRY_HOOKS[kind]
    registry = Registry(label, hook_name, failed_plugins=dict(failed_plugins))
    # Called one plugin at a time so every entry records which plugin made it. A hook
    # that raises takes only its own plugin down, as a failed import does.
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        view = PluginRegistry(registry, impl.plugin_name)
        try:
            impl.function(**{arg: view for arg in impl.argnames})
        except ValueError:  # a malformed registration: the plugin's bug, named by the message
            raise
        except Exception as e:
            why = f"its {hook_name!r} hook raised {type(e).__name__}: {e}"
            registry.failed_plugins[impl.plugin_name] = why
            warnings.warn(f"atom plugin {impl.plugin_name!r}: {why}; what it registers there is left out", stacklevel=2)
    return registry


def list_plugins(pm: pluggy.PluginManager | None = None) -> list[dict[str, Any]]:
    """What each installed plugin provides, for `atom plugins` and debugging."""
    pm = pm or get_plugin_manager()
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = sorted(c.name for c in pm.get_hookcallers(plugin) or [])
        rows.append({"name": name, "distribution": plugin_distributions.get(name), "hooks": hooks})
    return rows
