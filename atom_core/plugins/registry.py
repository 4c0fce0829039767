"""Name -> class maps that plugins fill, with errors that tell the user what to install."""

from __future__ import annotations

import importlib
from typing import Any

import attrs


@attrs.define
class _Entry:
    target: Any  # a class, or "module:Class" imported on first use
    plugin: str


class RegistryError(KeyError):
    """An unknown or doubly-registered name. A KeyError whose message reads well."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry:
    """One kind of pluggable thing: models, attention builders, samplers or proposers.

    Targets may be "module:Class" strings so that listing what is installed never
    imports torch models nobody asked for.
    """

    def __init__(self, kind: str, hook_name: str, failed_plugins: dict[str, str] | None = None):
        self.kind = kind
        self.hook_name = hook_name
        self.failed_plugins = failed_plugins or {}
        self._entries: dict[str, _Entry] = {}
        self._conflicts: dict[str, str] = {}  # name -> why it cannot be used (registered twice)

    def register(self, name: str, target: Any, *, plugin: str = "<unknown>") -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: a lazy target must read 'module:Class', got {target!r}")
        previous = self._entries.get(name)
        if previous is not None:  # an error when the name is asked for, not for every other name
            by = (
                f"by plugin {plugin!r} ({_describe(previous.target)} and {_describe(target)}); fix that plugin"
                if previous.plugin == plugin
                else f"by plugin {previous.plugin!r} ({_describe(previous.target)}) and by plugin {plugin!r} "
                f"({_describe(target)}); uninstall one of them"
            )
            self._conflicts[name] = f"{self.kind} {name!r} is registered twice: {by}"
            return
        self._entries[name] = _Entry(target, plugin)

    def get(self, name: str) -> Any:
        """The class registered under `name`, imported now if it was registered lazily."""
        if name in self._conflicts:
            raise RegistryError(self._conflicts[name])
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            message = (
                f"unknown {self.kind} {name!r}. Known {_plural(self.kind)}: {known}. "
                f"A plugin package provides more: install one that implements the "
                f"'{self.hook_name}' hook under the 'atom' entry-point group"
            )
            if self.failed_plugins:
                broken = "; ".join(f"{k} ({v})" for k, v in sorted(self.failed_plugins.items()))
                message += f". These plugins failed to load: {broken}"
            raise RegistryError(message)
        if isinstance(entry.target, str):
            module_name, _, attr = entry.target.partition(":")
            try:
                obj: Any = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as e:
                raise ImportError(
                    f"{self.kind} {name!r} from plugin {entry.plugin!r} points to {entry.target!r}, "
                    f"which cannot be imported: {e}"
                ) from e
            entry.target = obj
        return entry.target

    def plugin_of(self, name: str) -> str:
        """Which plugin registered `name` (unknown names raise as `get` does)."""
        if name not in self._entries:
            self.get(name)
        return self._entries[name].plugin

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self.names())})"


class PluginRegistry:
    """What a plugin's hook receives: `register(name, target)` adds one entry, stamped with
    the plugin's name (shown when two plugins register the same name). `target` is the class
    or object itself, or a "module:attribute" string imported when the name is first asked for."""

    def __init__(self, registry: Registry, plugin: str):
        self._registry = registry
        self._plugin = plugin

    def register(self, name: str, target: Any) -> None:
        self._registry.register(name, target, plugin=self._plugin)


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
