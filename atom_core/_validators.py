"""attrs validators whose messages name the field, the limit and the value."""

from __future__ import annotations

import math
import numbers
from typing import Any, TypeGuard

import attrs


def is_number(value: Any) -> TypeGuard[int | float]:
    """An int or a float, not a bool (True == 1 would pass for a number otherwise)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def boolean(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    """True or False: a string such as "false" would otherwise count as on."""
    if not isinstance(value, bool):
        raise ValueError(f"{attr.name} must be True or False, got {value!r}")


def name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    """A registry name (a policy's, a sampler's): a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attr.name} must be a name (a non-empty string), got {value!r}")


def positive(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attr.name} must be a positive integer, got {value!r}")


def non_negative_int(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attr.name} must be an integer >= 0, got {value!r}")


def non_negative_float(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{attr.name} must be a finite number >= 0, got {value!r}")


def in_unit_interval(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    """(0, 1]: a fraction that must leave something."""
    if not is_number(value) or not 0 < value <= 1:
        raise ValueError(f"{attr.name} must be in (0, 1], got {value!r}")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def optional_token_id(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not _is_token_id(value):
        raise ValueError(f"{attr.name} must be a token id (integer >= 0) or None, got {value!r}")


def token_ids_of(field: str, value: Any) -> list[int]:
    """`value` as a list of token ids (numpy's integers count: np.int64 is no int); errors name `field`."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{field} must be a list of token ids, got {value!r}")
    ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in value]
    for t in ids:
        if not _is_token_id(t):
            raise ValueError(f"{field} must hold token ids (integers >= 0), got {t!r}")
    return ids


def token_id_list(value: Any) -> list[int]:
    """attrs converter for `stop_token_ids` (config and per request)."""
    return [] if value is None else token_ids_of("stop_token_ids", value)


def one_of(choices: tuple) -> Any:
    """A validator whose error names the field, the choices and the value."""

    def check(inst: object, attr: attrs.Attribute, value: object) -> None:
        # type too: 32.0 == 32, but a float group size fails deep in a reshape
        if isinstance(value, bool) or not any(type(value) is type(c) and value == c for c in choices):
            raise ValueError(f"{attr.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    return check


def option_names(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    """A mapping of setting name -> value (`Config.additional_config`)."""
    bad = [k for k in value if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"{attr.name} takes setting names (non-empty strings) as keys, got {bad[0]!r}")
