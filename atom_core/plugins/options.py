"""Settings that belong to a plugin, not to the core's `Config`.

A scheduling policy or an attention builder declares its settings as an attrs class on its
own class (`options_class = SpyreOptions`), with validators whose messages name the setting, the
limit and the value, as `Config`'s do. The values travel in `Config.additional_config` (vLLM's
name for plugin settings); the plugin reads them with `plugin_options(cls, config.additional_config)` when it is
built. `LLMEngine(...)` and the CLI accept a declared setting by its name and check it before
any model is loaded (`check_plugin_options`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import attrs

from atom_core.plugins.manager import get_registry

# The registries whose classes may declare settings.
OPTION_KINDS = ("scheduler_policies", "attention_builders")


def plugin_options(cls: type, values: Mapping[str, Any] | None) -> Any:
    """`cls.options_class` built from `values` (`Config.additional_config`: the keys it declares;
    defaults for the rest), or None for a class that declares none."""
    options = getattr(cls, "options_class", None)
    if options is None:
        return None
    values = values or {}
    names = {f.name for f in attrs.fields(options)}
    return options(**{k: v for k, v in values.items() if k in names})


def declared_options(pm: Any = None) -> dict[str, list[type]]:
    """Setting name -> the registered plugin classes that declare it."""
    declared: dict[str, list[type]] = {}
    for kind in OPTION_KINDS:
        registry = get_registry(kind, pm)
        for name in registry.names():
            try:
                cls = registry.get(name)
            except Exception:  # a plugin whose class cannot load declares nothing; using it says why
                continue
            options = getattr(cls, "options_class", None)
            if options is not None:
                for field in attrs.fields(options):
                    declared.setdefault(field.name, []).append(cls)
    return declared


def check_plugin_options(values: Mapping[str, Any], pm: Any = None) -> None:
    """Every setting in `values` is declared by some plugin and valid for each one declaring it.

    Raises TypeError naming an unknown setting and the ones plugins declare; a value a
    plugin's validators refuse raises their ValueError."""
    if not values:
        return
    declared = declared_options(pm)
    unknown = sorted(set(values) - set(declared))
    if unknown:
        raise TypeError(
            f"unknown plugin setting(s) {', '.join(map(repr, unknown))} in additional_config; "
            f"settings the installed plugins declare: {', '.join(sorted(declared)) or 'none'}"
        )
    classes = {cls for name in values for cls in declared[name]}
    for cls in classes:
        plugin_options(cls, values)


def settings_of_other_policies(values: Mapping[str, Any], policy: str, pm: Any = None) -> list[str]:
    """The settings in `values` that only scheduling policies declare, none of them `policy`:
    given, but nothing in an engine on `policy` reads them."""
    registry = get_registry("scheduler_policies", pm)
    policies = set()
    for name in registry.names():
        try:
            policies.add(registry.get(name))
        except Exception:  # a plugin whose class cannot load
            continue
    with contextlib.suppress(Exception):
        policies.discard(registry.get(policy))
    declared = declared_options(pm)
    return sorted(name for name in values if name in declared and set(declared[name]) <= policies)
